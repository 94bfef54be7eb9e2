//! `control-probe MANAGE_SOCK METRICS_SOCK SECONDS`: times the node daemon's answers as a
//! long-lived client sees them — one management connection, no process started per question —
//! asking `ListDisks` (what `vmdisk ls` asks), `Status` (`vmdisk stats`) and a `/metrics`
//! scrape every 0.1 s for SECONDS, each under a 10 s deadline. Prints one line per question:
//! `NAME COUNT P50_MS P99_MS MAX_MS FAILED`. `make bench` (benches/baddays.sh) runs it beside the
//! CLI, whose own start-up is part of what `vmdisk ls` costs on a loaded machine.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vmdisk::api::vmdisk::v1::manage_client::ManageClient;
use vmdisk::api::vmdisk::v1::{ListDisksRequest, StatusRequest};

const DEADLINE: Duration = Duration::from_secs(10);

async fn scrape(socket: &str) -> std::io::Result<()> {
    let mut s = tokio::net::UnixStream::connect(socket).await?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await?;
    let mut body = Vec::new();
    s.read_to_end(&mut body).await?;
    if !body.starts_with(b"HTTP/1.1 200") {
        return Err(std::io::Error::other("the scrape was not answered 200"));
    }
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [manage, metrics, seconds] = args.as_slice() else {
        eprintln!("usage: control-probe MANAGE_SOCK METRICS_SOCK SECONDS");
        return std::process::ExitCode::from(2);
    };
    let Ok(seconds) = seconds.parse::<u64>() else {
        eprintln!("control-probe: SECONDS is a whole number");
        return std::process::ExitCode::from(2);
    };
    let channel = match vmdisk::api::unix::channel(manage.as_str()).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("control-probe: {}", e.chain());
            return std::process::ExitCode::FAILURE;
        }
    };
    let mut client = ManageClient::new(channel);
    // Per question: answer times (ms) and failures.
    let mut times: [(Vec<f64>, u32); 3] = Default::default();
    let end = Instant::now() + Duration::from_secs(seconds);
    while Instant::now() < end {
        for (i, slot) in times.iter_mut().enumerate() {
            let t0 = Instant::now();
            let ok = match i {
                0 => tokio::time::timeout(DEADLINE, client.list_disks(ListDisksRequest::default()))
                    .await
                    .is_ok_and(|r| r.is_ok()),
                1 => tokio::time::timeout(DEADLINE, client.status(StatusRequest {}))
                    .await
                    .is_ok_and(|r| r.is_ok()),
                _ => tokio::time::timeout(DEADLINE, scrape(metrics))
                    .await
                    .is_ok_and(|r| r.is_ok()),
            };
            if ok {
                slot.0.push(t0.elapsed().as_secs_f64() * 1000.0);
            } else {
                slot.1 += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (name, (mut t, failed)) in ["ls", "stats", "metrics"].into_iter().zip(times) {
        t.sort_by(f64::total_cmp);
        let at = |q: f64| t.get(((t.len() as f64 * q) as usize).min(t.len().saturating_sub(1)));
        let show = |v: Option<&f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
        println!(
            "{name} {} {} {} {} {failed}",
            t.len(),
            show(at(0.5)),
            show(at(0.99)),
            show(t.last())
        );
    }
    std::process::ExitCode::SUCCESS
}

//! The shaped link the benches put in front of registries (`vmdisk_testing::link`,
//! `examples/shaped-link.rs`), measured against its own rate: it must never be what a bench
//! measures.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use vmdisk_testing::link::{serve, Shape, BUFFER};

const RTT_MS: f64 = 20.0;
const MBIT: f64 = 200.0;

/// A server on loopback answering each request line `<n>` on a connection with `n` bytes,
/// behind a link of 20 ms and 200 Mbit/s (the benches' cluster link); the link's address.
async fn answers_behind_a_link() -> SocketAddr {
    let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = server.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((conn, _)) = server.accept().await {
            tokio::spawn(async move {
                let (read, mut write) = conn.into_split();
                let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(read));
                let zeros = vec![0u8; 1 << 20];
                while let Ok(Some(line)) = lines.next_line().await {
                    let mut left: usize = line.trim().parse().unwrap();
                    while left > 0 {
                        let n = left.min(zeros.len());
                        if write.write_all(&zeros[..n]).await.is_err() {
                            return;
                        }
                        left -= n;
                    }
                }
            });
        }
    });
    let link = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = link.local_addr().unwrap();
    tokio::spawn(serve(link, upstream, Shape::new(RTT_MS, MBIT)));
    addr
}

/// Asks `size` bytes at a time on a connection to `link`, once and then again until
/// `until`; the bytes received.
async fn ask_repeatedly(link: SocketAddr, size: usize, until: Instant) -> u64 {
    let conn = TcpStream::connect(link).await.unwrap();
    conn.set_nodelay(true).unwrap();
    let (mut read, mut write) = conn.into_split();
    let mut buf = vec![0u8; 64 << 10];
    let mut got = 0u64;
    loop {
        write
            .write_all(format!("{size}\n").as_bytes())
            .await
            .unwrap();
        let mut left = size;
        while left > 0 {
            let n = read.read(&mut buf[..left.min(64 << 10)]).await.unwrap();
            assert!(n > 0, "the link hung up");
            left -= n;
        }
        got += size as u64;
        if Instant::now() >= until {
            return got;
        }
    }
}

/// `n` connections asking `size` bytes at a time for 3 s, each waiting for its answer
/// before the next, as parallel random readers' chunk fetches do; how busy they kept the
/// link (1.0: its rate).
async fn askers_keep_busy(n: usize, size: usize) -> f64 {
    let link = answers_behind_a_link().await;
    let started = Instant::now();
    let until = started + Duration::from_secs(3);
    let askers: Vec<_> = (0..n)
        .map(|_| tokio::spawn(ask_repeatedly(link, size, until)))
        .collect();
    let mut bytes = 0;
    for a in askers {
        bytes += a.await.unwrap();
    }
    let rate = Shape::new(RTT_MS, MBIT).bytes_per_sec;
    bytes as f64 / started.elapsed().as_secs_f64() / rate
}

/// 16 askers of 64 KiB, and 4 of 256 KiB (1 MiB in flight, twice what the link holds),
/// keep the link at least 95% busy: the link is shared, not wasted. (4 of 256 KiB kept it
/// 69% busy when it served a piece per connection in turn.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_askers_of_chunks_keep_the_link_busy() {
    for (n, size) in [(16, 64 << 10), (4, 256 << 10)] {
        let busy = askers_keep_busy(n, size).await;
        assert!(
            (0.95..=1.02).contains(&busy),
            "{n} askers of {} KiB kept the link {:.1}% busy",
            size >> 10,
            busy * 100.0
        );
    }
}

/// Four bulk streams share the link evenly and fill it, and a small answer asked meanwhile
/// comes behind at most the bottleneck's buffer, not behind their bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_share_the_link_evenly_and_a_small_answer_passes_them() {
    let link = answers_behind_a_link().await;
    let rate = Shape::new(RTT_MS, MBIT).bytes_per_sec;
    let started = Instant::now();
    let until = started + Duration::from_secs(3);
    let streams: Vec<_> = (0..4)
        .map(|_| tokio::spawn(ask_repeatedly(link, 2 << 20, until)))
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let asked = Instant::now();
    ask_repeatedly(link, 4 << 10, asked).await;
    let small = asked.elapsed();
    let mut each = Vec::new();
    for s in streams {
        each.push(s.await.unwrap());
    }
    let elapsed = started.elapsed().as_secs_f64();
    let busy = each.iter().sum::<u64>() as f64 / elapsed / rate;
    assert!(busy >= 0.9, "the link was {:.1}% busy", busy * 100.0);
    let (least, most) = (each.iter().min().unwrap(), each.iter().max().unwrap());
    assert!(
        *least as f64 >= *most as f64 * 0.75,
        "uneven shares: {each:?} bytes"
    );
    // A round trip for the connection, one for the request, the buffer ahead of it (42 ms),
    // and a round trip of slack: not the streams' 2 MiB answers (80 ms each alone).
    let buffer = Duration::from_secs_f64(BUFFER as f64 / rate);
    let bound = Duration::from_millis(3 * RTT_MS as u64) + buffer;
    assert!(
        small < bound,
        "a 4 KiB answer took {small:?} behind four streams (at most {bound:?})"
    );
}

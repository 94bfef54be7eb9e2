//! A shaped network link for benchmarks: a TCP relay that adds latency and caps bandwidth
//! between a client and a server on this machine, the way a registry link in a cluster would.
//!
//! ```text
//! shaped-link LISTEN_ADDR UPSTREAM_ADDR RTT_MS MBIT_PER_S
//! shaped-link 127.0.0.1:5001 127.0.0.1:5000 20 200     # the "cluster" link
//! ```
//!
//! The kernel here has no netem, so delay is added in user space: each direction is a link of
//! its own with half the round trip as propagation delay and the bandwidth as its rate, shared
//! by every connection (as one bottleneck link would be). Bytes read from one side are given a
//! departure time on that direction's link (they wait for the bytes before them to be sent at
//! the link's rate) and are written to the other side one propagation delay after departing.
//! Many bytes can be in flight at once, so a sender that keeps the pipe full gets the link's
//! bandwidth, and one request-response costs at least one round trip: what TCP over a real
//! link of that shape gives (without loss or slow start).
//!
//! It prints `listening on ADDR` once it accepts connections, and runs until killed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// Largest piece of data scheduled at once (smaller than a TCP window, so pieces pipeline).
const PIECE: usize = 16 << 10;
/// Pieces in flight per connection direction: enough for 10 Gbit/s × 50 ms.
const IN_FLIGHT: usize = 4096;

/// One direction of the link: when it is free to send the next byte.
struct Link {
    bytes_per_sec: f64,
    delay: Duration,
    free_at: Mutex<Instant>,
}

impl Link {
    /// When `n` bytes handed over now arrive at the other end.
    fn schedule(&self, n: usize) -> Instant {
        let now = Instant::now();
        let mut free_at = self.free_at.lock();
        let start = (*free_at).max(now);
        let departs = start + Duration::from_secs_f64(n as f64 / self.bytes_per_sec);
        *free_at = departs;
        departs + self.delay
    }
}

/// Copies `from` to `to` through `link`.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, link: Arc<Link>) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(Instant, Vec<u8>)>(IN_FLIGHT);
    let reader = async move {
        let mut buf = vec![0u8; PIECE];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let arrives = link.schedule(n);
            if tx.send((arrives, buf[..n].to_vec())).await.is_err() {
                break;
            }
        }
    };
    let writer = async move {
        while let Some((arrives, piece)) = rx.recv().await {
            tokio::time::sleep_until(arrives).await;
            if to.write_all(&piece).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}

async fn relay(client: TcpStream, upstream: SocketAddr, links: (Arc<Link>, Arc<Link>)) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    tokio::join!(pump(cr, sw, links.0), pump(sr, cw, links.1));
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, listen, upstream, rtt_ms, mbit] = &args[..] else {
        return Err("usage: shaped-link LISTEN_ADDR UPSTREAM_ADDR RTT_MS MBIT_PER_S".into());
    };
    let upstream: SocketAddr = upstream.parse()?;
    let delay = Duration::from_secs_f64(rtt_ms.parse::<f64>()? / 2000.0);
    let bytes_per_sec = mbit.parse::<f64>()? * 1e6 / 8.0;
    if bytes_per_sec <= 0.0 {
        return Err("the bandwidth must be positive".into());
    }
    let link = || {
        Arc::new(Link {
            bytes_per_sec,
            delay,
            free_at: Mutex::new(Instant::now()),
        })
    };
    let (up, down) = (link(), link());
    let listener = TcpListener::bind(listen).await?;
    println!("listening on {}", listener.local_addr()?);
    loop {
        let (client, _) = listener.accept().await?;
        tokio::spawn(relay(
            client,
            upstream,
            (Arc::clone(&up), Arc::clone(&down)),
        ));
    }
}

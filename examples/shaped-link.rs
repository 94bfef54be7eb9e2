//! A shaped network link for benchmarks: a TCP relay that adds latency and caps bandwidth
//! between a client and a server on this machine, the way a registry link in a cluster would.
//!
//! ```text
//! shaped-link LISTEN_ADDR UPSTREAM_ADDR RTT_MS MBIT_PER_S
//! shaped-link 127.0.0.1:5001 127.0.0.1:5000 20 200     # the "cluster" link
//! ```
//!
//! The kernel here has no netem, so the link is made in user space. Each direction is a link of
//! its own, shared by every connection as one bottleneck would be: a wire of the link's rate
//! with half the round trip as propagation delay, behind a fair queue — one queue per
//! connection, served a piece at a time in turn, as Linux's default qdisc (fq_codel) serves
//! flows — so a short answer is not queued behind another connection's bulk transfer.
//!
//! Each connection's direction has a window: bytes read from its sender and not yet delivered
//! to its receiver are at most [`WINDOW`] (Linux's largest default send buffer), as TCP's flow
//! control bounds what a sender has in flight. A sender that keeps its window full gets the
//! link's bandwidth (or its fair share), one request-response costs at least one round trip,
//! and a receiver that hangs up stops its sender within a window, not after whatever the sender
//! could have written. What it does not model: loss, slow start.
//!
//! It prints `listening on ADDR` once it accepts connections, and runs until killed.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Largest piece of data read and scheduled at once (the fair queue's quantum).
const PIECE: usize = 16 << 10;
/// Bytes of one connection's direction in flight at most (read from its sender, not yet
/// delivered): `net.ipv4.tcp_wmem`'s default maximum.
const WINDOW: usize = 4 << 20;
/// How late the wire's clock may fall behind a timer's wake-up and still send back to back.
const SLACK: Duration = Duration::from_millis(5);

/// A piece on its way, holding its part of its connection's window until delivered.
struct Piece {
    bytes: Vec<u8>,
    _window: OwnedSemaphorePermit,
}

/// One connection's direction as the link sees it: the pieces waiting for the wire, and where
/// the wire hands them over (at their arrival time).
struct Flow {
    waiting: Mutex<VecDeque<Piece>>,
    deliver: mpsc::UnboundedSender<(Instant, Piece)>,
}

/// One direction of the link: the flows with pieces waiting, in the order they are served.
struct Link {
    bytes_per_sec: f64,
    delay: Duration,
    turns: Mutex<VecDeque<Arc<Flow>>>,
    ready: Notify,
}

impl Link {
    /// Queues `piece` on `flow`'s queue (and `flow` for a turn if it had nothing waiting).
    fn enqueue(&self, flow: &Arc<Flow>, piece: Piece) {
        let mut turns = self.turns.lock();
        let mut waiting = flow.waiting.lock();
        if waiting.is_empty() {
            turns.push_back(Arc::clone(flow));
        }
        waiting.push_back(piece);
        drop(waiting);
        drop(turns);
        self.ready.notify_one();
    }

    /// The next piece to send: the first piece of the flow whose turn it is (that flow goes to
    /// the back of the line if it has more).
    fn next(&self) -> Option<(Arc<Flow>, Piece)> {
        let mut turns = self.turns.lock();
        let flow = turns.pop_front()?;
        let mut waiting = flow.waiting.lock();
        let piece = waiting.pop_front()?;
        let more = !waiting.is_empty();
        drop(waiting);
        if more {
            turns.push_back(Arc::clone(&flow));
        }
        Some((flow, piece))
    }

    /// The wire: sends the queued pieces one after the other at the link's rate; each arrives
    /// one propagation delay after it has been sent. A piece whose receiver has gone is dropped
    /// without using the wire.
    async fn run(self: Arc<Self>) {
        let mut free_at = Instant::now();
        loop {
            let ready = self.ready.notified();
            let Some((flow, piece)) = self.next() else {
                ready.await;
                continue;
            };
            if flow.deliver.is_closed() {
                continue;
            }
            let now = Instant::now();
            let start = if free_at + SLACK < now { now } else { free_at };
            free_at =
                start + Duration::from_secs_f64(piece.bytes.len() as f64 / self.bytes_per_sec);
            let _ = flow.deliver.send((free_at + self.delay, piece));
            if free_at > now {
                tokio::time::sleep_until(free_at).await;
            }
        }
    }
}

/// Copies `from` to `to` through `link`, at most [`WINDOW`] bytes in flight; stops reading
/// `from` once `to` is gone.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, link: Arc<Link>) {
    let (deliver, mut arrivals) = mpsc::unbounded_channel::<(Instant, Piece)>();
    let flow = Arc::new(Flow {
        waiting: Mutex::new(VecDeque::new()),
        deliver,
    });
    let window = Arc::new(Semaphore::new(WINDOW));
    let reader = async move {
        let mut buf = vec![0u8; PIECE];
        loop {
            let n = tokio::select! {
                read = from.read(&mut buf) => match read {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                },
                () = flow.deliver.closed() => break,
            };
            let Ok(permit) = Arc::clone(&window).acquire_many_owned(n as u32).await else {
                break;
            };
            let piece = Piece {
                bytes: buf[..n].to_vec(),
                _window: permit,
            };
            link.enqueue(&flow, piece);
        }
    };
    let writer = async move {
        while let Some((arrives, piece)) = arrivals.recv().await {
            tokio::time::sleep_until(arrives).await;
            if to.write_all(&piece.bytes).await.is_err() {
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
        let link = Arc::new(Link {
            bytes_per_sec,
            delay,
            turns: Mutex::new(VecDeque::new()),
            ready: Notify::new(),
        });
        tokio::spawn(Arc::clone(&link).run());
        link
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

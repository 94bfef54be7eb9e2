//! A shaped network link for benchmarks and tests: a TCP relay that adds latency and caps
//! bandwidth between a client and a server on this machine, the way a registry link in a cluster
//! or across the internet would (`examples/shaped-link.rs` runs one).
//!
//! The kernel here has no netem, so the link is made in user space. Each direction is a link of
//! its own, shared by every connection as one bottleneck would be: a wire of the link's rate
//! with half the round trip as propagation delay, behind the bottleneck's buffer — a first-in,
//! first-out queue of [`BUFFER`] bytes, as a router's —, which the connections with bytes to
//! send fill in turn, a piece each, as TCP's congestion control shares a full bottleneck among
//! its senders. So streams share the link evenly; a short answer waits behind at most the
//! buffer (42 ms at 200 Mbit/s), never behind another connection's bulk transfer; and answers
//! that come together leave one after the other instead of all finishing last together (a
//! queue served a piece per connection in turn, as fq_codel serves flows, makes a few
//! request-response askers wait for each other and idle the link a round trip each time:
//! 4 askers of 256 KiB kept a 20 ms, 200 Mbit/s link 69% busy).
//!
//! The wire keeps its own clock: a piece starts when the one before it has left (back to back),
//! or when it is queued on an idle wire. This relay being scheduled late (a busy machine, the
//! timer's millisecond) delays when it hands pieces over, never how many the wire carries: time
//! the wire was busy is never lost, time it stood idle is never credited.
//!
//! Each connection's direction has a window: bytes read from its sender and not yet delivered
//! to its receiver are at most [`WINDOW`] (Linux's largest default send buffer), as TCP's flow
//! control bounds what a sender has in flight. A sender that keeps its window full gets the
//! link's bandwidth (or its fair share), one request-response costs at least one round trip,
//! and a receiver that hangs up stops its sender within a window, not after whatever the sender
//! could have written. What it does not model: loss, slow start.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Largest piece of data read and scheduled at once (the fair queue's quantum).
const PIECE: usize = 16 << 10;
/// The bottleneck's buffer: bytes queued for the wire at most (about two round trips' worth at
/// the benches' cluster link, 20 ms and 200 Mbit/s). First in, first out: answers that come
/// together leave one after the other, as on a router's queue, so each asker has its answer
/// as soon as the link can give it and asks again while the others' bytes still flow.
pub const BUFFER: usize = 1 << 20;
/// Bytes of one connection's direction in flight at most (read from its sender, not yet
/// delivered): `net.ipv4.tcp_wmem`'s default maximum.
pub const WINDOW: usize = 4 << 20;

/// What a link is: its round trip and its rate in each direction.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub rtt: Duration,
    pub bytes_per_sec: f64,
}

impl Shape {
    /// A link of `rtt_ms` round trip and `mbit` Mbit/s.
    pub fn new(rtt_ms: f64, mbit: f64) -> Self {
        assert!(mbit > 0.0, "the bandwidth must be positive");
        Shape {
            rtt: Duration::from_secs_f64(rtt_ms / 1000.0),
            bytes_per_sec: mbit * 1e6 / 8.0,
        }
    }
}

/// A piece on its way, holding its part of its connection's window until delivered.
struct Piece {
    bytes: Vec<u8>,
    _window: OwnedSemaphorePermit,
}

/// One connection's direction as the link sees it: the pieces waiting for room in the buffer, and where
/// the wire hands them over (at their arrival time).
struct Flow {
    waiting: Mutex<VecDeque<Piece>>,
    deliver: mpsc::UnboundedSender<(Instant, Piece)>,
}

/// One direction of the link: the bottleneck's buffer, the pieces in it in the order they go on
/// the wire, and the flows waiting for room in it, in turn.
struct Wire {
    bytes_per_sec: f64,
    delay: Duration,
    queue: Mutex<Queue>,
    ready: Notify,
}

/// The bottleneck's queue: its buffer ([`BUFFER`] bytes, first in, first out) and the flows
/// whose pieces wait for room in it.
#[derive(Default)]
struct Queue {
    buffer: VecDeque<(Arc<Flow>, Piece)>,
    buffered: usize,
    turns: VecDeque<Arc<Flow>>,
}

impl Queue {
    /// Moves waiting pieces into the buffer while they fit, a piece from each flow in turn (a
    /// flow with more goes to the back of the line): what TCP's congestion control does to
    /// senders sharing a full bottleneck, each getting its share of the room that frees.
    fn admit(&mut self) {
        while let Some(flow) = self.turns.front() {
            let mut waiting = flow.waiting.lock().unwrap();
            let Some(len) = waiting.front().map(|p| p.bytes.len()) else {
                drop(waiting);
                self.turns.pop_front();
                continue;
            };
            if self.buffered + len > BUFFER && self.buffered > 0 {
                return;
            }
            let piece = waiting.pop_front().expect("a piece is waiting");
            let more = !waiting.is_empty();
            drop(waiting);
            let flow = self.turns.pop_front().expect("the flow whose turn it is");
            if more {
                self.turns.push_back(Arc::clone(&flow));
            }
            self.buffered += len;
            self.buffer.push_back((flow, piece));
        }
    }
}

impl Wire {
    fn start(shape: Shape) -> Arc<Self> {
        let wire = Arc::new(Wire {
            bytes_per_sec: shape.bytes_per_sec,
            delay: shape.rtt / 2,
            queue: Mutex::new(Queue::default()),
            ready: Notify::new(),
        });
        tokio::spawn(Arc::clone(&wire).run());
        wire
    }

    /// Queues `piece` on `flow`'s queue (and `flow` for a turn if it had nothing waiting), and
    /// into the buffer if there is room.
    fn enqueue(&self, flow: &Arc<Flow>, piece: Piece) {
        let mut queue = self.queue.lock().unwrap();
        let mut waiting = flow.waiting.lock().unwrap();
        if waiting.is_empty() {
            queue.turns.push_back(Arc::clone(flow));
        }
        waiting.push_back(piece);
        drop(waiting);
        queue.admit();
        drop(queue);
        self.ready.notify_one();
    }

    /// The next piece to send: the buffer's first (its room goes to the pieces waiting).
    fn next(&self) -> Option<(Arc<Flow>, Piece)> {
        let mut queue = self.queue.lock().unwrap();
        let (flow, piece) = queue.buffer.pop_front()?;
        queue.buffered -= piece.bytes.len();
        queue.admit();
        Some((flow, piece))
    }

    /// The wire: sends the queued pieces one after the other at the link's rate; each arrives
    /// one propagation delay after it has been sent. A piece whose receiver has gone is dropped
    /// without using the wire. `free_at`, when the wire is done with what it was given, moves
    /// on by each piece's time on the wire, and jumps to the present only after the wire stood
    /// idle.
    async fn run(self: Arc<Self>) {
        let mut free_at = Instant::now();
        loop {
            let ready = self.ready.notified();
            let Some((flow, piece)) = self.next() else {
                ready.await;
                free_at = free_at.max(Instant::now());
                continue;
            };
            if flow.deliver.is_closed() {
                continue;
            }
            free_at += Duration::from_secs_f64(piece.bytes.len() as f64 / self.bytes_per_sec);
            let _ = flow.deliver.send((free_at + self.delay, piece));
            tokio::time::sleep_until(free_at).await;
        }
    }
}

/// Copies `from` to `to` through `wire`, at most [`WINDOW`] bytes in flight; stops reading
/// `from` once `to` is gone.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, wire: Arc<Wire>) {
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
            wire.enqueue(&flow, piece);
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

async fn relay(client: TcpStream, upstream: SocketAddr, wires: (Arc<Wire>, Arc<Wire>)) {
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    tokio::join!(pump(cr, sw, wires.0), pump(sr, cw, wires.1));
}

/// Relays each connection `listener` accepts to `upstream` through a link of `shape` (one wire
/// each way, shared by all of them); runs until its task is dropped.
pub async fn serve(listener: TcpListener, upstream: SocketAddr, shape: Shape) {
    let (up, down) = (Wire::start(shape), Wire::start(shape));
    while let Ok((client, _)) = listener.accept().await {
        tokio::spawn(relay(
            client,
            upstream,
            (Arc::clone(&up), Arc::clone(&down)),
        ));
    }
}

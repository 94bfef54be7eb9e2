//! A shaped network link for benchmarks: a TCP relay that adds latency and caps bandwidth
//! between a client and a server on this machine, the way a registry link in a cluster would
//! (`vmdisk_testing::link`: one wire each way behind a router's first-in, first-out buffer,
//! which the connections fill in turn, each with a TCP window in flight).
//!
//! ```text
//! shaped-link LISTEN_ADDR UPSTREAM_ADDR RTT_MS MBIT_PER_S
//! shaped-link 127.0.0.1:5001 127.0.0.1:5000 20 200     # the "cluster" link
//! ```
//!
//! It prints `listening on ADDR` once it accepts connections, and runs until killed.

use std::net::SocketAddr;

use vmdisk_testing::link::{serve, Shape};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, listen, upstream, rtt_ms, mbit] = &args[..] else {
        return Err("usage: shaped-link LISTEN_ADDR UPSTREAM_ADDR RTT_MS MBIT_PER_S".into());
    };
    let upstream: SocketAddr = upstream.parse()?;
    let (rtt_ms, mbit): (f64, f64) = (rtt_ms.parse()?, mbit.parse()?);
    if !(mbit > 0.0 && rtt_ms >= 0.0) {
        return Err(
            "the round trip must not be negative and the bandwidth must be positive".into(),
        );
    }
    let listener = tokio::net::TcpListener::bind(listen).await?;
    println!("listening on {}", listener.local_addr()?);
    serve(listener, upstream, Shape::new(rtt_ms, mbit)).await;
    Ok(())
}

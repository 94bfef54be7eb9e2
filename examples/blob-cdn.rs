//! A registry as the internet runs them, for benches and the demo: a front that redirects blob
//! GETs to a blob host with signed, expiring URLs, and the blob host serving the registry's
//! storage (`vmdisk_testing::cdn`).
//!
//! ```text
//! blob-cdn FRONT_ADDR BLOB_ADDR ORIGIN_URL STORAGE_DIR BLOB_URL [LIFETIME_SECS]
//! blob-cdn 127.0.0.1:5100 127.0.0.1:5200 http://127.0.0.1:5000 /tmp/reg/data http://127.0.0.1:5201 300
//! ```
//!
//! BLOB_URL is where clients reach the blob host (its link's address). `GET BLOB_URL/_cdn/stats`
//! answers the counts as JSON. It prints `listening` once both accept connections, and runs
//! until killed.

use std::time::Duration;

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 5 {
        eprintln!(
            "usage: blob-cdn FRONT_ADDR BLOB_ADDR ORIGIN_URL STORAGE_DIR BLOB_URL [LIFETIME_SECS]"
        );
        std::process::exit(2);
    }
    let lifetime = args
        .get(5)
        .map(|s| s.parse::<u64>().expect("LIFETIME_SECS is a number"))
        .unwrap_or(300);
    let bind = |addr: &str| {
        let addr = addr.to_string();
        async move {
            tokio::net::TcpListener::bind(&addr)
                .await
                .unwrap_or_else(|e| panic!("binding {addr}: {e}"))
        }
    };
    let front = bind(&args[0]).await;
    let blobs = bind(&args[1]).await;
    let options = vmdisk_testing::cdn::Options {
        origin: args[2].clone(),
        storage: args[3].clone().into(),
        blob_url: args[4].clone(),
        lifetime: Duration::from_secs(lifetime),
    };
    let _cdn = vmdisk_testing::cdn::Cdn::start(options, front, blobs);
    println!("listening");
    std::future::pending::<()>().await;
}

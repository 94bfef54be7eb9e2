//! The integration tests' fixtures for the bash benches and the demo (`integration/lib/`): starts
//! one real part as the tests start it ([`fixtures`]), prints what a script needs as `NAME=value`
//! lines, and leaves it running; the script stops it by the pid printed as `LAB_PID`.
//!
//! ```text
//! lab registry DIR [--data DIR] [--realm URL] [--tls-cert PEM --tls-key PEM] [--extra YAML]
//! lab containerd DIR --mirror HOST:PORT [--snapshotter SOCKET [--name NAME]] [--extra TOML]
//! lab node DIR --program VMDISK_SNAPSHOTTER [--containerd-root DIR] [--top TOML] [--extra TOML]
//! ```

#[path = "fixtures/mod.rs"]
#[allow(dead_code, unused_imports)]
mod fixtures;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use fixtures::cri::{CriContainerd, Daemon, DaemonSettings, ProxySnapshotter};
use fixtures::harness::{Registry, RegistryLog};

#[derive(Parser)]
#[command(about = "Starts one real part of the integration tests for a script")]
struct Lab {
    #[command(subcommand)]
    part: Part,
}

#[derive(Subcommand)]
enum Part {
    /// A CNCF distribution registry storing in --data (DIR/registry), logging each request
    /// (with the bytes it sent) to DIR/registry.log; prints REG (127.0.0.1:port). With --realm
    /// it answers a request without a token with the challenge public registries send and takes
    /// any token; with --tls-cert and --tls-key it speaks HTTPS; --extra YAML (a `proxy` block)
    /// is added to its configuration.
    Registry {
        dir: PathBuf,
        #[arg(long)]
        data: Option<PathBuf>,
        #[arg(long)]
        realm: Option<String>,
        #[arg(long, requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        #[arg(long, requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        #[arg(long, default_value = "")]
        extra: String,
    },
    /// containerd 1.6 with its CRI plugin in DIR (socket DIR/containerd.sock), reaching the
    /// loopback registry MIRROR over plain HTTP, its CRI snapshotter the proxy snapshotter at
    /// --snapshotter called --name (overlayfs without); --extra TOML appended.
    Containerd {
        dir: PathBuf,
        #[arg(long)]
        mirror: String,
        #[arg(long)]
        snapshotter: Option<PathBuf>,
        #[arg(long, default_value = "vmdisk")]
        name: String,
        #[arg(long, default_value = "")]
        extra: String,
    },
    /// A node's vmdisk-snapshotter (--program) with its files in DIR (DIR/vmdisk.sock,
    /// DIR/manage.sock, DIR/vmdisk.log) and vmdisk's defaults, reading the content store of the
    /// containerd rooted at --containerd-root; --top among its top-level settings, --extra
    /// after its [registry] table.
    Node {
        dir: PathBuf,
        #[arg(long)]
        program: PathBuf,
        #[arg(long)]
        containerd_root: Option<PathBuf>,
        #[arg(long, default_value = "")]
        top: String,
        #[arg(long, default_value = "")]
        extra: String,
    },
}

fn main() {
    match Lab::parse().part {
        Part::Registry {
            dir,
            data,
            realm,
            tls_cert,
            tls_key,
            extra,
        } => {
            let auth = realm.map_or_else(String::new, |realm| {
                format!("auth: {{ silly: {{ realm: \"{realm}\", service: origin }} }}\n")
            });
            let tls = match (tls_cert, tls_key) {
                (Some(cert), Some(key)) => format!(
                    ", tls: {{ certificate: {}, key: {} }}",
                    cert.display(),
                    key.display()
                ),
                _ => String::new(),
            };
            let data = data.unwrap_or_else(|| dir.join("registry"));
            let yaml = format!("{auth}{extra}\n");
            let registry = Registry::start_at(&dir, &data, (&tls, &yaml), RegistryLog::Requests);
            println!("REG={}", registry.host());
            leave_running(registry, |r| r.pid());
        }
        Part::Containerd {
            dir,
            mirror,
            snapshotter,
            name,
            extra,
        } => {
            let proxy = snapshotter.as_deref().map(|socket| ProxySnapshotter {
                name: &name,
                socket,
            });
            let containerd = CriContainerd::start_in(&dir, proxy, &[mirror], "", &extra, &[]);
            leave_running(containerd, |c| c.pid());
        }
        Part::Node {
            dir,
            program,
            containerd_root,
            top,
            extra,
        } => {
            let containerd_root = containerd_root.unwrap_or_else(|| dir.join("no-containerd"));
            let node = Daemon::start_at(
                &program,
                &dir,
                &containerd_root,
                DaemonSettings::Defaults,
                (&top, &extra),
                &[],
            );
            leave_running(node, Daemon::pid);
        }
    }
}

/// Prints `part`'s pid as `LAB_PID` and leaves it running when this program ends (its fixture
/// would stop it when dropped).
fn leave_running<T>(part: T, pid: impl Fn(&T) -> u32) {
    println!("LAB_PID={}", pid(&part));
    std::mem::forget(part);
}

//! A fleet behind a pull-through cache: several daemons (separate roots and caches) read the
//! same disk through CNCF distribution in proxy mode, configured as their `hosts.toml`
//! mirror, as a Harbor or distribution cache would be deployed in front of a real fleet.
//!
//! Two counting proxies stand in front of the origin registry, one for the cache's own
//! fetches and one for the nodes' direct requests, so the test sees what the origin served
//! to whom. The proxy cache answers a Range request for a blob it does not hold yet with the
//! whole blob (HTTP 200); the nodes must pass by it for those and come back once it holds the
//! blob. Then the mirror is stopped and a new node reads everything from the origin.

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use sha2::{Digest as _, Sha256};

use crate::fixtures::cri::Daemon;
use crate::fixtures::harness::*;
use crate::fixtures::node::hosts_dir;

/// Every sample of a metrics scrape whose series starts with `prefix`, by series.
fn samples(text: &str, prefix: &str) -> BTreeMap<String, u64> {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(series, v)| (series.to_string(), v.parse().unwrap()))
        .collect()
}

fn scrape(daemon: &Daemon) -> String {
    crate::fixtures::node::scrape(&daemon.root.parent().unwrap().join("metrics.sock"))
}

/// A daemon named `name` whose `hosts.toml` for `registry` lists `mirror` (if any) before the
/// registry.
fn node(scratch: &Scratch, name: &str, registry: &str, mirror: Option<&str>) -> Daemon {
    let metrics = scratch.path(name).join("metrics.sock");
    let daemon = Daemon::start_in(
        scratch,
        name,
        &format!("[metrics]\naddress = \"unix:{}\"\n", metrics.display()),
    );
    let dir = daemon.hosts.join(registry);
    std::fs::create_dir_all(&dir).unwrap();
    let mirror = mirror.map_or(String::new(), |m| {
        format!("\n[host.\"http://{m}\"]\n  capabilities = [\"pull\", \"resolve\"]\n")
    });
    std::fs::write(
        dir.join("hosts.toml"),
        format!("server = \"http://{registry}\"\n{mirror}"),
    )
    .unwrap();
    daemon
}

/// Reads the disk `reference` names in full through `daemon`; checks it is `want` (sha256).
fn read_disk(daemon: &Daemon, reference: &str, want: &str) {
    let path = daemon.vmdisk_ok(&["path", reference]);
    let path = Path::new(path.trim());
    dd_read(path, "1M");
    assert_eq!(
        sha256_file(path),
        want,
        "{} read through the fleet",
        path.display()
    );
}

/// Waits (at most two minutes) until `daemon` fetched `blob` bytes of disks from the registry's
/// endpoints: its mount server hydrated the disk it mounted.
fn wait_until_hydrated(daemon: &Daemon, blob: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let fetched: u64 = samples(&scrape(daemon), "vmdisk_registry_bytes_total")
            .values()
            .sum();
        if fetched >= blob {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the node fetched {fetched} of the {blob}-byte disk"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits (at most a minute) until `registry` answers a Range request for the blob with 206.
fn wait_until_it_serves_ranges(registry: &Registry, digest: &str) {
    let url = registry.url(&format!("/v2/vm/fleet/blobs/{digest}"));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        // A 200 carries the whole blob: curl gives up on it at once (--max-filesize).
        let out = std::process::Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-r", "0-0"])
            .args(["--max-filesize", "65536", &url])
            .output()
            .expect("run curl");
        let code = out.stdout;
        if code == b"206" {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the pull-through cache still answers a Range request with {}",
            String::from_utf8_lossy(&code)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Node `n`, as the snapshotter runs one by default (background hydration at 50 MB/s): a
/// mount of `reference` through the mirrors of `hosts`, with a cache of its own.
fn hydrating_node(scratch: &Scratch, n: usize, reference: &str, hosts: &Path) -> Mount {
    Mount::start(
        reference,
        &scratch.path(&format!("node{n}/cache")),
        &scratch.path(&format!("node{n}/mnt")),
        &[
            "--hosts-dir",
            hosts.to_str().unwrap(),
            "--hydrate",
            "background",
        ],
    )
}

/// Node `n`'s boot: 16 scattered 64 KiB reads of the disk `mount` serves, each checked against
/// `disk`'s bytes.
fn boot(n: usize, mount: &Mount, disk: &Path) {
    let (got, want) = (
        std::fs::File::open(&mount.disk).unwrap(),
        std::fs::File::open(disk).unwrap(),
    );
    let pieces = want.metadata().unwrap().len() / (1 << 20);
    for i in 0..16u64 {
        let at = ((i * 7 + n as u64) % pieces) * (1 << 20);
        let (mut a, mut b) = (vec![0u8; 65536], vec![0u8; 65536]);
        got.read_exact_at(&mut a, at).unwrap();
        want.read_exact_at(&mut b, at).unwrap();
        assert!(a == b, "node {n}: wrong bytes at {at}");
    }
}

/// A qcow2 of 64 MiB of random data (`seed`) pushed as `repo:1` to `origin`: its path and
/// its disk blob's size.
fn random_disk(
    scratch: &Scratch,
    origin: &Registry,
    repo: &str,
    seed: u64,
) -> (std::path::PathBuf, u64) {
    let disk = scratch.path(&format!("{}.qcow2", repo.replace('/', "-")));
    make_qcow2(&disk, "72M", &[]);
    write_random(&disk, 4 << 20, 64 << 20, seed);
    vmdisk_ok(&[
        "push",
        disk.to_str().unwrap(),
        &format!("{}/{repo}:1", origin.host()),
    ]);
    let blob = inspect_json(&format!("{}/{repo}:1", origin.host()))["platforms"][0]["layers"][0]
        ["size"]
        .as_u64()
        .unwrap();
    (disk, blob)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1 << 20)
}

/// Nodes (the daemon, its mount servers) one after the other behind a pull-through registry
/// cache: each mounts the disk and hydrates it in the background, as by default, before a
/// reader reads it all. The first node's hydration has the cache fill the blob and waits for
/// it; the next nodes hydrate through the filled cache (a mount server learns in the run that
/// the cache serves the blob), so they cost the origin (almost) nothing. With the cache gone,
/// a node reads everything from the origin without errors.
#[test]
fn a_fleet_behind_a_pull_through_cache_fetches_each_chunk_from_the_origin_about_once() {
    const NODES: usize = 4;
    let scratch = Scratch::new();
    let origin = Registry::start(&scratch);
    // 32 MiB of random data (incompressible: 128 chunks of 256 KiB).
    let qcow2 = scratch.path("fleet.qcow2");
    make_qcow2(&qcow2, "40M", &[]);
    write_random(&qcow2, 4 << 20, 32 << 20, 11);
    let want = sha256_file(&qcow2);
    vmdisk_ok(&[
        "push",
        qcow2.to_str().unwrap(),
        &format!("{}/vm/fleet:1", origin.host()),
    ]);
    let (blob, blob_digest) = {
        let report = inspect_json(&format!("{}/vm/fleet:1", origin.host()));
        let layer = &report["platforms"][0]["layers"][0];
        (
            layer["size"].as_u64().unwrap(),
            layer["digest"].as_str().unwrap().to_string(),
        )
    };
    // What the origin serves to the cache, and to the nodes directly.
    let to_cache = FaultProxy::counting(origin.port);
    let to_nodes = FaultProxy::counting(origin.port);
    let mirror = Registry::start_with(
        &scratch,
        &format!("proxy: {{ remoteurl: \"http://{}\" }}\n", to_cache.host()),
    );
    // The nodes know the registry by the host of the proxy that counts their direct requests.
    let reference = format!("{}/vm/fleet:1", to_nodes.host());

    let origin_sent = || to_cache.bytes_to_client() + to_nodes.bytes_to_client();
    let mut read_by_nodes = 0u64;
    let mut mirror_failures = 0u64;
    let mut after_first = 0;
    for n in 0..NODES {
        let daemon = node(
            &scratch,
            &format!("node{n}"),
            &to_nodes.host(),
            Some(&mirror.host()),
        );
        daemon.vmdisk_ok(&["path", &reference]);
        wait_until_hydrated(&daemon, blob * 9 / 10);
        read_disk(&daemon, &reference, &want);
        let text = scrape(&daemon);
        let bytes = samples(&text, "vmdisk_registry_endpoint_bytes_total");
        read_by_nodes += bytes.values().sum::<u64>();
        mirror_failures += samples(&text, "vmdisk_registry_endpoint_failures_total")
            .iter()
            .filter(|(series, _)| series.contains(&mirror.host()))
            .map(|(_, v)| v)
            .sum::<u64>();
        let errors = samples(&text, "vmdisk_read_errors_total");
        assert!(errors.values().all(|&v| v == 0), "read errors: {errors:?}");
        if n == 0 {
            // The first node's hydration waited for the cache's fill: it answers ranges now.
            wait_until_it_serves_ranges(&mirror, &blob_digest);
            after_first = origin_sent();
        }
    }
    let (cache_bytes, direct_bytes) = (to_cache.bytes_to_client(), to_nodes.bytes_to_client());
    let later_nodes = origin_sent() - after_first;
    eprintln!(
        "fleet of {NODES}: disk blob {:.1} MiB; the nodes received {:.1} MiB; the origin sent {:.1} MiB to the cache and {:.1} MiB to the nodes directly ({:.2}x the blob in all, {:.2}x without a mirror; {:.2} MiB for the {} nodes after the first); {mirror_failures} requests passed by the mirror",
        mib(blob),
        mib(read_by_nodes),
        mib(cache_bytes),
        mib(direct_bytes),
        (cache_bytes + direct_bytes) as f64 / blob as f64,
        read_by_nodes as f64 / blob as f64,
        mib(later_nodes),
        NODES - 1,
    );
    assert!(
        read_by_nodes >= NODES as u64 * blob * 9 / 10,
        "each node read the disk in full"
    );
    // The nodes after the first cost the origin (almost) nothing: its share does not grow
    // with the fleet.
    assert!(
        later_nodes < blob / 10,
        "the nodes after the first made the origin send {later_nodes} bytes"
    );
    // The cache fetches the blob once to store it, and every request that missed while it
    // filled (each one passed by the mirror) streams its own copy from the origin until the
    // node hangs up: how much of it depends on timing, at most a blob each. The first node's
    // TOC and any reads before its hydration went to the origin.
    assert!(
        cache_bytes + direct_bytes <= (2 + mirror_failures) * blob + blob / 10,
        "the origin sent {} bytes for a {blob}-byte blob read by {NODES} nodes, {mirror_failures} requests passing by the mirror",
        cache_bytes + direct_bytes
    );

    // The mirror goes away: a new node reads everything from the origin, without errors.
    let stopped = mirror.host();
    drop(mirror);
    let before = to_nodes.bytes_to_client();
    let late = node(&scratch, "late", &to_nodes.host(), Some(&stopped));
    read_disk(&late, &reference, &want);
    let from_origin = to_nodes.bytes_to_client() - before;
    let text = scrape(&late);
    let failures: u64 = samples(&text, "vmdisk_registry_endpoint_failures_total")
        .values()
        .sum();
    let requests = samples(&text, "vmdisk_registry_endpoint_requests_total");
    eprintln!(
        "with the mirror down: {:.1} MiB from the origin; requests {requests:?}; {failures} failed",
        mib(from_origin)
    );
    assert!(
        from_origin >= blob * 9 / 10,
        "{from_origin} bytes from the origin"
    );
    let errors = samples(&text, "vmdisk_read_errors_total");
    assert!(errors.values().all(|&v| v == 0), "read errors: {errors:?}");
}

/// A pull-through registry cache (CNCF distribution here; Harbor's proxy cache does the same)
/// fetches a whole blob from the origin whenever it is asked for one it lacks, a Range request
/// included, and cannot answer a range of it before it holds it. Nodes run the default
/// configuration (background hydration): the cache does not declare itself a Range cache, so the
/// first node's boot reads go to the origin and start no fill racing them on the origin's link;
/// its hydration then asks the cache, whose one fill it waits for instead of fetching the disk
/// from the origin itself; the rest of the fleet boots from the origin and hydrates through the
/// filled cache (and reads through it once it served them a range). Before, a node's TOC read
/// could start the fill during its boot (a cache that held the config answered its range as a
/// Range cache does), and its hydration fetched the whole disk from the origin beside the
/// cache's fill (2 blobs, not 1).
#[test]
fn a_fleet_through_a_cold_pull_through_cache_boots_past_its_fill_and_hydrates_through_it() {
    const NODES: usize = 8;
    let scratch = Scratch::new();
    let origin = Registry::start(&scratch);
    let to_cache = FaultProxy::counting(origin.port);
    let to_nodes = FaultProxy::counting(origin.port);
    let mirror = Registry::start_with(
        &scratch,
        &format!("proxy: {{ remoteurl: \"http://{}\" }}\n", to_cache.host()),
    );
    let hosts = hosts_dir(&scratch, &to_nodes.host(), &mirror.host());
    let (disk, blob) = random_disk(&scratch, &origin, "vm/disk", 1);
    let reference = format!("{}/vm/disk:1", to_nodes.host());
    let start = |n: usize| hydrating_node(&scratch, n, &reference, &hosts);
    let boot = |n: usize, mount: &Mount| boot(n, mount, &disk);

    // The first node meets the cache cold: its boot starts no fill.
    let mut first = start(0);
    boot(0, &first);
    let during_boot = to_cache.bytes_to_client();
    first.wait_for("hydrated", Duration::from_secs(180));
    let first_direct = to_nodes.bytes_to_client();
    first.stop();
    eprintln!(
        "one node through a cold pull-through cache: {:.2} MiB to the cache during its boot; then, hydrated, {:.1} MiB to the cache and {:.1} MiB to the node from the origin (blob {:.1} MiB)",
        mib(during_boot),
        mib(to_cache.bytes_to_client()),
        mib(to_nodes.bytes_to_client()),
        mib(blob)
    );
    assert!(
        during_boot < 1 << 20,
        "the cache fetched {during_boot} bytes from the origin during the first boot: a fill raced it"
    );

    // The fleet boots and hydrates at once through the filled cache.
    std::thread::scope(|s| {
        for n in 1..NODES {
            let (start, boot) = (&start, &boot);
            s.spawn(move || {
                let mut mount = start(n);
                boot(n, &mount);
                mount.wait_for("hydrated", Duration::from_secs(180));
                mount.stop();
            });
        }
    });
    let (cache_total, direct_total) = (to_cache.bytes_to_client(), to_nodes.bytes_to_client());
    eprintln!(
        "{NODES} nodes booted and hydrated: the origin sent {:.1} MiB to the cache and {:.1} MiB to the nodes ({:.2} x the blob; {NODES} x with no mirror)",
        mib(cache_total),
        mib(direct_total),
        (cache_total + direct_total) as f64 / blob as f64
    );
    // The nodes after the first read their boots (16 reads of a 256 KiB chunk each, and their
    // TOCs) from the origin and hydrated through the cache: under 7 x 4 MiB, not 7 blobs.
    let fleet_direct = direct_total - first_direct;
    assert!(
        fleet_direct < blob / 2,
        "the origin sent {fleet_direct} bytes to the {} nodes after the first",
        NODES - 1
    );
    // One fill (the cache's, plus what it streamed to requests it was hung up on) and the
    // nodes' boots: under two blobs.
    assert!(
        cache_total + direct_total <= blob * 2,
        "the origin sent {} bytes for a {blob}-byte disk hydrated by {NODES} nodes",
        cache_total + direct_total
    );
}

/// The shipped regional cache (`config/nginx-regional-cache.conf`: nginx's slice cache, run as
/// shipped but for the places it marks EDIT) in front of the origin: a fleet booting a new
/// disk at once and hydrating it, as nodes do by default, costs the origin the blob once —
/// each slice is fetched once, concurrent misses wait for the first — and every byte is right.
/// With the cache gone, a node reads from the origin.
#[test]
fn a_fleet_behind_the_shipped_slice_cache_costs_the_origin_what_one_node_does() {
    const NODES: usize = 8;
    let scratch = Scratch::new();
    let origin = Registry::start(&scratch);
    let to_cache = FaultProxy::counting(origin.port);
    let to_nodes = FaultProxy::counting(origin.port);
    let cache = RegionalCache::start(&scratch, &to_cache.host());
    let hosts = hosts_dir(&scratch, &to_nodes.host(), &cache.host());
    // Two disks of the same shape (64 MiB of random data): one read by a node alone, one by
    // the fleet at once, both new to the cache.
    let publish = |name: &str, seed: u64| {
        let qcow2 = scratch.path(&format!("{name}.qcow2"));
        make_qcow2(&qcow2, "72M", &[]);
        write_random(&qcow2, 4 << 20, 64 << 20, seed);
        vmdisk_ok(&[
            "push",
            qcow2.to_str().unwrap(),
            &format!("{}/vm/{name}:1", origin.host()),
        ]);
        qcow2
    };
    let disks = [publish("alone", 1), publish("fleet", 2)];
    // The boot set every node reads: 24 scattered 64 KiB pieces of the qcow2 file.
    let mibs = std::fs::metadata(&disks[0]).unwrap().len() >> 20;
    let boot_set: Vec<u64> = (0..24u64)
        .map(|i| ((i * 37) % (mibs - 1)) * (1 << 20) + (i % 3) * 200_000)
        .collect();
    // A node boots (reads the boot set), and with `hydrate` goes on as the snapshotter does
    // by default (background hydration) until it holds the whole disk.
    let read = |node: &str, disk: usize, hydrate: bool| {
        let name = ["alone", "fleet"][disk];
        let mut args = vec!["--hosts-dir", hosts.to_str().unwrap(), "--plain-http"];
        if hydrate {
            args.extend(["--hydrate", "background"]);
        }
        let mut mount = Mount::start(
            &format!("{}/vm/{name}:1", to_nodes.host()),
            &scratch.path(&format!("{node}/cache")),
            &scratch.path(&format!("{node}/mnt")),
            &args,
        );
        let (got, want) = (
            std::fs::File::open(&mount.disk).unwrap(),
            std::fs::File::open(&disks[disk]).unwrap(),
        );
        for &at in &boot_set {
            let (mut a, mut b) = (vec![0u8; 65536], vec![0u8; 65536]);
            got.read_exact_at(&mut a, at).unwrap();
            want.read_exact_at(&mut b, at).unwrap();
            assert!(a == b, "{node}: wrong bytes at {at}");
        }
        drop(got);
        if hydrate {
            mount.wait_for("hydrated", Duration::from_secs(180));
        }
        mount.stop();
    };
    let origin_sent = || (to_cache.bytes_to_client(), to_nodes.bytes_to_client());

    read("alone", 0, false);
    let (alone_cache, alone_direct) = origin_sent();
    std::thread::scope(|s| {
        for n in 0..NODES {
            let read = &read;
            s.spawn(move || read(&format!("node{n}"), 1, true));
        }
    });
    let (cache_total, direct_total) = origin_sent();
    let (fleet_cache, fleet_direct) = (cache_total - alone_cache, direct_total - alone_direct);
    let log = cache.access_log();
    let hits = log.lines().filter(|l| l.contains(" HIT ")).count();
    eprintln!(
        "through the slice cache: one node cost the origin {:.2} MiB ({alone_direct} bytes around the cache), {NODES} nodes at once {:.2} MiB ({fleet_direct} bytes around it); {hits} cache hits",
        mib(alone_cache),
        mib(fleet_cache),
    );
    // Every node went through the cache: nothing came from the origin around it.
    assert_eq!(
        (alone_direct, fleet_direct),
        (0, 0),
        "bytes the nodes fetched from the origin directly"
    );
    assert!(
        alone_cache > 24 * 65536,
        "one node's boot set came through the cache"
    );
    // Booted and hydrated, the fleet cost the origin the blob once: each slice fetched once
    // for all, a node's hydration answered from slices others fetched.
    let fleet_blob = inspect_json(&format!("{}/vm/fleet:1", origin.host()))["platforms"][0]
        ["layers"][0]["size"]
        .as_u64()
        .unwrap();
    eprintln!(
        "{NODES} nodes booted and hydrated: {:.2} x the blob from the origin",
        fleet_cache as f64 / fleet_blob as f64
    );
    assert!(
        fleet_cache <= fleet_blob * 11 / 10 && fleet_cache >= fleet_blob * 9 / 10,
        "{NODES} nodes booting and hydrating a {fleet_blob}-byte blob cost the origin {fleet_cache} bytes"
    );

    // A pull (a GET with no Range) of the disk's blob through the cache gets the whole blob,
    // from the 8 MiB slices of its own location (an nginx cache file starts with its key).
    let report = inspect_json(&format!("{}/vm/fleet:1", origin.host()));
    let layer = report["platforms"][0]["layers"]
        .as_array()
        .unwrap()
        .iter()
        .max_by_key(|l| l["size"].as_u64().unwrap())
        .unwrap()["digest"]
        .as_str()
        .unwrap()
        .to_string();
    let whole = curl(&[
        "-sf",
        &format!("http://{}/v2/vm/fleet/blobs/{layer}", cache.host()),
    ]);
    assert_eq!(
        format!("sha256:{}", hex::encode(Sha256::digest(&whole))),
        layer,
        "the whole blob through the cache"
    );
    let key = format!("KEY: whole/v2/vm/fleet/blobs/{layer}bytes=8388608-16777215");
    let found = std::process::Command::new("grep")
        .args(["-rlF", &key])
        .arg(cache.dir.join("cache"))
        .output()
        .unwrap();
    assert!(
        !found.stdout.is_empty(),
        "no cache entry {key:?}: the whole blob was not answered from 8 MiB slices"
    );

    // The cache goes away: a new node reads the boot set from the origin, every byte right.
    cache.stop();
    read("late", 1, false);
    let late_direct = to_nodes.bytes_to_client() - direct_total;
    eprintln!(
        "with the cache down: {:.2} MiB from the origin directly",
        mib(late_direct)
    );
    assert!(
        late_direct > 24 * 65536,
        "the node read from the origin: {late_direct} bytes"
    );
}

/// An origin that wants a token, as every public registry does, behind the shipped slice
/// cache: a node's first manifest request carries no credentials, and the cache sends such a
/// request to the origin instead of answering it from its copy, so the node meets the
/// origin's challenge, authenticates and sends its token with every blob request; a slice the
/// cache lacks is fetched with it. The fleet, booted and hydrated, costs the origin the blob
/// once and no byte goes around the cache. (Answered from the cache, the manifest taught a node
/// no token: a slice it missed came back as the origin's 401, cut in the middle of the answer,
/// and the node read it from the origin itself — 1.1 to 2.4 times the blob at 20 nodes.)
#[test]
fn a_fleet_behind_the_slice_cache_of_an_origin_that_wants_tokens_costs_it_the_blob_once() {
    const NODES: usize = 6;
    let scratch = Scratch::new();
    let tokens = crate::fixtures::token::TokenServer::start(&scratch, "fleet", "secret");
    let origin = tokens.registry(&scratch);
    let to_cache = FaultProxy::counting(origin.port);
    let to_nodes = FaultProxy::counting(origin.port);
    let cache = RegionalCache::start(&scratch, &to_cache.host());
    let hosts = hosts_dir(&scratch, &to_nodes.host(), &cache.host());
    let auth = docker_config(scratch.dir.path(), &to_nodes.host(), "fleet", "secret");
    let auth = auth.to_str().unwrap();
    let reference = format!("{}/vm/tokens:1", to_nodes.host());
    let disk = scratch.path("tokens.qcow2");
    make_qcow2(&disk, "72M", &[]);
    write_random(&disk, 4 << 20, 64 << 20, 5);
    vmdisk_ok(&[
        "push",
        "--auth-file",
        auth,
        disk.to_str().unwrap(),
        &reference,
    ]);
    let report: serde_json::Value = serde_json::from_str(&vmdisk_ok(&[
        "inspect",
        "--auth-file",
        auth,
        "--json",
        &reference,
    ]))
    .unwrap();
    let blob = report["platforms"][0]["layers"][0]["size"]
        .as_u64()
        .unwrap();
    // A node boots, and with `hydrate` goes on until it holds the whole disk.
    let node = |n: usize, hydrate: bool| {
        let mut args = vec!["--hosts-dir", hosts.to_str().unwrap(), "--auth-file", auth];
        if hydrate {
            args.extend(["--hydrate", "background"]);
        }
        let mut mount = Mount::start(
            &reference,
            &scratch.path(&format!("node{n}/cache")),
            &scratch.path(&format!("node{n}/mnt")),
            &args,
        );
        // Every node reads the same boot set, as a fleet booting one image does.
        boot(0, &mount, &disk);
        if hydrate {
            mount.wait_for("hydrated", Duration::from_secs(180));
        }
        mount.stop();
    };
    // A first node boots: the cache holds the tag's manifest (for 10 s) and the slices of the
    // boot reads. The fleet that follows at once finds both there, and its hydration then asks
    // for ranges whose first slice is cached and whose next ones are not.
    node(0, false);
    let before = (to_cache.bytes_to_client(), to_nodes.bytes_to_client());
    std::thread::scope(|s| {
        for n in 1..=NODES {
            let node = &node;
            s.spawn(move || node(n, true));
        }
    });
    let (through, around) = (
        to_cache.bytes_to_client() - before.0,
        to_nodes.bytes_to_client() - before.1,
    );
    eprintln!(
        "{NODES} nodes booted and hydrated after a first one, through the slice cache of an origin that wants tokens: {:.2} x the blob through it, {around} bytes around it",
        through as f64 / blob as f64
    );
    assert_eq!(
        around, 0,
        "bytes the nodes fetched from the origin around the cache"
    );
    assert!(
        through <= blob * 11 / 10,
        "{NODES} nodes booting and hydrating a {blob}-byte blob cost the origin {through} bytes"
    );
}

/// `vmdisk preheat` warms a regional cache with a disk, no node mounting it: the shipped slice
/// cache (every range read through it once) and a pull-through cache (the preheat waits for
/// its fill). A rollout after it — nodes booting and hydrating as they do by default — costs
/// the origin no byte of the disk through the slice cache; through the pull-through cache, which
/// does not declare itself a Range cache, the nodes' boots read from the origin (a node cannot
/// tell it holds the disk without asking it, and asking one that does not starts its fill beside
/// the boot) and their hydration, through the cache, costs the origin nothing.
#[test]
fn a_preheated_cache_serves_a_rollout_without_the_origin() {
    const NODES: usize = 8;
    let scratch = Scratch::new();
    let origin = Registry::start(&scratch);
    let to_cache = FaultProxy::counting(origin.port);
    let to_nodes = FaultProxy::counting(origin.port);
    let slices = RegionalCache::start(&scratch, &to_cache.host());
    let pull_through = Registry::start_with(
        &scratch,
        &format!("proxy: {{ remoteurl: \"http://{}\" }}\n", to_cache.host()),
    );
    for (name, mirror) in [
        ("slices", slices.host()),
        ("pull-through", pull_through.host()),
    ] {
        let hosts = hosts_dir(&scratch, &to_nodes.host(), &mirror);
        let repo = format!("vm/{name}");
        let (disk, blob) = random_disk(&scratch, &origin, &repo, name.len() as u64);
        let reference = format!("{}/{repo}:1", to_nodes.host());
        let before = to_cache.bytes_to_client();
        let out = vmdisk_ok(&[
            "preheat",
            "--hosts-dir",
            hosts.to_str().unwrap(),
            "--plain-http",
            &reference,
        ]);
        let (warmed, direct) = (to_cache.bytes_to_client(), to_nodes.bytes_to_client());
        eprintln!("{name}: {}", out.trim());
        assert!(out.contains(&mirror), "{out}");
        assert!(
            warmed - before >= blob,
            "{name}: the cache fetched {} bytes of a {blob}-byte disk to be warmed",
            warmed - before
        );
        std::thread::scope(|s| {
            for n in 0..NODES {
                let (scratch, reference, hosts, disk) = (&scratch, &reference, &hosts, &disk);
                s.spawn(move || {
                    let mut mount = hydrating_node(scratch, n + 10 * name.len(), reference, hosts);
                    boot(n, &mount, disk);
                    mount.wait_for("hydrated", Duration::from_secs(180));
                    mount.stop();
                });
            }
        });
        let (rollout_cache, rollout_direct) = (
            to_cache.bytes_to_client() - warmed,
            to_nodes.bytes_to_client() - direct,
        );
        eprintln!(
            "{name}: {NODES} nodes booted and hydrated after the preheat; the origin sent {rollout_cache} bytes to the cache and {rollout_direct} to the nodes"
        );
        // Manifests and tags are asked again (a tag's copy is kept 10 s); the disk never
        // through the slice cache, and only the boots' reads (8 x 16 reads of a 256 KiB chunk
        // at most, and the TOCs) beside the pull-through cache.
        let bound = if name == "slices" { 64 << 10 } else { blob };
        assert!(
            rollout_cache + rollout_direct < bound,
            "{name}: a preheated rollout cost the origin {} bytes",
            rollout_cache + rollout_direct
        );
    }
}

/// The shipped slice cache in front of an HTTPS origin — every public registry's case — as
/// operators deploy it: the origin's certificate verified (`proxy_ssl_verify on`) against a CA
/// (a test CA here, the system's in production) under the name it gives. Eight nodes boot and
/// hydrate a disk through it, every byte right, and the origin sends the blob once. A cache
/// that does not trust the origin's certificate answers nothing of it (502).
#[test]
fn the_shipped_slice_cache_speaks_https_to_the_origin_and_verifies_it() {
    let scratch = Scratch::new();
    let origin = Registry::start(&scratch);
    let (https, ca) = origin.tls_front(&scratch);
    let to_cache = FaultProxy::counting(https.port);
    let cache = RegionalCache::start_https(&scratch, &to_cache.host(), &ca, "localhost");
    let (disk, blob) = random_disk(&scratch, &origin, "vm/tls", 5);
    let hosts = scratch.path("hosts-https");
    std::fs::create_dir_all(hosts.join(https.host())).unwrap();
    std::fs::write(
        hosts.join(https.host()).join("hosts.toml"),
        format!(
            "server = \"https://{}\"\nca = \"{}\"\n[host.\"http://{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
            https.host(),
            ca.display(),
            cache.host()
        ),
    )
    .unwrap();
    let reference = format!("{}/vm/tls:1", https.host());
    std::thread::scope(|s| {
        for n in 0..8 {
            let (scratch, reference, hosts, disk) = (&scratch, &reference, &hosts, &disk);
            s.spawn(move || {
                let mut mount = hydrating_node(scratch, n, reference, hosts);
                boot(n, &mount, disk);
                mount.wait_for("hydrated", Duration::from_secs(180));
                mount.stop();
            });
        }
    });
    let sent = to_cache.bytes_to_client();
    let misses = cache
        .access_log()
        .lines()
        .filter(|l| l.contains("/blobs/") && l.contains(" MISS "))
        .count();
    eprintln!(
        "eight nodes through the slice cache of an HTTPS origin: the origin sent {:.2} x the blob over TLS; {misses} slice misses",
        sent as f64 / blob as f64
    );
    assert!(misses > 0, "the cache fetched no slice from the origin");
    assert!(
        sent >= blob && sent <= blob * 11 / 10,
        "the origin sent {sent} bytes (TLS included) for a {blob}-byte blob"
    );

    // Not trusting the origin's CA (the system's CAs do not know the test CA), the cache
    // answers nothing of it.
    let untrusting = RegionalCache::start_https(
        &scratch,
        &to_cache.host(),
        Path::new("/etc/ssl/certs/ca-certificates.crt"),
        "localhost",
    );
    let digest = inspect_json(&format!("{}/vm/tls:1", origin.host()))["platforms"][0]["layers"][0]
        ["digest"]
        .as_str()
        .unwrap()
        .to_string();
    let code = curl(&[
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "-r",
        "0-9",
        &format!("http://{}/v2/vm/tls/blobs/{digest}", untrusting.host()),
    ]);
    assert_eq!(
        String::from_utf8_lossy(&code),
        "502",
        "a cache that cannot verify the origin"
    );
}

/// The shipped slice cache in front of an origin that redirects its blobs to a blob host with
/// signed, expiring URLs, as every public registry does: the cache follows the redirect for
/// the fleet (its blob fetcher) and keeps the slices under the blob's digest and range, so a
/// fleet booting the same disk costs the blob host what one node does, and every node's reads
/// come through the cache (before, nginx handed each node the 307 and every node fetched its
/// boot from the blob host itself: 4 nodes cost it 4 boots).
#[test]
fn a_fleet_behind_the_slice_cache_of_a_redirecting_origin_costs_the_blob_host_what_one_node_does() {
    const NODES: usize = 8;
    let scratch = Scratch::new();
    let origin = Registry::start(&scratch);
    let (disk, _) = random_disk(&scratch, &origin, "vm/cdn", 21);
    let cdn = crate::fixtures::cdn::CdnRegistry::start(
        &origin,
        &origin.root.join("data"),
        Duration::from_secs(60),
    );
    let reference = format!("{}/vm/cdn:1", cdn.host());
    let from_blob_host = || cdn.count(|c| &c.blob_bytes);
    let boot_through = |cache: &RegionalCache, nodes: std::ops::Range<usize>| {
        let hosts = hosts_dir(&scratch, &cdn.host(), &cache.host());
        let before = from_blob_host();
        std::thread::scope(|s| {
            for n in nodes {
                let (scratch, reference, hosts, disk) = (&scratch, &reference, &hosts, &disk);
                s.spawn(move || {
                    let mount = Mount::start(
                        reference,
                        &scratch.path(&format!("node{n}/cache")),
                        &scratch.path(&format!("node{n}/mnt")),
                        &["--hosts-dir", hosts.to_str().unwrap()],
                    );
                    boot(0, &mount, disk);
                    mount.stop()
                });
            }
        });
        from_blob_host() - before
    };
    // One node behind a cache of its own, then a fleet behind another: each cache cold.
    let one = boot_through(&RegionalCache::start(&scratch, &cdn.host()), 0..1);
    let cache = RegionalCache::start(&scratch, &cdn.host());
    let fleet = boot_through(&cache, 1..NODES + 1);
    let redirects_to_nodes = cache
        .access_log()
        .lines()
        .filter(|l| {
            // The nodes' requests (the cache's own port), not its fetcher's.
            l.ends_with(&format!(" {}", cache.port))
                && l.contains("/blobs/")
                && l.split_whitespace().nth(3) == Some("307")
        })
        .count();
    eprintln!(
        "the slice cache of a redirecting origin: one node cost the blob host {:.2} MiB, {NODES} nodes {:.2} MiB ({:.2}x); {} blob requests to the registry, {redirects_to_nodes} redirects handed to nodes",
        mib(one),
        mib(fleet),
        fleet as f64 / one as f64,
        cdn.count(|c| &c.registry_blob_requests)
    );
    assert!(one > 0, "the node read nothing from the blob host");
    assert_eq!(
        redirects_to_nodes, 0,
        "the cache handed the origin's redirects to the nodes"
    );
    assert!(
        fleet * 10 <= one * 11,
        "{NODES} nodes cost the blob host {fleet} bytes, one node {one}"
    );
    assert_eq!(cdn.count(|c| &c.blob_with_authorization), 0);
}

//! Text inputs: image references, WWW-Authenticate challenges, hosts.toml, OVF descriptors.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmdisk::registry::hosts::{parse_hosts_toml, Endpoint};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(r) = text.parse::<vmdisk::oci::reference::Reference>() {
        // A parsed reference prints back to something that parses to the same thing.
        assert_eq!(r.to_string().parse::<vmdisk::oci::reference::Reference>().ok(), Some(r));
    }
    let _ = vmdisk::registry::auth::parse_challenge(text);
    let _ = parse_hosts_toml(text, std::path::Path::new("/etc/containerd/certs.d/r"), Endpoint::upstream("r", false));
    let _ = vmdisk::format::disk::first_disk_href(text);
});

//! Integration tests: the real registry, containerd, skopeo and qemu tools on loopback.
//! They need root (containerd mounts) and the packages `make test` installs.

mod cases;
mod fixtures;

//! Integration tests: the real registry, containerd, skopeo and qemu tools on loopback.
//! They need root (containerd mounts) and the packages `make test` installs.

mod artifact;
mod baddays;
mod boot;
mod cli;
mod conformance;
mod crash;
mod cri;
mod daemon;
mod daemonset;
mod fleet;
mod harness;
mod hostile;
mod index;
mod libvirt;
mod matrix;
mod monitoring;
mod mount;
mod packages;
mod publish;
mod rawview;
mod redirects;
mod signatures;
mod snapshotter;
mod tenants;
mod token;
mod trace;

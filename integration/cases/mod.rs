//! The integration tests, one file per capability; what they share is in `crate::fixtures`.

mod artifact;
mod baddays;
mod boot;
mod cli;
mod conformance;
mod crash;
mod daemon;
mod daemonset;
mod fleet;
mod hostile;
mod index;
mod libvirt;
mod link;
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
mod trace;

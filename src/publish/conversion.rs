//! A `vmdisk convert` under way: what its source's platforms are republished with.

use super::PublishOptions;
use crate::oci::reference::Reference;
use crate::registry::RegistryClient;

/// A `vmdisk convert`: republished from `source` to `target` with `client`, as `opts` say.
pub(super) struct Conversion<'a> {
    pub(super) client: &'a RegistryClient,
    pub(super) source: &'a Reference,
    pub(super) target: &'a Reference,
    pub(super) opts: &'a PublishOptions,
}

//! What the policy's parts read with bounds: policy, key and certificate files, and the
//! signature artifacts a registry lists.

use std::path::Path;

use crate::error::{Error, Result};
use crate::oci::reference::Reference;
use crate::oci::ManifestKind;
use crate::registry::Registry;

/// Most signatures of one kind read for one digest.
pub const MAX_SIGNATURES: usize = 16;

/// Longest signature blob (bundle, payload, envelope) read.
pub const MAX_SIGNATURE_BLOB: u64 = 256 << 10;

/// Reads at most `max` bytes of `path` (a policy, key or certificate).
pub fn read_bounded(path: &Path, max: u64, what: &str) -> Result<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::File::open(path)
        .map_err(|e| Error::io(format!("reading the {what} {}", path.display()), e))?;
    let mut bytes = Vec::new();
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| Error::io(format!("reading the {what} {}", path.display()), e))?;
    if bytes.len() as u64 > max {
        return Err(Error::invalid(format!(
            "the {what} {} is over {max} bytes",
            path.display()
        )));
    }
    Ok(bytes)
}

/// The layers of referrer `desc` in `repo` (none if it is not an image manifest): where a
/// signature artifact keeps its envelope.
pub(super) async fn artifact_layers(
    client: &dyn Registry,
    repo: &Reference,
    desc: &crate::oci::Descriptor,
) -> Result<Vec<crate::oci::Descriptor>> {
    match client
        .get_manifest(&repo.with_digest(desc.digest))
        .await?
        .manifest
    {
        ManifestKind::Image(m) => Ok(m.layers),
        ManifestKind::Index(_) => Ok(Vec::new()),
    }
}

//! Copies of chunks other cached layers hold: a chunk whose digest another layer in the
//! node's cache has kept is copied from that layer's data file instead of fetched. The index
//! is built once per mount, after it is ready, from the other layers' records, TOCs and
//! presence bitmaps; a copy is checked against the chunk's digest like any fetch (the other
//! layer's files are the node's cache, untrusted) and is simply not made when it fails.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::cache::{CacheRoot, Integrity};
use crate::layer::Resolved;
use crate::oci::digest::Digest;
use crate::task::off_the_runtime;

/// Where a chunk with a given digest can be copied from.
struct Source {
    path: PathBuf,
    offset: u64,
    size: u64,
}

/// The chunks of the other cached layers, by digest: empty until [`OtherLayers::index`].
#[derive(Default)]
pub(super) struct OtherLayers {
    by_digest: OnceLock<HashMap<Digest, Source>>,
}

impl OtherLayers {
    /// Indexes the kept chunks of every layer in `cache` but `own` (and those found to differ
    /// from their config, which share nothing); returns how many digests it found. Reads every
    /// cached TOC: blocking I/O, run off the start-up path. Once only: a second call finds the
    /// first's index.
    pub(super) fn index(&self, cache: &CacheRoot, own: &Digest) -> usize {
        self.by_digest.get_or_init(|| build(cache, own)).len()
    }

    /// The bytes of a chunk of `size` bytes with `digest` another layer keeps, checked
    /// against the digest; `None` where no layer keeps it or its copy is not what it claims.
    pub(super) fn copy(&self, digest: &Digest, size: u64) -> Option<Vec<u8>> {
        let source = self.by_digest.get()?.get(digest)?;
        if source.size != size {
            return None;
        }
        off_the_runtime(|| {
            let mut data = vec![0u8; usize::try_from(size).ok()?];
            let file = std::fs::File::open(&source.path).ok()?;
            file.read_exact_at(&mut data, source.offset).ok()?;
            digest
                .verify(&data, "a chunk copied from another layer")
                .ok()?;
            Some(data)
        })
    }
}

fn build(cache: &CacheRoot, own: &Digest) -> HashMap<Digest, Source> {
    let mut map = HashMap::new();
    for digest in cache.layers().into_iter().filter(|d| d != own) {
        if matches!(cache.load_integrity(&digest), Some(Integrity::Failed(_))) {
            continue;
        }
        let Some((meta, toc)) = cache.load_layer_meta(&digest) else {
            continue;
        };
        let reference = meta.reference.clone();
        let Ok(layer) = crate::layer::codec::open(reference, meta, &toc, Resolved::Offline) else {
            continue;
        };
        let dir = cache.layer_dir(&digest);
        let Some(bits) = crate::cache::layer::durable_bits(&dir, layer.chunks.len()) else {
            continue;
        };
        for idx in 0..layer.chunks.len() {
            let (file, chunk) = layer.chunk(idx);
            if bits[idx / 8] & (1 << (idx % 8)) == 0 {
                continue;
            }
            if let Some(d) = chunk.digest {
                map.entry(d).or_insert(Source {
                    path: crate::cache::data_file(&dir, file),
                    offset: chunk.offset,
                    size: chunk.size,
                });
            }
        }
    }
    map
}

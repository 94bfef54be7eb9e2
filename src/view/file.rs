//! Views of plain files: a file of a lazily loaded layer, read through its engine
//! ([`LayerFile`]), and a local file ([`LocalFile`], for images on disk and tests).

use std::ops::Range;
use std::sync::Arc;

use futures_util::future::BoxFuture;

use super::{clipped, DiskView};
use crate::engine::Engine;
use crate::error::{Error, Result};

/// File `file` of a layer, read through its engine.
#[derive(Clone)]
pub struct LayerFile {
    engine: Arc<Engine>,
    file: usize,
}

impl LayerFile {
    pub fn new(engine: Arc<Engine>, file: usize) -> Self {
        LayerFile { engine, file }
    }

    /// The layer's disk.
    pub fn disk(engine: Arc<Engine>) -> Self {
        let disk = engine.layer().disk;
        Self::new(engine, disk)
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// [`DiskView::read`] for reads of our own (metadata), which a boot trace does not record.
    pub async fn read_unrecorded(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        self.engine.read_unrecorded(self.file, offset, len).await
    }
}

impl DiskView for LayerFile {
    fn size(&self) -> u64 {
        self.engine.layer().file_size(self.file)
    }

    fn read_cached(&self, offset: u64, len: u64) -> Option<Result<Vec<u8>>> {
        self.engine.read_cached(self.file, offset, len)
    }

    fn read_cached_into(&self, offset: u64, len: u64, out: &mut Vec<u8>) -> Option<Result<()>> {
        self.engine.read_cached_into(self.file, offset, len, out)
    }

    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Vec<u8>>> {
        Box::pin(self.engine.read(self.file, offset, len))
    }

    fn prefetch(&self, range: Range<u64>) -> BoxFuture<'_, Result<()>> {
        let chunks = self.engine.layer().chunks_for(self.file, range);
        Box::pin(async move {
            if self.engine.all_present(chunks.clone()) {
                return Ok(());
            }
            self.engine.ensure(chunks).await
        })
    }

    /// The cache's data file, once it is fit for passthrough ([`Engine::passthrough_file`]).
    fn backing_file(&self) -> Option<&std::fs::File> {
        self.engine.passthrough_file(self.file)
    }

    fn backing_pending(&self) -> bool {
        self.engine.passthrough_pending(self.file)
    }
}

/// A local file: everything is cached.
pub struct LocalFile {
    file: Arc<std::fs::File>,
    size: u64,
}

impl LocalFile {
    pub fn new(file: std::fs::File) -> Result<Self> {
        let size = file
            .metadata()
            .map_err(|e| Error::io("reading a local disk's size", e))?
            .len();
        Ok(LocalFile {
            file: Arc::new(file),
            size,
        })
    }

    fn read_now(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; clipped(offset, len, self.size) as usize];
        std::os::unix::fs::FileExt::read_exact_at(self.file.as_ref(), &mut buf, offset)
            .map_err(|e| Error::io(format!("reading {} bytes at {offset}", buf.len()), e))?;
        Ok(buf)
    }
}

impl DiskView for LocalFile {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_cached(&self, offset: u64, len: u64) -> Option<Result<Vec<u8>>> {
        Some(self.read_now(offset, len))
    }

    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Vec<u8>>> {
        Box::pin(async move { crate::task::off_the_runtime(|| self.read_now(offset, len)) })
    }

    fn prefetch(&self, _range: Range<u64>) -> BoxFuture<'_, Result<()>> {
        Box::pin(async { Ok(()) })
    }
}

//! The upload plumbing of a publish: a layer built on a blocking thread streamed into a
//! registry blob segment by segment, and whole uploads started again after a broken request.

use bytes::Bytes;

use crate::error::{Error, ErrorKind, Result};
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::registry::{BlobUpload, RegistryClient, UPLOAD_SEGMENT};

/// A `Write` that cuts the stream into upload segments and hands them to the async uploader.
pub(super) struct SegmentSink {
    tx: tokio::sync::mpsc::Sender<Bytes>,
    buf: Vec<u8>,
}

impl SegmentSink {
    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let seg = Bytes::from(std::mem::replace(
            &mut self.buf,
            Vec::with_capacity(UPLOAD_SEGMENT),
        ));
        self.tx
            .blocking_send(seg)
            .map_err(|_| std::io::Error::other("the upload stopped"))
    }
}

impl std::io::Write for SegmentSink {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let room = UPLOAD_SEGMENT - self.buf.len();
        let n = room.min(data.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == UPLOAD_SEGMENT {
            self.send()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `build` on a blocking thread, streaming what it writes into a new blob of `target`.
/// Unless `started` is given, the upload session opens with the first segment, so a build
/// that fails or finds nothing before writing leaves no trace in the registry. `build` reports the blob's digest, or
/// `None` if it wrote nothing; the result comes back once the registry has accepted the blob.
pub(super) async fn upload_streamed<'c, T, F>(
    client: &'c RegistryClient,
    target: &Reference,
    started: Option<BlobUpload<'c>>,
    build: F,
) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce(SegmentSink) -> Result<(T, Option<Digest>, SegmentSink)> + Send + 'static,
{
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(1);
    let worker = tokio::task::spawn_blocking(move || -> Result<(T, Option<Digest>)> {
        let (value, digest, mut sink) = build(SegmentSink {
            tx,
            buf: Vec::with_capacity(UPLOAD_SEGMENT),
        })?;
        sink.send()
            .map_err(|e| Error::io("uploading the layer", e))?;
        Ok((value, digest))
    });
    let mut upload = started;
    while let Some(segment) = rx.recv().await {
        if upload.is_none() {
            upload = Some(client.start_upload(target).await?);
        }
        upload
            .as_mut()
            .expect("started above")
            .write(segment)
            .await?;
    }
    let (value, digest) = worker
        .await
        .map_err(|e| Error::new(ErrorKind::Io, "layer builder failed").with_source(e))??;
    match (upload, digest) {
        (Some(upload), Some(digest)) => upload.finish(&digest).await?,
        (_, None) => {}
        _ => {
            return Err(Error::new(
                ErrorKind::Io,
                "the layer builder's output and its digest disagree",
            ))
        }
    }
    Ok(value)
}

/// Runs `attempt` again when it fails with a network error, under the client's retry policy.
/// Used around whole layer uploads: registries such as distribution 2.8 cancel an upload whose
/// request broke part-way, and then only a new upload of the layer helps. A layer takes as
/// long as it takes: each request of it is bounded, the upload as a whole is not.
pub(super) async fn with_restarts<T, Fut>(
    client: &RegistryClient,
    attempt: impl FnMut() -> Fut,
) -> Result<T>
where
    Fut: std::future::Future<Output = Result<T>>,
{
    client
        .retry_policy()
        .with_deadline(std::time::Duration::MAX)
        .run_when("uploading a layer", attempt, |e| {
            e.kind() == ErrorKind::Network
        })
        .await
}

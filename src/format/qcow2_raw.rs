//! A raw view of a qcow2 image: the guest's bytes at guest offsets, computed on the fly from
//! the image's L1/L2 tables, without converting or copying the image.
//!
//! Kata boots its guest from a raw, partitioned image given by path; publishers ship qcow2.
//! This reader serves the raw bytes from a qcow2 that is itself read lazily, so only the
//! clusters a guest reads are fetched: unallocated and zero clusters are answered with zeros
//! and never read, compressed clusters (deflate, or zstd when the header says so) are
//! decompressed one cluster at a time and bounded by the cluster size. qcow2 v2 and v3; images
//! with a backing file, encryption, an external data file or extended L2 entries are refused
//! (by [`Header::read`]). It never returns bytes it could not map: a table or cluster that
//! points outside the file is an error, not zeros.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::qcow2::{self, Cluster, Header, ReadAt};
use crate::error::{Error, Result};

/// L2 tables kept in memory (each one cluster); enough to cover 64 GiB at 64 KiB clusters.
const L2_CACHE: usize = 128;

/// The raw view of one qcow2 image read through `S`.
pub struct RawView<S> {
    src: S,
    header: Header,
    l1: Vec<u64>,
    zstd: bool,
    l2_cache: Mutex<HashMap<u64, Arc<Vec<u64>>>>,
}

impl<S: ReadAt> RawView<S> {
    /// Reads and checks the header and the L1 table.
    pub fn open(src: S) -> Result<Self> {
        let header = Header::read(&src)?;
        let tables = header.tables(src.size())?;
        let l1_bytes = tables.l1.end - tables.l1.start;
        let mut raw = vec![0u8; l1_bytes as usize];
        read(&src, &mut raw, header.l1_table_offset, "the L1 table")?;
        let l1 = qcow2::entries(&raw).collect();
        let zstd = header.compression == qcow2::Compression::Zstd;
        Ok(RawView {
            src,
            header,
            l1,
            zstd,
            l2_cache: Mutex::new(HashMap::new()),
        })
    }

    /// What the image is read from.
    pub fn source(&self) -> &S {
        &self.src
    }

    /// The guest's size in bytes.
    pub fn size(&self) -> u64 {
        self.header.virtual_size
    }

    fn l2(&self, offset: u64) -> Result<Arc<Vec<u64>>> {
        if let Some(t) = self.l2_cache.lock().expect("l2 cache").get(&offset) {
            return Ok(Arc::clone(t));
        }
        let mut raw = vec![0u8; self.header.cluster_size() as usize];
        read(&self.src, &mut raw, offset, "an L2 table")?;
        let table: Arc<Vec<u64>> = Arc::new(qcow2::entries(&raw).collect());
        let mut cache = self.l2_cache.lock().expect("l2 cache");
        if cache.len() >= L2_CACHE {
            cache.clear();
        }
        cache.insert(offset, Arc::clone(&table));
        Ok(table)
    }

    fn cluster(&self, index: u64) -> Result<Cluster> {
        let per_l2 = self.header.l2_entries();
        let l1_entry = self.l1.get((index / per_l2) as usize).copied().unwrap_or(0);
        let l2_offset = qcow2::l2_offset(l1_entry);
        if l2_offset == 0 {
            return Ok(Cluster::Zero);
        }
        let entry = self.l2(l2_offset)?[(index % per_l2) as usize];
        Ok(match self.header.cluster(entry) {
            Cluster::Compressed { offset, max_len } => Cluster::Compressed {
                offset,
                max_len: max_len.min(self.src.size().saturating_sub(offset)),
            },
            c => c,
        })
    }

    /// The image file's byte ranges that hold the guest's bytes `range` (data clusters, merged
    /// where adjacent, and compressed clusters; zero clusters need none): what a sequential
    /// reader of the view reads next, for read-ahead.
    pub fn host_ranges(&self, range: std::ops::Range<u64>) -> Result<Vec<std::ops::Range<u64>>> {
        let cs = self.header.cluster_size();
        let end = range.end.min(self.size());
        let mut out: Vec<std::ops::Range<u64>> = Vec::new();
        let mut index = range.start / cs;
        while index * cs < end {
            let host = match self.cluster(index)? {
                Cluster::Zero => None,
                Cluster::Data(host) => Some(host..host + cs),
                Cluster::Compressed { offset, max_len } => Some(offset..offset + max_len),
            };
            match (out.last_mut(), host) {
                (Some(last), Some(h)) if last.end == h.start => last.end = h.end,
                (_, Some(h)) => out.push(h),
                (_, None) => {}
            }
            index += 1;
        }
        Ok(out)
    }

    /// Fills `buf` with the guest's bytes at `offset`; reads past the end fail.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= self.size())
            .ok_or_else(|| {
                Error::invalid(format!(
                    "read of {} bytes at {offset} past the {}-byte disk",
                    buf.len(),
                    self.size()
                ))
            })?;
        let cs = self.header.cluster_size();
        let mut pos = offset;
        while pos < end {
            let index = pos / cs;
            let within = pos % cs;
            let n = (cs - within).min(end - pos);
            let out = &mut buf[(pos - offset) as usize..(pos - offset + n) as usize];
            match self.cluster(index)? {
                Cluster::Zero => out.fill(0),
                Cluster::Data(host) => read(&self.src, out, host + within, "a data cluster")?,
                Cluster::Compressed { offset, max_len } => {
                    let data = self.decompress(offset, max_len)?;
                    out.copy_from_slice(&data[within as usize..(within + n) as usize]);
                }
            }
            pos += n;
        }
        Ok(())
    }

    fn decompress(&self, offset: u64, max_len: u64) -> Result<Vec<u8>> {
        let cs = self.header.cluster_size() as usize;
        let mut input = vec![0u8; max_len as usize];
        read(&self.src, &mut input, offset, "a compressed cluster")?;
        let mut out = vec![0u8; cs];
        let produced = if self.zstd {
            // The stream may be followed by unrelated bytes up to the sector end.
            let mut d = zstd::stream::read::Decoder::with_buffer(&input[..])
                .map_err(|e| Error::io("starting zstd", e))?
                .single_frame();
            read_full(&mut d, &mut out)
        } else {
            let mut d = flate2::Decompress::new(false);
            d.decompress(&input, &mut out, flate2::FlushDecompress::Finish)
                .map(|_| d.total_out() as usize)
                .map_err(std::io::Error::other)
        }
        .map_err(|e| {
            Error::corrupt(format!(
                "qcow2 compressed cluster at {offset} does not decompress"
            ))
            .with_source(e)
        })?;
        if produced != cs {
            return Err(Error::corrupt(format!(
                "qcow2 compressed cluster at {offset} holds {produced} bytes, not {cs}"
            )));
        }
        Ok(out)
    }
}

fn read_full(r: &mut impl std::io::Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

fn read(src: &impl ReadAt, buf: &mut [u8], offset: u64, what: &str) -> Result<()> {
    if offset.saturating_add(buf.len() as u64) > src.size() {
        return Err(Error::corrupt(format!(
            "qcow2 {what} at {offset} lies beyond the end of the image ({} bytes)",
            src.size()
        )));
    }
    src.read_exact_at(buf, offset)
        .map_err(|e| Error::io(format!("reading qcow2 {what} at {offset}"), e))
}

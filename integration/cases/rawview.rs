//! The raw view of qcow2 images (`view::qcow2`, mapping by `format::qcow2_raw`) against
//! qemu-img's own conversion: v2 and v3 images, deflate and zstd compressed clusters, zero
//! clusters, sparse regions; read cold (fetching) and cached, and read-ahead covering what a
//! sequential reader then reads.

use std::ops::Range;
use std::path::Path;

use futures_util::future::BoxFuture;
use parking_lot::Mutex;
use vmdisk::view::file::LocalFile;
use vmdisk::view::qcow2::Qcow2View;
use vmdisk::view::DiskView;

use crate::fixtures::harness::*;

/// A local image that answers from its "cache" only what was read or prefetched before, and
/// records what was asked of it.
struct Lazy {
    file: LocalFile,
    present: Mutex<Vec<Range<u64>>>,
    reads: Mutex<Vec<Range<u64>>>,
    prefetched: Mutex<Vec<Range<u64>>>,
}

impl Lazy {
    fn open(image: &Path) -> Self {
        Lazy {
            file: LocalFile::new(std::fs::File::open(image).unwrap()).unwrap(),
            present: Mutex::default(),
            reads: Mutex::default(),
            prefetched: Mutex::default(),
        }
    }

    fn fetched(&self, range: Range<u64>) {
        self.present.lock().push(range);
    }
}

impl DiskView for Lazy {
    fn size(&self) -> u64 {
        self.file.size()
    }

    fn read_cached(&self, offset: u64, len: u64) -> Option<vmdisk::error::Result<Vec<u8>>> {
        let end = offset + len.min(self.size().saturating_sub(offset));
        let present = self.present.lock();
        present
            .iter()
            .any(|r| r.start <= offset && end <= r.end)
            .then(|| self.file.read_cached(offset, len).unwrap())
    }

    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, vmdisk::error::Result<Vec<u8>>> {
        self.reads.lock().push(offset..offset + len);
        self.fetched(offset..offset + len);
        self.file.read(offset, len)
    }

    fn prefetch(&self, range: Range<u64>) -> BoxFuture<'_, vmdisk::error::Result<()>> {
        self.prefetched.lock().push(range.clone());
        self.fetched(range);
        Box::pin(async { Ok(()) })
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
}

/// Reads the whole raw view in odd-sized pieces, cold and then from the cache, and compares
/// both with `qemu-img convert -O raw`.
fn assert_view_equals_qemu(image: &Path) {
    let raw = image.with_extension("raw");
    qemu_img_raw(image, &raw);
    let want = std::fs::read(&raw).unwrap();
    let rt = runtime();
    let view = rt.block_on(Qcow2View::open(Lazy::open(image))).unwrap();
    assert_eq!(view.size(), want.len() as u64);
    // 300 KiB pieces straddle cluster boundaries of every cluster size used here.
    let piece = 300u64 << 10;
    let mut cold = Vec::with_capacity(want.len());
    for at in (0..view.size()).step_by(piece as usize) {
        cold.extend(rt.block_on(view.read(at, piece)).unwrap());
    }
    assert!(
        cold == want,
        "raw view of {} differs from qemu-img's conversion",
        image.display()
    );
    // Everything was read once: every piece now answers from the cache, without a fetch.
    let reads = view.inner().reads.lock().len();
    let mut cached = Vec::with_capacity(want.len());
    for at in (0..view.size()).step_by(piece as usize) {
        cached.extend(view.read_cached(at, piece).expect("cached").unwrap());
    }
    assert!(cached == want, "cached reads of {} differ", image.display());
    assert_eq!(
        view.inner().reads.lock().len(),
        reads,
        "no fetch for cached reads"
    );
    std::fs::remove_file(raw).unwrap();
    assert_prefetch_covers_reads(image);
}

/// What read-ahead fetches for a window of the guest covers every byte of the image that
/// reading the window then reads, and no more than its clusters.
fn assert_prefetch_covers_reads(image: &Path) {
    let rt = runtime();
    let view = rt.block_on(Qcow2View::open(Lazy::open(image))).unwrap();
    let window = 3 << 20;
    for start in (0..view.size()).step_by(window as usize) {
        let end = (start + window).min(view.size());
        rt.block_on(view.prefetch(start..end)).unwrap();
        let hosts: Vec<_> = view.inner().prefetched.lock().drain(..).collect();
        view.inner().reads.lock().clear();
        assert_eq!(
            rt.block_on(view.read(start, end - start)).unwrap().len() as u64,
            end - start
        );
        for read in view.inner().reads.lock().drain(..) {
            assert!(
                hosts
                    .iter()
                    .any(|h| h.start <= read.start && read.end <= h.end),
                "{}: read {read:?} for guest bytes {start}..{end} is outside {hosts:?}",
                image.display()
            );
        }
        let mapped: u64 = hosts.iter().map(|h| h.end - h.start).sum();
        assert!(
            mapped <= (end - start) + (2 << 20),
            "{mapped} bytes mapped for {}",
            end - start
        );
    }
}

#[test]
fn raw_view_equals_qemu_img_convert() {
    let scratch = Scratch::new();
    // A source with data, zeros and holes.
    let src = scratch.path("src.qcow2");
    make_qcow2(
        &src,
        "96M",
        &[(0, 4 << 20, 0xab), (40 << 20, 1 << 20, 0x00)],
    );
    write_random(&src, 10 << 20, 6 << 20, 3);
    write_random(&src, (95 << 20) + 4096, 512 << 10, 4);
    // v3 zero clusters over allocated data.
    run(
        "qemu-io",
        &[
            "-c",
            "write -z 1M 1M",
            "-c",
            "write -z -u 11M 64k",
            src.to_str().unwrap(),
        ],
    );
    assert_view_equals_qemu(&src);

    // qemu-img's conversions of it: v2 with small clusters, deflate-compressed (64 KiB and
    // 2 MiB clusters), zstd-compressed.
    let variants: [(&str, &[&str]); 4] = [
        ("v2", &["-o", "compat=0.10,cluster_size=4096"]),
        ("deflate", &["-c"]),
        ("big-clusters", &["-c", "-o", "cluster_size=2M"]),
        ("zstd", &["-c", "-o", "compression_type=zstd"]),
    ];
    for (name, opts) in variants {
        let out = scratch.path(&format!("{name}.qcow2"));
        let mut args = vec!["convert", "-O", "qcow2"];
        args.extend_from_slice(opts);
        args.extend([src.to_str().unwrap(), out.to_str().unwrap()]);
        run("qemu-img", &args);
        assert_view_equals_qemu(&out);
    }
}

#[test]
fn raw_view_refuses_what_it_cannot_map() {
    let scratch = Scratch::new();
    let rt = runtime();
    let overlay = qcow2_with_backing(scratch.dir.path());
    let err = rt
        .block_on(Qcow2View::open(Lazy::open(&overlay)))
        .err()
        .unwrap();
    assert!(err.to_string().contains("backing file"), "{err}");
    // Truncated: the data cluster lies past the end; the read fails, never zeros.
    let bytes = std::fs::read(scratch.path("base.qcow2")).unwrap();
    let cut = scratch.path("cut.qcow2");
    std::fs::write(&cut, &bytes[..bytes.len() - 4096]).unwrap();
    let view = rt.block_on(Qcow2View::open(Lazy::open(&cut))).unwrap();
    let err = rt.block_on(view.read(0, 1 << 20)).unwrap_err();
    assert!(err.to_string().contains("beyond the end"), "{err}");
    // Reads end at the guest's end (16 MiB), as a file's do.
    assert_eq!(
        rt.block_on(view.read((16 << 20) - 10, 1 << 20))
            .unwrap()
            .len(),
        10
    );
    assert!(rt
        .block_on(view.read(16 << 20, 1 << 20))
        .unwrap()
        .is_empty());
}

//! The raw view of qcow2 images (`format::qcow2_raw`) against qemu-img's own conversion:
//! v2 and v3 images, deflate and zstd compressed clusters, zero clusters, sparse regions.

use std::path::Path;

use vmdisk::format::qcow2_raw::RawView;

use crate::harness::*;

/// Reads the whole raw view in odd-sized pieces and compares it with `qemu-img convert -O raw`.
fn assert_view_equals_qemu(image: &Path) {
    let raw = image.with_extension("raw");
    qemu_img_raw(image, &raw);
    let want = std::fs::read(&raw).unwrap();
    let file = std::fs::File::open(image).unwrap();
    let view = RawView::open(&file).unwrap();
    assert_eq!(view.size(), want.len() as u64);
    let mut got = vec![0u8; want.len()];
    // 300 KiB pieces straddle cluster boundaries of every cluster size used here.
    for (i, piece) in got.chunks_mut(300 << 10).enumerate() {
        view.read_at(piece, i as u64 * (300 << 10)).unwrap();
    }
    assert!(
        got == want,
        "raw view of {} differs from qemu-img's conversion",
        image.display()
    );
    assert_host_ranges_cover_reads(image);
    std::fs::remove_file(raw).unwrap();
}

/// A file that records the ranges read from it once `recording` is set.
struct Recorded {
    file: std::fs::File,
    recording: std::sync::atomic::AtomicBool,
    reads: std::sync::Mutex<Vec<std::ops::Range<u64>>>,
}

impl vmdisk::format::qcow2::ReadAt for Recorded {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        if self.recording.load(std::sync::atomic::Ordering::SeqCst) {
            let end = offset + buf.len() as u64;
            self.reads.lock().unwrap().push(offset..end);
        }
        self.file.read_exact_at(buf, offset)
    }
    fn size(&self) -> u64 {
        self.file.size()
    }
}

/// What read-ahead fetches for a window of the guest (`RawView::host_ranges`) covers every
/// byte of the image that reading the window then reads, and no more than its clusters.
fn assert_host_ranges_cover_reads(image: &Path) {
    let source = Recorded {
        file: std::fs::File::open(image).unwrap(),
        recording: false.into(),
        reads: Default::default(),
    };
    let view = RawView::open(&source).unwrap();
    let window = 3 << 20;
    for start in (0..view.size()).step_by(window as usize) {
        let end = (start + window).min(view.size());
        // Mapping reads the L2 tables (kept by the view); the window's reads then are data.
        let hosts = view.host_ranges(start..end).unwrap();
        source
            .recording
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let mut buf = vec![0u8; (end - start) as usize];
        view.read_at(&mut buf, start).unwrap();
        source
            .recording
            .store(false, std::sync::atomic::Ordering::SeqCst);
        for read in source.reads.lock().unwrap().drain(..) {
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
    let overlay = qcow2_with_backing(scratch.dir.path());
    let err = RawView::open(std::fs::File::open(&overlay).unwrap())
        .err()
        .unwrap();
    assert!(err.to_string().contains("backing file"), "{err}");
    // Truncated: the data cluster lies past the end; the read fails, never zeros.
    let bytes = std::fs::read(scratch.path("base.qcow2")).unwrap();
    let cut = &bytes[..bytes.len() - 4096];
    let view = RawView::open(cut).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let err = view.read_at(&mut buf, 0).unwrap_err();
    assert!(err.to_string().contains("beyond the end"), "{err}");
    assert!(
        view.read_at(&mut buf, 16 << 20).is_err(),
        "reads past the disk fail"
    );
}

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
    std::fs::remove_file(raw).unwrap();
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

//! The zstd:chunked reader and writer against each other and against hostile TOCs and layers.

use std::collections::BTreeMap;

use super::testing::write_layer;
use super::*;
use crate::format::toc::TocEntry;
use crate::format::toc::{MAX_PATH_DEPTH, MAX_TOC_ENTRIES, MAX_TOC_FILES};
use crate::format::tree::clean_path;
use crate::format::zstd_frames::{decode_region, decompress_bounded, SKIPPABLE_MAGIC};
use crate::oci::digest::Digest;

fn sample(len: usize) -> Vec<u8> {
    let mut v: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    v[len / 2..len / 2 + 4096.min(len / 2)].fill(0);
    v
}

#[test]
fn layer_is_a_plain_tar_zstd_stream() {
    let content = sample(10_000 + 3);
    let (summary, blob) = write_layer(&content, 4096);
    assert_eq!(Digest::of(&blob), summary.digest);
    let tar_bytes = zstd::stream::decode_all(&blob[..]).unwrap();
    assert_eq!(Digest::of(&tar_bytes), summary.diff_id);
    let mut archive = tar::Archive::new(&tar_bytes[..]);
    let mut names = Vec::new();
    for entry in archive.entries().unwrap() {
        let mut entry = entry.unwrap();
        let name = entry.path().unwrap().to_string_lossy().into_owned();
        if name == "disk/d.raw" {
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut data).unwrap();
            assert_eq!(data, content);
            assert_eq!(entry.header().uid().unwrap(), 107);
            assert_eq!(entry.header().mode().unwrap(), 0o644);
        }
        names.push(name);
    }
    assert_eq!(names, ["disk/", "disk/d.raw"]);
}

#[test]
fn toc_round_trips_and_chunks_verify() {
    let content = sample(3 * 4096 + 100);
    let (summary, blob) = write_layer(&content, 4096);
    let loc = TocLocation::from_annotations(&summary.annotations)
        .unwrap()
        .unwrap();
    assert_eq!(loc, summary.toc_location);
    let toc = decode_toc(
        &blob[loc.range().start as usize..loc.range().end as usize],
        &loc,
    )
    .unwrap();
    let nodes = toc.nodes(loc.offset - SKIPPABLE_HEADER).unwrap();
    assert_eq!(nodes.len(), 2);
    let file = &nodes[1];
    assert_eq!(
        (file.path.as_str(), file.size, file.uid),
        ("disk/d.raw", content.len() as u64, 107)
    );
    assert_eq!(file.chunks.len(), 4);
    assert_eq!(summary.chunks, 4);
    for c in &file.chunks {
        let frame = &blob[c.compressed.start as usize..c.compressed.end as usize];
        let data = decompress_bounded(frame, c.size).unwrap();
        assert_eq!(
            data,
            content[c.offset as usize..(c.offset + c.size) as usize]
        );
        c.digest.unwrap().verify(&data, "chunk").unwrap();
    }
    assert_eq!(file.digest, Some(Digest::of(&content)));
}

/// `read_toc` on `json` compressed, with the uncompressed length annotated (`annotated`:
/// parsed from memory) or not (parsed as it is decompressed).
fn read_json(json: &[u8], annotated: bool) -> Result<Vec<Node>> {
    let compressed = zstd::bulk::compress(json, 1).unwrap();
    let loc = TocLocation {
        offset: 1 << 20,
        length: compressed.len() as u64,
        uncompressed_length: if annotated { json.len() as u64 } else { 0 },
        checksum: Digest::of(&compressed),
    };
    read_toc(&compressed, &loc)
}

#[test]
fn a_toc_read_from_memory_or_as_a_stream_gives_the_same_nodes() {
    let content = sample(20 * 4096 + 7);
    let (summary, blob) = write_layer(&content, 4096);
    let loc = summary.toc_location;
    let toc = decode_toc(
        &blob[loc.offset as usize..(loc.offset + loc.length) as usize],
        &loc,
    )
    .unwrap();
    let json = serde_json::to_vec(&toc).unwrap();
    let expected = toc.nodes(1 << 20).unwrap();
    for annotated in [true, false] {
        let nodes = read_json(&json, annotated).unwrap();
        assert_eq!(nodes.len(), expected.len());
        for (a, b) in nodes.iter().zip(&expected) {
            assert_eq!((&a.path, a.size, &a.chunks), (&b.path, b.size, &b.chunks));
        }
        assert_eq!(nodes[1].chunks.len(), 21);
    }
}

#[test]
fn a_streamed_toc_is_bounded_and_checked_like_one_in_memory() {
    let (summary, blob) = write_layer(&sample(5000), 4096);
    let loc = summary.toc_location;
    let compressed = &blob[loc.offset as usize..(loc.offset + loc.length) as usize];
    // The annotated length is checked either way.
    for uncompressed in [loc.uncompressed_length - 1, loc.uncompressed_length + 1] {
        let wrong = TocLocation {
            uncompressed_length: uncompressed,
            ..loc
        };
        let err = read_toc(compressed, &wrong).unwrap_err();
        assert!(err.to_string().contains("the annotation says"), "{err}");
    }
    // Documents that are not a version-1 TOC, as a stream and from memory.
    let cases: [(&str, &str); 5] = [
        (
            r#"{"version":2,"entries":[]}"#,
            "version 2 is not supported",
        ),
        (r#"{"entries":[]}"#, "no version"),
        (r#"{"version":1}"#, "missing field `entries`"),
        (
            r#"{"version":1,"entries":[]} trailing"#,
            "trailing characters",
        ),
        (
            r#"{"version":1,"entries":[{"type":"chunk","name":"a"}]}"#,
            "without a preceding reg entry",
        ),
    ];
    for (json, why) in cases {
        for annotated in [true, false] {
            let err = read_json(json.as_bytes(), annotated).unwrap_err();
            assert!(
                err.to_string().contains(why),
                "{json}: expected {why:?}: {err}"
            );
        }
    }
    // Unknown fields are ignored, as containers/storage adds some.
    let nodes = read_json(
        br#"{"version":1,"x":[1],"entries":[{"type":"dir","name":"d","y":{}}]}"#,
        false,
    )
    .unwrap();
    assert_eq!(nodes[0].path, "d");
}

#[test]
fn footer_and_skippable_frames_are_well_formed() {
    let (summary, blob) = write_layer(&sample(5000), 4096);
    let footer = &blob[blob.len() - 64..];
    assert_eq!(&footer[56..], FOOTER_MAGIC);
    let field = |i: usize| u64::from_le_bytes(footer[i * 8..i * 8 + 8].try_into().unwrap());
    assert_eq!(field(0), summary.toc_location.offset);
    assert_eq!(field(1), summary.toc_location.length);
    assert_eq!(field(3), 1);
    let toc_frame = (summary.toc_location.offset - 8) as usize;
    assert_eq!(blob[toc_frame..toc_frame + 4], SKIPPABLE_MAGIC);
}

#[test]
fn zero_chunks_are_marked() {
    let mut content = vec![0u8; 8192];
    content[5000] = 1;
    let (summary, _) = write_layer(&content, 4096);
    assert_eq!((summary.chunks, summary.zero_chunks), (2, 1));
}

#[test]
fn rejects_tampered_toc_and_bad_annotations() {
    let (summary, mut blob) = write_layer(&sample(5000), 4096);
    let loc = summary.toc_location;
    blob[loc.offset as usize + 3] ^= 1;
    let err = decode_toc(
        &blob[loc.offset as usize..(loc.offset + loc.length) as usize],
        &loc,
    )
    .unwrap_err();
    assert_eq!(err.kind(), crate::error::ErrorKind::Corrupt);
    let mut ann = summary.annotations.clone();
    ann.insert(ANN_TOC_POSITION.into(), "1:2:3".into());
    assert!(TocLocation::from_annotations(&ann).is_err());
    ann.insert(
        ANN_TOC_POSITION.into(),
        format!("1:{}:3:1", MAX_TOC_COMPRESSED + 1),
    );
    assert!(TocLocation::from_annotations(&ann).is_err());
    ann.remove(ANN_TOC_CHECKSUM);
    ann.insert(ANN_TOC_POSITION.into(), "1:2:3:1".into());
    assert!(TocLocation::from_annotations(&ann).is_err());
    assert!(TocLocation::from_annotations(&BTreeMap::new())
        .unwrap()
        .is_none());
}

#[test]
fn rejects_unsafe_or_inconsistent_tocs() {
    assert!(clean_path("../etc/passwd").is_err());
    assert!(clean_path("/").is_err());
    assert_eq!(clean_path("./disk//d.qcow2").unwrap(), "disk/d.qcow2");
    let reg = |name: &str, size: i64, end: i64| TocEntry {
        kind: "reg".into(),
        name: name.into(),
        size,
        offset: 10,
        end_offset: end,
        ..Default::default()
    };
    let toc = |entries| Toc {
        version: 1,
        entries,
        tar_split_digest: None,
    };
    // Compressed range beyond the data region.
    assert!(toc(vec![reg("a", 100, 5000)]).nodes(1000).is_err());
    // Chunks that do not cover the file.
    let mut first = reg("a", 100, 200);
    first.chunk_size = 50;
    assert!(toc(vec![first.clone()]).nodes(1000).is_err());
    // Chunk entry for a different file.
    let other = TocEntry {
        kind: "chunk".into(),
        name: "b".into(),
        chunk_offset: 50,
        chunk_size: 50,
        offset: 100,
        ..Default::default()
    };
    assert!(toc(vec![first.clone(), other]).nodes(1000).is_err());
    // A consistent two-chunk file without digests is accepted but not verifiable.
    let second = TocEntry {
        kind: "chunk".into(),
        name: "a".into(),
        chunk_offset: 50,
        chunk_size: 50,
        offset: 100,
        ..Default::default()
    };
    let nodes = toc(vec![first, second]).nodes(1000).unwrap();
    assert_eq!(nodes[0].chunks[1].compressed, 100..200);
    assert!(!nodes[0].verifiable());
}

/// A TOC of `entries`, whose chunk-less reg entries get a one-chunk range each.
fn toc_of(entries: Vec<TocEntry>) -> Toc {
    Toc {
        version: 1,
        entries,
        tar_split_digest: None,
    }
}

fn entry(kind: &str, name: &str) -> TocEntry {
    TocEntry {
        kind: kind.into(),
        name: name.into(),
        ..Default::default()
    }
}

fn file(name: &str, at: i64) -> TocEntry {
    TocEntry {
        size: 100,
        offset: at,
        end_offset: at + 50,
        chunk_size: 100,
        chunk_digest: Digest::of(name.as_bytes()).to_string(),
        ..entry("reg", name)
    }
}

fn refused(entries: Vec<TocEntry>, why: &str) {
    let err = toc_of(entries).nodes(1 << 20).unwrap_err();
    assert!(err.to_string().contains(why), "expected {why:?}: {err}");
}

#[test]
fn toc_paths_must_be_unique_and_only_under_directories() {
    refused(
        vec![file("disk/a", 100), file("disk/a", 200)],
        "listed twice",
    );
    refused(
        vec![entry("dir", "disk"), entry("dir", "disk/")],
        "listed twice",
    );
    refused(
        vec![file("disk/a", 100), file("disk/a/b", 200)],
        "lies under disk/a",
    );
    refused(
        vec![file("disk/a/b", 100), file("disk/a", 200)],
        "other entries lie under it",
    );
    // A directory listed after what it holds is fine, once.
    let nodes = toc_of(vec![file("disk/a", 100), entry("dir", "disk")])
        .nodes(1 << 20)
        .unwrap();
    assert_eq!(nodes.len(), 2);
}

#[test]
fn hardlinks_must_name_an_earlier_file() {
    let link = |target: &str| TocEntry {
        link_name: target.into(),
        ..entry("hardlink", "disk/l")
    };
    refused(vec![file("disk/a", 100), link("")], "unusable target");
    refused(
        vec![file("disk/a", 100), link("../etc/shadow")],
        "unusable target",
    );
    refused(
        vec![file("disk/a", 100), link("disk/b")],
        "not an earlier file",
    );
    refused(
        vec![entry("dir", "disk"), link("disk")],
        "not an earlier file",
    );
    refused(
        vec![link("disk/a"), file("disk/a", 100)],
        "not an earlier file",
    );
    let nodes = toc_of(vec![file("disk/a", 100), link("./disk//a")])
        .nodes(1 << 20)
        .unwrap();
    assert_eq!(nodes[1].link, "disk/a");
    refused(
        vec![TocEntry {
            link_name: String::new(),
            ..entry("symlink", "disk/s")
        }],
        "empty",
    );
    refused(vec![entry("char", "disk/tty")], "serves no devices");
}

#[test]
fn chunk_frames_follow_each_other_without_gaps_or_overlaps() {
    // The file's last frame ends at 200 but the file's bytes end at 300: the 100 bytes
    // between would be file content in the tar stream.
    let mut first = file("disk/a", 100);
    first.chunk_size = 50;
    first.end_offset = 300;
    let second = TocEntry {
        chunk_offset: 50,
        chunk_size: 50,
        offset: 160,
        end_offset: 200,
        chunk_digest: Digest::of(b"2").to_string(),
        ..entry("chunk", "disk/a")
    };
    refused(vec![first, second], "must follow each other");
    // Two files whose frames overlap.
    refused(vec![file("disk/a", 100), file("disk/b", 120)], "overlap");
    // A chunk marked zeros still needs a digest.
    let mut zeros = file("disk/z", 100);
    zeros.chunk_type = "zeros".into();
    zeros.chunk_digest = String::new();
    let nodes = toc_of(vec![zeros]).nodes(1 << 20).unwrap();
    assert!(
        !nodes[0].verifiable(),
        "a zeros chunk without digest cannot be verified"
    );
}

#[test]
fn toc_size_counts_and_depth_are_bounded() {
    let deep = (0..=MAX_PATH_DEPTH)
        .map(|_| "d")
        .collect::<Vec<_>>()
        .join("/");
    refused(vec![entry("dir", &deep)], "deeper than");
    let many: Vec<TocEntry> = (0..=MAX_TOC_FILES)
        .map(|i| entry("dir", &format!("d{i}")))
        .collect();
    refused(many, "more than 4096");
    // A TOC of more than MAX_TOC_ENTRIES tiny entries fails while it is parsed.
    let mut json = String::from("{\"version\":1,\"entries\":[");
    for i in 0..=MAX_TOC_ENTRIES {
        if i > 0 {
            json.push(',');
        }
        json.push_str("{\"type\":\"chunk\",\"name\":\"a\"}");
    }
    json.push_str("]}");
    let started = std::time::Instant::now();
    let err = serde_json::from_str::<Toc>(&json).unwrap_err();
    assert!(err.to_string().contains("more than"), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
    // Streamed, valid entries are counted as they come: one file of 1-byte chunks.
    let mut json = String::from(
        r#"{"version":1,"entries":[{"type":"reg","name":"a","size":9999999,"offset":100,"chunkSize":1}"#,
    );
    for i in 1..=MAX_TOC_ENTRIES {
        json.push_str(&format!(
            r#",{{"type":"chunk","name":"a","offset":{},"chunkOffset":{i},"chunkSize":1}}"#,
            100 + i
        ));
    }
    json.push_str("]}");
    let err = parse_toc(
        serde_json::Deserializer::from_reader(std::io::BufReader::new(json.as_bytes())),
        1 << 40,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("more than 1048576 entries"),
        "{err}"
    );
}

#[test]
fn regions_between_chunks_decode_as_an_ordinary_decoder_reads_them() {
    let frame = zstd::bulk::compress(b"header bytes", 1).unwrap();
    let mut region = frame.clone();
    region.extend_from_slice(&[0x5f, 0x2a, 0x4d, 0x18, 3, 0, 0, 0, 9, 9, 9]);
    region.extend_from_slice(&frame);
    assert_eq!(
        decode_region(&region, 1 << 20).unwrap(),
        b"header bytesheader bytes"
    );
    // A skippable frame that runs past the region hides what follows it.
    let cut = [0x50, 0x2a, 0x4d, 0x18, 200, 0, 0, 0, 1, 2];
    assert!(decode_region(&cut, 1 << 20).is_err());
    assert!(decode_region(b"not zstd", 1 << 20).is_err());
    assert!(decode_region(&region, 10).is_err(), "bounded output");
    assert!(check_regular_frames(&frame).is_ok());
    assert!(check_regular_frames(&region).is_err());
}

#[test]
fn a_chunk_marked_zeros_is_checked_to_be_zeros_without_being_held() {
    let zeros = vec![0u8; 3 << 20];
    let frame = zstd::bulk::compress(&zeros, 3).unwrap();
    let chunk = |digest: Digest| super::super::tree::Chunk {
        offset: 0,
        size: zeros.len() as u64,
        compressed: 0..frame.len() as u64,
        digest: Some(digest),
        zeros: true,
    };
    check_zeros(&frame, &chunk(Digest::of(&zeros))).unwrap();
    // One byte that is not zero, under the zeros' digest and mark.
    let mut other = zeros.clone();
    other[(2 << 20) + 5] = 1;
    let not_zeros = zstd::bulk::compress(&other, 3).unwrap();
    let short = zstd::bulk::compress(&zeros[1..], 3).unwrap();
    let long = zstd::bulk::compress(&[&zeros[..], &[0u8][..]].concat(), 3).unwrap();
    for (frame, why) in [
        (&not_zeros, "a byte not zero"),
        (&short, "a byte short"),
        (&long, "a byte long"),
    ] {
        let err = check_zeros(frame, &chunk(Digest::of(&zeros))).unwrap_err();
        assert_eq!(err.kind(), crate::error::ErrorKind::Corrupt, "{why}");
    }
    // A digest that is not that of the zeros the mark claims.
    let err = check_zeros(&frame, &chunk(Digest::of(&other))).unwrap_err();
    assert!(err.to_string().contains("not that of"), "{err}");
}

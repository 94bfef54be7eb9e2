//! `estargz-layout LAYOUT FILE PATH_IN_IMAGE [CHUNK_BYTES]`: an OCI image layout (tag `latest`)
//! whose one layer is FILE at PATH_IN_IMAGE as an eStargz layer, laid out as
//! stargz-snapshotter's writer lays it out (default chunk 4 MiB, as its writer's), with the TOC
//! digest annotation stargz-snapshotter verifies against. `skopeo copy` publishes it unchanged.
//! Used by `make bench` to put stargz-snapshotter beside vmdisk on the same eStargz image; no
//! packaged tool writes eStargz here.

use std::path::Path;

fn put(blobs: &Path, data: &[u8]) -> std::io::Result<(String, usize)> {
    let digest = vmdisk_testing::sha256(data);
    std::fs::write(blobs.join(&digest["sha256:".len()..]), data)?;
    Ok((digest, data.len()))
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (layout, file, path, chunk) = match args.as_slice() {
        [layout, file, path] => (layout, file, path, 4 << 20),
        [layout, file, path, chunk] => match chunk.parse() {
            Ok(c) if c > 0 => (layout, file, path, c),
            _ => {
                eprintln!("estargz-layout: CHUNK_BYTES must be a positive number, not {chunk:?}");
                return std::process::ExitCode::from(2);
            }
        },
        _ => {
            eprintln!("usage: estargz-layout LAYOUT FILE PATH_IN_IMAGE [CHUNK_BYTES]");
            return std::process::ExitCode::from(2);
        }
    };
    match write(Path::new(layout), Path::new(file), path, chunk) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("estargz-layout: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn write(layout: &Path, file: &Path, path: &str, chunk: usize) -> std::io::Result<()> {
    let content = std::fs::read(file)?;
    let layer = vmdisk_testing::estargz::layer(&[(path, content)], chunk);
    let blobs = layout.join("blobs/sha256");
    std::fs::create_dir_all(&blobs)?;
    let (layer_digest, layer_size) = put(&blobs, &layer.blob)?;
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux", "config": {},
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id]},
    });
    let (config_digest, config_size) = put(&blobs, config.to_string().as_bytes())?;
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest, "size": config_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": layer_digest, "size": layer_size,
            "annotations": {vmdisk::format::estargz::ANN_TOC_DIGEST: layer.toc_digest}}],
    });
    let (manifest_digest, manifest_size) = put(&blobs, manifest.to_string().as_bytes())?;
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest, "size": manifest_size,
            "annotations": {"org.opencontainers.image.ref.name": "latest"}}],
    });
    std::fs::write(layout.join("index.json"), index.to_string())?;
    std::fs::write(
        layout.join("oci-layout"),
        r#"{"imageLayoutVersion":"1.0.0"}"#,
    )
}

//! Generates the gRPC code for containerd's snapshots and version APIs, vmdisk's management API and the
//! mount servers' control API from `proto/`, with a vendored `protoc` so no system protobuf
//! compiler is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // prost-build finds protoc through PROTOC; build scripts run single-threaded.
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    let well_known = protoc_bin_vendored::include_path()?;
    let well_known = well_known.to_str().ok_or("non-UTF-8 include path")?;
    tonic_prost_build::configure()
        // Credentials get a Debug that does not print the secret (src/snapshotter/control.rs).
        .skip_debug([".vmdisk.v1.Credentials"])
        .compile_protos(
            &[
                "proto/containerd/services/snapshots/v1/snapshots.proto",
                "proto/containerd/services/version/v1/version.proto",
                "proto/vmdisk/v1/manage.proto",
                "proto/vmdisk/v1/layer.proto",
            ],
            &["proto", well_known],
        )?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}

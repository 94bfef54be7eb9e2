//! The commands that publish and read images in a registry: `push`, `convert`, `index`,
//! `inspect`.

use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::format::disk::DiskFormat;
use crate::oci::digest::Digest;
use crate::oci::reference::Reference;
use crate::oci::Platform;
use crate::progress::Unit;
use crate::publish::{self, PublishOptions};

use super::args::{repository, ConvertArgs, IndexArgs, InspectArgs, PushArgs};

/// `vmdisk push`: disk files published as an image (one per platform).
pub(super) async fn push(args: PushArgs) -> Result<()> {
    let (files, target) = args.operands()?;
    publish::check_target(&target)?;
    let pairs = pair_platforms(&args.platforms, &files)?;
    let opts = publish_options(args.path, args.chunk_size, args.format);
    let client = args.registry.client()?;
    let mut images = Vec::new();
    for (platform, file) in pairs {
        let progress = args
            .progress
            .display()
            .start(format!("pushing {}", file.display()), Unit::Bytes);
        let opts = PublishOptions {
            progress: progress.clone(),
            ..opts.clone()
        };
        let (published, bytes) =
            publish::push_disk(&client, &target, file.clone(), &platform, &opts).await?;
        progress.finish();
        println!(
            "pushed {} ({}) as /{} {} virtual {} bytes: layer {} ({} bytes, {} chunks, {} zero)",
            file.display(),
            platform,
            published.disk.path,
            published.disk.format.name(),
            published.disk.virtual_size,
            published.layer.digest,
            published.layer.size,
            published.chunks,
            published.zero_chunks
        );
        images.push((published, bytes));
    }
    let digest: Digest = publish::tag_images(&client, &target, &images).await?;
    let pinned = target.with_digest(digest);
    eprintln!("to sign it: cosign sign --key KEY {pinned} (or notation sign {pinned})");
    println!("{digest}");
    Ok(())
}

/// `vmdisk convert`: an image's disk republished in the lazy layout.
pub(super) async fn convert(args: ConvertArgs) -> Result<()> {
    let (source, target) = (args.source, args.target);
    let tag = |r: &Reference| r.tag.clone().unwrap_or_else(|| "latest".into());
    if target.registry == source.registry
        && target.repository == source.repository
        && source.digest.is_none()
        && tag(&target) == tag(&source)
    {
        return Err(Error::invalid(format!(
            "convert would overwrite {source}, the image it reads; name another tag or repository"
        )));
    }
    let progress = args
        .progress
        .display()
        .start(format!("converting {source}"), Unit::Bytes);
    let opts = PublishOptions {
        progress: progress.clone(),
        ..publish_options(args.path, args.chunk_size, None)
    };
    let platform = args.platform.unwrap_or_else(Platform::host);
    let client = args.registry.client()?;
    let digest = publish::republish::convert(&client, &source, &target, &opts, &platform).await?;
    progress.finish();
    let pinned = target.with_digest(digest);
    eprintln!(
            "the converted image is new content: signatures of {source} do not cover it; sign it: cosign sign --key KEY {pinned} (or notation sign {pinned})"
        );
    println!("{digest}");
    Ok(())
}

/// `vmdisk index`: a seekable index published beside an unchanged image.
pub(super) async fn index(args: IndexArgs) -> Result<()> {
    let reference = args.reference;
    let to = args
        .to
        .as_deref()
        .map(|t| repository(t, "--to"))
        .transpose()?;
    let span = crate::units::parse_size(&args.span)? as u64;
    let client = args.registry.client()?;
    let progress = args
        .progress
        .display()
        .start(format!("indexing {reference}"), Unit::Bytes);
    let r = crate::publish::index::index(&client, &reference, to.as_ref(), span, &progress).await?;
    progress.finish();
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&r).expect("report serialises")
        );
    } else {
        println!(
                "indexed {} ({:?}, {} bytes; {} of tar stream, disk {}) in {:.1} s: {} spans of {}, index {} bytes ({:.2}% of the stream)\npublished {} in {} (subject {})",
                r.layer,
                r.compression,
                r.layer_size,
                r.stream_size,
                r.disk,
                r.seconds,
                r.spans,
                r.span_size,
                r.index_size,
                100.0 * r.index_size as f64 / r.stream_size.max(1) as f64,
                r.artifact,
                r.repository,
                r.manifest
            );
        // The image is unchanged (its signatures stay valid); the index is new, and a
        // policy that requires signatures in its repository requires it signed.
        println!(
            "to sign the index: cosign sign --key KEY {}@{} (or notation sign)",
            r.repository, r.artifact
        );
    }
    Ok(())
}

/// `vmdisk inspect`: what an image holds and whether it loads lazily.
pub(super) async fn inspect(args: InspectArgs) -> Result<()> {
    let reference = args.reference;
    let client = args.registry.client()?;
    let trust = args.policy.verifier()?;
    let report = crate::inspect::inspect(&client, &trust, &reference).await?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).expect("report serialises")
        );
    } else {
        print!("{}", crate::inspect::render_text(&report));
    }
    Ok(())
}

fn publish_options(
    path: Option<String>,
    chunk_size: usize,
    format: Option<DiskFormat>,
) -> PublishOptions {
    PublishOptions {
        path,
        chunk_size,
        format,
        ..PublishOptions::default()
    }
}

/// Pairs `--platform` values with files in order; one file without `--platform` is the host's.
pub fn pair_platforms(
    platforms: &[Platform],
    files: &[PathBuf],
) -> Result<Vec<(Platform, PathBuf)>> {
    if platforms.is_empty() && files.len() == 1 {
        return Ok(vec![(Platform::host(), files[0].clone())]);
    }
    if platforms.len() != files.len() {
        return Err(Error::invalid(format!(
            "{} --platform flags for {} disk files: give one --platform before each file (e.g. --platform linux/amd64 a.qcow2 --platform linux/arm64 b.qcow2 REF)",
            platforms.len(),
            files.len()
        )));
    }
    let pairs: Vec<(Platform, PathBuf)> = platforms
        .iter()
        .zip(files)
        .map(|(p, f)| (p.clone(), f.clone()))
        .collect();
    for (i, (p, _)) in pairs.iter().enumerate() {
        if pairs[..i].iter().any(|(q, _)| q == p) {
            return Err(Error::invalid(format!("platform {p} is given twice")));
        }
    }
    Ok(pairs)
}

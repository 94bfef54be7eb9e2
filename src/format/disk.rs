//! Recognising VM disk images by their content, and preparing any input for publishing:
//! qcow2 and raw are published as they are (qcow2 checked for completeness first); vmdk, vhdx,
//! vpc and vdi are converted to qcow2 with `qemu-img`; an OVA is unpacked and its first disk,
//! as named by the OVF descriptor, is used.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::qcow2::{self, ReadAt};
use crate::error::{Error, Result};

/// What a file's content says it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskFormat {
    Qcow2,
    Raw,
    /// A format qemu-img can convert (its qemu-img driver name).
    Foreign(&'static str),
    Ova,
}

/// The formats `qemu-img` converts for `vmdisk push`, by their driver names.
const FOREIGN: [&str; 4] = ["vmdk", "vhdx", "vpc", "vdi"];

impl DiskFormat {
    /// The format's name, as annotations, metadata and `qemu-img` spell it (`qcow2`, `raw`).
    pub fn name(&self) -> &'static str {
        match self {
            DiskFormat::Qcow2 => "qcow2",
            DiskFormat::Raw => "raw",
            DiskFormat::Foreign(f) => f,
            DiskFormat::Ova => "ova",
        }
    }

    /// Whether disks in this format are published and served as they are (qcow2, raw).
    pub fn is_served(&self) -> bool {
        matches!(self, DiskFormat::Qcow2 | DiskFormat::Raw)
    }
}

impl std::fmt::Display for DiskFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DiskFormat {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "qcow2" => Ok(DiskFormat::Qcow2),
            "raw" => Ok(DiskFormat::Raw),
            "ova" => Ok(DiskFormat::Ova),
            other => FOREIGN
                .iter()
                .find(|f| **f == other)
                .map(|f| DiskFormat::Foreign(f))
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "{other:?} is not a disk format vmdisk knows (qcow2, raw, ova, {})",
                        FOREIGN.join(", ")
                    ))
                }),
        }
    }
}

impl serde::Serialize for DiskFormat {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for DiskFormat {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        name.parse()
            .map_err(|e: Error| serde::de::Error::custom(e.chain()))
    }
}

/// Identifies a disk format from the first 64 KiB (and the last 512 bytes) of a file.
/// Returns `None` when nothing marks the content as a disk.
pub fn sniff(head: &[u8], tail: &[u8], len: u64) -> Option<DiskFormat> {
    let at = |off: usize, magic: &[u8]| {
        head.len() >= off + magic.len() && &head[off..off + magic.len()] == magic
    };
    if qcow2::is_qcow2(head) {
        return Some(DiskFormat::Qcow2);
    }
    if at(0, b"KDMV") || at(0, b"# Disk DescriptorFile") {
        return Some(DiskFormat::Foreign("vmdk"));
    }
    if at(0, b"vhdxfile") {
        return Some(DiskFormat::Foreign("vhdx"));
    }
    if at(0, b"conectix") || tail.starts_with(b"conectix") {
        return Some(DiskFormat::Foreign("vpc"));
    }
    if at(64, &[0x7f, 0x10, 0xda, 0xbe]) {
        return Some(DiskFormat::Foreign("vdi"));
    }
    if at(257, b"ustar") {
        return Some(DiskFormat::Ova);
    }
    let raw_marks = at(510, &[0x55, 0xaa])          // MBR / boot sector
        || at(512, b"EFI PART")                      // GPT
        || at(1080, &[0x53, 0xef])                   // ext2/3/4 superblock
        || at(0, b"XFSB")                            // XFS
        || at(0, b"hsqs")                            // squashfs
        || at(32769, b"CD001")                       // ISO 9660
        || at(65600, b"_BHRfS_M"); // btrfs
    (raw_marks && len.is_multiple_of(512)).then_some(DiskFormat::Raw)
}

/// What the first bytes of a disk of `size` bytes say: its format, if recognised, and its
/// guest-visible size (0 when the format does not tell). Fails only on a malformed qcow2
/// header.
pub fn identify(head: &[u8], size: u64) -> Result<(Option<DiskFormat>, u64)> {
    match sniff(head, &[], size) {
        Some(DiskFormat::Qcow2) => Ok((
            Some(DiskFormat::Qcow2),
            qcow2::Header::read(head)?.virtual_size,
        )),
        Some(DiskFormat::Raw) => Ok((Some(DiskFormat::Raw), size)),
        other => Ok((other, 0)),
    }
}

/// Reads what [`sniff`] needs from a file.
pub fn sniff_file(file: &File) -> Result<Option<DiskFormat>> {
    let len = ReadAt::size(file);
    let mut head = vec![0u8; len.min(66 * 1024) as usize];
    file.read_exact_at(&mut head, 0)
        .map_err(|e| Error::io("reading the disk header", e))?;
    let tail_len = len.min(512);
    let mut tail = vec![0u8; tail_len as usize];
    file.read_exact_at(&mut tail, len - tail_len)
        .map_err(|e| Error::io("reading the disk footer", e))?;
    Ok(sniff(&head, &tail, len))
}

/// A disk ready to be published.
#[derive(Debug)]
pub struct PreparedDisk {
    /// The file to read (the input, or a converted copy in `_workdir`).
    pub path: PathBuf,
    /// The file name to publish it under.
    pub file_name: String,
    pub format: DiskFormat,
    pub virtual_size: u64,
    pub size: u64,
    /// Holds converted files until publishing is done.
    pub _workdir: Option<tempfile::TempDir>,
}

/// Checks `input` and turns it into a qcow2 or raw disk. `forced` skips content detection
/// (`--format raw` for an unpartitioned raw image).
pub fn prepare(input: &Path, forced: Option<DiskFormat>) -> Result<PreparedDisk> {
    let shown = input.display();
    let file = File::open(input).map_err(|e| Error::io(format!("cannot open disk {shown}"), e))?;
    let meta = file
        .metadata()
        .map_err(|e| Error::io(format!("cannot stat {shown}"), e))?;
    if !meta.is_file() {
        return Err(Error::invalid(format!("{shown} is not a regular file")));
    }
    if meta.len() == 0 {
        return Err(Error::invalid(format!(
            "{shown} is empty, not a disk image"
        )));
    }
    let format = match forced {
        Some(f) => f,
        None => sniff_file(&file)?.ok_or_else(|| {
            Error::invalid(format!(
                "{shown} does not look like a VM disk: it is not qcow2, vmdk, vhdx, vpc, vdi or an OVA, and has no \
                 partition table or filesystem signature of a raw disk (pass --format raw to publish it anyway)"
            ))
        })?,
    };
    let file_name = input
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::invalid(format!("{shown}: file name is not valid UTF-8")))?
        .to_string();
    match format {
        DiskFormat::Qcow2 => {
            let header = qcow2::check_complete(&file).map_err(|e| e.context(format!("{shown}")))?;
            Ok(PreparedDisk {
                path: input.to_path_buf(),
                file_name,
                format,
                virtual_size: header.virtual_size,
                size: meta.len(),
                _workdir: None,
            })
        }
        DiskFormat::Raw => Ok(PreparedDisk {
            path: input.to_path_buf(),
            file_name,
            format,
            virtual_size: meta.len(),
            size: meta.len(),
            _workdir: None,
        }),
        DiskFormat::Foreign(driver) => convert_to_qcow2(input, driver, &file_name, None),
        DiskFormat::Ova => {
            let workdir =
                tempfile::tempdir().map_err(|e| Error::io("creating a work directory", e))?;
            let (disk, name) = extract_ova_disk(input, workdir.path())?;
            let disk_file =
                File::open(&disk).map_err(|e| Error::io("opening the disk from the OVA", e))?;
            match sniff_file(&disk_file)? {
                Some(DiskFormat::Foreign(driver)) => {
                    convert_to_qcow2(&disk, driver, &name, Some(workdir))
                }
                Some(DiskFormat::Qcow2 | DiskFormat::Raw) | None => {
                    let mut prepared = prepare(&disk, None)
                        .map_err(|e| e.context(format!("disk {name} in {shown}")))?;
                    prepared._workdir = Some(workdir);
                    Ok(prepared)
                }
                Some(DiskFormat::Ova) => Err(Error::invalid(format!(
                    "{shown}: the OVA's disk {name} is itself an archive"
                ))),
            }
        }
    }
}

fn convert_to_qcow2(
    input: &Path,
    driver: &str,
    name: &str,
    workdir: Option<tempfile::TempDir>,
) -> Result<PreparedDisk> {
    let workdir = match workdir {
        Some(w) => w,
        None => tempfile::tempdir().map_err(|e| Error::io("creating a work directory", e))?,
    };
    let stem = Path::new(name)
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("disk");
    let out = workdir.path().join(format!("{stem}.qcow2"));
    tracing::info!(input = %input.display(), driver, "converting to qcow2 with qemu-img");
    let status = Command::new("qemu-img")
        .args(["convert", "-q", "-f", driver, "-O", "qcow2"])
        .arg(input)
        .arg(&out)
        .status()
        .map_err(|e| Error::io("running qemu-img (install qemu-utils)", e))?;
    if !status.success() {
        return Err(Error::invalid(format!(
            "qemu-img could not convert {} from {driver} ({status})",
            input.display()
        )));
    }
    let mut prepared = prepare(&out, Some(DiskFormat::Qcow2))?;
    prepared._workdir = Some(workdir);
    Ok(prepared)
}

/// Finds the first disk an OVF names and extracts it into `dir`.
fn extract_ova_disk(ova: &Path, dir: &Path) -> Result<(PathBuf, String)> {
    let shown = ova.display();
    let open = || File::open(ova).map_err(|e| Error::io(format!("opening {shown}"), e));
    let mut ovf = None;
    for entry in tar::Archive::new(open()?)
        .entries()
        .map_err(|e| Error::io(format!("reading {shown}"), e))?
    {
        let mut entry = entry.map_err(|e| Error::io(format!("reading {shown}"), e))?;
        let path = entry
            .path()
            .map_err(|e| Error::io("OVA entry name", e))?
            .to_string_lossy()
            .into_owned();
        if path.ends_with(".ovf") {
            if entry.size() > 16 << 20 {
                return Err(Error::invalid(format!(
                    "{shown}: OVF descriptor {path} is larger than 16 MiB"
                )));
            }
            let mut text = String::new();
            entry
                .read_to_string(&mut text)
                .map_err(|e| Error::io(format!("reading {path} in {shown}"), e))?;
            ovf = Some(text);
            break;
        }
    }
    let ovf = ovf.ok_or_else(|| {
        Error::invalid(format!(
            "{shown} is a tar archive without an .ovf descriptor"
        ))
    })?;
    let href =
        first_disk_href(&ovf).map_err(|e| e.context(format!("OVF descriptor in {shown}")))?;
    let name = super::tree::clean_path(&href).map_err(|e| e.context(format!("{shown}")))?;
    let base = name.rsplit('/').next().unwrap_or(&name).to_string();
    for entry in tar::Archive::new(open()?)
        .entries()
        .map_err(|e| Error::io(format!("reading {shown}"), e))?
    {
        let mut entry = entry.map_err(|e| Error::io(format!("reading {shown}"), e))?;
        let path = entry
            .path()
            .map_err(|e| Error::io("OVA entry name", e))?
            .to_string_lossy()
            .into_owned();
        if super::tree::clean_path(&path).ok().as_deref() == Some(name.as_str()) {
            let out = dir.join(&base);
            let mut file =
                File::create(&out).map_err(|e| Error::io("extracting the OVA disk", e))?;
            std::io::copy(&mut entry, &mut file)
                .map_err(|e| Error::io("extracting the OVA disk", e))?;
            return Ok((out, base));
        }
    }
    Err(Error::invalid(format!(
        "{shown}: the OVF names disk file {href:?}, which the archive does not contain"
    )))
}

/// The `href` of the file behind the first `<Disk>` of an OVF descriptor.
pub fn first_disk_href(ovf: &str) -> Result<String> {
    let doc = roxmltree::Document::parse(ovf)
        .map_err(|e| Error::invalid(format!("not valid XML: {e}")))?;
    let attr = |n: roxmltree::Node<'_, '_>, name: &str| {
        n.attributes()
            .find(|a| a.name() == name)
            .map(|a| a.value().to_string())
    };
    let file_ref = doc
        .descendants()
        .find(|n| n.tag_name().name() == "Disk")
        .and_then(|n| attr(n, "fileRef"))
        .ok_or_else(|| Error::invalid("no <Disk ovf:fileRef=...> in the DiskSection"))?;
    doc.descendants()
        .filter(|n| n.tag_name().name() == "File")
        .find(|n| attr(*n, "id").as_deref() == Some(file_ref.as_str()))
        .and_then(|n| attr(n, "href"))
        .ok_or_else(|| {
            Error::invalid(format!(
                "no <File ovf:id={file_ref:?} ovf:href=...> in References"
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sniffs_formats() {
        let mut head = vec![0u8; 4096];
        assert_eq!(sniff(&head, &[], 4096), None);
        head[510] = 0x55;
        head[511] = 0xaa;
        assert_eq!(sniff(&head, &[], 4096), Some(DiskFormat::Raw));
        assert_eq!(sniff(&head, &[], 4097), None, "raw disks are whole sectors");
        head[..4].copy_from_slice(b"QFI\xfb");
        assert_eq!(sniff(&head, &[], 4096), Some(DiskFormat::Qcow2));
        head[..4].copy_from_slice(b"KDMV");
        assert_eq!(sniff(&head, &[], 4096), Some(DiskFormat::Foreign("vmdk")));
        assert_eq!(sniff(b"hello world, not a disk", &[], 23), None);
    }

    #[test]
    fn finds_first_ovf_disk() {
        let ovf = r#"<?xml version="1.0"?>
<Envelope xmlns="http://schemas.dmtf.org/ovf/envelope/1" xmlns:ovf="http://schemas.dmtf.org/ovf/envelope/1">
  <References><File ovf:id="file2" ovf:href="data.vmdk"/><File ovf:id="file1" ovf:href="root.vmdk"/></References>
  <DiskSection><Disk ovf:diskId="vmdisk1" ovf:fileRef="file1" ovf:capacity="10"/></DiskSection>
</Envelope>"#;
        assert_eq!(first_disk_href(ovf).unwrap(), "root.vmdk");
        assert!(first_disk_href("<Envelope/>").is_err());
        assert!(first_disk_href("<<<").is_err());
    }

    #[test]
    fn prepare_rejects_non_disks() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("notes.txt");
        std::fs::write(&text, "just some text\n").unwrap();
        let err = prepare(&text, None).unwrap_err();
        assert!(
            err.to_string().contains("does not look like a VM disk"),
            "{err}"
        );
        let err = prepare(&dir.path().join("missing.qcow2"), None).unwrap_err();
        assert_eq!(err.kind(), crate::error::ErrorKind::NotFound);
        let empty = dir.path().join("empty.raw");
        std::fs::write(&empty, "").unwrap();
        assert!(prepare(&empty, None)
            .unwrap_err()
            .to_string()
            .contains("empty"));
    }
}

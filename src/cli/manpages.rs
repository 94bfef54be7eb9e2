//! Manual pages, generated from the command-line definitions (`clap_mangen`), so they never
//! drift from `--help`: `vmdisk generate-man DIR` writes `man1/vmdisk.1`, one `man1/vmdisk-<command>.1`
//! per command, `man8/vmdisk-snapshotter.8` and `man8/containerd-shim-vmdisk-v2.8`. The
//! Debian package installs them (packaging/deb.sh).

use std::path::{Path, PathBuf};

use clap::CommandFactory;

use crate::error::{Error, Result};

fn render(cmd: &clap::Command, section: &str, dir: &Path, name: &str) -> Result<PathBuf> {
    let dir = dir.join(format!("man{section}"));
    std::fs::create_dir_all(&dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    let path = dir.join(format!("{name}.{section}"));
    let mut out = Vec::new();
    clap_mangen::Man::new(cmd.clone().name(name.to_string()))
        .section(section)
        .manual("vmdisk")
        .source(format!("vmdisk {}", env!("CARGO_PKG_VERSION")))
        .render(&mut out)
        .map_err(|e| Error::io(format!("rendering {}", path.display()), e))?;
    std::fs::write(&path, out).map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
    Ok(path)
}

/// The shim has no argument parser of its own (containerd's shim protocol); its page is its
/// `--help`.
fn shim_command() -> clap::Command {
    clap::Command::new("containerd-shim-vmdisk-v2")
        .about("a containerd runtime shim (v2) that hands a VM runtime a ready disk")
        .long_about(crate::shim::HELP)
        .version(env!("CARGO_PKG_VERSION"))
        .disable_help_flag(true)
        .disable_version_flag(true)
}

/// Writes every manual page under `dir`; returns their paths.
pub fn write_all(dir: &Path) -> Result<Vec<PathBuf>> {
    let vmdisk = super::args::Cli::command();
    let mut written = vec![render(&vmdisk, "1", dir, "vmdisk")?];
    for sub in vmdisk.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = format!("vmdisk-{}", sub.get_name());
        written.push(render(sub, "1", dir, &name)?);
    }
    written.push(render(
        &crate::snapshotter::args::Args::command(),
        "8",
        dir,
        "vmdisk-snapshotter",
    )?);
    written.push(render(
        &shim_command(),
        "8",
        dir,
        "containerd-shim-vmdisk-v2",
    )?);
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_program_and_command_has_a_page_naming_its_options() {
        let dir = tempfile::tempdir().unwrap();
        let pages = write_all(dir.path()).unwrap();
        let page = |name: &str| {
            let path = pages
                .iter()
                .find(|p| p.file_name().unwrap() == name)
                .unwrap();
            std::fs::read_to_string(path).unwrap()
        };
        assert!(page("vmdisk.1").contains("containerd\\-config"));
        assert!(page("vmdisk-path.1").contains("\\-\\-namespace"));
        assert!(page("vmdisk-snapshotter.8").contains("\\-\\-config"));
        assert!(page("containerd-shim-vmdisk-v2.8").contains("vmdisk.io/image"));
    }
}

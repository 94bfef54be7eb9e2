//! Setting a node's containerd up for vmdisk: `vmdisk containerd-config`.
//!
//! vmdisk ships one containerd snippet per release and setup (`config/containerd-*.toml`,
//! embedded here, so what the command writes is what the tests run). This module picks the one
//! that fits the containerd on the node (asked over its socket, or named) and merges it into
//! the node's own configuration file key by key ([`toml_merge`]), keeping every other key,
//! table and comment as it was. containerd 1.x replaces a whole plugin section when an `imports` drop-in names
//! it, so a drop-in would lose the node's `SystemdCgroup`, sandbox image and registry settings;
//! a merge in place loses nothing. Arrays of tables (2.x's `unpack_config`) gain the entries
//! they lack. A configuration of another config version is refused, naming the way out.

use std::path::Path;
use std::time::Duration;

use toml_edit::{DocumentMut, Item};

use crate::error::{Error, ErrorKind, Result};

pub mod toml_merge;

/// The containerd releases vmdisk ships snippets for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    V1_6,
    V1_7,
    /// 2.0 and later (config version 3).
    V2,
}

impl Release {
    /// The release a containerd version string (`1.7.24`, `v2.1.9`, `1.7.24~ds1`) belongs to.
    pub fn of_version(version: &str) -> Result<Self> {
        let v = version.trim().trim_start_matches('v');
        let mut parts = v.split(|c: char| !c.is_ascii_digit());
        let (major, minor) = (parts.next(), parts.next());
        match (major, minor) {
            (Some("1"), Some("6")) => Ok(Release::V1_6),
            (Some("1"), Some("7")) => Ok(Release::V1_7),
            (Some(m), _) if m.parse::<u32>().is_ok_and(|m| m >= 2) => Ok(Release::V2),
            _ => Err(Error::unsupported(format!(
                "containerd {version} is not one vmdisk has a configuration for (1.6, 1.7, 2.x)"
            ))),
        }
    }
}

/// Which images go through vmdisk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setup {
    /// vmdisk is the CRI snapshotter: every pull of a lazily loadable disk is lazy.
    AllImages,
    /// Only the VM runtime handlers use vmdisk (pods also need the handler annotation for a
    /// lazy pull); the node's own pods keep overlayfs.
    Handlers,
}

/// The snippet vmdisk ships for `release` and `setup`.
pub fn snippet(release: Release, setup: Setup) -> Result<&'static str> {
    Ok(match (release, setup) {
        (Release::V1_6, Setup::AllImages) => include_str!("../../config/containerd-1.6.toml"),
        (Release::V1_7, Setup::AllImages) => include_str!("../../config/containerd-1.7.toml"),
        (Release::V2, Setup::AllImages) => include_str!("../../config/containerd-2.x.toml"),
        (Release::V1_7, Setup::Handlers) => include_str!("../../config/containerd-1.7-handlers.toml"),
        (Release::V2, Setup::Handlers) => include_str!("../../config/containerd-2.x-handlers.toml"),
        (Release::V1_6, Setup::Handlers) => {
            return Err(Error::unsupported(
                "containerd 1.6 has one CRI snapshotter for every image and no per-handler one: run vmdisk as the node's snapshotter (the Debian package and config/containerd-1.6.toml), not per handler",
            ))
        }
    })
}

/// Asks the containerd at `socket` for its version (within 5 s).
pub async fn running_release(socket: &Path) -> Result<(Release, String)> {
    use crate::api::containerd::services::version::v1::version_client::VersionClient;
    let ask = async {
        let channel = crate::api::unix::channel(socket).await?;
        let answer = VersionClient::new(channel).version(()).await?;
        Ok::<_, Error>(answer.into_inner().version)
    };
    let version = tokio::time::timeout(Duration::from_secs(5), ask)
        .await
        .map_err(|_| {
            Error::new(
                ErrorKind::Timeout,
                format!(
                    "containerd at {} did not say its version within 5 s; name it with --release",
                    socket.display()
                ),
            )
        })?
        .map_err(|e| {
            e.context(format!(
                "asking containerd at {} for its version (or name it with --release)",
                socket.display()
            ))
        })?;
    Ok((Release::of_version(&version)?, version))
}

/// The release of the containerd this node runs, and how it was learnt: asked of the
/// containerd at `socket` if one answers, else `containerd --version` on PATH, else from
/// the configuration file's `version` (3 is 2.x; 2 is 1.6 or 1.7, which it cannot tell).
pub async fn node_release(socket: &Path, config: &str) -> Result<(Release, String)> {
    let running = match running_release(socket).await {
        Ok((release, version)) => return Ok((release, format!("{version} (running)"))),
        Err(e) => e,
    };
    let installed = match installed_release().await {
        Ok((release, version)) => return Ok((release, format!("{version} (installed)"))),
        Err(e) => e,
    };
    let version = config
        .parse::<DocumentMut>()
        .ok()
        .and_then(|d| d.get("version").and_then(Item::as_integer));
    match version {
        Some(3) => Ok((Release::V2, "2.x (configuration version 3)".into())),
        _ => Err(Error::new(
            ErrorKind::NotFound,
            format!(
                "cannot tell which containerd this node runs: {}; {}; and the configuration file does not say version 3 (2.x) — name the release with --release 1.6, 1.7 or 2",
                running.chain(),
                installed.chain()
            ),
        )),
    }
}

/// The release of the `containerd` binary on PATH (`containerd --version`, within 5 s).
async fn installed_release() -> Result<(Release, String)> {
    let mut command = tokio::process::Command::new("containerd");
    command.arg("--version").kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(5), command.output())
        .await
        .map_err(|_| {
            Error::new(
                ErrorKind::Timeout,
                "`containerd --version` did not answer within 5 s",
            )
        })?
        .map_err(|e| Error::io("running `containerd --version`", e))?;
    let text = String::from_utf8_lossy(&output.stdout);
    let version = version_said(&text)
        .ok_or_else(|| Error::invalid(format!("`containerd --version` said {:?}", text.trim())))?;
    Ok((Release::of_version(version)?, version.to_string()))
}

/// The version in what `containerd --version` prints: "containerd
/// github.com/containerd/containerd/v2 v2.1.9 <revision>" (Debian's: "… 1.6.20~ds1
/// 1.6.20~ds1-1+b1").
fn version_said(text: &str) -> Option<&str> {
    let mut words = text.split_whitespace();
    (words.next()? == "containerd").then_some(())?;
    words.nth(1)
}

/// `config` (a containerd configuration file's text; empty for none) with `snippet` merged in:
/// the snapshotter socket set to `socket` and the transfer platforms to `platform`.
pub fn merge(config: &str, snippet: &str, socket: &Path, platform: &str) -> Result<String> {
    let snippet = snippet
        .replace(
            "\"/run/vmdisk/snapshotter.sock\"",
            &toml_edit::Value::from(socket.display().to_string()).to_string(),
        )
        .replace(
            "\"linux/amd64\"",
            &toml_edit::Value::from(platform).to_string(),
        );
    let snippet: DocumentMut = snippet
        .parse()
        .map_err(|e| Error::invalid(format!("the shipped snippet does not parse: {e}")))?;
    let want = snippet
        .get("version")
        .and_then(Item::as_integer)
        .unwrap_or(1);
    if config.trim().is_empty() {
        return Ok(snippet.to_string());
    }
    let mut doc: DocumentMut = config
        .parse()
        .map_err(|e| Error::invalid(format!("the containerd configuration does not parse: {e}")))?;
    let have = doc.get("version").and_then(Item::as_integer).unwrap_or(1);
    if have != want {
        return Err(Error::invalid(format!(
            "the containerd configuration is version {have}, this containerd's is written in version {want}; run `containerd config migrate` on it first (containerd 2.x reads version 2 but names its plugins as version 3 does)"
        )));
    }
    toml_merge::merge_into(&mut doc, &snippet);
    Ok(doc.to_string())
}

/// Writes `text` to `path` atomically, keeping the first original beside it
/// (`<path>.vmdisk-backup`); returns the backup's path if one was made now.
pub fn write_config(path: &Path, text: &str) -> Result<Option<std::path::PathBuf>> {
    let mut backup = path.as_os_str().to_owned();
    backup.push(".vmdisk-backup");
    let backup = std::path::PathBuf::from(backup);
    let made = if path.exists() && !backup.exists() {
        std::fs::copy(path, &backup).map_err(|e| {
            Error::io(
                format!("keeping {} as {}", path.display(), backup.display()),
                e,
            )
        })?;
        Some(backup)
    } else {
        None
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".vmdisk-new");
    let tmp = std::path::PathBuf::from(tmp);
    std::fs::write(&tmp, text)
        .and_then(|()| {
            if let Ok(m) = std::fs::metadata(path) {
                std::fs::set_permissions(&tmp, m.permissions())?;
            }
            std::fs::rename(&tmp, path)
        })
        .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
    Ok(made)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node's containerd 1.7 configuration as kubeadm-style installs leave it.
    const NODE_17: &str = r#"version = 2
# the node's own comment
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.9"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'  # the node's quoting
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = true
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "/etc/containerd/certs.d"
[metrics]
  address = "127.0.0.1:1338"
"#;

    fn get<'a>(doc: &'a toml::Value, path: &[&str]) -> Option<&'a toml::Value> {
        path.iter().try_fold(doc, |v, k| v.get(k))
    }

    #[test]
    fn merging_keeps_the_nodes_cri_settings_and_adds_vmdisks() {
        let sock = Path::new("/run/vmdisk/snapshotter.sock");
        let snippet = snippet(Release::V1_7, Setup::Handlers).unwrap();
        let merged = merge(NODE_17, snippet, sock, "linux/arm64").unwrap();
        assert!(merged.contains("# the node's own comment"), "{merged}");
        let doc: toml::Value = toml::from_str(&merged).unwrap();
        let cri = ["plugins", "io.containerd.grpc.v1.cri"];
        let at = |rest: &[&str]| {
            let path: Vec<&str> = cri.iter().chain(rest).copied().collect();
            get(&doc, &path).cloned()
        };
        assert_eq!(
            at(&["sandbox_image"]).unwrap().as_str(),
            Some("registry.k8s.io/pause:3.9")
        );
        assert_eq!(
            at(&["containerd", "runtimes", "runc", "options", "SystemdCgroup"])
                .unwrap()
                .as_bool(),
            Some(true)
        );
        assert_eq!(
            at(&["registry", "config_path"]).unwrap().as_str(),
            Some("/etc/containerd/certs.d")
        );
        assert_eq!(
            at(&["containerd", "snapshotter"]).unwrap().as_str(),
            Some("overlayfs")
        );
        assert_eq!(
            at(&["containerd", "disable_snapshot_annotations"])
                .unwrap()
                .as_bool(),
            Some(false)
        );
        assert_eq!(
            at(&["containerd", "runtimes", "kubevirt", "snapshotter"])
                .unwrap()
                .as_str(),
            Some("vmdisk")
        );
        assert_eq!(
            get(&doc, &["proxy_plugins", "vmdisk", "address"])
                .unwrap()
                .as_str(),
            Some("/run/vmdisk/snapshotter.sock")
        );
        // Merging again changes nothing.
        assert_eq!(
            merge(&merged, snippet, sock, "linux/arm64").unwrap(),
            merged
        );
    }

    /// The file's lines stay as they were (the runc line's quoting and comment too); the new
    /// tables go where containerd's default configuration has them (sorted by name: the
    /// handlers after runc, the proxy plugin after the plugins and metrics), indented like
    /// their neighbours, and so do new keys.
    #[test]
    fn merging_writes_as_a_person_would() {
        let sock = Path::new("/run/vmdisk/snapshotter.sock");
        let merged = merge(
            NODE_17,
            snippet(Release::V1_7, Setup::AllImages).unwrap(),
            sock,
            "linux/amd64",
        )
        .unwrap();
        let lines: Vec<&str> = merged.lines().collect();
        let mut at = 0;
        for line in NODE_17.lines().filter(|l| !l.contains("snapshotter = ")) {
            at += lines[at..]
                .iter()
                .position(|l| l == &line)
                .unwrap_or_else(|| panic!("{line:?} is gone or moved:\n{merged}"));
        }
        let line = |text: &str| {
            lines
                .iter()
                .position(|l| l.contains(text))
                .unwrap_or_else(|| panic!("no {text:?}:\n{merged}"))
        };
        assert_eq!(
            lines[line("disable_snapshot_annotations")],
            "    disable_snapshot_annotations = false"
        );
        assert_eq!(
            lines[line("snapshotter = \"vmdisk\"")],
            "    snapshotter = \"vmdisk\""
        );
        let vmdisk = line(".runtimes.vmdisk]");
        assert!(
            vmdisk > line("SystemdCgroup") && vmdisk < line(".registry]"),
            "{merged}"
        );
        assert!(lines[vmdisk].starts_with("    [p"), "{merged}");
        assert!(
            lines[vmdisk + 1].starts_with("      runtime_type"),
            "{merged}"
        );
        let proxy = line("[proxy_plugins.vmdisk]");
        assert!(proxy > line("address = \"127.0.0.1:1338\""), "{merged}");
        assert_eq!(lines[proxy + 1], "  type = \"snapshot\"", "{merged}");
        assert_eq!(
            merge(
                &merged,
                snippet(Release::V1_7, Setup::AllImages).unwrap(),
                sock,
                "linux/amd64"
            )
            .unwrap(),
            merged
        );

        // containerd 2.x writes 'literal' strings: what is added follows.
        let node = "version = 3\n[plugins]\n  [plugins.'io.containerd.cri.v1.images']\n    snapshotter = 'overlayfs'\n";
        let merged = merge(
            node,
            snippet(Release::V2, Setup::AllImages).unwrap(),
            sock,
            "linux/amd64",
        )
        .unwrap();
        assert!(merged.contains("    snapshotter = 'vmdisk'\n"), "{merged}");
        assert!(
            merged.contains("  [proxy_plugins.vmdisk]\n    type = 'snapshot'\n")
                || merged.contains("[proxy_plugins.vmdisk]\n  type = 'snapshot'\n"),
            "{merged}"
        );
        // (Values; the new tables' names keep the snippet's quoting.)
        assert!(
            !merged.contains("= \"") && !merged.contains("[\""),
            "{merged}"
        );
    }

    #[test]
    fn the_installed_version_is_read_from_what_containerd_says() {
        let said = |t| version_said(t).map(Release::of_version).map(Result::unwrap);
        assert_eq!(
            said("containerd github.com/containerd/containerd/v2 v2.1.9 abc\n"),
            Some(Release::V2)
        );
        assert_eq!(
            said("containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+b1\n"),
            Some(Release::V1_6)
        );
        assert_eq!(said("runc version 1.1\n"), None);
    }

    #[test]
    fn arrays_of_tables_gain_what_they_lack_and_platforms_follow_the_node() {
        let node = "version = 3\n[[plugins.\"io.containerd.transfer.v1.local\".unpack_config]]\n  platform = \"linux/arm64\"\n  snapshotter = \"overlayfs\"\n  differ = \"walking\"\n";
        let merged = merge(
            node,
            snippet(Release::V2, Setup::Handlers).unwrap(),
            Path::new("/run/v.sock"),
            "linux/arm64",
        )
        .unwrap();
        let doc: toml::Value = toml::from_str(&merged).unwrap();
        let unpack = get(
            &doc,
            &[
                "plugins",
                "io.containerd.transfer.v1.local",
                "unpack_config",
            ],
        )
        .unwrap()
        .as_array()
        .unwrap();
        let snapshotters: Vec<&str> = unpack
            .iter()
            .map(|u| u["snapshotter"].as_str().unwrap())
            .collect();
        assert_eq!(snapshotters, ["overlayfs", "vmdisk"], "{merged}");
        assert!(unpack
            .iter()
            .all(|u| u["platform"].as_str() == Some("linux/arm64")));
    }

    #[test]
    fn what_does_not_fit_is_refused() {
        let sock = Path::new("/s");
        // 1.6 has no per-handler snapshotter.
        assert_eq!(
            snippet(Release::V1_6, Setup::Handlers).unwrap_err().kind(),
            ErrorKind::Unsupported
        );
        // A version-2 file for containerd 2.x.
        let e = merge(
            "version = 2\n",
            snippet(Release::V2, Setup::AllImages).unwrap(),
            sock,
            "linux/amd64",
        )
        .unwrap_err();
        assert!(e.to_string().contains("containerd config migrate"), "{e}");
        assert_eq!(Release::of_version("1.7.24~ds1").unwrap(), Release::V1_7);
        assert_eq!(Release::of_version("v2.1.9").unwrap(), Release::V2);
        assert_eq!(Release::of_version("1.6.20~ds1").unwrap(), Release::V1_6);
        assert!(Release::of_version("1.5.0").is_err());
        // No file yet: the snippet itself.
        let fresh = merge(
            "",
            snippet(Release::V1_7, Setup::AllImages).unwrap(),
            sock,
            "linux/amd64",
        )
        .unwrap();
        assert!(fresh.contains("address = \"/s\""), "{fresh}");
    }
}

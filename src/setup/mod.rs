//! Setting a node's containerd up for vmdisk: `vmdisk containerd-config`.
//!
//! vmdisk ships one containerd snippet per release and setup (`config/containerd-*.toml`,
//! embedded here, so what the command writes is what the tests run). This module picks the one
//! that fits the containerd on the node (asked over its socket, or named) and merges it into
//! the node's own configuration file key by key ([`toml_merge`]), keeping every other key,
//! table and comment as it was. containerd 1.x replaces a whole plugin section when an `imports` drop-in names
//! it, so a drop-in would lose the node's `SystemdCgroup`, sandbox image and registry settings;
//! a merge in place loses nothing. Arrays of tables (2.x's `unpack_config`) gain the entries
//! they lack.
//!
//! The file keeps the configuration version it has ([`ConfigVersion`]): containerd 2.x reads
//! versions 2 and 3 (and 4 from 2.3 on, which `containerd config default` and `config migrate`
//! of 2.3 and 2.4 write), migrating older ones as it loads them. The snippet is written in the
//! names the file's version uses ([`ConfigVersion::render`]); a file with no configuration
//! gets the version its containerd writes itself, so containerd has nothing to migrate.

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
    /// 2.0 to 2.2 (they write configuration version 3).
    V2,
    /// 2.3 and later (they write configuration version 4; the plugins vmdisk configures keep
    /// their version-3 names).
    V2_3,
}

impl Release {
    /// The release a containerd version string (`1.7.24`, `v2.1.9`, `1.7.24~ds1`) belongs to.
    pub fn of_version(version: &str) -> Result<Self> {
        let v = version.trim().trim_start_matches('v');
        let mut parts = v.split(|c: char| !c.is_ascii_digit());
        let number = |p: Option<&str>| p.and_then(|p| p.parse::<u32>().ok());
        match (number(parts.next()), number(parts.next())) {
            (Some(1), Some(6)) => Ok(Release::V1_6),
            (Some(1), Some(7)) => Ok(Release::V1_7),
            (Some(2), Some(0..=2)) => Ok(Release::V2),
            // `--release 2`: a 2.x that may be older than 2.3.
            (Some(2), None) => Ok(Release::V2),
            (Some(m), _) if m >= 2 => Ok(Release::V2_3),
            _ => Err(Error::unsupported(format!(
                "containerd {version} is not one vmdisk has a configuration for (1.6, 1.7, 2.x)"
            ))),
        }
    }

    /// How the release is written in messages.
    fn name(self) -> &'static str {
        match self {
            Release::V1_6 => "1.6",
            Release::V1_7 => "1.7",
            Release::V2 => "2.0-2.2",
            Release::V2_3 => "2.3 or later",
        }
    }

    /// The configuration version this release writes itself (`containerd config default`).
    pub fn config_version(self) -> ConfigVersion {
        match self {
            Release::V1_6 | Release::V1_7 => ConfigVersion::V2,
            Release::V2 => ConfigVersion::V3,
            Release::V2_3 => ConfigVersion::V4,
        }
    }

    /// The configuration versions this release reads that vmdisk writes into (every one it
    /// reads but version 1, whose short plugin names vmdisk does not write).
    fn reads(self, version: ConfigVersion) -> bool {
        match self {
            Release::V1_6 | Release::V1_7 => version == ConfigVersion::V2,
            Release::V2 | Release::V2_3 => version <= self.config_version(),
        }
    }
}

/// A containerd configuration file's `version`: what its tables are named.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ConfigVersion {
    /// containerd 1.x; 2.x migrates it: the CRI plugin is one (`io.containerd.grpc.v1.cri`).
    V2,
    /// containerd 2.0 and later: the CRI plugin split (`io.containerd.cri.v1.images`,
    /// `io.containerd.cri.v1.runtime`).
    V3,
    /// containerd 2.3 and later: the servers' sections (`[grpc]`, `[ttrpc]`, `[metrics]`,
    /// `[debug]`) became `io.containerd.server.v1.*` plugins; the CRI, transfer and proxy plugins
    /// keep their version-3 names.
    V4,
}

impl ConfigVersion {
    /// The version a configuration document says it is, or why vmdisk does not write into it.
    fn of(doc: &DocumentMut) -> Result<Self> {
        match doc.get("version").map(|v| v.as_integer()) {
            Some(Some(2)) => Ok(ConfigVersion::V2),
            Some(Some(3)) => Ok(ConfigVersion::V3),
            Some(Some(4)) => Ok(ConfigVersion::V4),
            // containerd reads a file without `version` as version 1 (short plugin names).
            None | Some(Some(1)) => Err(Error::unsupported(
                "the containerd configuration is version 1 (it has no `version` line), whose short plugin names vmdisk does not write; put `version = 2` at its top and name each plugin table in full (`[plugins.cri]` becomes `[plugins.\"io.containerd.grpc.v1.cri\"]`), or start from what `containerd config default` prints",
            )),
            Some(other) => Err(Error::unsupported(format!(
                "the containerd configuration says `version = {}`, which no containerd vmdisk knows writes (1.x: 2; 2.0-2.2: 2 or 3; 2.3 and later: 2, 3 or 4); check the file's first lines",
                other.map_or_else(|| doc["version"].to_string().trim().to_string(), |v| v.to_string())
            ))),
        }
    }

    fn number(self) -> i64 {
        match self {
            ConfigVersion::V2 => 2,
            ConfigVersion::V3 => 3,
            ConfigVersion::V4 => 4,
        }
    }

    /// `snippet` (a shipped one, in the version its release writes first: 2 for 1.x, 3 for 2.x)
    /// written in this version's names. Versions 3 and 4 name every plugin vmdisk configures
    /// alike. Version 2 read by containerd 2.x names the CRI plugin as 1.x did, and containerd
    /// moves what it holds into the version-3 plugins as it loads the file — overwriting the
    /// images plugin's snapshotter with the old section's, and keeping the old runtimes only if
    /// the runtime plugin has none: so vmdisk's CRI keys go where containerd's migration takes
    /// them from (its `images` and `runtime` plugins' migrations, inverted), and what has no
    /// version-2 name (`runtime_platforms`, the transfer service, the proxy plugin) keeps its
    /// full plugin name, which version 2 reads as it is.
    fn render(self, mut snippet: DocumentMut) -> DocumentMut {
        let written = snippet
            .get("version")
            .and_then(Item::as_integer)
            .unwrap_or(2);
        if written == 3 && self == ConfigVersion::V2 {
            to_version_2(&mut snippet);
        }
        snippet["version"] = toml_edit::value(self.number());
        snippet
    }
}

/// The CRI plugin's keys that containerd 2.x's migration of a version-2 file takes from
/// `[plugins."io.containerd.grpc.v1.cri".containerd]` into the images plugin.
const IMAGES_KEYS_OF_VERSION_2: [&str; 3] = [
    "snapshotter",
    "disable_snapshot_annotations",
    "discard_unpacked_layers",
];

/// A version-3 snippet's CRI tables moved to the names a version-2 file gives them (see
/// [`ConfigVersion::render`]).
fn to_version_2(snippet: &mut DocumentMut) {
    let Some(plugins) = snippet.get_mut("plugins").and_then(Item::as_table_mut) else {
        return;
    };
    let mut containerd = toml_edit::Table::new();
    if let Some(images) = plugins
        .get_mut("io.containerd.cri.v1.images")
        .and_then(Item::as_table_mut)
    {
        for key in IMAGES_KEYS_OF_VERSION_2 {
            if let Some((key, value)) = images.remove_entry(key) {
                containerd.insert_formatted(&key, value);
            }
        }
    }
    if let Some(runtime) = plugins
        .get_mut("io.containerd.cri.v1.runtime")
        .and_then(Item::as_table_mut)
    {
        if let Some(Item::Table(moved)) = runtime.remove("containerd") {
            for (key, value) in moved {
                containerd.insert(&key, value);
            }
        }
    }
    for empty in [
        "io.containerd.cri.v1.images",
        "io.containerd.cri.v1.runtime",
    ] {
        if plugins
            .get(empty)
            .and_then(Item::as_table)
            .is_some_and(toml_edit::Table::is_empty)
        {
            plugins.remove(empty);
        }
    }
    if containerd.is_empty() {
        return;
    }
    let mut cri = toml_edit::Table::new();
    cri.set_implicit(true);
    cri.insert("containerd", Item::Table(containerd));
    plugins.insert("io.containerd.grpc.v1.cri", Item::Table(cri));
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
        (Release::V2 | Release::V2_3, Setup::AllImages) => {
            include_str!("../../config/containerd-2.x.toml")
        }
        (Release::V1_7, Setup::Handlers) => include_str!("../../config/containerd-1.7-handlers.toml"),
        (Release::V2 | Release::V2_3, Setup::Handlers) => {
            include_str!("../../config/containerd-2.x-handlers.toml")
        }
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
        .and_then(|d| ConfigVersion::of(&d).ok());
    match version {
        Some(ConfigVersion::V3) => Ok((Release::V2, "2.x (configuration version 3)".into())),
        Some(ConfigVersion::V4) => Ok((Release::V2_3, "2.3 or later (configuration version 4)".into())),
        _ => Err(Error::new(
            ErrorKind::NotFound,
            format!(
                "cannot tell which containerd this node runs: {}; {}; and the configuration file does not say version 3 or 4 (2.x) — name the release with --release 1.6, 1.7, 2.1 or 2.3",
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

/// Where the daemon a snippet configures containerd for is: its snapshots socket and its root.
#[derive(Clone, Copy, Debug)]
pub struct Daemon<'a> {
    pub socket: &'a Path,
    pub root: &'a Path,
}

/// `config` (a containerd configuration file's text; empty for none) with the snippet of
/// `release` merged in, written in the file's configuration version (none: the one `release`
/// writes): the snapshotter's socket and root those of `daemon`, the transfer platforms
/// `platform`.
pub fn merge(
    config: &str,
    release: Release,
    setup: Setup,
    daemon: Daemon<'_>,
    platform: &str,
) -> Result<String> {
    let path = |p: &Path| toml_edit::Value::from(p.display().to_string()).to_string();
    let snippet = snippet(release, setup)?
        .replace("\"/run/vmdisk/snapshotter.sock\"", &path(daemon.socket))
        .replace("\"/var/lib/vmdisk-snapshotter\"", &path(daemon.root))
        .replace(
            "\"linux/amd64\"",
            &toml_edit::Value::from(platform).to_string(),
        );
    let snippet: DocumentMut = snippet
        .parse()
        .map_err(|e| Error::invalid(format!("the shipped snippet does not parse: {e}")))?;
    if config.trim().is_empty() {
        return Ok(release.config_version().render(snippet).to_string());
    }
    let mut doc: DocumentMut = config
        .parse()
        .map_err(|e| Error::invalid(format!("the containerd configuration does not parse: {e}")))?;
    let version = ConfigVersion::of(&doc)?;
    if !release.reads(version) {
        return Err(Error::unsupported(format!(
            "the containerd configuration is version {}, which containerd {} does not read (it writes version {}); a file written for another containerd release? `containerd config default` of the containerd installed prints one it reads",
            version.number(),
            release.name(),
            release.config_version().number(),
        )));
    }
    toml_merge::merge_into(&mut doc, &version.render(snippet));
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

    /// The daemon at socket `sock` and the default root.
    fn daemon(sock: &Path) -> Daemon<'_> {
        Daemon {
            socket: sock,
            root: Path::new("/var/lib/vmdisk-snapshotter"),
        }
    }

    fn get<'a>(doc: &'a toml::Value, path: &[&str]) -> Option<&'a toml::Value> {
        path.iter().try_fold(doc, |v, k| v.get(k))
    }

    #[test]
    fn merging_keeps_the_nodes_cri_settings_and_adds_vmdisks() {
        let sock = Path::new("/run/vmdisk/snapshotter.sock");
        let merged = merge(
            NODE_17,
            Release::V1_7,
            Setup::Handlers,
            daemon(sock),
            "linux/arm64",
        )
        .unwrap();
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
            merge(
                &merged,
                Release::V1_7,
                Setup::Handlers,
                daemon(sock),
                "linux/arm64"
            )
            .unwrap(),
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
            Release::V1_7,
            Setup::AllImages,
            daemon(sock),
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
                Release::V1_7,
                Setup::AllImages,
                daemon(sock),
                "linux/amd64"
            )
            .unwrap(),
            merged
        );

        // containerd 2.x writes 'literal' strings: what is added follows.
        let node = "version = 3\n[plugins]\n  [plugins.'io.containerd.cri.v1.images']\n    snapshotter = 'overlayfs'\n";
        let merged = merge(
            node,
            Release::V2,
            Setup::AllImages,
            daemon(sock),
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
            said("containerd github.com/containerd/containerd/v2 v2.4.2 abc\n"),
            Some(Release::V2_3)
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
            Release::V2,
            Setup::Handlers,
            daemon(Path::new("/run/v.sock")),
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

    /// What `containerd config default` of 2.3 and 2.4 writes, in part: version 4, the servers
    /// as plugins.
    const NODE_23: &str = r#"version = 4
root = '/var/lib/containerd'
state = '/run/containerd'

[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = 'registry.k8s.io/pause:3.10.1'
  [plugins.'io.containerd.cri.v1.runtime']
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes]
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
          runtime_type = 'io.containerd.runc.v2'
          [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
            SystemdCgroup = true
  [plugins.'io.containerd.server.v1.grpc']
    address = '/run/containerd/containerd.sock'
  [plugins.'io.containerd.transfer.v1.local']
    config_path = ''
"#;

    /// A 2.3 or 2.4 node's own file (version 4) stays version 4, with vmdisk's snapshotter,
    /// handlers and proxy plugin where version 3 names them; one with no file gets version 4;
    /// a 2.1 node's file is version 3 and stays so.
    #[test]
    fn a_version_4_file_stays_version_4() {
        let sock = Path::new("/run/vmdisk/snapshotter.sock");
        for setup in [Setup::AllImages, Setup::Handlers] {
            let merged = merge(NODE_23, Release::V2_3, setup, daemon(sock), "linux/amd64").unwrap();
            let doc: toml::Value = toml::from_str(&merged).unwrap();
            assert_eq!(doc["version"].as_integer(), Some(4), "{merged}");
            let images = &doc["plugins"]["io.containerd.cri.v1.images"];
            let runtimes =
                &doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"];
            assert_eq!(
                runtimes["runc"]["options"]["SystemdCgroup"].as_bool(),
                Some(true)
            );
            assert_eq!(
                runtimes["vmdisk"]["runtime_type"].as_str(),
                Some("io.containerd.vmdisk.v2")
            );
            assert_eq!(
                doc["proxy_plugins"]["vmdisk"]["address"].as_str(),
                sock.to_str()
            );
            assert_eq!(
                doc["plugins"]["io.containerd.server.v1.grpc"]["address"].as_str(),
                Some("/run/containerd/containerd.sock")
            );
            let snapshotter = images["snapshotter"].as_str();
            match setup {
                Setup::AllImages => assert_eq!(snapshotter, Some("vmdisk")),
                Setup::Handlers => {
                    assert_eq!(snapshotter, Some("overlayfs"));
                    assert_eq!(
                        images["runtime_platforms"]["kubevirt"]["snapshotter"].as_str(),
                        Some("vmdisk")
                    );
                }
            }
            assert!(
                !merged.contains("[grpc]") && !merged.contains("io.containerd.grpc.v1.cri"),
                "{merged}"
            );
            assert_eq!(
                merge(&merged, Release::V2_3, setup, daemon(sock), "linux/amd64").unwrap(),
                merged
            );
        }
        let fresh = merge(
            "",
            Release::V2_3,
            Setup::AllImages,
            daemon(sock),
            "linux/amd64",
        )
        .unwrap();
        assert!(fresh.contains("\nversion = 4\n"), "{fresh}");
        let fresh = merge(
            "",
            Release::V2,
            Setup::AllImages,
            daemon(sock),
            "linux/amd64",
        )
        .unwrap();
        assert!(fresh.contains("\nversion = 3\n"), "{fresh}");
        // A version-3 file on 2.3 (kept from 2.1 across an upgrade) stays version 3.
        let kept =
            "version = 3\n[plugins.'io.containerd.cri.v1.images']\n  snapshotter = 'overlayfs'\n";
        let merged = merge(
            kept,
            Release::V2_3,
            Setup::AllImages,
            daemon(sock),
            "linux/amd64",
        )
        .unwrap();
        assert!(
            merged.starts_with("version = 3\n") && merged.contains("snapshotter = 'vmdisk'"),
            "{merged}"
        );
    }

    /// containerd 2.x reading a version-2 file (written for 1.7, kept across an upgrade) moves
    /// the old CRI section's snapshotter over the images plugin's, and keeps its runtimes only
    /// if the runtime plugin has none: vmdisk's keys go under the old names, so the node's runc
    /// and its own settings survive containerd's migration and vmdisk's snapshotter wins.
    #[test]
    fn a_version_2_file_for_containerd_2_gets_the_names_version_2_uses() {
        let sock = Path::new("/run/vmdisk/snapshotter.sock");
        for release in [Release::V2, Release::V2_3] {
            let merged = merge(
                NODE_17,
                release,
                Setup::AllImages,
                daemon(sock),
                "linux/amd64",
            )
            .unwrap();
            let doc: toml::Value = toml::from_str(&merged).unwrap();
            assert_eq!(doc["version"].as_integer(), Some(2), "{merged}");
            let cri = &doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"];
            assert_eq!(cri["snapshotter"].as_str(), Some("vmdisk"), "{merged}");
            assert_eq!(
                cri["runtimes"]["runc"]["options"]["SystemdCgroup"].as_bool(),
                Some(true)
            );
            assert_eq!(
                cri["runtimes"]["vmdisk"]["runtime_type"].as_str(),
                Some("io.containerd.vmdisk.v2")
            );
            // The 2.x snippet does not turn the snapshot annotations off (1.7's does).
            assert!(
                cri.get("disable_snapshot_annotations").is_none(),
                "{merged}"
            );
            let plugins = doc["plugins"].as_table().unwrap();
            assert!(
                !plugins.contains_key("io.containerd.cri.v1.runtime"),
                "{merged}"
            );
            assert!(
                !plugins.contains_key("io.containerd.cri.v1.images"),
                "{merged}"
            );
            assert_eq!(
                doc["plugins"]["io.containerd.transfer.v1.local"]["unpack_config"][0]
                    ["snapshotter"]
                    .as_str(),
                Some("vmdisk")
            );
            assert_eq!(
                doc["proxy_plugins"]["vmdisk"]["exports"]["enable_remote_snapshot_annotations"]
                    .as_str(),
                Some("true")
            );
            let handlers = merge(
                NODE_17,
                release,
                Setup::Handlers,
                daemon(sock),
                "linux/amd64",
            )
            .unwrap();
            let doc: toml::Value = toml::from_str(&handlers).unwrap();
            let cri = &doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"];
            assert_eq!(cri["snapshotter"].as_str(), Some("overlayfs"), "{handlers}");
            assert_eq!(
                cri["runtimes"]["kubevirt"]["snapshotter"].as_str(),
                Some("vmdisk")
            );
            assert_eq!(
                doc["plugins"]["io.containerd.cri.v1.images"]["runtime_platforms"]["kubevirt"]
                    ["snapshotter"]
                    .as_str(),
                Some("vmdisk"),
                "{handlers}"
            );
        }
    }

    #[test]
    fn what_does_not_fit_is_refused() {
        let sock = Path::new("/s");
        // 1.6 has no per-handler snapshotter.
        assert_eq!(
            snippet(Release::V1_6, Setup::Handlers).unwrap_err().kind(),
            ErrorKind::Unsupported
        );
        // A file of a version the release does not read, or no release writes, or version 1:
        // each says what to do, and none sends to `containerd config migrate` (whose output
        // would be refused again).
        for (file, release, says) in [
            (
                "version = 3\n",
                Release::V1_7,
                "`containerd config default`",
            ),
            ("version = 4\n", Release::V2, "`containerd config default`"),
            ("version = 5\n", Release::V2_3, "no containerd vmdisk knows"),
            ("[plugins.cri]\n", Release::V2_3, "`version = 2`"),
        ] {
            let e =
                merge(file, release, Setup::AllImages, daemon(sock), "linux/amd64").unwrap_err();
            assert!(e.to_string().contains(says), "{file}: {e}");
            assert!(!e.to_string().contains("migrate"), "{file}: {e}");
        }
        assert_eq!(Release::of_version("1.7.24~ds1").unwrap(), Release::V1_7);
        assert_eq!(Release::of_version("v2.1.9").unwrap(), Release::V2);
        assert_eq!(Release::of_version("2").unwrap(), Release::V2);
        assert_eq!(Release::of_version("v2.3.7").unwrap(), Release::V2_3);
        assert_eq!(Release::of_version("2.4.2").unwrap(), Release::V2_3);
        assert_eq!(Release::of_version("1.6.20~ds1").unwrap(), Release::V1_6);
        assert!(Release::of_version("1.5.0").is_err());
        // No file yet: the snippet itself.
        let fresh = merge(
            "",
            Release::V1_7,
            Setup::AllImages,
            daemon(sock),
            "linux/amd64",
        )
        .unwrap();
        assert!(fresh.contains("address = \"/s\""), "{fresh}");
    }
}

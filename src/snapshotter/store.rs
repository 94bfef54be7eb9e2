//! The snapshot metadata: one record per snapshot key, in an embedded transactional database
//! (`redb`) under the daemon's root, so a crash between two steps never leaves half a commit.
//!
//! The store owns the rules containerd's snapshotters share (a key exists once; a parent must
//! be committed; committing turns an active snapshot into a committed one under a new name; a
//! snapshot with children cannot be removed). It never touches the file system: the
//! snapshotter orders directory changes around these transactions.

use std::collections::BTreeMap;
use std::path::Path;

use redb::{Database, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::oci::digest::Digest;
use crate::oci::reference::{ImageName, Reference};

const SNAPSHOTS: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshots");
const COUNTERS: TableDefinition<&str, u64> = TableDefinition::new("counters");
/// Disks kept ready through the management API, by the reference asked for.
const PINS: TableDefinition<&str, &[u8]> = TableDefinition::new("pins");

/// What a snapshot is, as containerd names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    View,
    Active,
    Committed,
}

impl Kind {
    /// containerd's spelling (`snapshots.Kind.String()`), used by filters.
    pub fn name(self) -> &'static str {
        match self {
            Kind::View => "View",
            Kind::Active => "Active",
            Kind::Committed => "Committed",
        }
    }
}

/// A committed snapshot served lazily: the layer's FUSE mount stands in for its directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteLayerRef {
    /// `registry/repository@manifest-digest` the layer was resolved from.
    pub reference: Reference,
    /// The layer's key ([`crate::layer::LayerId::key`]): what was verified about it, not the
    /// blob digest its manifest claims. Names its mount and cache.
    pub layer: Digest,
    /// The image name it was pulled as (the ready-disk directory's readable alias).
    #[serde(default)]
    pub alias: Option<ImageName>,
}

/// Disk usage of a snapshot's own directory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub size: u64,
    pub inodes: u64,
}

/// One snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Names the snapshot's directory (`snapshots/<id>`); kept across commit.
    pub id: u64,
    pub kind: Kind,
    /// Key of the parent ("" for none).
    pub parent: String,
    pub labels: BTreeMap<String, String>,
    /// Unix nanoseconds.
    pub created: i64,
    pub updated: i64,
    /// Usage frozen at commit (committed snapshots only).
    pub usage: Option<Usage>,
    pub remote: Option<RemoteLayerRef>,
}

/// The metadata database.
pub struct Store {
    db: Database,
}

/// Maps any redb error to an I/O error naming what the store was doing.
macro_rules! db {
    ($e:expr, $what:expr) => {
        $e.map_err(|e| {
            Error::new(ErrorKind::Io, format!("snapshot metadata: {}", $what))
                .with_source(redb::Error::from(e))
        })
    };
}

/// Current time in Unix nanoseconds.
pub fn now() -> i64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(t.as_nanos()).unwrap_or(i64::MAX)
}

fn decode(key: &str, bytes: &[u8]) -> Result<Record> {
    serde_json::from_slice(bytes).map_err(|e| {
        Error::new(
            ErrorKind::Corrupt,
            format!("snapshot metadata of {key:?} is unreadable"),
        )
        .with_source(e)
    })
}

fn encode(record: &Record) -> Vec<u8> {
    serde_json::to_vec(record).expect("records serialise")
}

/// A write transaction with the table open.
struct Tx<'a> {
    table: redb::Table<'a, &'static str, &'static [u8]>,
}

impl Tx<'_> {
    fn get(&self, key: &str) -> Result<Option<Record>> {
        match db!(self.table.get(key), "reading")? {
            Some(v) => decode(key, v.value()).map(Some),
            None => Ok(None),
        }
    }

    fn must_get(&self, key: &str) -> Result<Record> {
        self.get(key)?
            .ok_or_else(|| Error::not_found(format!("snapshot {key:?} does not exist")))
    }

    fn put(&mut self, key: &str, record: &Record) -> Result<()> {
        db!(self.table.insert(key, encode(record).as_slice()), "writing")?;
        Ok(())
    }

    fn has_children(&self, key: &str) -> Result<bool> {
        for entry in db!(self.table.iter(), "listing")? {
            let (k, v) = db!(entry, "listing")?;
            if decode(k.value(), v.value())?.parent == key {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

impl Store {
    /// Opens (creating) the database at `path`.
    pub fn open(path: &Path) -> Result<Store> {
        let db = Database::create(path).map_err(|e| {
            Error::new(
                ErrorKind::Io,
                format!("opening the snapshot metadata {}", path.display()),
            )
            .with_source(e)
        })?;
        let store = Store { db };
        store.write(|_| Ok(()))?;
        Ok(store)
    }

    /// Runs `f` in one write transaction, committed only if it succeeds.
    fn write<T>(&self, f: impl FnOnce(&mut Tx<'_>) -> Result<T>) -> Result<T> {
        let txn = db!(self.db.begin_write(), "starting a transaction")?;
        let out = {
            let table = db!(txn.open_table(SNAPSHOTS), "opening")?;
            let mut tx = Tx { table };
            f(&mut tx)?
        };
        db!(txn.commit(), "committing")?;
        Ok(out)
    }

    fn next_id(&self) -> Result<u64> {
        let txn = db!(self.db.begin_write(), "starting a transaction")?;
        let id = {
            let mut t = db!(txn.open_table(COUNTERS), "opening")?;
            let id = db!(t.get("next_id"), "reading")?.map_or(1, |v| v.value());
            db!(t.insert("next_id", id + 1), "writing")?;
            id
        };
        db!(txn.commit(), "committing")?;
        Ok(id)
    }

    /// The record of `key`, if any.
    pub fn get(&self, key: &str) -> Result<Option<Record>> {
        let txn = db!(self.db.begin_read(), "starting a read")?;
        let table = db!(txn.open_table(SNAPSHOTS), "opening")?;
        match db!(table.get(key), "reading")? {
            Some(v) => decode(key, v.value()).map(Some),
            None => Ok(None),
        }
    }

    /// The record of `key`, or NotFound.
    pub fn must_get(&self, key: &str) -> Result<Record> {
        self.get(key)?
            .ok_or_else(|| Error::not_found(format!("snapshot {key:?} does not exist")))
    }

    /// Every snapshot, by key.
    pub fn list(&self) -> Result<Vec<(String, Record)>> {
        let txn = db!(self.db.begin_read(), "starting a read")?;
        let table = db!(txn.open_table(SNAPSHOTS), "opening")?;
        let mut out = Vec::new();
        for entry in db!(table.iter(), "listing")? {
            let (k, v) = db!(entry, "listing")?;
            out.push((k.value().to_string(), decode(k.value(), v.value())?));
        }
        Ok(out)
    }

    /// Keys from `key`'s parent to the root, nearest first.
    pub fn ancestors(&self, key: &str) -> Result<Vec<(String, Record)>> {
        let mut out = Vec::new();
        let mut next = self.must_get(key)?.parent;
        while !next.is_empty() {
            let r = self.get(&next)?.ok_or_else(|| {
                Error::new(
                    ErrorKind::Corrupt,
                    format!("snapshot metadata: parent {next:?} is missing"),
                )
            })?;
            let parent = r.parent.clone();
            out.push((next, r));
            next = parent;
            if out.len() > 4096 {
                return Err(Error::corrupt("snapshot metadata: parent chain loops"));
            }
        }
        Ok(out)
    }

    /// Creates an active or view snapshot `key` on `parent` (committed, or "").
    pub fn create(
        &self,
        key: &str,
        kind: Kind,
        parent: &str,
        labels: BTreeMap<String, String>,
        remote: Option<RemoteLayerRef>,
    ) -> Result<Record> {
        if key.is_empty() {
            return Err(Error::invalid("a snapshot key must not be empty"));
        }
        let id = self.next_id()?;
        self.write(|tx| {
            if tx.get(key)?.is_some() {
                return Err(Error::new(
                    ErrorKind::AlreadyExists,
                    format!("snapshot {key:?} already exists"),
                ));
            }
            if !parent.is_empty() {
                let p = tx.get(parent)?.ok_or_else(|| {
                    Error::not_found(format!("parent snapshot {parent:?} does not exist"))
                })?;
                if p.kind != Kind::Committed {
                    return Err(Error::new(
                        ErrorKind::FailedPrecondition,
                        format!("parent {parent:?} is not a committed snapshot"),
                    ));
                }
            }
            let t = now();
            let record = Record {
                id,
                kind,
                parent: parent.to_string(),
                labels,
                created: t,
                updated: t,
                usage: None,
                remote,
            };
            tx.put(key, &record)?;
            Ok(record)
        })
    }

    /// Turns active snapshot `key` into committed snapshot `name` with `labels`.
    pub fn commit(
        &self,
        key: &str,
        name: &str,
        labels: BTreeMap<String, String>,
        usage: Usage,
    ) -> Result<Record> {
        if name.is_empty() {
            return Err(Error::invalid("a committed snapshot needs a name"));
        }
        self.write(|tx| {
            let mut record = tx.must_get(key)?;
            if record.kind != Kind::Active {
                return Err(Error::new(
                    ErrorKind::FailedPrecondition,
                    format!(
                        "snapshot {key:?} is not active; only active snapshots can be committed"
                    ),
                ));
            }
            if tx.get(name)?.is_some() {
                return Err(Error::new(
                    ErrorKind::AlreadyExists,
                    format!("snapshot {name:?} already exists"),
                ));
            }
            db!(tx.table.remove(key), "removing")?;
            record.kind = Kind::Committed;
            record.labels = labels;
            record.usage = Some(usage);
            let t = now();
            record.created = t;
            record.updated = t;
            tx.put(name, &record)?;
            Ok(record)
        })
    }

    /// Removes `key`, which must have no children.
    pub fn remove(&self, key: &str) -> Result<Record> {
        self.write(|tx| {
            let record = tx.must_get(key)?;
            if tx.has_children(key)? {
                return Err(Error::new(
                    ErrorKind::FailedPrecondition,
                    format!("snapshot {key:?} has children; remove them first"),
                ));
            }
            db!(tx.table.remove(key), "removing")?;
            Ok(record)
        })
    }

    /// Keeps `remote` ready under the name `reference`.
    pub fn pin(&self, reference: &str, remote: &RemoteLayerRef) -> Result<()> {
        let txn = db!(self.db.begin_write(), "starting a transaction")?;
        {
            let mut t = db!(txn.open_table(PINS), "opening")?;
            let value = serde_json::to_vec(remote).expect("pins serialise");
            db!(t.insert(reference, value.as_slice()), "writing")?;
        }
        db!(txn.commit(), "committing")
    }

    /// Forgets the pin `reference`; returns it.
    pub fn unpin(&self, reference: &str) -> Result<Option<RemoteLayerRef>> {
        let txn = db!(self.db.begin_write(), "starting a transaction")?;
        let old = {
            let mut t = db!(txn.open_table(PINS), "opening")?;
            let old = db!(t.remove(reference), "removing")?;
            old.map(|v| serde_json::from_slice(v.value())).transpose()
        };
        db!(txn.commit(), "committing")?;
        old.map_err(|e| Error::corrupt(format!("pin {reference:?} is unreadable")).with_source(e))
    }

    /// Every pin.
    pub fn pins(&self) -> Result<Vec<(String, RemoteLayerRef)>> {
        let txn = db!(self.db.begin_read(), "starting a read")?;
        let table = match txn.open_table(PINS) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return db!(Err(e), "opening"),
        };
        let mut out = Vec::new();
        for entry in db!(table.iter(), "listing")? {
            let (k, v) = db!(entry, "listing")?;
            let r = serde_json::from_slice(v.value()).map_err(|e| {
                Error::corrupt(format!("pin {:?} is unreadable", k.value())).with_source(e)
            })?;
            out.push((k.value().to_string(), r));
        }
        Ok(out)
    }

    /// Replaces `key`'s labels (all of them, or only the `labels.<name>` paths given).
    pub fn update_labels(
        &self,
        key: &str,
        labels: &BTreeMap<String, String>,
        paths: &[String],
    ) -> Result<Record> {
        self.write(|tx| {
            let mut record = tx.must_get(key)?;
            if paths.is_empty() {
                record.labels = labels.clone();
            }
            for path in paths {
                if path == "labels" {
                    record.labels = labels.clone();
                } else if let Some(name) = path.strip_prefix("labels.") {
                    match labels.get(name) {
                        Some(v) => record.labels.insert(name.to_string(), v.clone()),
                        None => record.labels.remove(name),
                    };
                } else {
                    return Err(Error::invalid(format!(
                        "cannot update field {path:?} of a snapshot; only labels and labels.<name> can change"
                    )));
                }
            }
            record.updated = now();
            tx.put(key, &record)?;
            Ok(record)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn snapshot_lifecycle_follows_containerd_rules() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("meta.db")).unwrap();
        let a = store
            .create("a", Kind::Active, "", BTreeMap::new(), None)
            .unwrap();
        let kind = |e: Error| e.kind();
        assert_eq!(
            kind(
                store
                    .create("a", Kind::Active, "", BTreeMap::new(), None)
                    .unwrap_err()
            ),
            ErrorKind::AlreadyExists
        );
        // An active parent is refused; a missing one is not found.
        assert_eq!(
            kind(
                store
                    .create("b", Kind::Active, "a", BTreeMap::new(), None)
                    .unwrap_err()
            ),
            ErrorKind::FailedPrecondition
        );
        assert_eq!(
            kind(
                store
                    .create("b", Kind::Active, "zz", BTreeMap::new(), None)
                    .unwrap_err()
            ),
            ErrorKind::NotFound
        );
        let c = store
            .commit("a", "base", labels(&[("x", "1")]), Usage::default())
            .unwrap();
        assert_eq!(c.id, a.id);
        assert_eq!(c.kind, Kind::Committed);
        assert!(store.get("a").unwrap().is_none());
        assert_eq!(
            kind(
                store
                    .commit("base", "again", BTreeMap::new(), Usage::default())
                    .unwrap_err()
            ),
            ErrorKind::FailedPrecondition
        );
        let child = store
            .create("child", Kind::View, "base", BTreeMap::new(), None)
            .unwrap();
        assert_ne!(child.id, a.id);
        assert_eq!(store.ancestors("child").unwrap()[0].0, "base");
        assert_eq!(
            kind(store.remove("base").unwrap_err()),
            ErrorKind::FailedPrecondition
        );
        store.remove("child").unwrap();
        store.remove("base").unwrap();
        assert_eq!(kind(store.remove("base").unwrap_err()), ErrorKind::NotFound);
        assert!(store.list().unwrap().is_empty());
    }

    #[test]
    fn label_updates_by_path() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("meta.db")).unwrap();
        store
            .create(
                "k",
                Kind::Active,
                "",
                labels(&[("a", "1"), ("b", "2")]),
                None,
            )
            .unwrap();
        let r = store
            .update_labels(
                "k",
                &labels(&[("b", "3"), ("c", "4")]),
                &["labels.b".into(), "labels.a".into()],
            )
            .unwrap();
        assert_eq!(r.labels, labels(&[("b", "3")]));
        let r = store
            .update_labels("k", &labels(&[("z", "9")]), &[])
            .unwrap();
        assert_eq!(r.labels, labels(&[("z", "9")]));
        assert!(store
            .update_labels("k", &BTreeMap::new(), &["name".into()])
            .is_err());
        // Survives reopening.
        drop(store);
        let store = Store::open(&dir.path().join("meta.db")).unwrap();
        assert_eq!(store.must_get("k").unwrap().labels, labels(&[("z", "9")]));
    }
}

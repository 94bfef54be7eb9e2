//! The names of a layer's files in its cache directory (the layout in `cache`'s module docs),
//! spelled only here, and where a file's data is.

use std::path::{Path, PathBuf};

pub const META: &str = "meta.json";
pub const TOC: &str = "toc.zst";
pub const DATA: &str = "data";
pub const BITMAP: &str = "bitmap";
pub const SUMS: &str = "sums";
pub const STRUCTURE_CHECKED: &str = "structure-checked";
pub const INTEGRITY: &str = "integrity";
pub const LOCK: &str = "lock";
pub const LAST_USED: &str = "last-used";

/// The data file of the layer's regular file number `n`, in its cache directory `layer_dir`.
pub fn data_file(layer_dir: &Path, n: usize) -> PathBuf {
    layer_dir.join(DATA).join(n.to_string())
}

//! A TOML document merged into another key by key, as a person would edit it: every key,
//! table, comment and blank line of the first kept where it was; tables merged recursively,
//! arrays of tables gaining the entries they lack, values replaced unless equal (keeping the
//! replaced value's comment); the new tables placed beside their kin, indented and quoted as the
//! file around them is. General, not containerd's: `vmdisk containerd-config` merges its
//! snippet with it ([`super::merge`]), and the tests their machines' settings.

use std::collections::{HashMap, HashSet};

use serde::Deserialize;

use toml_edit::{DocumentMut, Item, Table, TableLike};

/// `from` merged into `doc` (see the module's doc).
pub fn merge_into(doc: &mut DocumentMut, from: &DocumentMut) {
    let had: HashSet<TablePath> = tables(doc.as_table()).into_iter().map(|t| t.path).collect();
    let quotes = Quotes::of(doc.as_table());
    merge_table(doc.as_table_mut(), from.as_table(), quotes);
    lay_out(doc, &had);
}

/// A table's place in the document: its keys, with an array-of-tables entry's index as a
/// segment of its own (`\0` and the index, zero-padded: entries sort in order, after their
/// siblings' names never collide with a key).
type TablePath = Vec<String>;

/// A table of the document as rendered: where, in which position, and how its header is
/// indented (`None` when it is implicit: not written).
#[derive(Clone)]
struct Placed {
    path: TablePath,
    position: usize,
    indent: Option<usize>,
}

/// Every table of `root` (array-of-tables entries included), as toml_edit renders them: depth
/// first, in key order, a table without a position of its own placed after the one before it.
fn tables(root: &Table) -> Vec<Placed> {
    fn visit(table: &Table, path: &mut TablePath, last: &mut usize, out: &mut Vec<Placed>) {
        let mut found = |t: &Table, path: &mut TablePath, out: &mut Vec<Placed>| {
            if let Some(p) = t.position() {
                *last = p;
            }
            let prefix = t.decor().prefix().and_then(|p| p.as_str()).unwrap_or("");
            out.push(Placed {
                path: path.clone(),
                position: *last,
                indent: (!t.is_implicit()).then(|| prefix.rsplit('\n').next().unwrap_or("").len()),
            });
            visit(t, path, last, out);
        };
        for (key, item) in table.iter() {
            path.push(key.to_string());
            match item {
                Item::Table(t) => found(t, path, out),
                Item::ArrayOfTables(a) => {
                    for (i, t) in a.iter().enumerate() {
                        path.push(format!("\0{i:06}"));
                        found(t, path, out);
                        path.pop();
                    }
                }
                _ => {}
            }
            path.pop();
        }
    }
    let mut out = Vec::new();
    visit(root, &mut Vec::new(), &mut 0, &mut out);
    out
}

/// The table at `path` under `root`.
fn table_at<'a>(root: &'a mut Table, path: &[String]) -> Option<&'a mut Table> {
    let mut table = root;
    let mut rest = path;
    while let Some((key, tail)) = rest.split_first() {
        let item = table.get_mut(key)?;
        table = match (item, tail.first().and_then(|s| s.strip_prefix('\0'))) {
            (Item::ArrayOfTables(a), Some(i)) => {
                rest = &tail[1..];
                a.get_mut(i.parse().ok()?)?
            }
            (Item::Table(t), _) => {
                rest = tail;
                t
            }
            _ => return None,
        };
    }
    Some(table)
}

/// The indent of the nearest written table above `path` among `written`, if any.
fn ancestor_indent(written: &HashMap<TablePath, usize>, path: &[String]) -> Option<usize> {
    (1..path.len())
        .rev()
        .find_map(|n| written.get(&path[..n]).copied())
}

/// Spaces a table's header is indented beyond the nearest written table above it, as the
/// file does it (its first nested table that is), or containerd's own 2 in a file with no
/// nested tables.
fn indent_step(placed: &[Placed]) -> usize {
    let written: HashMap<TablePath, usize> = placed
        .iter()
        .filter_map(|t| Some((t.path.clone(), t.indent?)))
        .collect();
    let steps: Vec<usize> = placed
        .iter()
        .filter_map(|t| {
            Some(
                t.indent?
                    .saturating_sub(ancestor_indent(&written, &t.path)?),
            )
        })
        .collect();
    match steps.iter().find(|s| **s > 0) {
        Some(step) => *step,
        None if !steps.is_empty() => 0,
        None => 2,
    }
}

/// Where in `order` a new table at `path` goes: among the tables under its nearest ancestor
/// that has any (the whole document at worst), after the last that sorts before it, else
/// before the first. containerd's default configuration is sorted by name, so in a file
/// like it the new table lands where containerd would have written it; in any other it
/// stays among its relatives.
fn place(order: &[TablePath], path: &TablePath) -> usize {
    let relatives = |k: usize| -> Vec<usize> {
        (0..order.len())
            .filter(|&i| order[i].starts_with(&path[..k]))
            .collect()
    };
    let block = (0..path.len())
        .rev()
        .map(relatives)
        .find(|b| !b.is_empty())
        .unwrap_or_default();
    match block.iter().rev().find(|&&i| order[i] < *path) {
        Some(&i) => i + 1,
        None => block.first().copied().unwrap_or(order.len()),
    }
}

/// Places the tables the merge added where containerd's own default configuration has them
/// ([`place`]), indents each one `step` beyond the nearest written table above it, and indents every
/// new key as its table's keys are; the file's own tables keep their order and formatting.
fn lay_out(doc: &mut DocumentMut, had: &HashSet<TablePath>) {
    let placed = tables(doc.as_table());
    let step = indent_step(
        &placed
            .iter()
            .filter(|t| had.contains(&t.path))
            .cloned()
            .collect::<Vec<_>>(),
    );
    let (mut kept, new): (Vec<Placed>, Vec<Placed>) =
        placed.into_iter().partition(|t| had.contains(&t.path));
    kept.sort_by_key(|t| t.position);
    let mut written: HashMap<TablePath, usize> = kept
        .iter()
        .filter_map(|t| Some((t.path.clone(), t.indent?)))
        .collect();
    let mut order: Vec<TablePath> = kept.into_iter().map(|t| t.path).collect();
    let mut new: Vec<TablePath> = new.into_iter().map(|t| t.path).collect();
    new.sort();
    for path in new {
        let at = place(&order, &path);
        order.insert(at, path);
    }
    let root = doc.as_table_mut();
    for (position, path) in order.iter().enumerate() {
        let Some(table) = table_at(root, path) else {
            continue;
        };
        table.set_position(position + 1);
        let added = !had.contains(path);
        if added && !table.is_implicit() {
            let indent = ancestor_indent(&written, path).map_or(0, |i| i + step);
            written.insert(path.clone(), indent);
            let pad = " ".repeat(indent);
            let prefix = table
                .decor()
                .prefix()
                .and_then(|p| p.as_str())
                .unwrap_or("");
            let mut decorated = String::from("\n");
            for comment in prefix.lines().map(str::trim).filter(|l| !l.is_empty()) {
                decorated.push_str(&format!("{pad}{comment}\n"));
            }
            decorated.push_str(&pad);
            table.decor_mut().set_prefix(decorated);
        }
        // Keys: an added table's one step beyond its header; a key added to the file's table
        // (the file's keys have a prefix, if an empty one) as that table's others.
        let header = " ".repeat(written.get(path).copied().unwrap_or(0) + step);
        let keys = match added {
            true => header,
            false => table
                .iter()
                .filter(|(_, item)| item.is_value())
                .find_map(|(key, _)| {
                    let prefix = table.key(key)?.leaf_decor().prefix()?.as_str()?;
                    Some(prefix.to_string())
                })
                .filter(|p| p.chars().all(|c| c == ' ' || c == '\t'))
                .unwrap_or(header),
        };
        for (mut key, item) in table.iter_mut() {
            if item.is_value() && (added || key.leaf_decor().prefix().is_none()) {
                key.leaf_decor_mut().set_prefix(keys.clone());
            }
        }
    }
}

/// Merges `from` into `into`: tables key by key (a table `into` lacks is added whole),
/// arrays of tables by appending the entries `into` lacks, values replaced unless equal. A
/// replaced value keeps its key's and its own formatting (a trailing comment).
fn merge_table(into: &mut dyn TableLike, from: &Table, quotes: Quotes) {
    for (key, item) in from.iter() {
        match (into.get_mut(key), item) {
            (Some(existing), Item::Table(table)) if existing.is_table_like() => {
                let existing = existing.as_table_like_mut().expect("a table");
                merge_table(existing, table, quotes);
            }
            (Some(Item::ArrayOfTables(existing)), Item::ArrayOfTables(tables)) => {
                for t in tables.iter() {
                    let same = |e: &Table| {
                        t.iter().all(|(k, v)| {
                            match (e.get(k).and_then(Item::as_value), v.as_value()) {
                                (Some(a), Some(b)) => same_value(a, b),
                                _ => false,
                            }
                        })
                    };
                    if !existing.iter().any(same) {
                        let mut t = t.clone();
                        quotes.apply_all(&mut t);
                        existing.push(t);
                    }
                }
            }
            (Some(Item::Value(old)), Item::Value(value)) => {
                if !same_value(old, value) {
                    let decor = old.decor().clone();
                    *old = value.clone();
                    quotes.apply(old);
                    *old.decor_mut() = decor;
                }
            }
            (_, Item::None) => {}
            (_, item) => {
                let mut item = item.clone();
                match &mut item {
                    Item::Value(value) => {
                        value.decor_mut().clear();
                        quotes.apply(value);
                    }
                    Item::Table(t) => quotes.apply_all(t),
                    Item::ArrayOfTables(a) => a.iter_mut().for_each(|t| quotes.apply_all(t)),
                    Item::None => {}
                }
                into.insert(key, item);
            }
        }
    }
}

/// How the file writes its strings: containerd 2.x's `config default` writes `'literal'`
/// strings, 1.x and most people `"basic"` ones. What the merge writes follows the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Quotes {
    Basic,
    Literal,
}

impl Quotes {
    /// The file's way: literal if most of its strings are.
    fn of(root: &Table) -> Quotes {
        fn count(table: &Table, n: &mut (usize, usize)) {
            for (_, item) in table.iter() {
                match item {
                    Item::Value(toml_edit::Value::String(s)) => {
                        match s.display_repr().starts_with('\'') {
                            true => n.1 += 1,
                            false => n.0 += 1,
                        }
                    }
                    Item::Table(t) => count(t, n),
                    Item::ArrayOfTables(a) => a.iter().for_each(|t| count(t, n)),
                    _ => {}
                }
            }
        }
        let mut n = (0, 0);
        count(root, &mut n);
        if n.1 > n.0 {
            Quotes::Literal
        } else {
            Quotes::Basic
        }
    }

    /// `value` (a string, or strings in an array) written this way where it can be: a literal
    /// string cannot hold a `'` or a line break.
    fn apply(self, value: &mut toml_edit::Value) {
        match value {
            toml_edit::Value::String(s) if self == Quotes::Literal => {
                let text = s.value();
                if !text.contains(['\'', '\n', '\r']) {
                    if let Ok(literal) = format!("'{text}'").parse::<toml_edit::Value>() {
                        let decor = s.decor().clone();
                        *value = literal;
                        *value.decor_mut() = decor;
                    }
                }
            }
            toml_edit::Value::Array(a) => a.iter_mut().for_each(|v| self.apply(v)),
            _ => {}
        }
    }

    /// Every value in `table` and the tables under it.
    fn apply_all(self, table: &mut Table) {
        for (_, item) in table.iter_mut() {
            match item {
                Item::Value(v) => self.apply(v),
                Item::Table(t) => self.apply_all(t),
                Item::ArrayOfTables(a) => a.iter_mut().for_each(|t| self.apply_all(t)),
                Item::None => {}
            }
        }
    }
}

/// Whether two values say the same, however each is written (quotes, spacing, comments).
fn same_value(a: &toml_edit::Value, b: &toml_edit::Value) -> bool {
    let plain = |v: &toml_edit::Value| {
        let mut v = v.clone();
        v.decor_mut().clear();
        toml::Value::deserialize(toml::de::ValueDeserializer::new(&v.to_string())).ok()
    };
    match (plain(a), plain(b)) {
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

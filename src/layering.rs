//! The module graph's rule, checked (`docs/architecture.md`): a module of `src/` uses only
//! modules of its own layer or the layers below it, and no two modules use each other, however
//! indirectly. Read from the sources (`crate::<module>` paths outside comments and test
//! modules), so a new import that breaks the rule fails `make test`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The layers, top first, as the diagram in `docs/architecture.md` draws them.
const LAYERS: [(&str, &[&str]); 6] = [
    ("binaries", &["bin", "cli", "snapshotter", "shim"]),
    ("features", &["publish", "inspect", "trace", "setup"]),
    ("serving", &["serve", "view", "engine", "resolve", "policy"]),
    ("model", &["blob", "layer", "cache", "registry"]),
    ("formats", &["format"]),
    (
        "vocabulary",
        &[
            "error", "oci", "units", "task", "retry", "dirs", "logging", "api", "progress",
        ],
    ),
];

/// Each top-level module and the other top-level modules its code names.
fn imports(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut files = vec![src.to_path_buf()];
    while let Some(path) = files.pop() {
        if path.is_dir() {
            files.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
            continue;
        }
        let rel = path.strip_prefix(src).unwrap();
        let top = rel
            .iter()
            .next()
            .unwrap()
            .to_string_lossy()
            .replace(".rs", "");
        if path.extension().is_none_or(|e| e != "rs") || top == "lib" || top == "layering" {
            continue;
        }
        if path.file_name().is_some_and(|n| n == "tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        // Test modules may reach anything; the rule is for the code that ships.
        let code = match text.find("\n#[cfg(test)]\nmod tests {") {
            Some(at) => &text[..at],
            None => &text,
        };
        let used = graph.entry(top.clone()).or_default();
        for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for (at, _) in line.match_indices("crate::") {
                let name: String = line[at + 7..]
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if name != top {
                    used.insert(name);
                }
            }
        }
    }
    graph
}

/// The modules `from` reaches through the graph (itself included only through a cycle).
fn reached(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut next: Vec<&String> = graph.get(from).into_iter().flatten().collect();
    while let Some(m) = next.pop() {
        if seen.insert(m.clone()) {
            next.extend(graph.get(m).into_iter().flatten());
        }
    }
    seen
}

#[test]
fn modules_use_only_their_layer_and_those_below_and_no_two_use_each_other() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = imports(&src);
    let layer_of: BTreeMap<&str, usize> = LAYERS
        .iter()
        .enumerate()
        .flat_map(|(i, (_, modules))| modules.iter().map(move |m| (*m, i)))
        .collect();
    let mut wrong = Vec::new();
    for (module, used) in &graph {
        let Some(&mine) = layer_of.get(module.as_str()) else {
            wrong.push(format!("{module} is in no layer of docs/architecture.md"));
            continue;
        };
        for other in used {
            match layer_of.get(other.as_str()) {
                Some(&theirs) if theirs < mine => wrong.push(format!(
                    "{module} ({}) uses {other} ({}), a layer above it",
                    LAYERS[mine].0, LAYERS[theirs].0
                )),
                Some(_) => {}
                None => wrong.push(format!("{module} uses {other}, which is in no layer")),
            }
        }
        if reached(&graph, module).contains(module) {
            wrong.push(format!(
                "{module} reaches itself through the modules it uses"
            ));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    // The check sees the graph: the engine uses the cache, and the binaries use the serving
    // layer through them.
    assert!(graph["engine"].contains("cache") && reached(&graph, "cli").contains("engine"));
}

/// The files of a crate rooted at `root` (`lib.rs` or `main.rs` there) and the files each
/// one's code names: `crate::`, `super::` and `self::` paths, and paths through the child
/// modules it declares, each resolved to the deepest file of the module path (a `mod.rs` for
/// a directory). Tests in files of their own (`tests.rs`, `tests/`) are files like any other;
/// a test module inside a file (`#[cfg(test)] mod tests { … }` at its end) is left out: its
/// `super` is the file itself.
fn file_graph(root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut texts = BTreeMap::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path
                    .strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .to_string();
                let text = std::fs::read_to_string(&path).unwrap();
                let code = match text.find("\n#[cfg(test)]\nmod tests {") {
                    Some(at) => text[..at].to_string(),
                    None => text,
                };
                texts.insert(rel, code);
            }
        }
    }
    // A file's module path: `a/b.rs` and `a/b/mod.rs` are `a::b`; the crate root is `[]`.
    let module_of = |rel: &str| -> Vec<String> {
        let mut parts: Vec<String> = rel
            .trim_end_matches(".rs")
            .split('/')
            .map(String::from)
            .collect();
        if matches!(
            parts.last().map(String::as_str),
            Some("mod" | "lib" | "main")
        ) {
            parts.pop();
        }
        parts
    };
    let by_module: BTreeMap<Vec<String>, String> = texts
        .keys()
        .map(|rel| (module_of(rel), rel.clone()))
        .collect();
    let file_of = |path: &[String]| -> Option<String> {
        (0..=path.len())
            .rev()
            .find_map(|n| by_module.get(&path[..n]).cloned())
    };
    let path_re =
        regex::Regex::new(r"\b(crate|super|self)((?:::(?:super\b|[A-Za-z_][A-Za-z0-9_]*))*)")
            .unwrap();
    let child_re =
        regex::Regex::new(r"(?m)^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+([a-z_0-9]+)\s*;").unwrap();
    // A visibility (`pub(super)`, `pub(crate)`, `pub(in …)`) names no module the file uses.
    let visibility_re = regex::Regex::new(r"pub\((?:crate|super|self|in [^)]*)\)").unwrap();
    let mut graph = BTreeMap::new();
    for (rel, code) in &texts {
        let me = module_of(rel);
        let children: Vec<String> = child_re
            .captures_iter(code)
            .map(|c| c[1].to_string())
            .collect();
        let mut used = BTreeSet::new();
        for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
            let line = visibility_re.replace_all(line, "");
            let line = line.as_ref();
            for c in path_re.captures_iter(line) {
                let mut segments = c[2].split("::").filter(|s| !s.is_empty());
                let mut at: Vec<String> = match &c[1] {
                    "crate" => Vec::new(),
                    "super" => me[..me.len().saturating_sub(1)].to_vec(),
                    _ => me.clone(),
                };
                let mut rest = Vec::new();
                for s in segments.by_ref() {
                    if s == "super" && rest.is_empty() {
                        at.pop();
                    } else if s != "self" {
                        rest.push(s.to_string());
                    }
                }
                at.extend(rest);
                used.extend(file_of(&at));
            }
            for child in &children {
                for (i, _) in line.match_indices(&format!("{child}::")) {
                    let before = line[..i].chars().last();
                    if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                        continue;
                    }
                    let mut at = me.clone();
                    at.push(child.clone());
                    at.extend(
                        line[i + child.len() + 2..]
                            .split("::")
                            .map(|s| {
                                s.chars()
                                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                                    .collect::<String>()
                            })
                            .take_while(|s| !s.is_empty()),
                    );
                    used.extend(file_of(&at));
                }
            }
        }
        used.remove(rel);
        graph.insert(rel.clone(), used);
    }
    graph
}

/// The cycles of `graph`: each set of nodes that reach one another (of two or more).
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    let mut found: Vec<BTreeSet<String>> = Vec::new();
    for node in graph.keys() {
        let from = reached(graph, node);
        if !from.contains(node) || found.iter().any(|c| c.contains(node)) {
            continue;
        }
        found.push(
            from.into_iter()
                .filter(|other| reached(graph, other).contains(node))
                .collect(),
        );
    }
    found
}

/// `graph` with each file replaced by its unit below `dir` (the file or directory directly in
/// it); the files outside `dir`, and `dir`'s own `mod.rs`, are left out.
fn units_below(
    graph: &BTreeMap<String, BTreeSet<String>>,
    dir: &str,
) -> BTreeMap<String, BTreeSet<String>> {
    let unit = |file: &str| -> Option<String> {
        let rest = file.strip_prefix(dir)?;
        let unit = rest.split('/').next()?.trim_end_matches(".rs");
        (unit != "mod").then(|| unit.to_string())
    };
    let mut units: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (file, used) in graph {
        let Some(from) = unit(file) else { continue };
        let entry = units.entry(from.clone()).or_default();
        entry.extend(used.iter().filter_map(|u| unit(u)).filter(|u| *u != from));
    }
    units
}

#[test]
fn the_modules_of_a_directory_use_one_another_without_a_cycle() {
    let mut graph = file_graph(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    // Tests of a module may reach whatever they test it with (a resolution's tests open an
    // engine); the rule is for the code that ships, as at the top level.
    graph.retain(|file, _| !file.ends_with("/tests.rs") && !file.contains("/tests/"));
    let dirs: BTreeSet<String> = graph
        .keys()
        .filter_map(|f| f.rsplit_once('/').map(|(d, _)| format!("{d}/")))
        .collect();
    let mut wrong = Vec::new();
    for dir in std::iter::once(String::new()).chain(dirs) {
        for cycle in cycles(&units_below(&graph, &dir)) {
            wrong.push(format!("in src/{dir}: {cycle:?} use one another"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    // The check sees the graph: the remote Prepare uses the snapshotter's store.
    assert!(graph["snapshotter/remote.rs"].contains("snapshotter/store.rs"));
}

#[test]
fn no_file_of_the_integration_tests_reaches_itself() {
    let graph = file_graph(&Path::new(env!("CARGO_MANIFEST_DIR")).join("integration"));
    let found = cycles(&graph);
    assert!(found.is_empty(), "{found:#?}");
    // The check sees the graph: cases stand on the fixtures, which stand on the harness.
    assert!(graph["cases/crash.rs"].contains("fixtures/cri.rs"));
    assert!(graph["fixtures/images.rs"].contains("fixtures/harness.rs"));
    let cases: BTreeSet<&String> = graph.keys().filter(|f| f.starts_with("cases/")).collect();
    for (file, used) in &graph {
        if file.starts_with("cases/") {
            let other: Vec<_> = used.iter().filter(|u| cases.contains(u)).collect();
            assert!(
                other.is_empty(),
                "{file} uses the case files {other:?}: what two cases share is a fixture"
            );
        }
    }
}

#[test]
fn the_engine_is_changed_only_through_its_own_methods() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for (file, _) in file_graph(&src) {
        let text = std::fs::read_to_string(src.join(&file)).unwrap();
        assert!(
            file.starts_with("engine/") || file == "layering.rs" || !text.contains("impl Engine {"),
            "{file} implements Engine outside src/engine/"
        );
    }
    let engine = std::fs::read_to_string(src.join("engine/mod.rs")).unwrap();
    let body = &engine[engine.find("pub struct Engine {").unwrap()..];
    let body = &body[..body.find("\n}").unwrap()];
    assert!(
        !body.contains("\n    pub "),
        "a pub field of Engine:\n{body}"
    );
}

#[test]
fn no_file_of_src_reaches_itself() {
    let graph = file_graph(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let found = cycles(&graph);
    assert!(found.is_empty(), "{found:#?}");
    // The test writers' crate too (the examples and fuzz targets are one file each).
    let testing = cycles(&file_graph(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("testing/src"),
    ));
    assert!(testing.is_empty(), "{testing:#?}");
    // The check sees the graph: the registry client's files use its vocabulary, not the facade.
    assert!(graph["registry/transport.rs"].contains("registry/client.rs"));
    assert!(graph["registry/mod.rs"].contains("registry/client.rs"));
}

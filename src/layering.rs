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

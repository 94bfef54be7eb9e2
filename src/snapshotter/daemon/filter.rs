//! containerd's filter language, as `ctr snapshots ls` and the metadata layer send it in
//! `List` (Walk): `name==a`, `parent!="x"`, `labels."containerd.io/snapshot.ref"==sha256:…`,
//! `kind~=^Comm` (RE2 syntax, as containerd's Go `regexp`), or a bare field path that must be present. Selectors separated by `,` must all
//! hold; several filter strings in one request match if any one does.
//!
//! Filters arrive from the caller (containerd, an operator's `ctr`): parsing is strict and the
//! error names the position, so a malformed filter is refused rather than matching everything.

use std::collections::BTreeMap;

use crate::error::{Error, Result};

/// The comparison of a selector.
#[derive(Debug, Clone)]
enum Op {
    Present,
    Equal(String),
    NotEqual(String),
    Matches(regex::Regex),
}

/// One `fieldpath op value` term.
#[derive(Debug, Clone)]
struct Selector {
    path: Vec<String>,
    op: Op,
}

/// A parsed filter: a conjunction of selectors. The empty filter matches everything.
#[derive(Debug, Clone)]
pub struct Filter {
    selectors: Vec<Selector>,
}

/// The fields of a snapshot a filter can look at.
pub struct Fields<'a> {
    pub name: &'a str,
    pub parent: &'a str,
    /// containerd's spelling: "View", "Active" or "Committed".
    pub kind: &'a str,
    pub labels: &'a BTreeMap<String, String>,
}

impl Fields<'_> {
    fn get(&self, path: &[String]) -> Option<&str> {
        match path {
            [f] if f == "name" => Some(self.name),
            [f] if f == "parent" => Some(self.parent),
            [f] if f == "kind" => Some(self.kind),
            [f, rest @ ..] if f == "labels" && !rest.is_empty() => {
                self.labels.get(&rest.join(".")).map(String::as_str)
            }
            _ => None,
        }
    }
}

impl Filter {
    /// Parses one filter string.
    pub fn parse(text: &str) -> Result<Filter> {
        Parser { text, pos: 0 }.filter()
    }

    /// Whether `fields` satisfy every selector.
    pub fn matches(&self, fields: &Fields<'_>) -> bool {
        self.selectors.iter().all(|s| {
            let value = fields.get(&s.path);
            // Kinds compare without case: containerd prints "Committed", users type "committed".
            let eq = |v: &str, want: &str| {
                if s.path.len() == 1 && s.path[0] == "kind" {
                    v.eq_ignore_ascii_case(want)
                } else {
                    v == want
                }
            };
            match (&s.op, value) {
                (Op::Present, v) => v.is_some(),
                (Op::Equal(want), Some(v)) => eq(v, want),
                (Op::Equal(_), None) => false,
                (Op::NotEqual(want), Some(v)) => !eq(v, want),
                (Op::NotEqual(_), None) => true,
                (Op::Matches(re), Some(v)) => re.is_match(v),
                (Op::Matches(_), None) => false,
            }
        })
    }
}

/// Parses every filter of a request; an empty list matches everything.
pub fn parse_all(filters: &[String]) -> Result<Vec<Filter>> {
    filters.iter().map(|f| Filter::parse(f)).collect()
}

/// Whether `fields` satisfy any of `filters` (all, if there are none).
pub fn any_matches(filters: &[Filter], fields: &Fields<'_>) -> bool {
    filters.is_empty() || filters.iter().any(|f| f.matches(fields))
}

struct Parser<'a> {
    text: &'a str,
    pos: usize,
}

impl Parser<'_> {
    fn error(&self, what: &str) -> Error {
        Error::invalid(format!(
            "filter {:?}: {what} at offset {}; the syntax is field==value, field!=value, field~=regexp or a field path, joined by ','",
            self.text, self.pos
        ))
    }

    fn peek(&self) -> Option<char> {
        self.text[self.pos..].chars().next()
    }

    fn eat(&mut self, s: &str) -> bool {
        if self.text[self.pos..].starts_with(s) {
            self.pos += s.len();
            true
        } else {
            false
        }
    }

    fn skip_spaces(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.pos += 1;
        }
    }

    fn filter(mut self) -> Result<Filter> {
        let mut selectors = Vec::new();
        self.skip_spaces();
        if self.pos == self.text.len() {
            return Ok(Filter { selectors });
        }
        loop {
            selectors.push(self.selector()?);
            self.skip_spaces();
            match self.peek() {
                None => return Ok(Filter { selectors }),
                Some(',') => self.pos += 1,
                Some(_) => return Err(self.error("expected ',' or the end")),
            }
        }
    }

    fn selector(&mut self) -> Result<Selector> {
        self.skip_spaces();
        let mut path = vec![self.field()?];
        while self.eat(".") {
            path.push(self.field()?);
        }
        self.skip_spaces();
        let op = if self.eat("==") {
            Op::Equal(self.value()?)
        } else if self.eat("!=") {
            Op::NotEqual(self.value()?)
        } else if self.eat("~=") {
            let pattern = self.value()?;
            Op::Matches(compile(&pattern).map_err(|e| self.error(&e))?)
        } else {
            Op::Present
        };
        Ok(Selector { path, op })
    }

    fn field(&mut self) -> Result<String> {
        if self.peek() == Some('"') {
            return self.quoted();
        }
        let start = self.pos;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            self.pos += 1;
        }
        if start == self.pos {
            return Err(self.error("expected a field name"));
        }
        Ok(self.text[start..self.pos].to_string())
    }

    fn value(&mut self) -> Result<String> {
        self.skip_spaces();
        if self.peek() == Some('"') {
            return self.quoted();
        }
        let start = self.pos;
        while self.peek().is_some_and(|c| c != ',') {
            self.pos += self.peek().map_or(1, char::len_utf8);
        }
        let value = self.text[start..self.pos].trim_end();
        if value.is_empty() {
            return Err(self.error("expected a value"));
        }
        Ok(value.to_string())
    }

    /// A Go-style double-quoted string (`%q` output): `\"`, `\\`, `\n`, `\t`, `\r`.
    fn quoted(&mut self) -> Result<String> {
        self.pos += 1;
        let mut out = String::new();
        loop {
            let Some(c) = self.peek() else {
                return Err(self.error("unterminated quoted string"));
            };
            self.pos += c.len_utf8();
            match c {
                '"' => return Ok(out),
                '\\' => {
                    let Some(e) = self.peek() else {
                        return Err(self.error("unterminated escape"));
                    };
                    self.pos += e.len_utf8();
                    out.push(match e {
                        'n' => '\n',
                        't' => '\t',
                        'r' => '\r',
                        '"' | '\\' | '/' => e,
                        _ => return Err(self.error("unknown escape")),
                    });
                }
                c => out.push(c),
            }
        }
    }
}

/// Longest `~=` pattern accepted; containerd's own filters are a few dozen bytes.
const MAX_PATTERN: usize = 4096;

/// Compiles a `~=` pattern with the `regex` crate: RE2 syntax, as containerd's Go `regexp`
/// reads it, matched in time linear in the text (no backtracking), with the compiled program
/// bounded so a hostile pattern cannot take the daemon's memory.
fn compile(pattern: &str) -> std::result::Result<regex::Regex, String> {
    if pattern.len() > MAX_PATTERN {
        return Err(format!(
            "the pattern is {} bytes; at most {MAX_PATTERN} are accepted",
            pattern.len()
        ));
    }
    regex::RegexBuilder::new(pattern)
        .size_limit(1 << 20)
        .dfa_size_limit(1 << 20)
        .build()
        .map_err(|e| format!("not a valid regular expression: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields<'a>(labels: &'a BTreeMap<String, String>) -> Fields<'a> {
        Fields {
            name: "default/3/sha256:abc",
            parent: "default/2/sha256:def",
            kind: "Committed",
            labels,
        }
    }

    #[test]
    fn matches_what_containerd_sends() {
        let mut labels = BTreeMap::new();
        labels.insert(
            "containerd.io/snapshot.ref".to_string(),
            "sha256:abc".to_string(),
        );
        let f = fields(&labels);
        // The metadata layer's lookup of a remote snapshot.
        let q = r#"labels."containerd.io/snapshot.ref"==sha256:abc,parent=="default/2/sha256:def""#;
        assert!(Filter::parse(q).unwrap().matches(&f));
        let q = "labels.\"containerd.io/snapshot.ref\"==sha256:abc,parent==\"\"";
        assert!(!Filter::parse(q).unwrap().matches(&f));
        assert!(
            !Filter::parse(r#"labels."containerd.io/snapshot.ref"==sha256:abd"#)
                .unwrap()
                .matches(&f)
        );
        assert!(Filter::parse("kind==committed").unwrap().matches(&f));
        assert!(Filter::parse("kind!=active,name~=^default/3/")
            .unwrap()
            .matches(&f));
        assert!(Filter::parse(r#"labels."containerd.io/snapshot.ref""#)
            .unwrap()
            .matches(&f));
        assert!(!Filter::parse("labels.missing").unwrap().matches(&f));
        assert!(Filter::parse("labels.missing!=x").unwrap().matches(&f));
        assert!(Filter::parse("").unwrap().matches(&f));
        assert!(!Filter::parse("name==other").unwrap().matches(&f));
    }

    #[test]
    fn any_of_several_filters() {
        let labels = BTreeMap::new();
        let f = fields(&labels);
        let fs = parse_all(&["name==x".into(), "kind==Committed".into()]).unwrap();
        assert!(any_matches(&fs, &f));
        let fs = parse_all(&["name==x".into(), "kind==View".into()]).unwrap();
        assert!(!any_matches(&fs, &f));
        assert!(any_matches(&[], &f));
    }

    #[test]
    fn refuses_malformed_filters() {
        for bad in [
            "==x",
            "name==",
            "labels.\"unterminated==x",
            "name==a,",
            "name~=[a-z",
            "name==\"a\" extra",
        ] {
            let err = Filter::parse(bad).unwrap_err();
            assert!(err.to_string().contains("filter"), "{bad}: {err}");
        }
    }

    #[test]
    fn patterns_are_re2() {
        let m = |p: &str, t: &str| compile(p).unwrap().is_match(t);
        assert!(m("^sha256:", "sha256:abc"));
        assert!(!m("^abc", "sha256:abc"));
        assert!(m("abc$", "sha256:abc"));
        assert!(m("^ab*c$", "ac") && m("^ab*c$", "abbbc") && !m("^ab+c$", "ac"));
        // Character classes, alternation, counted repetition: what containerd's Go regexp takes.
        assert!(m("^[0-9]+$", "42") && !m("^[0-9]+$", "4a"));
        assert!(m(
            r"^default/\d+/sha256:[[:xdigit:]]{3}$",
            "default/3/sha256:abc"
        ));
        assert!(m("^(View|Active)$", "Active") && !m("^(View|Active)$", "Committed"));
        assert!(m("", "anything"));
        // Backreferences and look-around are not RE2; refused with a reason.
        assert!(compile(r"(a)\1")
            .unwrap_err()
            .contains("regular expression"));
        assert!(compile(&"a".repeat(MAX_PATTERN + 1)).is_err());
    }

    #[test]
    fn pathological_patterns_match_in_linear_time() {
        // Exponential for a backtracking matcher: (a*)^30 c against 40 a's.
        let pattern = format!("^{}c$", "a*".repeat(30));
        let text = "a".repeat(40);
        let f = Filter::parse(&format!("name~={pattern}")).unwrap();
        let labels = BTreeMap::new();
        let fields = Fields {
            name: &text,
            ..fields(&labels)
        };
        let started = std::time::Instant::now();
        assert!(!f.matches(&fields));
        // Generous: linear matching takes microseconds; backtracking here takes hours.
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
    }
}

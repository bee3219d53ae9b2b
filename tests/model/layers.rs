//! The library's top-level modules form layers that only point down: no import cycle
//! between them (issue 28). A cycle means nothing in it can be read, tested or replaced on
//! its own, so this test fails on one and names it, with the line that makes each step.
//!
//! Every `crate::…` path in `src/` (in `use` items, `use crate::{a, b::c}` groups and
//! expressions) and every `super::…` path that climbs to the crate root is an edge from the
//! top-level module of the file it is in to the top-level module it names. Comments and
//! string literals are not read. Only the modules `src/lib.rs` declares count (the binary's
//! own tree, `src/bin/outbox-relay/`, sits above the library and is left out).
//! The order the layers form, bottom up, is printed on success.
//!
//! Two checks keep the layout readable from the paths alone (issue 51): the top of `src/`
//! holds the library's modules and one folder for the binary, and no two files of different
//! modules share a name, but for the names every module may have for the same job.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Where one top-level module uses another: `file:line`.
type Edges = BTreeMap<(String, String), Vec<String>>;

#[test]
fn the_library_modules_have_no_import_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    read_tree(&src, &src, &mut files);
    let lib = files
        .iter()
        .find(|(path, _)| path == "lib.rs")
        .map(|(_, text)| text.clone())
        .expect("src/lib.rs");
    let modules = declared_modules(&lib);
    assert!(
        modules.len() >= 10,
        "src/lib.rs declares only {modules:?}: is the parser still reading it?"
    );
    let edges = edges(&modules, &files);
    assert!(
        edges.len() >= 10,
        "only {} edges found between {modules:?}: is the parser still reading src/?",
        edges.len()
    );
    if let Err(cycle) = check(&modules, &edges) {
        panic!("{cycle}");
    }
    println!(
        "layers, bottom up: {}",
        layers(&modules, &edges).join(" < ")
    );
}

/// The top of `src/` is `lib.rs`, the modules it declares, and `bin/`, the binary's tree:
/// a file or folder beside them is either compiled by nobody or a piece of the command
/// line among the library's modules.
#[test]
fn the_top_of_src_is_the_library_and_one_folder_for_the_binary() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules = declared_modules(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
    let mut strays: Vec<String> = std::fs::read_dir(&src)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| {
            let module = name.strip_suffix(".rs").unwrap_or(name);
            name != "lib.rs" && name != "bin" && !modules.contains(module)
        })
        .collect();
    strays.sort();
    assert!(
        strays.is_empty(),
        "src/ holds {strays:?}, which src/lib.rs does not declare: the library's modules are \
         declared in src/lib.rs, the command line's files go under src/bin/outbox-relay/"
    );
}

/// Names every module may use for the same job: a folder module's root, the settings a
/// layer owns, a destination's settings.
const SHARED_NAMES: [&str; 3] = ["mod.rs", "settings.rs", "config.rs"];

/// No two files under `src/` share a name (but for [`SHARED_NAMES`]): a name says which
/// file it is, in a stack trace, an editor's tab or a review, without its folder.
#[test]
fn no_two_files_share_a_name() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    read_tree(&src, &src, &mut files);
    let mut by_name: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (path, _) in &files {
        let name = path.rsplit('/').next().unwrap().to_owned();
        if !SHARED_NAMES.contains(&name.as_str()) {
            by_name.entry(name).or_default().push(format!("src/{path}"));
        }
    }
    let shared: Vec<String> = by_name
        .into_values()
        .filter(|paths| paths.len() > 1)
        .map(|paths| paths.join(" and "))
        .collect();
    assert!(
        shared.is_empty(),
        "files that share a name: {}; give each a name that says its job (a verb's file ends \
         in _verb.rs)",
        shared.join("; ")
    );
}

/// The checker on a made-up crate whose modules `a`, `b` and `c` use each other in a ring
/// (through a group, a `super::super::` path and an expression), beside a comment and a
/// string that mention `crate::d`: it must find the ring and name every step, and it must
/// pass the same crate once the ring is broken.
#[test]
fn the_check_finds_a_cycle_in_a_made_up_crate() {
    let lib = "//! made up\npub mod a;\npub mod b;\npub mod c;\npub mod d;\n";
    let mut files = vec![
        ("lib.rs".to_owned(), lib.to_owned()),
        (
            "a.rs".to_owned(),
            "use crate::b::Thing;\n// crate::d is only mentioned\nconst S: &str = \"crate::d\";\n"
                .to_owned(),
        ),
        (
            "b/mod.rs".to_owned(),
            "mod inner;\npub use crate::{d::Low, c::Mid as M};\n".to_owned(),
        ),
        (
            "c/deep.rs".to_owned(),
            "mod tests {\n    fn f() { let _ = super::super::super::a::f(); }\n}\n".to_owned(),
        ),
        ("d.rs".to_owned(), "pub struct Low;\n".to_owned()),
    ];
    let modules = declared_modules(lib);
    let found = edges(&modules, &files);
    let err = check(&modules, &found).expect_err("a -> b -> c -> a is a cycle");
    assert!(err.contains("a -> b -> c -> a"), "{err}");
    for step in ["a.rs:1", "b/mod.rs:2", "c/deep.rs:2"] {
        assert!(err.contains(step), "{step} is not named in: {err}");
    }
    assert!(
        !found.contains_key(&("a".to_owned(), "d".to_owned())),
        "comments and strings are not imports"
    );

    files[3].1 = "mod tests {\n    fn f() { let _ = super::super::super::d::Low; }\n}\n".to_owned();
    let found = edges(&modules, &files);
    check(&modules, &found).expect("no cycle once c stops using a");
    assert_eq!(layers(&modules, &found), ["d", "c", "b", "a"]);
}

fn read_tree(root: &Path, dir: &Path, out: &mut Vec<(String, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            read_tree(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            out.push((rel, std::fs::read_to_string(&path).unwrap()));
        }
    }
}

/// The modules `lib.rs` declares (`mod x;`, with any visibility).
fn declared_modules(lib: &str) -> BTreeSet<String> {
    let tokens = tokens(lib);
    tokens
        .windows(3)
        .filter(|w| w[0].text == "mod" && w[2].text == ";")
        .map(|w| w[1].text.clone())
        .collect()
}

/// The edges between top-level modules, with where each is made.
fn edges(modules: &BTreeSet<String>, files: &[(String, String)]) -> Edges {
    let mut edges = Edges::new();
    for (path, text) in files {
        let Some(file_module) = module_path(path) else {
            continue;
        };
        let Some(from) = file_module.first().filter(|m| modules.contains(*m)) else {
            continue;
        };
        for (to, line) in references(&tokens(text), file_module.len()) {
            if &to != from && modules.contains(&to) {
                edges
                    .entry((from.clone(), to))
                    .or_default()
                    .push(format!("src/{path}:{line}"));
            }
        }
    }
    edges
}

/// `store.rs` and `store/mod.rs` are `[store]`, `dispatch/circuit.rs` is
/// `[dispatch, circuit]`; `lib.rs`, the crate root, is None.
fn module_path(path: &str) -> Option<Vec<String>> {
    let trimmed = path.strip_suffix(".rs")?;
    let mut parts: Vec<String> = trimmed.split('/').map(str::to_owned).collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    if parts.len() == 1 && parts[0] == "lib" {
        return None;
    }
    Some(parts)
}

/// The top-level modules named by the `crate::` paths and root-climbing `super::` paths of
/// a file `depth` modules below the root, with their lines.
fn references(tokens: &[Token], depth: usize) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    // For each open brace: whether it opens an inline `mod name { … }`.
    let mut braces: Vec<bool> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let t = &tokens[i];
        match t.text.as_str() {
            "{" => {
                let inline_mod = i >= 2 && tokens[i - 2].text == "mod";
                braces.push(inline_mod);
            }
            "}" => {
                braces.pop();
            }
            "crate" if next_is(tokens, i + 1, "::") => {
                found.extend(named_after(tokens, i + 2));
            }
            "super" if next_is(tokens, i + 1, "::") && !(i >= 1 && tokens[i - 1].text == "::") => {
                let mut climbs = 0;
                let mut j = i;
                while tokens.get(j).is_some_and(|t| t.text == "super")
                    && next_is(tokens, j + 1, "::")
                {
                    climbs += 1;
                    j += 2;
                }
                let inline = braces.iter().filter(|m| **m).count();
                if climbs == depth + inline {
                    found.extend(named_after(tokens, j));
                }
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    found
}

fn next_is(tokens: &[Token], i: usize, text: &str) -> bool {
    tokens.get(i).is_some_and(|t| t.text == text)
}

/// What a path names at `i`, just after `crate::`: one identifier, or the first
/// identifier of each item of a `{ … }` group.
fn named_after(tokens: &[Token], i: usize) -> Vec<(String, usize)> {
    let Some(t) = tokens.get(i) else {
        return Vec::new();
    };
    if t.text != "{" {
        return if t.ident {
            vec![(t.text.clone(), t.line)]
        } else {
            Vec::new()
        };
    }
    let mut names = Vec::new();
    let mut depth = 0;
    let mut item_start = true;
    for t in &tokens[i + 1..] {
        match t.text.as_str() {
            "{" => depth += 1,
            "}" if depth == 0 => break,
            "}" => depth -= 1,
            "," if depth == 0 => item_start = true,
            _ if item_start && depth == 0 => {
                if t.ident && t.text != "self" {
                    names.push((t.text.clone(), t.line));
                }
                item_start = false;
            }
            _ => {}
        }
    }
    names
}

/// A cycle among `modules`, if any, as `a -> b -> a` with the lines that make each step.
fn check(modules: &BTreeSet<String>, edges: &Edges) -> Result<(), String> {
    for start in modules {
        if let Some(cycle) = cycle_through(start, edges) {
            let steps: Vec<String> = cycle
                .windows(2)
                .map(|w| {
                    let at = &edges[&(w[0].clone(), w[1].clone())];
                    format!("  {} -> {}: {}", w[0], w[1], at.join(", "))
                })
                .collect();
            return Err(format!(
                "import cycle between top-level modules: {}\n{}\nbreak it by moving what the \
                 lower module needs down (a type it owns, a plain value) so that the edge \
                 points one way only",
                cycle.join(" -> "),
                steps.join("\n")
            ));
        }
    }
    Ok(())
}

/// The shortest path from `start` back to itself (breadth first), if there is one.
fn cycle_through(start: &str, edges: &Edges) -> Option<Vec<String>> {
    let mut came_from: BTreeMap<String, String> = BTreeMap::new();
    let mut frontier = vec![start.to_owned()];
    while !frontier.is_empty() {
        let mut next = Vec::new();
        for node in frontier {
            for (from, to) in edges.keys() {
                if *from != node {
                    continue;
                }
                if to == start {
                    // node, its predecessor, …, back to start; then turned round.
                    let mut path = vec![node.clone()];
                    while let Some(prev) = came_from.get(path.last().unwrap()) {
                        path.push(prev.clone());
                    }
                    path.reverse();
                    path.push(start.to_owned());
                    return Some(path);
                }
                if !came_from.contains_key(to) && to != start {
                    came_from.insert(to.clone(), node.clone());
                    next.push(to.clone());
                }
            }
        }
        frontier = next;
    }
    None
}

/// The modules in an order where each uses only those before it (ties by name).
fn layers(modules: &BTreeSet<String>, edges: &Edges) -> Vec<String> {
    let mut placed: Vec<String> = Vec::new();
    let mut left: BTreeSet<String> = modules.clone();
    while !left.is_empty() {
        let ready: Vec<String> = left
            .iter()
            .filter(|m| {
                edges
                    .keys()
                    .all(|(from, to)| from != *m || !left.contains(to))
            })
            .cloned()
            .collect();
        assert!(!ready.is_empty(), "a cycle is left among {left:?}");
        for m in ready {
            left.remove(&m);
            placed.push(m);
        }
    }
    placed
}

struct Token {
    text: String,
    ident: bool,
    line: usize,
}

/// Identifiers, `::` and single punctuation, without comments and literals.
fn tokens(text: &str) -> Vec<Token> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    let at = |i: usize| chars.get(i).copied().unwrap_or('\0');
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            loop {
                if i >= chars.len() {
                    break;
                }
                if chars[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if chars[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if c == '"' || ((c == 'r' || c == 'b') && raw_or_byte_string(&chars, i)) {
            // "…", b"…", r"…", r#"…"#, br#"…"#
            let mut j = i;
            while chars[j] != '"' && chars[j] != '#' {
                j += 1;
            }
            let raw = chars[i..j].contains(&'r');
            let mut hashes = 0;
            while chars[j] == '#' {
                hashes += 1;
                j += 1;
            }
            j += 1; // the opening quote
            loop {
                if j >= chars.len() {
                    break;
                }
                match chars[j] {
                    '\\' if !raw => j += 2,
                    '"' if (0..hashes).all(|h| at(j + 1 + h) == '#') => {
                        j += 1 + hashes;
                        break;
                    }
                    ch => {
                        if ch == '\n' {
                            line += 1;
                        }
                        j += 1;
                    }
                }
            }
            i = j;
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{1F600}') or a lifetime ('a).
            if at(i + 1) == '\\' {
                i += 2;
                while i < chars.len() && chars[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                i += 1;
            }
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let ident = !word.starts_with(|ch: char| ch.is_ascii_digit());
            out.push(Token {
                text: word,
                ident,
                line,
            });
        } else if c == ':' && at(i + 1) == ':' {
            out.push(Token {
                text: "::".into(),
                ident: false,
                line,
            });
            i += 2;
        } else {
            out.push(Token {
                text: c.to_string(),
                ident: false,
                line,
            });
            i += 1;
        }
    }
    out
}

/// Whether `chars[i..]` opens a raw or byte string (`r"`, `r#"`, `b"`, `br"`, `br#"`)
/// rather than an identifier that starts with r or b.
fn raw_or_byte_string(chars: &[char], i: usize) -> bool {
    if i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_') {
        return false;
    }
    let mut j = i;
    if chars.get(j) == Some(&'b') {
        j += 1;
    }
    if chars.get(j) == Some(&'r') {
        j += 1;
        while chars.get(j) == Some(&'#') {
            j += 1;
        }
    }
    j > i && chars.get(j) == Some(&'"')
}

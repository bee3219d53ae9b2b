//! `docs/configuration.md` and `docs/destinations.md` against the code's own definitions,
//! so that a setting cannot be missing from the reference and a default cannot drift:
//!
//! - every flag of every verb, read from the binary's `--help` (clap's definitions), has
//!   exactly one row in its verb's section (globals in their own), with its environment
//!   variable and the default the help states; a row naming a flag the verb does not have
//!   is reported too;
//! - every environment variable any help text names is in the reference;
//! - every key of the config file (the names serde accepts, from its own "expected one of"
//!   list) has exactly one row;
//! - every default of a `run` setting given as a value, set explicitly in a config, yields
//!   the same validated settings as leaving it out (so the reference, the help and the code
//!   agree);
//! - every key of every destination type is in that type's section of the destinations
//!   page, and the dispatch keys' defaults are the code's.
//!
//! The checks are functions returning the problems they find, so that a test can show that
//! a flag removed from the reference is reported.

use std::collections::BTreeMap;
use std::process::Command;

use outbox_relay::config::{RawConfig, Settings};
use outbox_relay::destination::DestinationConfig;
use outbox_relay::dispatch::{DEFAULT_MAX_IN_FLIGHT, DEFAULT_TIMEOUT_MS, RouteConfig};

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");
const CONFIGURATION: &str = "docs/configuration.md";
const DESTINATIONS: &str = "docs/destinations.md";

fn read(path: &str) -> String {
    std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

// ---------------------------------------------------------------------------------------
// The binary's help

/// A verb, as the words that name it (`["dead-letters", "list"]`), with its options.
type VerbFlags = (Vec<String>, Vec<Flag>);

/// One option of a verb as its `--help` describes it.
#[derive(Debug)]
struct Flag {
    long: String,
    env: Option<String>,
    default: Option<String>,
}

/// `outbox-relay ARGS --help`, with no variable of ours set (clap shows set values).
fn help(args: &[&str]) -> String {
    let out = Command::new(BIN)
        .args(args)
        .arg("--help")
        .env_clear()
        .output()
        .unwrap();
    assert!(out.status.success(), "outbox-relay {args:?} --help failed");
    String::from_utf8(out.stdout).unwrap()
}

/// The lines of a help section (`Options:`, `Commands:`), up to the next one.
fn help_section<'a>(help: &'a str, title: &str) -> Vec<&'a str> {
    help.lines()
        .skip_while(|l| *l != title)
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with(' '))
        .collect()
}

/// The options of a help text (its own, then the global ones), without `--help` and
/// `--version`.
fn flags(help: &str) -> Vec<Flag> {
    let mut flags: Vec<(String, String)> = Vec::new();
    let lines = help_section(help, "Options:")
        .into_iter()
        .chain(help_section(help, "Global options:"));
    for line in lines {
        let trimmed = line.trim_start();
        let option = trimmed
            .strip_prefix("--")
            .or_else(|| trimmed.get(4..).and_then(|t| t.strip_prefix("--")));
        match option {
            Some(rest) if line.len() - trimmed.len() <= 6 => {
                let long = rest.split([' ', '[', '<']).next().unwrap().to_owned();
                // The description may follow on the same line, after two spaces.
                let text = rest.split_once("  ").map_or("", |(_, t)| t.trim());
                flags.push((long, format!("{text} ")));
            }
            _ => {
                if let Some((_, text)) = flags.last_mut() {
                    text.push_str(trimmed);
                    text.push(' ');
                }
            }
        }
    }
    flags
        .into_iter()
        .filter(|(long, _)| long != "help" && long != "version")
        .map(|(long, text)| Flag {
            long: format!("--{long}"),
            env: bracket(&text, "[env: ").map(|e| e.split('=').next().unwrap().to_owned()),
            default: bracket(&text, "[default: "),
        })
        .collect()
}

/// The text of `[PREFIX…]` in `text`.
fn bracket(text: &str, prefix: &str) -> Option<String> {
    let start = text.find(prefix)? + prefix.len();
    let end = text[start..].find(']')? + start;
    Some(text[start..end].to_owned())
}

/// The subcommands a help text lists, without `help`.
fn commands(help: &str) -> Vec<String> {
    help_section(help, "Commands:")
        .iter()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_owned)
        .collect()
}

/// Every verb as the words that name it (`["dead-letters", "list"]`), with its help.
fn verbs() -> Vec<(Vec<String>, String)> {
    let mut verbs = Vec::new();
    let mut todo: Vec<Vec<String>> = commands(&help(&[])).into_iter().map(|c| vec![c]).collect();
    while let Some(path) = todo.pop() {
        let args: Vec<&str> = path.iter().map(String::as_str).collect();
        let text = help(&args);
        let subcommands = commands(&text);
        if subcommands.is_empty() {
            verbs.push((path, text));
        } else {
            todo.extend(subcommands.into_iter().map(|c| {
                let mut p = path.clone();
                p.push(c);
                p
            }));
        }
    }
    verbs.sort();
    verbs
}

// ---------------------------------------------------------------------------------------
// The reference's Markdown

/// The text under the heading whose title (after the `#`s) satisfies `pick`, up to the
/// next heading of the same or a higher level.
fn section(doc: &str, pick: impl Fn(&str) -> bool) -> Option<&str> {
    let mut start = None;
    let mut level = 0;
    let mut offset = 0;
    let mut in_code = false;
    for line in doc.split_inclusive('\n') {
        if line.starts_with("```") {
            in_code = !in_code;
        }
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if !in_code && hashes > 0 && line[hashes..].starts_with(' ') {
            match start {
                Some(s) if hashes <= level => return Some(&doc[s..offset]),
                None if pick(line[hashes..].trim()) => {
                    start = Some(offset + line.len());
                    level = hashes;
                }
                _ => {}
            }
        }
        offset += line.len();
    }
    start.map(|s| &doc[s..])
}

/// The rows of every table in `text`, each as column name → cell (`\|` kept as `|`).
fn table_rows(text: &str) -> Vec<BTreeMap<String, String>> {
    let cells = |line: &str| -> Vec<String> {
        let line = line.trim().trim_start_matches('|').trim_end_matches('|');
        line.replace("\\|", "\u{0}")
            .split('|')
            .map(|c| c.trim().replace('\u{0}', "|"))
            .collect()
    };
    let mut rows = Vec::new();
    let mut header: Option<Vec<String>> = None;
    for line in text.lines() {
        if !line.starts_with('|') {
            header = None;
            continue;
        }
        match &header {
            None => header = Some(cells(line)),
            Some(_) if line.starts_with("| ---") || line.starts_with("|---") => {}
            Some(names) => rows.push(names.iter().cloned().zip(cells(line)).collect()),
        }
    }
    rows
}

/// The code spans of a cell: "`--a`, `--b`" → ["--a", "--b"].
fn code_spans(cell: &str) -> Vec<&str> {
    cell.split('`').skip(1).step_by(2).collect()
}

/// A default as written in the reference, without code quotes.
fn plain(cell: &str) -> String {
    cell.replace('`', "")
}

fn heading_names(title: &str, verb: &str) -> bool {
    title == format!("`{verb}`")
}

// ---------------------------------------------------------------------------------------
// The checks

/// Flags of every verb against the reference: one row each in the verb's section (globals
/// in "Global flags"), environment variable and default as the help gives them, and no row
/// for a flag the verb does not have.
fn flag_problems(doc: &str, globals: &[Flag], verbs: &[VerbFlags]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut check = |title: &str, text: Option<&str>, flags: &[&Flag]| {
        let Some(text) = text else {
            problems.push(format!("{CONFIGURATION} has no section {title}"));
            return;
        };
        let rows = table_rows(text);
        for flag in flags {
            let matching: Vec<_> = rows
                .iter()
                .filter(|r| {
                    r.get("flag")
                        .is_some_and(|c| code_spans(c) == [flag.long.as_str()])
                })
                .collect();
            let [row] = matching[..] else {
                problems.push(format!(
                    "{title}: {} has {} rows in {CONFIGURATION}, expected 1",
                    flag.long,
                    matching.len()
                ));
                continue;
            };
            let env_cell = row.get("environment").map(String::as_str).unwrap_or("");
            match &flag.env {
                Some(env) if !code_spans(env_cell).contains(&env.as_str()) => {
                    problems.push(format!(
                        "{title}: {}: environment variable {env} is not in its row",
                        flag.long
                    ))
                }
                None if !code_spans(env_cell).is_empty() => problems.push(format!(
                    "{title}: {}: its row names a variable ({env_cell}) the flag does not read",
                    flag.long
                )),
                _ => {}
            }
            let written = plain(row.get("default").map(String::as_str).unwrap_or(""));
            match &flag.default {
                Some(default) if written != *default => problems.push(format!(
                    "{title}: {}: the default is {default} (--help), the reference says {written}",
                    flag.long
                )),
                // No default in the help: "–", or a value the code check below confirms.
                None if written != "–" && row.get("config key").is_none_or(|k| k == "–") => {
                    problems.push(format!(
                        "{title}: {}: --help states no default, the reference says {written}",
                        flag.long
                    ))
                }
                _ => {}
            }
        }
        for row in &rows {
            if let Some(cell) = row.get("flag") {
                for long in code_spans(cell) {
                    if !flags.iter().any(|f| f.long == long) {
                        problems.push(format!(
                            "{title}: {long} is in the reference, not in --help"
                        ));
                    }
                }
            }
        }
    };
    let global_refs: Vec<&Flag> = globals.iter().collect();
    check(
        "Global flags",
        section(doc, |t| t == "Global flags"),
        &global_refs,
    );
    for (path, flags) in verbs {
        let verb = path.join(" ");
        let own: Vec<&Flag> = flags
            .iter()
            .filter(|f| !globals.iter().any(|g| g.long == f.long))
            .collect();
        check(
            &format!("`{verb}`"),
            section(doc, |t| heading_names(t, &verb)),
            &own,
        );
    }
    problems
}

/// The keys serde accepts for `T`, from its "unknown field" error.
fn serde_keys<T: serde::de::DeserializeOwned + std::fmt::Debug>(toml_text: &str) -> Vec<String> {
    let error = toml::from_str::<T>(toml_text).unwrap_err().to_string();
    let expected = error
        .split("expected ")
        .nth(1)
        .unwrap_or_else(|| panic!("no list of fields in: {error}"));
    code_spans(expected)
        .into_iter()
        .map(str::to_owned)
        .collect()
}

/// Config file keys against the reference: each in exactly one row, as a `config key` or
/// a `key`.
fn key_problems(doc: &str, keys: &[String]) -> Vec<String> {
    let rows = table_rows(doc);
    keys.iter()
        .filter_map(|key| {
            let n = rows
                .iter()
                .filter(|r| {
                    ["config key", "key"]
                        .iter()
                        .any(|c| r.get(*c).is_some_and(|cell| code_spans(cell) == [key]))
                })
                .count();
            (n != 1)
                .then(|| format!("config key {key} has {n} rows in {CONFIGURATION}, expected 1"))
        })
        .collect()
}

fn settings(toml_text: &str) -> Result<String, String> {
    let raw: RawConfig = toml::from_str(toml_text).map_err(|e| e.to_string())?;
    Settings::from_raw(raw)
        .map(|s| format!("{s:?}"))
        .map_err(|e| e.to_string())
}

/// `run`'s and the globals' defaults given as values, set explicitly, against the settings
/// of a config that leaves them out.
fn default_problems(doc: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mut checked = 0;
    for title in ["Global flags", "`run`"] {
        let text = section(doc, |t| t == title).unwrap_or("");
        for row in table_rows(text) {
            let (Some(key), Some(default)) = (row.get("config key"), row.get("default")) else {
                continue;
            };
            let ([key], [value]) = (&code_spans(key)[..], &code_spans(default)[..]) else {
                continue;
            };
            if *default != format!("`{value}`") {
                continue;
            }
            // The file sink applies this default itself when it is built (the help's
            // default is checked above); the settings keep what was given.
            if *key == "sink_file_fsync" {
                continue;
            }
            // The setting matters only with its sink; a random worker id would differ.
            let context = match *key {
                "null_latency_ms" => "worker_id = \"w\"\nsink = \"null\"\n",
                _ => "worker_id = \"w\"\n",
            };
            let given = [format!("{key} = {value}"), format!("{key} = \"{value}\"")]
                .into_iter()
                .map(|line| settings(&format!("{context}{line}\n")))
                .find(Result::is_ok)
                .unwrap_or_else(|| Err(format!("{key} = {value} is not accepted")));
            // Given by name, the default database is the same URL, but no longer the
            // unnamed default that the verbs that write refuse.
            let given = given.map(|s| {
                s.replace(
                    "database_url_is_default: false",
                    "database_url_is_default: true",
                )
            });
            let default_settings = settings(context).unwrap();
            checked += 1;
            match given {
                Ok(s) if s == default_settings => {}
                Ok(_) => problems.push(format!(
                    "{title}: {key}: the reference's default {value} is not the code's \
                     (settings differ from leaving it out)"
                )),
                Err(e) => problems.push(format!("{title}: {key}: default {value}: {e}")),
            }
        }
    }
    if checked < 20 {
        problems.push(format!(
            "only {checked} defaults could be checked against the code"
        ));
    }
    problems
}

// ---------------------------------------------------------------------------------------
// The tests

fn reference_flags() -> (Vec<Flag>, Vec<VerbFlags>) {
    let globals = flags(&help(&[]));
    let verbs = verbs()
        .into_iter()
        .map(|(path, text)| (path, flags(&text)))
        .collect();
    (globals, verbs)
}

#[test]
fn every_flag_of_every_verb_is_in_the_reference_once_with_its_default() {
    let (globals, verbs) = reference_flags();
    assert!(verbs.iter().any(|(p, _)| p == &["run"]), "{verbs:?}");
    assert!(
        verbs.iter().any(|(p, _)| p == &["dead-letters", "list"]),
        "{verbs:?}"
    );
    let problems = flag_problems(&read(CONFIGURATION), &globals, &verbs);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn a_flag_removed_from_the_reference_is_reported() {
    let (globals, verbs) = reference_flags();
    let doc = read(CONFIGURATION);
    for flag in ["--observe-interval-secs", "--migrate", "--config", "--step"] {
        let without: String = doc
            .lines()
            .filter(|l| !l.starts_with(&format!("| `{flag}` |")))
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(without != doc, "{flag} has a row to remove");
        let problems = flag_problems(&without, &globals, &verbs);
        assert!(
            problems
                .iter()
                .any(|p| p.contains(&format!("{flag} has 0 rows"))),
            "removing {flag} is not reported: {problems:?}"
        );
    }
    // A flag the binary does not have is reported too.
    let stale = doc.replace("| `--repair-limit` |", "| `--repair-limits` |");
    let problems = flag_problems(&stale, &globals, &verbs);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("--repair-limits is in the reference")),
        "{problems:?}"
    );
}

#[test]
fn every_environment_variable_the_help_names_is_in_the_reference() {
    let doc = read(CONFIGURATION);
    let mut texts = vec![help(&[])];
    texts.extend(verbs().into_iter().map(|(_, text)| text));
    let mut missing = Vec::new();
    for text in &texts {
        for word in text.split(|c: char| !(c.is_ascii_uppercase() || c == '_')) {
            let ours = word.starts_with("OUTBOX_") || word.starts_with("DATABASE_URL");
            if ours && !doc.contains(&format!("`{word}`")) && !missing.contains(&word) {
                missing.push(word);
            }
        }
    }
    assert!(missing.is_empty(), "not in {CONFIGURATION}: {missing:?}");
    assert!(doc.contains("`OUTBOX_DATABASE_URL_FILE`"));
}

#[test]
fn every_config_file_key_is_in_the_reference_once() {
    let keys = serde_keys::<RawConfig>("zz_not_a_key = 1");
    assert!(keys.contains(&"batch_size".to_owned()), "{keys:?}");
    assert!(keys.contains(&"routes".to_owned()), "{keys:?}");
    let problems = key_problems(&read(CONFIGURATION), &keys);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_defaults_in_the_reference_are_the_codes() {
    let problems = default_problems(&read(CONFIGURATION));
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // And a wrong one is caught.
    let wrong = read(CONFIGURATION).replace("| `batch_size` | `500` |", "| `batch_size` | `400` |");
    assert!(
        default_problems(&wrong)
            .iter()
            .any(|p| p.contains("batch_size")),
        "a wrong default of batch_size is not caught"
    );
}

#[test]
fn every_destination_key_is_in_its_section_of_the_destinations_page() {
    let doc = read(DESTINATIONS);
    let mut problems = Vec::new();
    for kind in DestinationConfig::KINDS {
        let title = format!("`type = \"{kind}\"`");
        let Some(text) = section(&doc, |t| t.contains(&title)) else {
            problems.push(format!("{DESTINATIONS} has no section naming {title}"));
            continue;
        };
        let error = toml::from_str::<DestinationConfig>(&format!("type = \"{kind}\"\nzz = 1"))
            .unwrap_err()
            .to_string();
        if error.contains("there are no fields") {
            continue;
        }
        let keys = serde_keys::<DestinationConfig>(&format!("type = \"{kind}\"\nzz = 1"));
        let rows = table_rows(text);
        for key in keys {
            let table = format!("[destinations.NAME.{key}]");
            let found = rows.iter().any(|r| {
                r.get("key").is_some_and(|c| {
                    code_spans(c).contains(&key.as_str()) || code_spans(c).contains(&table.as_str())
                })
            });
            if !found {
                problems.push(format!(
                    "{kind}: key {key} is not in its table in {DESTINATIONS}"
                ));
            }
        }
    }
    // The keys every destination table takes, with their defaults.
    let text = section(&doc, |t| t == "Dispatch deadlines and budgets").unwrap_or("");
    let rows = table_rows(text);
    for (key, default) in [
        ("timeout_ms", DEFAULT_TIMEOUT_MS),
        ("max_in_flight", DEFAULT_MAX_IN_FLIGHT),
    ] {
        let row = rows
            .iter()
            .find(|r| r.get("key").is_some_and(|c| code_spans(c) == [key]));
        match row.and_then(|r| r.get("default")) {
            Some(d) if plain(d) == default.to_string() => {}
            other => problems.push(format!(
                "{key}: the default is {default}, {DESTINATIONS} says {other:?}"
            )),
        }
    }
    let routing = section(&doc, |t| t == "Routing").unwrap_or("");
    for key in serde_keys::<RouteConfig>("topic = \"a\"\ndestination = \"b\"\nzz = 1") {
        if !routing.contains(&format!("`{key}`")) {
            problems.push(format!(
                "[[routes]] key {key} is not under Routing in {DESTINATIONS}"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

// ---------------------------------------------------------------------------------------
// The destination lists

/// The destination types named in the first column of the first table after the line
/// `after` in `path` (backticked names; a cell may name several: `` `file`, `stdout` ``).
fn table_types(path: &str, after: &str) -> std::collections::BTreeSet<String> {
    let text = read(path);
    let start = text
        .find(after)
        .unwrap_or_else(|| panic!("{path}: no line {after:?}"));
    let mut types = std::collections::BTreeSet::new();
    let mut in_table = false;
    for line in text[start..].lines().skip(1) {
        if let Some(row) = line.strip_prefix('|') {
            in_table = true;
            let first = row.split('|').next().unwrap_or_default();
            if first.trim() == "---" || first.contains("`type`") || first.trim() == "destination" {
                continue;
            }
            for (i, part) in first.split('`').enumerate() {
                if i % 2 == 1 {
                    types.insert(part.to_owned());
                }
            }
        } else if in_table {
            break;
        }
    }
    assert!(!types.is_empty(), "{path}: no table after {after:?}");
    types
}

#[test]
fn every_documented_destination_list_names_the_binarys_destinations() {
    let built: std::collections::BTreeSet<String> = DestinationConfig::KINDS
        .iter()
        .map(|k| (*k).to_owned())
        .collect();
    let without_null: std::collections::BTreeSet<String> =
        built.iter().filter(|k| *k != "null").cloned().collect();
    // The reference lists every type, the benchmark's `null` too.
    assert_eq!(
        table_types(DESTINATIONS, "# Destinations"),
        built,
        "{DESTINATIONS}"
    );
    // What a user chooses from and what a consumer relies on: the real destinations.
    assert_eq!(
        table_types("README.md", "## Choose a destination"),
        without_null,
        "README.md's table of destinations"
    );
    assert_eq!(
        table_types(
            "docs/guarantees.md",
            "Where the destination deduplicates by itself"
        ),
        without_null,
        "docs/guarantees.md's table of where the outbox_id and the sequence are"
    );
}

/// `bench --destination`'s choices (clap's possible values) are the ones its row in the
/// reference names, each as a code span.
#[test]
fn the_benchmarks_destinations_are_the_documented_ones() {
    let text = help(&["bench"]);
    let values = text
        .split("--destination <DESTINATION>")
        .nth(1)
        .expect("bench has --destination")
        .split("[possible values: ")
        .nth(1)
        .and_then(|rest| rest.split(']').next())
        .expect("bench --destination lists its possible values");
    let offered: std::collections::BTreeSet<&str> = values.split(", ").collect();
    let doc = read("docs/configuration.md");
    let row = doc
        .lines()
        .find(|l| l.starts_with("| `--destination` |"))
        .expect("the reference has a row for bench --destination");
    let named: std::collections::BTreeSet<&str> = code_spans(row)
        .into_iter()
        .filter(|s| offered.contains(s) || s.chars().all(|c| c.is_ascii_lowercase()))
        .filter(|s| *s != "--destination")
        .collect();
    assert_eq!(named, offered, "{row}");
}

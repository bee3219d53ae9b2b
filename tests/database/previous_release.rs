//! The rolling-upgrade rule, checked (docs/upgrades.md): the relayers of the previous release
//! keep working, with the statements they prepared, on the schema this release's migrations
//! leave.
//!
//! The previous release is read from git: the commit before the last one that changed
//! `schema/migrations/` (the last landed migration's predecessor), or `HEAD` while the
//! working tree holds a migration `HEAD` does not. Its statements are the SQL strings of its
//! store (`src/store/*.rs` at that commit, tests left out): every string literal that is a
//! statement (`SELECT`, `INSERT`, `UPDATE`, `DELETE`, `WITH`) naming `outbox.`, with the
//! `{CONST}`s of its `format!` filled in from the file's `const … : &str`. A statement the
//! reader cannot fill in fails the test, naming it; so does a history that git cannot show
//! (a source archive, a shallow clone): nothing passes unread.
//!
//! On a database migrated to the previous release's version, each statement is prepared on
//! one connection (an old relayer's, whose named statements outlive the migration) and
//! executed as the schema owner and as each of the roles `outbox_relay`, `outbox_producer`
//! and `outbox_reader`, in a transaction rolled back, with sample arguments of the types
//! the server inferred, against an empty outbox. Then this build migrates the database,
//! and each statement is executed again through the old connection's prepared statement,
//! prepared again on a new connection with those parameter types, and executed again under
//! each role. The test fails, naming the statement, the role and the SQLSTATE, when a call
//! that worked fails or fails otherwise, or when a statement's result columns change.
//! It also fails, naming both, when a function or relation that a function the previous
//! release calls names in its body (transitively) is gone: a call in flight during the
//! migration runs the body it started with, and fails with 42883 on what was dropped, as
//! V23's claim did when V29 dropped `claim_shard_candidates`. A function dropped and
//! created again under its name with added arguments that all have defaults (V36's
//! `enqueue`) is not gone: every call of the old signature resolves to it.

use crate::common::{self, TestDb};

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use tokio_postgres::types::{IsNull, ToSql, Type, to_sql_checked};
use tokio_postgres::{Client, Statement};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// Where the previous release keeps the statements its relayers prepare.
const STORE: &str = "src/store";
/// The roles a statement is executed as, besides the schema owner (the test's login).
const ROLES: [&str; 3] = ["outbox_relay", "outbox_producer", "outbox_reader"];

/// Statements of a past release that its store assembled at run time from fragments (the
/// console's filters before V38: `{sql}`, `{columns}`) and this reader cannot fill in,
/// accepted unread by (file, the statement's opening) and printed when met. They read
/// outbox.messages, outbox.attempts and outbox.dead_letters only, whose columns V38 (the
/// migration after them) leaves as they are. Since V38 the console calls functions with
/// literal statements, so no statement of a later store needs a place here; a statement
/// not listed still fails the test.
const ASSEMBLED_AT_RUN_TIME: [(&str, &str); 4] = [
    (
        "src/store/console.rs",
        "SELECT {} FROM outbox.messages AS m",
    ),
    (
        "src/store/console.rs",
        "SELECT {columns}, m.content_type, m.headers, m.payload, ",
    ),
    (
        "src/store/console.rs",
        "SELECT d.outbox_id, d.topic, d.message_key, d.dead_lettered_at, ",
    ),
    (
        "src/store/console.rs",
        "SELECT count(*) FROM (SELECT 1 FROM outbox.dead_letters AS d {sql} ",
    ),
];

// ---------------------------------------------------------------------------------------
// The previous release, from git
// ---------------------------------------------------------------------------------------

fn git(args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(ROOT)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{}", unavailable(args, &e.to_string())));
    if !out.status.success() {
        panic!(
            "{}",
            unavailable(args, String::from_utf8_lossy(&out.stderr).trim())
        );
    }
    String::from_utf8(out.stdout).expect("git prints UTF-8")
}

fn unavailable(args: &[&str], why: &str) -> String {
    format!(
        "previous_release: `git {}` failed in {ROOT}: {why}. This test reads the previous \
         release's statements from the repository's history (docs/upgrades.md): run it in a \
         git clone that has that history, not a source archive or a shallow clone",
        args.join(" ")
    )
}

/// The version of a migration file name (`V34__….sql` → 34).
fn version(name: &str) -> Option<i32> {
    let name = name.rsplit('/').next()?;
    name.strip_prefix('V')?.split("__").next()?.parse().ok()
}

fn newest(names: impl Iterator<Item = String>) -> i32 {
    names.filter_map(|n| version(&n)).max().unwrap_or(0)
}

/// The previous release's commit and the schema version its migrations reach.
fn previous_release() -> (String, i32) {
    let on_disk = newest(
        std::fs::read_dir(Path::new(ROOT).join("schema/migrations"))
            .expect("read schema/migrations")
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned()),
    );
    let at = |rev: &str| {
        newest(
            git(&["ls-tree", "--name-only", rev, "schema/migrations/"])
                .lines()
                .map(str::to_owned),
        )
    };
    let commit = if on_disk > at("HEAD") {
        git(&["rev-parse", "HEAD"])
    } else {
        // The commit that added the newest migration (not one that edited it before its
        // release): its parent is the previous release.
        let last = git(&[
            "log",
            "-1",
            "--diff-filter=A",
            "--format=%H",
            "--",
            "schema/migrations/",
        ]);
        git(&["rev-parse", &format!("{}^", last.trim())])
    };
    let commit = commit.trim().to_owned();
    let version = at(&commit);
    assert!(
        version > 0 && version < on_disk,
        "previous_release: the previous release ({commit}) has schema version {version}, this \
         tree {on_disk}"
    );
    (commit, version)
}

// ---------------------------------------------------------------------------------------
// Its statements, read from its store's source
// ---------------------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Word(String),
    Str(String),
    Punct(char),
}

/// The tokens of Rust source that matter here: words, string literals (unescaped, raw
/// strings included) and punctuation; comments, char literals and lifetimes left out.
fn tokens(src: &str) -> Vec<Token> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && c.get(i + 1) == Some(&'*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == '"' {
            let (text, end) = quoted(&c, i + 1);
            out.push(Token::Str(text));
            i = end;
        } else if ch == '\'' {
            // a char literal ('x', '\n', '"') or a lifetime ('static)
            if c.get(i + 1) == Some(&'\\') {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                out.push(Token::Punct('\''));
                i += 1;
            }
        } else if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            let raw = matches!(word.as_str(), "r" | "br");
            if raw && matches!(c.get(i), Some('"' | '#')) {
                let hashes = c[i..].iter().take_while(|&&h| h == '#').count();
                let open = i + hashes;
                let mut end = open + 1;
                let closing: Vec<char> = std::iter::once('"')
                    .chain(std::iter::repeat_n('#', hashes))
                    .collect();
                while end < c.len() && !c[end..].starts_with(&closing) {
                    end += 1;
                }
                out.push(Token::Str(c[open + 1..end].iter().collect()));
                i = end + closing.len();
            } else if word == "b" && c.get(i) == Some(&'"') {
                let (text, end) = quoted(&c, i + 1);
                out.push(Token::Str(text));
                i = end;
            } else {
                out.push(Token::Word(word));
            }
        } else {
            out.push(Token::Punct(ch));
            i += 1;
        }
    }
    out
}

/// The text of a `"…"` literal whose body starts at `i`, unescaped, and the index after it.
fn quoted(c: &[char], mut i: usize) -> (String, usize) {
    let mut text = String::new();
    while i < c.len() && c[i] != '"' {
        if c[i] == '\\' {
            i += 1;
            match c.get(i) {
                Some('n') => text.push('\n'),
                Some('t') => text.push('\t'),
                Some('r') => text.push('\r'),
                Some('0') => text.push('\0'),
                Some('\n') => {
                    // a line continuation: the newline and the next line's indentation go
                    while i + 1 < c.len() && c[i + 1].is_whitespace() {
                        i += 1;
                    }
                }
                Some(&other) => text.push(other),
                None => {}
            }
        } else {
            text.push(c[i]);
        }
        i += 1;
    }
    (text, i + 1)
}

/// The tokens without the items under `#[cfg(test)]`.
fn without_tests(tokens: Vec<Token>) -> Vec<Token> {
    let attribute = [
        Token::Punct('#'),
        Token::Punct('['),
        Token::Word("cfg".into()),
        Token::Punct('('),
        Token::Word("test".into()),
        Token::Punct(')'),
        Token::Punct(']'),
    ];
    let mut out = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        if tokens[i..].starts_with(&attribute) {
            i += attribute.len();
            while i < tokens.len() && !matches!(tokens[i], Token::Punct('{' | ';')) {
                i += 1;
            }
            if tokens.get(i) == Some(&Token::Punct('{')) {
                let mut depth = 0;
                while i < tokens.len() {
                    match tokens[i] {
                        Token::Punct('{') => depth += 1,
                        Token::Punct('}') => depth -= 1,
                        _ => {}
                    }
                    i += 1;
                    if depth == 0 {
                        break;
                    }
                }
            } else {
                i += 1;
            }
            continue;
        }
        out.push(tokens[i].clone());
        i += 1;
    }
    out
}

/// `text` as `format!` writes it, with each `{NAME}` from `consts`; Err names what it cannot
/// fill in.
fn formatted(text: &str, consts: &BTreeMap<String, String>) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(['{', '}']) {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        if tail.starts_with("{{") || tail.starts_with("}}") {
            out.push(tail.chars().next().unwrap());
            rest = &tail[2..];
        } else if let Some(end) = tail.strip_prefix('{').and_then(|t| t.find('}')) {
            let name = &tail[1..=end];
            match consts.get(name) {
                Some(value) => out.push_str(value),
                None => return Err(format!("{{{name}}}")),
            }
            rest = &tail[end + 2..];
        } else {
            return Err(tail.to_owned());
        }
    }
    out.push_str(rest);
    Ok(out)
}

fn is_statement(sql: &str) -> bool {
    let first = sql.split_whitespace().next().unwrap_or("");
    ["SELECT", "INSERT", "UPDATE", "DELETE", "WITH"].contains(&first) && sql.contains("outbox.")
}

/// The statements of one file of the store: (statement, or what could not be read).
fn statements_in(src: &str) -> Vec<Result<String, String>> {
    let tokens = without_tests(tokens(src));
    let mut consts = BTreeMap::new();
    for (i, t) in tokens.iter().enumerate() {
        if *t == Token::Word("const".into())
            && let Some(Token::Word(name)) = tokens.get(i + 1)
            && let Some(eq) = tokens[i..]
                .iter()
                .position(|t| matches!(t, Token::Punct('=' | ';')))
            && tokens[i + eq] == Token::Punct('=')
            && let Some(Token::Str(value)) = tokens.get(i + eq + 1)
            && tokens.get(i + eq + 2) == Some(&Token::Punct(';'))
        {
            consts.insert(name.clone(), value.clone());
        }
    }
    let mut out = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        let Token::Str(text) = t else { continue };
        let in_format = i >= 3
            && tokens[i - 3] == Token::Word("format".into())
            && tokens[i - 2] == Token::Punct('!')
            && tokens[i - 1] == Token::Punct('(');
        let sql = if in_format {
            match formatted(text, &consts) {
                Ok(sql) => sql,
                Err(what) if is_statement(text) => {
                    out.push(Err(format!("{text:?} (cannot fill in {what})")));
                    continue;
                }
                Err(_) => continue,
            }
        } else {
            text.clone()
        };
        if is_statement(&sql) {
            out.push(Ok(sql));
        }
    }
    out
}

/// Every statement of the store at `commit`, with the file it is in.
fn statements_of(commit: &str) -> BTreeMap<String, String> {
    let files = git(&["ls-tree", "-r", "--name-only", commit, "--", STORE]);
    let mut statements = BTreeMap::new();
    let mut unread = Vec::new();
    for file in files.lines().filter(|f| f.ends_with(".rs")) {
        let src = git(&["show", &format!("{commit}:{file}")]);
        for s in statements_in(&src) {
            match s {
                Ok(sql) => {
                    statements.entry(sql).or_insert_with(|| file.to_owned());
                }
                Err(what)
                    if ASSEMBLED_AT_RUN_TIME.iter().any(|(f, opening)| {
                        *f == file && what.starts_with(&format!("\"{opening}"))
                    }) =>
                {
                    eprintln!(
                        "previous_release: {file}: {what}: assembled at run time, accepted \
                         unread (ASSEMBLED_AT_RUN_TIME)"
                    );
                }
                Err(what) => unread.push(format!("{file}: {what}")),
            }
        }
    }
    assert!(
        unread.is_empty(),
        "previous_release: statements of {commit} that this reader cannot fill in (teach it \
         their form):\n{}",
        unread.join("\n")
    );
    assert!(
        statements
            .keys()
            .any(|s| s.contains("outbox.claim_outbox_batch")),
        "previous_release: no claim among the statements read from {STORE} at {commit} (did \
         the store move?): {statements:#?}"
    );
    statements
}

// ---------------------------------------------------------------------------------------
// Running them
// ---------------------------------------------------------------------------------------

/// NULL, for any parameter type this test has no sample of.
#[derive(Debug)]
struct Null;

impl ToSql for Null {
    fn to_sql(
        &self,
        _: &Type,
        _: &mut bytes::BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        Ok(IsNull::Yes)
    }
    fn accepts(_: &Type) -> bool {
        true
    }
    to_sql_checked!();
}

/// A sample argument of type `ty`: one that passes the SQL API's argument checks where it
/// can (a batch or limit of 1, a worker id, empty arrays), NULL where this test has none.
fn sample(ty: &Type) -> Box<dyn ToSql + Sync + Send> {
    match *ty {
        Type::BOOL => Box::new(false),
        Type::INT2 => Box::new(1i16),
        Type::INT4 => Box::new(1i32),
        Type::INT8 => Box::new(1i64),
        Type::FLOAT4 => Box::new(1f32),
        Type::FLOAT8 => Box::new(60f64),
        Type::TEXT | Type::VARCHAR => Box::new("previous-release".to_owned()),
        Type::UUID => Box::new(uuid::Uuid::now_v7()),
        Type::TIMESTAMPTZ => Box::new(chrono::Utc::now()),
        Type::JSONB | Type::JSON => Box::new(serde_json::json!({})),
        Type::BYTEA => Box::new(Vec::<u8>::new()),
        Type::TEXT_ARRAY => Box::new(Vec::<String>::new()),
        Type::UUID_ARRAY => Box::new(Vec::<uuid::Uuid>::new()),
        Type::INT4_ARRAY => Box::new(Vec::<i32>::new()),
        Type::TIMESTAMPTZ_ARRAY => Box::new(Vec::<chrono::DateTime<chrono::Utc>>::new()),
        _ => Box::new(Null),
    }
}

/// What a call came to: `ok` or the SQLSTATE and message of its error.
fn outcome(result: Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>) -> String {
    match result {
        Ok(_) => "ok".to_owned(),
        Err(e) => match e.as_db_error() {
            Some(db) => format!("SQLSTATE {}: {}", db.code().code(), db.message()),
            None => format!("error: {e}"),
        },
    }
}

/// Whether `after` is no worse than `before`: the same, or a success where there was an
/// error.
fn kept(before: &str, after: &str) -> bool {
    after == "ok" || before.get(..14) == after.get(..14)
}

/// The sample argument of parameter `n` (from 1) of `sql`, of type `ty`: [`sample`], but an
/// interval's text ('1 second') for a text parameter the statement casts to an interval
/// (`$5::text::interval`, the console's age filter), which 'previous-release' is not.
fn sample_of(sql: &str, n: usize, ty: &Type) -> Box<dyn ToSql + Sync + Send> {
    if *ty == Type::TEXT && sql.contains(&format!("${n}::text::interval")) {
        return Box::new("1 second".to_owned());
    }
    sample(ty)
}

/// `statement` (the text `sql`) executed with sample arguments as the schema owner and as
/// each role, each in a transaction rolled back.
async fn run_as_each(c: &Client, sql: &str, statement: &Statement) -> Vec<(&'static str, String)> {
    let args: Vec<Box<dyn ToSql + Sync + Send>> = statement
        .params()
        .iter()
        .enumerate()
        .map(|(i, ty)| sample_of(sql, i + 1, ty))
        .collect();
    let refs: Vec<&(dyn ToSql + Sync)> = args
        .iter()
        .map(|a| a.as_ref() as &(dyn ToSql + Sync))
        .collect();
    let mut out = Vec::new();
    for role in std::iter::once("the schema owner").chain(ROLES) {
        c.batch_execute("BEGIN").await.unwrap();
        if role != "the schema owner" {
            c.batch_execute(&format!("SET LOCAL ROLE {role}"))
                .await
                .unwrap();
        }
        let result = c.query(statement, &refs).await;
        c.batch_execute("ROLLBACK").await.unwrap();
        out.push((role, outcome(result)));
    }
    out
}

fn columns(statement: &Statement) -> Vec<String> {
    statement
        .columns()
        .iter()
        .map(|c| format!("{} {}", c.name(), c.type_()))
        .collect()
}

/// The `outbox.<name>` words of a function body or statement, code only (`--` comments
/// left out): (name, whether a `(` follows).
fn outbox_names(text: &str) -> BTreeSet<(String, bool)> {
    let code: String = text
        .lines()
        .map(|l| l.find("--").map_or(l, |at| &l[..at]))
        .collect::<Vec<_>>()
        .join("\n");
    code.match_indices("outbox.")
        .filter(|(at, _)| {
            !code[..*at]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        })
        .filter_map(|(at, _)| {
            let rest = &code[at + "outbox.".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let call = rest[name.len()..].trim_start().starts_with('(');
            (!name.is_empty()).then_some((name, call))
        })
        .collect()
}

/// What the statements reach on the database `c` is connected to: every `outbox` function
/// they call, and those their bodies call, transitively (each as `regprocedure` text, with
/// the function that names it), and every relation or type named on the way (with the
/// function or statement that names it). Names that resolve to nothing (a lock key such as
/// `'outbox.migrate'`) are left out.
async fn reached(c: &Client, statements: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut found: BTreeMap<String, String> = BTreeMap::new();
    let mut todo: Vec<(String, String)> = statements
        .keys()
        .map(|s| (s.clone(), format!("the statement {s:?}")))
        .collect();
    let mut seen_functions: BTreeSet<String> = BTreeSet::new();
    while let Some((text, named_by)) = todo.pop() {
        for (name, call) in outbox_names(&text) {
            if call {
                if !seen_functions.insert(name.clone()) {
                    continue;
                }
                let rows = c
                    .query(
                        "SELECT p.oid::regprocedure::text, p.prosrc FROM pg_proc AS p
                          WHERE p.pronamespace = 'outbox'::regnamespace AND p.proname = $1",
                        &[&name],
                    )
                    .await
                    .unwrap();
                for r in rows {
                    let identity: String = r.get(0);
                    found
                        .entry(format!("function {identity}"))
                        .or_insert_with(|| named_by.clone());
                    todo.push((r.get(1), format!("the body of {identity}")));
                }
            } else {
                let exists: bool = c
                    .query_one(
                        "SELECT to_regclass($1) IS NOT NULL OR to_regtype($1) IS NOT NULL",
                        &[&format!("outbox.{name}")],
                    )
                    .await
                    .unwrap()
                    .get(0);
                if exists {
                    found
                        .entry(format!("relation or type outbox.{name}"))
                        .or_insert_with(|| named_by.clone());
                }
            }
        }
    }
    found
}

/// Whether `what` (as [`reached`] names it) exists on the database `c` is connected to.
async fn exists(c: &Client, what: &str) -> bool {
    let (kind, name) = if let Some(f) = what.strip_prefix("function ") {
        ("SELECT to_regprocedure($1) IS NOT NULL", f)
    } else {
        (
            "SELECT to_regclass($1) IS NOT NULL OR to_regtype($1) IS NOT NULL",
            what.strip_prefix("relation or type ").unwrap(),
        )
    };
    c.query_one(kind, &[&name]).await.unwrap().get(0)
}

/// The shape of each function among `reached` on the database `c` is connected to, by its
/// `regprocedure` text: its arguments as `pg_get_function_arguments` prints them (names,
/// types, defaults), how many, and its result.
async fn shapes(
    c: &Client,
    reached: &BTreeMap<String, String>,
) -> BTreeMap<String, (String, i16, String)> {
    let mut shapes = BTreeMap::new();
    for what in reached.keys() {
        if let Some(f) = what.strip_prefix("function ") {
            let r = c
                .query_one(
                    "SELECT pg_get_function_arguments(p.oid), p.pronargs, pg_get_function_result(p.oid)
                       FROM pg_proc AS p WHERE p.oid = to_regprocedure($1)",
                    &[&f],
                )
                .await
                .unwrap();
            shapes.insert(f.to_owned(), (r.get(0), r.get(1), r.get(2)));
        }
    }
    shapes
}

/// Whether the function `identity`, gone by its exact signature, was extended in place on
/// the database `c` is connected to: exactly one function of its name and result whose
/// arguments begin with all of the old ones as they were (`shape`: names, types and
/// defaults) and whose added arguments all have defaults. Every call of the old signature,
/// by position or by name, resolves to it, and a call in flight finds it when it next
/// resolves the name. (The old function cannot stay beside it: Postgres finds any call
/// that leaves the added arguments out ambiguous between the two.)
async fn extended(c: &Client, identity: &str, shape: &(String, i16, String)) -> bool {
    let (arguments, count, result) = shape;
    let name = identity.split('(').next().unwrap_or_default();
    let matching: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_proc AS p
              WHERE p.pronamespace = 'outbox'::regnamespace
                AND format('outbox.%s', p.proname) = $1
                AND pg_get_function_result(p.oid) = $4
                AND p.pronargs > $3
                AND p.pronargdefaults >= p.pronargs - $3
                AND ($2 = '' OR starts_with(pg_get_function_arguments(p.oid), $2 || ', '))",
            &[&name, arguments, count, result],
        )
        .await
        .unwrap()
        .get(0);
    matching == 1
}

#[tokio::test]
async fn the_previous_releases_statements_work_on_the_newest_schema() {
    let (commit, previous) = previous_release();
    let statements = statements_of(&commit);
    let db = TestDb::at_version(previous).await;
    // The old relayer's connection: its statements are prepared before the migration and
    // used after it.
    let old = db.client().await;

    struct Before {
        file: String,
        statement: Statement,
        columns: Vec<String>,
        outcomes: Vec<(&'static str, String)>,
    }
    let mut before = BTreeMap::new();
    for (sql, file) in &statements {
        let statement = old.prepare(sql).await.unwrap_or_else(|e| {
            panic!(
                "{file} at {commit}: {sql:?} does not prepare on its own schema (version \
                 {previous}): {}; the statement reader misread it",
                outcome(Err(e))
            )
        });
        let outcomes = run_as_each(&old, sql, &statement).await;
        // It runs, or is turned down by the SQL API's own checks (P7001 for a sample
        // argument naming nothing), for some role: the sample arguments reach its body.
        assert!(
            outcomes
                .iter()
                .any(|(_, o)| o == "ok" || o.starts_with("SQLSTATE P7")),
            "{file} at {commit}: {sql:?} runs for no role on its own schema: {outcomes:?}"
        );
        before.insert(
            sql.clone(),
            Before {
                file: file.clone(),
                columns: columns(&statement),
                statement,
                outcomes,
            },
        );
    }
    let reached_before = reached(&old, &statements).await;
    let shapes_before = shapes(&old, &reached_before).await;

    let applied = outbox_relay::store::Store::connect(&db.url, 2)
        .unwrap()
        .migrate()
        .await
        .expect("migrate to this build's schema");
    assert!(!applied.is_empty(), "the migration applied something");

    let new = db.client().await;
    let mut failures = Vec::new();
    for (sql, b) in &before {
        let who = format!("{} at {} ({sql:?})", b.file, &commit[..12]);
        // The old relayer's prepared statement, used after the migration.
        for ((role, was), (_, now)) in b
            .outcomes
            .iter()
            .zip(run_as_each(&old, sql, &b.statement).await)
        {
            if !kept(was, &now) {
                failures.push(format!(
                    "{who}, prepared before the migration, as {role}: {now} (before: {was})"
                ));
            }
        }
        // Prepared again, as that release prepares it, by a relayer started after it.
        let types = b.statement.params().to_vec();
        match new.prepare_typed(sql, &types).await {
            Err(e) => failures.push(format!("{who} does not prepare: {}", outcome(Err(e)))),
            Ok(statement) => {
                if columns(&statement) != b.columns {
                    failures.push(format!(
                        "{who} returns other columns: {:?} (before: {:?})",
                        columns(&statement),
                        b.columns
                    ));
                }
                for ((role, was), (_, now)) in b
                    .outcomes
                    .iter()
                    .zip(run_as_each(&new, sql, &statement).await)
                {
                    if !kept(was, &now) {
                        failures.push(format!("{who}, as {role}: {now} (before: {was})"));
                    }
                }
            }
        }
    }
    // What a call in flight during the migration may still reach.
    for (what, named_by) in &reached_before {
        let in_place = match what.strip_prefix("function ") {
            Some(f) => extended(&new, f, &shapes_before[f]).await,
            None => false,
        };
        if !exists(&new, what).await && !in_place {
            failures.push(format!(
                "{what} is gone, but {named_by} names it: a call of the previous release in \
                 flight during the migration fails with SQLSTATE 42883 (42P01 for a relation); \
                 drop it a release later (docs/upgrades.md)"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "the previous release ({commit}, schema version {previous}) on this build's schema \
         (version {}), {} statements:\n{}",
        outbox_relay::schema::version(),
        before.len(),
        failures.join("\n")
    );
    eprintln!(
        "previous release {commit} (version {previous}): {} statements, {} functions and \
         relations reached, all kept",
        before.len(),
        reached_before.len()
    );

    drop(old);
    drop(new);
    db.finish().await;
}

// ---------------------------------------------------------------------------------------
// The reader and the checks, against broken inputs
// ---------------------------------------------------------------------------------------

#[test]
fn the_statement_reader_fills_in_consts_and_leaves_tests_out() {
    let src = r##"
        const COLUMNS: &str = "a, \
             b";
        /// "SELECT outbox.not_a_statement()" in a comment
        fn f() {
            let c = '"';
            q("SELECT * FROM outbox.one($1, \
               $2)");
            q(&format!("SELECT {COLUMNS} FROM outbox.two WHERE x = '{{}}'"));
            q(r#"SELECT "quoted" FROM outbox.three"#);
            q("not sql outbox.x");
        }
        #[cfg(test)]
        mod tests {
            fn t() { q("SELECT outbox.in_a_test()"); }
        }
    "##;
    let read: Vec<_> = statements_in(src).into_iter().map(Result::unwrap).collect();
    assert_eq!(
        read,
        [
            "SELECT * FROM outbox.one($1, $2)",
            "SELECT a, b FROM outbox.two WHERE x = '{}'",
            "SELECT \"quoted\" FROM outbox.three",
        ]
    );
    // A statement with a placeholder the reader cannot fill in is reported, not skipped.
    let unread = statements_in(r#"fn f() { q(&format!("SELECT {cols} FROM outbox.t")); }"#);
    assert!(
        matches!(&unread[..], [Err(what)] if what.contains("{cols}")),
        "{unread:?}"
    );
}

#[tokio::test]
async fn a_dropped_function_that_an_old_body_calls_is_named() {
    // As V29 did to V23's claim: a function the previous release's bodies call, dropped.
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "CREATE FUNCTION outbox.helper_of_old() RETURNS integer LANGUAGE sql AS 'SELECT 1';
         CREATE FUNCTION outbox.old_entry() RETURNS integer LANGUAGE plpgsql
             AS $$ BEGIN RETURN outbox.helper_of_old(); END; $$;",
    )
    .await
    .unwrap();
    let statements = BTreeMap::from([(
        "SELECT outbox.old_entry()".to_owned(),
        "src/store/x.rs".to_owned(),
    )]);
    let reached_before = reached(&c, &statements).await;
    assert!(
        reached_before.contains_key("function outbox.helper_of_old()"),
        "{reached_before:?}"
    );
    c.batch_execute("DROP FUNCTION outbox.helper_of_old()")
        .await
        .unwrap();
    assert!(!exists(&c, "function outbox.helper_of_old()").await);
    assert!(exists(&c, "function outbox.old_entry()").await);
    // And such a call does fail with 42883.
    let (code, _) = common::sqlstate(c.query("SELECT outbox.old_entry()", &[]).await);
    assert_eq!(code, "42883");
    db.finish().await;
}

#[tokio::test]
async fn a_function_extended_in_place_by_defaulted_arguments_is_kept() {
    // As V36 did to enqueue: the old signature dropped, the same name created with added
    // arguments that have defaults; an old body's call still resolves. Added arguments
    // without defaults, or a second function that also matches, are not in place.
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "CREATE FUNCTION outbox.helper_of_old(p_n integer, p_m integer DEFAULT 1) RETURNS integer
             LANGUAGE sql AS 'SELECT p_n + p_m';
         CREATE FUNCTION outbox.old_entry() RETURNS integer LANGUAGE plpgsql
             AS $$ BEGIN RETURN outbox.helper_of_old(p_n => 1) + outbox.helper_of_old(1, 2); END; $$;",
    )
    .await
    .unwrap();
    let statements = BTreeMap::from([(
        "SELECT outbox.old_entry()".to_owned(),
        "src/store/x.rs".to_owned(),
    )]);
    let reached_before = reached(&c, &statements).await;
    let shapes_before = shapes(&c, &reached_before).await;
    let old = "outbox.helper_of_old(integer,integer)";
    assert!(shapes_before.contains_key(old), "{shapes_before:?}");
    c.batch_execute(
        "DROP FUNCTION outbox.helper_of_old(integer, integer);
         CREATE FUNCTION outbox.helper_of_old(p_n integer, p_m integer DEFAULT 1, p_k integer DEFAULT 0)
             RETURNS integer LANGUAGE sql AS 'SELECT p_n + p_m + p_k';",
    )
    .await
    .unwrap();
    assert!(!exists(&c, &format!("function {old}")).await);
    assert!(extended(&c, old, &shapes_before[old]).await);
    let n: i32 = c
        .query_one("SELECT outbox.old_entry()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 5, "the old body's calls reach the extended function");

    c.batch_execute(
        "DROP FUNCTION outbox.helper_of_old(integer, integer, integer);
         CREATE FUNCTION outbox.helper_of_old(p_n integer, p_m integer, p_k integer)
             RETURNS integer LANGUAGE sql AS 'SELECT p_n + p_m + p_k';",
    )
    .await
    .unwrap();
    assert!(
        !extended(&c, old, &shapes_before[old]).await,
        "added arguments without defaults"
    );
    let (code, _) = common::sqlstate(c.query("SELECT outbox.old_entry()", &[]).await);
    assert_eq!(code, "42883");
    db.finish().await;
}

//! The guards of the SQL contract. `schema/NN_*.sql` is the current definition of schema
//! `outbox`, one file per contract area; `schema/migrations/` is the append-only upgrade
//! path that `outbox-relay migrate` applies. These tests keep the two honest:
//!
//! - the area files and the migrations build the same schema (`pg_dump --schema-only`,
//!   normalised), so what a reader sees in `schema/` is what runs;
//! - every landed migration is pinned by its SHA-256 in `schema/migrations.sha256`: editing
//!   one fails, naming the file; appending a new one passes;
//! - every function, table, view and type of schema `outbox` carries a `COMMENT`, and none is
//!   executable or readable by PUBLIC (read from the catalogue, not from a list);
//! - `docs/sql-api.md` is what the catalogue says (`make sql-api-doc` writes it);
//! - a database migrated by the previous release, holding messages, attempts and dead
//!   letters, upgrades with nothing lost.
//!
//! Each guard also runs once against a deliberately broken input and asserts that it fails
//! and names the culprit, so none of them can pass by checking nothing.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{TestDb, sql};
use sha2::{Digest, Sha256};
use tokio_postgres::Client;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const PINS: &str = "schema/migrations.sha256";
const REFERENCE: &str = "docs/sql-api.md";
/// Set to write `docs/sql-api.md` instead of comparing it (`make sql-api-doc`).
const UPDATE_REFERENCE: &str = "UPDATE_SQL_API_DOC";
/// The roles the migrations create, in the order the reference lists them.
const ROLES: [&str; 3] = ["outbox_producer", "outbox_relay", "outbox_reader"];

// ---------------------------------------------------------------------------------------
// Area files = migrations
// ---------------------------------------------------------------------------------------

/// `schema/NN_*.sql`, in load order.
fn area_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(Path::new(ROOT).join("schema"))
        .expect("read schema/")
        .map(|e| e.expect("schema/ entry").path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            p.extension().is_some_and(|e| e == "sql")
                && name.len() > 3
                && name.as_bytes()[..2].iter().all(u8::is_ascii_digit)
                && name.as_bytes()[2] == b'_'
        })
        .collect();
    files.sort();
    assert!(
        files.len() >= 8,
        "schema/ holds too few area files: {files:?}"
    );
    files
}

/// Loads the area files into an empty database, each in one transaction, as a reader would
/// with `psql -1 -f`. refinery's history table comes first: `outbox.schema_version()` reads
/// it and its body is bound when it is created.
async fn load_area_files(c: &Client) {
    c.batch_execute(
        "CREATE TABLE refinery_schema_history (version int4 PRIMARY KEY, name varchar(255), \
         applied_on varchar(255), checksum varchar(255))",
    )
    .await
    .expect("create refinery_schema_history");
    for file in area_files() {
        let sql = std::fs::read_to_string(&file).expect("read area file");
        if let Err(e) = c.batch_execute(&sql).await {
            panic!("{} does not load: {}", file.display(), describe(&e));
        }
    }
}

fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!(
            "{} ({}){}",
            db.message(),
            db.code().code(),
            db.where_().map_or(String::new(), |w| format!(", {w}"))
        ),
        None => e.to_string(),
    }
}

/// `pg_dump --schema-only` of a database without what differs between two equal schemas:
/// comment lines, session settings, the dump's random `\restrict` key, refinery's history.
fn dump(url: &str) -> String {
    let out = Command::new("pg_dump")
        .args([
            "--schema-only",
            "--no-owner",
            "--exclude-table=public.refinery_schema_history",
            "--dbname",
            url,
        ])
        .output()
        .expect("pg_dump (the PostgreSQL client) is on PATH");
    assert!(
        out.status.success(),
        "pg_dump failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    normalise(&String::from_utf8(out.stdout).expect("pg_dump prints UTF-8"))
}

fn normalise(dump: &str) -> String {
    let mut out = String::new();
    let mut blank = true;
    let mut preamble = true;
    for line in dump.lines() {
        preamble &= !line.starts_with("CREATE ");
        let dump_comment = line == "--"
            || ["-- Name: ", "-- PostgreSQL database dump", "-- Dumped "]
                .iter()
                .any(|p| line.starts_with(p));
        let session = preamble
            && (line.starts_with("SET ") || line.starts_with("SELECT pg_catalog.set_config"));
        if dump_comment
            || session
            || line.starts_with("\\restrict")
            || line.starts_with("\\unrestrict")
        {
            continue;
        }
        if line.trim().is_empty() {
            if !blank {
                out.push('\n');
            }
            blank = true;
            continue;
        }
        blank = false;
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// `Ok` when the two texts are equal, else a unified diff (`diff -u`, `-` first, `+` second).
fn compare(first: (&str, &str), second: (&str, &str)) -> Result<(), String> {
    if first.1 == second.1 {
        return Ok(());
    }
    let dir = Path::new(ROOT).join("target").join("schema-contract");
    std::fs::create_dir_all(&dir).expect("create target/schema-contract");
    let unique = format!("{}-{}", std::process::id(), rand_tag());
    let a = dir.join(format!("{unique}-{}", first.0.replace('/', "_")));
    let b = dir.join(format!("{unique}-{}", second.0.replace('/', "_")));
    std::fs::write(&a, first.1).unwrap();
    std::fs::write(&b, second.1).unwrap();
    let diff = Command::new("diff")
        .args(["-u", "--label", first.0, "--label", second.0])
        .arg(&a)
        .arg(&b)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_else(|e| format!("(diff not available: {e})"));
    let _ = std::fs::remove_file(&a);
    let _ = std::fs::remove_file(&b);
    Err(diff)
}

fn rand_tag() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

/// Every row of every table of schema `outbox` as text, by table, in a stable order. A
/// partitioned table's rows are listed under it, not under its partitions; a message's
/// slot (where it is stored) and the times the slots were opened are left out.
async fn rows_by_table(c: &Client) -> BTreeMap<String, Vec<String>> {
    let tables: Vec<String> = c
        .query(
            "SELECT c.oid::regclass::text FROM pg_class AS c
              WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind IN ('r', 'p')
                AND NOT c.relispartition
              ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut out = BTreeMap::new();
    for table in tables {
        let row = match table.as_str() {
            // The upgrade gives back the leases in flight (V32): compared without them; and
            // gives each message its order key (V41), checked apart.
            "outbox.messages" => {
                "(to_jsonb(t) - 'slot' - 'claimed_by' - 'lease_token' - 'lease_expires_at' \
                  - 'order_key')::text"
            }
            // The attempts become slot 0 of the log's ring (V33): compared without the slot.
            "outbox.attempts" => "(to_jsonb(t) - 'slot')::text",
            "outbox.message_slots" | "outbox.attempt_slots" => "t.slot::text",
            _ => "t::text",
        };
        let rows = c
            .query(&format!("SELECT {row} FROM {table} AS t ORDER BY 1"), &[])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        out.insert(table, rows);
    }
    out
}

/// [`rows_by_table`] as text a diff can show.
async fn seed_rows(c: &Client) -> String {
    let mut out = String::new();
    for (table, rows) in rows_by_table(c).await {
        let _ = writeln!(out, "{table}: {} rows", rows.len());
        for row in rows {
            let _ = writeln!(out, "  {row}");
        }
    }
    out
}

#[tokio::test]
async fn the_area_files_define_the_schema_the_migrations_build() {
    let migrated = TestDb::new().await;
    let loaded = TestDb::empty().await;
    load_area_files(&loaded.client().await).await;

    let from_migrations = dump(&migrated.url);
    let from_area_files = dump(&loaded.url);
    if let Err(diff) = compare(
        ("migrations", &from_migrations),
        ("area files", &from_area_files),
    ) {
        panic!(
            "schema/NN_*.sql and schema/migrations/ define different schemas (pg_dump \
             --schema-only, `-` from the migrations, `+` from the area files). Change the area \
             file and ship the same change as a new migration:\n{diff}"
        );
    }

    // The rows the schema is born with (the turn rows claims and repairs lock) are part of
    // it too, and a schema-only dump does not show them.
    let (seeded_by_migrations, seeded_by_area_files) = (
        seed_rows(&migrated.client().await).await,
        seed_rows(&loaded.client().await).await,
    );
    if let Err(diff) = compare(
        ("migrations", &seeded_by_migrations),
        ("area files", &seeded_by_area_files),
    ) {
        panic!("the area files seed other rows than the migrations:\n{diff}");
    }

    // The check fails, with the diff naming the object, when an area file goes stale.
    loaded
        .client()
        .await
        .batch_execute(
            "COMMENT ON FUNCTION outbox.prune_attempts(interval, bigint) IS 'a stale contract'",
        )
        .await
        .unwrap();
    let stale = compare(
        ("migrations", &from_migrations),
        ("area files", &dump(&loaded.url)),
    )
    .expect_err("a changed object must make the schemas differ");
    assert!(
        stale.contains("+COMMENT ON FUNCTION outbox.prune_attempts") && stale.contains("stale"),
        "the diff of a stale area file names the object that differs, got:\n{stale}"
    );

    loaded.finish().await;
    migrated.finish().await;
}

// ---------------------------------------------------------------------------------------
// Landed migrations are pinned
// ---------------------------------------------------------------------------------------

/// The version of a migration file name (`V12__x.sql` → 12).
fn version(file: &str) -> Option<u32> {
    file.strip_prefix('V')?.split("__").next()?.parse().ok()
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .fold(String::new(), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// The migration files, by name.
fn migrations() -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(Path::new(ROOT).join("schema/migrations"))
        .expect("read schema/migrations/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "sql"))
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).expect("read migration"),
            )
        })
        .collect()
}

/// Checks the migrations against the pins (`sha256sum` lines: `<hex>  <file>`). A pinned
/// file must be there, unchanged; a file not pinned yet must come after every pinned one.
fn check_pins(pins: &str, files: &BTreeMap<String, Vec<u8>>) -> Result<(), Vec<String>> {
    let mut problems = Vec::new();
    let mut pinned = BTreeSet::new();
    let mut newest_pinned = 0;
    for line in pins.lines().filter(|l| !l.trim().is_empty()) {
        let Some((hash, file)) = line.split_once("  ") else {
            problems.push(format!("{PINS}: malformed line {line:?}"));
            continue;
        };
        pinned.insert(file.to_owned());
        newest_pinned = newest_pinned.max(version(file).unwrap_or(0));
        match files.get(file) {
            None => problems.push(format!(
                "{file} is pinned but missing: a landed migration is never removed or renamed \
                 (databases have applied it)"
            )),
            Some(bytes) if sha256_hex(bytes) != hash => problems.push(format!(
                "{file} changed after it landed (pinned sha256 {hash}, now {}): refinery refuses \
                 every database that applied the old text; restore it and ship the change as a \
                 new migration",
                sha256_hex(bytes)
            )),
            Some(_) => {}
        }
    }
    for file in files.keys().filter(|f| !pinned.contains(*f)) {
        match version(file) {
            Some(v) if v > newest_pinned => {} // appended: pinned when it lands
            Some(v) => problems.push(format!(
                "{file} (version {v}) is not pinned and comes before V{newest_pinned}, the newest \
                 landed migration: new migrations are appended, never inserted"
            )),
            None => problems.push(format!("{file} is not named V<version>__<name>.sql")),
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

#[test]
fn landed_migrations_are_pinned_by_checksum() {
    let pins = std::fs::read_to_string(Path::new(ROOT).join(PINS)).expect("read pins");
    let files = migrations();
    if let Err(problems) = check_pins(&pins, &files) {
        panic!("{}", problems.join("\n"));
    }
    let newest = files.keys().filter_map(|f| version(f)).max().unwrap();

    // Appending a migration passes before it is pinned.
    let mut appended = files.clone();
    appended.insert(
        format!("V{}__appended.sql", newest + 1),
        b"SELECT 1;".to_vec(),
    );
    assert_eq!(
        check_pins(&pins, &appended),
        Ok(()),
        "an appended migration passes"
    );

    // Editing a landed one, even a comment, fails naming the file.
    let mut edited = files.clone();
    let victim = edited
        .keys()
        .find(|f| version(f) == Some(2))
        .unwrap()
        .clone();
    edited
        .get_mut(&victim)
        .unwrap()
        .extend_from_slice(b"\n-- edited\n");
    let problems = check_pins(&pins, &edited).expect_err("an edited migration fails");
    assert!(
        problems.len() == 1
            && problems[0].starts_with(&format!("{victim} changed after it landed")),
        "the failure names the edited file: {problems:?}"
    );

    // Inserting one between landed ones fails too.
    let mut inserted = files.clone();
    inserted.insert("V3__inserted.sql".into(), b"SELECT 1;".to_vec());
    let problems = check_pins(&pins, &inserted).expect_err("an inserted migration fails");
    assert!(
        problems[0].starts_with("V3__inserted.sql (version 3) is not pinned"),
        "{problems:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Comments and PUBLIC rights, from the catalogue
// ---------------------------------------------------------------------------------------

/// Objects of schema `outbox` (the schema, its functions, tables, views and types) without a
/// COMMENT, and those PUBLIC may use, execute or read.
async fn catalogue_problems(c: &Client) -> (Vec<String>, Vec<String>) {
    let rows = c
        .query(
            "SELECT 'function ' || p.oid::regprocedure::text,
                    obj_description(p.oid, 'pg_proc') IS NOT NULL,
                    p.proacl IS NULL OR EXISTS (
                        SELECT FROM aclexplode(p.proacl) AS a
                         WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE')
               FROM pg_proc AS p
              WHERE p.pronamespace = 'outbox'::regnamespace
             UNION ALL
             SELECT CASE c.relkind WHEN 'v' THEN 'view ' WHEN 'm' THEN 'view ' ELSE 'table ' END
                        || c.oid::regclass::text,
                    obj_description(c.oid, 'pg_class') IS NOT NULL,
                    EXISTS (SELECT FROM aclexplode(c.relacl) AS a WHERE a.grantee = 0)
               FROM pg_class AS c
              WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm')
             UNION ALL
             SELECT 'schema outbox', obj_description('outbox'::regnamespace, 'pg_namespace') IS NOT NULL,
                    EXISTS (SELECT FROM pg_namespace AS n, aclexplode(n.nspacl) AS a
                             WHERE n.nspname = 'outbox' AND a.grantee = 0)
             UNION ALL
             SELECT 'type ' || t.oid::regtype::text,
                    obj_description(t.oid, 'pg_type') IS NOT NULL,
                    t.typacl IS NULL OR EXISTS (
                        SELECT FROM aclexplode(t.typacl) AS a WHERE a.grantee = 0)
               FROM pg_type AS t
              WHERE t.typnamespace = 'outbox'::regnamespace AND t.typtype IN ('e', 'd')
              ORDER BY 1",
            &[],
        )
        .await
        .expect("read the catalogue");
    let mut uncommented = Vec::new();
    let mut public = Vec::new();
    for row in rows {
        let (object, commented, is_public): (String, bool, bool) =
            (row.get(0), row.get(1), row.get(2));
        // A type's default ACL lets PUBLIC use it (to name it in a cast); that is no right on
        // the data, so only functions and relations count for PUBLIC.
        if !commented {
            uncommented.push(object.clone());
        }
        if is_public && !object.starts_with("type ") {
            public.push(object);
        }
    }
    (uncommented, public)
}

#[tokio::test]
async fn every_function_table_view_and_type_of_schema_outbox_has_a_comment_and_none_is_open_to_public()
 {
    let db = TestDb::new().await;
    let c = db.client().await;
    let (uncommented, public) = catalogue_problems(&c).await;
    assert!(
        uncommented.is_empty(),
        "objects of schema outbox without a COMMENT (its one-line contract, shown by \\df+ and \
         \\dv+): {uncommented:?}"
    );
    assert!(
        public.is_empty(),
        "objects of schema outbox that PUBLIC may execute or read (REVOKE ALL … FROM PUBLIC \
         beside their definition): {public:?}"
    );

    // A function created the way Postgres defaults it (no comment, EXECUTE for PUBLIC) is
    // reported by both checks.
    c.batch_execute(
        "CREATE FUNCTION outbox.probe_default_rights() RETURNS int LANGUAGE sql AS 'SELECT 1'",
    )
    .await
    .unwrap();
    let (uncommented, public) = catalogue_problems(&c).await;
    let probe = "function outbox.probe_default_rights()".to_owned();
    assert_eq!(
        uncommented,
        vec![probe.clone()],
        "the missing comment is named"
    );
    assert_eq!(public, vec![probe], "the PUBLIC right is named");

    db.finish().await;
}

// ---------------------------------------------------------------------------------------
// docs/sql-api.md, generated from the catalogue
// ---------------------------------------------------------------------------------------

/// What the catalogue says about one function.
struct Function {
    oid: i64,
    name: String,
    identity: String,
    signature: String,
    comment: String,
    body: String,
    definer: bool,
    callers: Vec<&'static str>,
}

/// The readable name of a SQLSTATE a body raises.
fn sqlstate_name(code: &str) -> (&str, &str) {
    match code {
        "P7001" => ("P7001", "invalid argument; the message names it"),
        "P7002" => ("P7002", "LEASE_LOST"),
        "unique_violation" | "23505" => ("23505", "unique_violation"),
        other => (other, ""),
    }
}

/// A body without its `--` comments, so that neither codes nor calls are read from prose.
fn code_of(body: &str) -> String {
    body.lines()
        .map(|l| l.find("--").map_or(l, |at| &l[..at]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The SQLSTATEs a body raises itself (`ERRCODE = '…'`).
fn raised_here(body: &str) -> BTreeSet<String> {
    let mut codes = BTreeSet::new();
    let code = code_of(body);
    let mut rest = code.as_str();
    while let Some(at) = rest.find("ERRCODE") {
        rest = &rest[at + "ERRCODE".len()..];
        let after = rest.trim_start().trim_start_matches('=').trim_start();
        if let Some(quoted) = after.strip_prefix('\'')
            && let Some(end) = quoted.find('\'')
        {
            codes.insert(sqlstate_name(&quoted[..end]).0.to_owned());
        }
    }
    codes
}

/// The SQLSTATEs a contract line names (`P7001`, `23505`, `25006` …).
fn named_in(comment: &str) -> BTreeSet<String> {
    comment
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| {
            w.len() == 5
                && w.chars()
                    .all(|c| c.is_ascii_digit() || c.is_ascii_uppercase())
                && (w.starts_with('P') && w[1..].chars().all(|c| c.is_ascii_digit())
                    || w[..2].chars().all(|c| c.is_ascii_digit()))
        })
        .map(str::to_owned)
        .collect()
}

/// The SQL identifier at the start of `text` (letters, digits, underscores).
fn ident(text: &str) -> String {
    text.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// The `outbox` functions a body calls, by name (`outbox.name (`).
fn calls(body: &str) -> BTreeSet<String> {
    let code = code_of(body);
    code.match_indices("outbox.")
        .filter_map(|(at, _)| {
            let rest = &code[at + "outbox.".len()..];
            let name = ident(rest);
            rest[name.len()..]
                .trim_start()
                .starts_with('(')
                .then_some(name)
        })
        .collect()
}

/// Where each object is defined: (`FUNCTION`, `TABLE` or `VIEW`, name) → the area file,
/// read from the files' `CREATE … outbox.<name>` lines. (The copies of a slot 0 template
/// have no line of their own: the reference lists them with their template.)
fn definitions() -> BTreeMap<(String, String), String> {
    let mut out = BTreeMap::new();
    for file in area_files() {
        let shown = format!("schema/{}", file.file_name().unwrap().to_string_lossy());
        let text = std::fs::read_to_string(&file).unwrap();
        for line in text.lines() {
            if !line.starts_with("CREATE") {
                continue;
            }
            for kind in ["FUNCTION", "TABLE", "VIEW"] {
                let prefix = format!("{kind} outbox.");
                if let Some(at) = line.find(&prefix) {
                    let name = ident(&line[at + prefix.len()..]);
                    out.insert((kind.to_owned(), name), shown.clone());
                }
            }
        }
    }
    out
}

/// The area file that defines `outbox.<name>`.
fn defined_in(definitions: &BTreeMap<(String, String), String>, kind: &str, name: &str) -> String {
    definitions
        .get(&(kind.to_owned(), name.to_owned()))
        .unwrap_or_else(|| panic!("no area file defines {kind} outbox.{name}"))
        .clone()
}

async fn functions(c: &Client) -> Vec<Function> {
    let rows = c
        .query(
            "SELECT p.oid::int8, p.proname::text, pg_get_function_identity_arguments(p.oid),
                    pg_get_function_arguments(p.oid), pg_get_function_result(p.oid),
                    coalesce(obj_description(p.oid, 'pg_proc'), ''),
                    coalesce(p.prosrc, ''), p.prosecdef,
                    has_function_privilege('outbox_producer', p.oid, 'EXECUTE'),
                    has_function_privilege('outbox_relay', p.oid, 'EXECUTE'),
                    has_function_privilege('outbox_reader', p.oid, 'EXECUTE')
               FROM pg_proc AS p
              WHERE p.pronamespace = 'outbox'::regnamespace
              ORDER BY p.proname COLLATE \"C\", pg_get_function_identity_arguments(p.oid) COLLATE \"C\"",
            &[],
        )
        .await
        .expect("read functions");
    rows.iter()
        .map(|r| Function {
            oid: r.get(0),
            name: r.get(1),
            identity: r.get(2),
            signature: format!(
                "outbox.{}({}) RETURNS {}",
                r.get::<_, String>(1),
                r.get::<_, String>(3),
                r.get::<_, String>(4)
            ),
            comment: r.get(5),
            body: r.get(6),
            definer: r.get(7),
            callers: ROLES
                .iter()
                .zip([r.get::<_, bool>(8), r.get(9), r.get(10)])
                .filter_map(|(role, may)| may.then_some(*role))
                .collect(),
        })
        .collect()
}

/// The SQLSTATEs each function may raise (by oid): those its body raises itself, those its
/// contract line names (errors Postgres raises for it, such as a unique violation), and
/// those of the `outbox` functions it calls (every overload of a name it calls but itself).
fn raised(functions: &[Function]) -> BTreeMap<i64, BTreeSet<String>> {
    let mut all: BTreeMap<i64, BTreeSet<String>> = functions
        .iter()
        .map(|f| {
            let mut codes = raised_here(&f.body);
            codes.extend(named_in(&f.comment));
            (f.oid, codes)
        })
        .collect();
    let callees: BTreeMap<i64, Vec<i64>> = functions
        .iter()
        .map(|f| {
            let names = calls(&f.body);
            let oids = functions
                .iter()
                .filter(|g| g.oid != f.oid && names.contains(&g.name))
                .map(|g| g.oid)
                .collect();
            (f.oid, oids)
        })
        .collect();
    loop {
        let mut changed = false;
        for (oid, callees) in &callees {
            let inherited: BTreeSet<String> = callees
                .iter()
                .flat_map(|callee| all[callee].clone())
                .collect();
            let own = all.get_mut(oid).unwrap();
            let before = own.len();
            own.extend(inherited);
            changed |= own.len() != before;
        }
        if !changed {
            return all;
        }
    }
}

/// The oids of the copies of the slot 0 templates (`<stem>_slot1` … `_slot3`), which the
/// reference lists once, with their template. A template whose copies are not all there, or
/// differ from it in their arguments, comment (but for the slot), SQLSTATEs or callers, is
/// a failure naming it: the reference would say "one copy per slot" of what is not.
fn slot_copies(functions: &[Function]) -> BTreeSet<i64> {
    let raised = raised(functions);
    let mut copies = BTreeSet::new();
    for template in functions {
        let Some(stem) = template.name.strip_suffix("_slot0") else {
            continue;
        };
        for slot in 1..4 {
            let name = format!("{stem}_slot{slot}");
            let copy = functions
                .iter()
                .find(|g| g.name == name && g.identity == template.identity)
                .unwrap_or_else(|| {
                    panic!(
                        "outbox.{}({}) has no copy for slot {slot}: outbox.copy_for_slots makes it",
                        template.name, template.identity
                    )
                });
            assert!(
                copy.comment == template.comment.replace("slot 0", &format!("slot {slot}"))
                    && copy.callers == template.callers
                    && raised[&copy.oid] == raised[&template.oid]
                    && copy.definer == template.definer,
                "outbox.{name}({}) is not its template's copy for slot {slot}",
                copy.identity
            );
            copies.insert(copy.oid);
        }
    }
    copies
}

/// docs/sql-api.md for the database `c` is connected to.
async fn reference(c: &Client) -> String {
    let version: i32 = c
        .query_one("SELECT outbox.schema_version()", &[])
        .await
        .expect("schema_version")
        .get(0);
    let functions = functions(c).await;
    let raised = raised(&functions);
    let relations = c
        .query(
            "SELECT c.relname::text, CASE WHEN c.relkind IN ('v', 'm') THEN 'VIEW' ELSE 'TABLE' END,
                    coalesce(obj_description(c.oid, 'pg_class'), ''),
                    has_table_privilege('outbox_producer', c.oid, 'SELECT'),
                    has_table_privilege('outbox_relay', c.oid, 'SELECT'),
                    has_table_privilege('outbox_reader', c.oid, 'SELECT')
               FROM pg_class AS c
              WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm')
              ORDER BY c.relkind <> 'v', c.relname",
            &[],
        )
        .await
        .expect("read relations");

    let definitions = definitions();
    let copies = slot_copies(&functions);
    let mut by_area: BTreeMap<String, Vec<&Function>> = BTreeMap::new();
    for f in functions.iter().filter(|f| !copies.contains(&f.oid)) {
        by_area
            .entry(defined_in(&definitions, "FUNCTION", &f.name))
            .or_default()
            .push(f);
    }

    let mut out = String::new();
    let _ = writeln!(
        out,
        "# SQL API reference\n\n\
         Generated by `make sql-api-doc` from the catalogue of a database migrated to version \
         {version}: each function's signature, its one-line contract (its `COMMENT`), the \
         SQLSTATEs it may raise (those its body raises, those its contract names, and those \
         of the `outbox` functions it calls, whether or not its own arguments can reach \
         them), and the roles that may call it. A test (`tests/database/schema_contract.rs`) fails when this page and \
         the catalogue disagree. The full contract of each function (inputs, locks, \
         guarantees, errors, what a crash costs, why it has its shape) is the comment above \
         its definition in the area file named here.\n\n\
         SQLSTATEs: `P7001` invalid argument (the message names it), `P7002` `LEASE_LOST` (the \
         caller's lease is not the current one; nothing changed), `23505` an `outbox_id` \
         used before.\n\n\
         Roles: `outbox_producer` (applications), `outbox_relay` (the relayer), \
         `outbox_reader` (dashboards, operators). Functions no role may call are internal: \
         the public functions call them with their owner's rights.\n\n\
         Slot templates: a function named `<stem>_slot0` is written for slot 0 of \
         `outbox.messages` and copied for slots 1 to 3 when the schema is loaded \
         (`outbox.copy_for_slots`, which refuses a template that does not follow its rule); it \
         is listed once, for one copy per slot.\n"
    );
    for (area, functions) in &by_area {
        let _ = writeln!(out, "## `{area}`\n");
        for f in functions {
            let codes: Vec<String> = raised[&f.oid]
                .iter()
                .map(|code| match sqlstate_name(code) {
                    (code, "") => format!("`{code}`"),
                    (code, name) => format!("`{code}` ({name})"),
                })
                .collect();
            let copied = match f.name.strip_suffix("_slot0") {
                Some(stem) => format!(
                    "\n\nOne copy per slot: `outbox.{stem}_slot1` … `_slot3` are this function \
                     with slot 0's table and functions renumbered (`outbox.copy_for_slots`), \
                     with the same arguments, SQLSTATEs and callers."
                ),
                None => String::new(),
            };
            let _ = writeln!(
                out,
                "### `outbox.{}({})`\n\n```sql\n{}\n```\n\n{}{}\n\n\
                 - raises: {}\n- callable by: {}{}\n",
                f.name,
                f.identity,
                f.signature,
                f.comment,
                copied,
                if codes.is_empty() {
                    "none".to_owned()
                } else {
                    codes.join(", ")
                },
                if f.callers.is_empty() {
                    "no role (internal)".to_owned()
                } else {
                    f.callers
                        .iter()
                        .map(|r| format!("`{r}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                },
                if f.definer {
                    "; runs with its owner's rights (`SECURITY DEFINER`)"
                } else {
                    ""
                },
            );
        }
    }
    let _ = writeln!(out, "## Views and tables\n");
    let _ = writeln!(out, "| object | defined in | readable by | contract |");
    let _ = writeln!(out, "| --- | --- | --- | --- |");
    for r in relations {
        let (name, kind, comment): (String, &str, String) = (r.get(0), r.get(1), r.get(2));
        let readers: Vec<String> = ROLES
            .iter()
            .zip([r.get::<_, bool>(3), r.get(4), r.get(5)])
            .filter(|&(_, may)| may)
            .map(|(role, _)| format!("`{role}`"))
            .collect();
        let _ = writeln!(
            out,
            "| `outbox.{name}` ({}) | `{}` | {} | {} |",
            kind.to_lowercase(),
            defined_in(&definitions, kind, &name),
            if readers.is_empty() {
                "owner only".to_owned()
            } else {
                readers.join(", ")
            },
            comment.replace('|', "\\|")
        );
    }
    out
}

#[tokio::test]
async fn the_sql_api_reference_is_generated_from_the_catalogue() {
    let db = TestDb::new().await;
    let c = db.client().await;
    let generated = reference(&c).await;
    let path = Path::new(ROOT).join(REFERENCE);
    if std::env::var_os(UPDATE_REFERENCE).is_some() {
        std::fs::write(&path, &generated).expect("write docs/sql-api.md");
        eprintln!("wrote {REFERENCE}");
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    if let Err(diff) = compare((REFERENCE, &checked_in), ("catalogue", &generated)) {
        panic!("{REFERENCE} is stale: run `make sql-api-doc` and commit it:\n{diff}");
    }

    // A contract changed in the database makes the page stale, naming the function.
    c.batch_execute(
        "COMMENT ON FUNCTION outbox.release_outbox_leases(text, uuid[], uuid[]) IS 'changed'",
    )
    .await
    .unwrap();
    let diff = compare(
        (REFERENCE, &checked_in),
        ("catalogue", &reference(&c).await),
    )
    .expect_err("a changed comment makes the page stale");
    assert!(
        diff.lines().any(|l| l.starts_with("+changed")) && diff.contains("release_outbox_leases"),
        "the diff shows the changed contract: {diff}"
    );

    db.finish().await;
}

// ---------------------------------------------------------------------------------------
// Upgrade from the previous release
// ---------------------------------------------------------------------------------------

/// The previous release's schema version.
const PREVIOUS_RELEASE: i32 = 23;

#[tokio::test]
async fn a_database_of_the_previous_release_upgrades_with_nothing_lost() {
    let db = TestDb::at_version(PREVIOUS_RELEASE).await;
    let c = db.client().await;

    // Work in every state: pending (keyed and not), leased, retried, dead-lettered, replayed.
    c.batch_execute(
        "SELECT outbox.enqueue('orders', jsonb_build_object('n', n),
                               CASE WHEN n % 3 = 0 THEN 'key-' || (n % 5) END,
                               p_max_attempts => CASE WHEN n % 7 = 0 THEN 1 ELSE 10 END)
           FROM generate_series(1, 60) AS n",
    )
    .await
    .unwrap();
    // The previous release's claim: the one its relayers call.
    let claimed = sql::claim_kept(&c, 30, "w1", 60).await;
    assert!(claimed.len() >= 20, "claimed {}", claimed.len());
    // All but the last 5 are reported: 10 delivered, then retried and failed half and half.
    let (reported, still_leased) = claimed.split_at(claimed.len() - 5);
    let rest = reported.len() - 10;
    let states: Vec<&str> = (0..reported.len())
        .map(|i| match i {
            i if i < 10 => "DISPATCHED",
            i if i < 10 + rest / 2 => "RETRYABLE",
            _ => "FAILED",
        })
        .collect();
    assert_eq!(sql::complete_batch(&c, "w1", reported, &states).await, 0);
    let dead: i64 = c
        .query_one("SELECT count(*) FROM outbox.dead_letters", &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        dead >= 2,
        "some messages are dead-lettered before the upgrade ({dead})"
    );
    c.execute(
        "SELECT outbox.replay_dead_letters((SELECT array_agg(outbox_id) FROM
                   (SELECT outbox_id FROM outbox.dead_letters ORDER BY outbox_id LIMIT 1) AS o),
                 NULL, NULL, NULL, 'before the upgrade')",
        &[],
    )
    .await
    .unwrap();
    let before = rows_by_table(&c).await;
    for table in ["messages", "attempts", "dead_letters", "replays"] {
        assert!(
            !before[&format!("outbox.{table}")].is_empty(),
            "outbox.{table} holds rows before the upgrade"
        );
    }

    let applied = outbox_relay::store::Store::connect(&db.url, 2)
        .unwrap()
        .migrate()
        .await
        .expect("upgrade to this build's schema");
    assert!(
        !applied.is_empty(),
        "the upgrade applied the new migrations"
    );
    let mut after = rows_by_table(&c).await;
    let added: Vec<(String, Vec<String>)> = after
        .extract_if(.., |table, _| !before.contains_key(table))
        .collect();
    for (table, rows) in added {
        if table == "outbox.message_slots" || table == "outbox.attempt_slots" {
            assert_eq!(rows, ["0", "1", "2", "3"], "{table} holds one row per slot");
            continue;
        }
        assert!(
            rows.is_empty(),
            "{table}, added by the upgrade, starts empty"
        );
    }
    // The turns the upgrade added (a row each, locked by the functions that take them).
    let turns = after.get_mut("outbox.turns").expect("outbox.turns");
    turns.retain(|t| {
        before["outbox.turns"].contains(t) || !["(rotate)", "(prune)"].contains(&t.as_str())
    });
    assert_eq!(
        before, after,
        "the upgrade changed no row of the outbox tables"
    );
    let reordered: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.messages WHERE order_key IS DISTINCT FROM message_key",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        reordered, 0,
        "each pending message keeps the order it had: its order key is its key"
    );
    let version: i32 = c
        .query_one("SELECT outbox.schema_version()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(version, outbox_relay::schema::version());

    // The leases in flight were given back, as a release would (their tokens name no
    // slot): their holder's completion is a lost lease that records nothing, and the
    // messages are delivered again with the attempt numbers the lost leases had.
    let leased: i64 = c
        .query_one(
            "SELECT count(*) FROM outbox.messages WHERE lease_token IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(leased, 0, "the upgrade gave back the leases in flight");
    let attempts_before = after["outbox.attempts"].len();
    assert_eq!(
        sql::complete_batch(&c, "w1", still_leased, &["DISPATCHED"; 5]).await,
        5,
        "a lease taken before the upgrade is lost after it"
    );
    assert_eq!(
        rows_by_table(&c).await["outbox.attempts"].len(),
        attempts_before,
        "a lost lease records no attempt"
    );
    // The upgraded database goes on working: everything pending drains, claimed in turn by
    // the previous release's claim (its relayers still run after the upgrade) and by this
    // release's.
    c.batch_execute("UPDATE outbox.messages SET available_at = now()")
        .await
        .unwrap();
    for round in 0..100 {
        let batch = if round % 2 == 0 {
            sql::claim_kept(&c, 10, "w2", 60).await
        } else {
            sql::claim(&c, 10, "w2", 60).await
        };
        if batch.is_empty() {
            break;
        }
        sql::complete_batch(&c, "w2", &batch, &vec!["DISPATCHED"; batch.len()]).await;
    }
    let pending: i64 = c
        .query_one("SELECT count(*) FROM outbox.messages", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(pending, 0, "everything pending drains after the upgrade");

    drop(c);
    db.finish().await;
}

// ---------------------------------------------------------------------------------------
// The slot copies: one body per rule, copied and dispatched by a checked rule
// ---------------------------------------------------------------------------------------

/// The SQLSTATE and message (with its detail) of a failed statement.
async fn refused(c: &Client, sql: &str) -> (String, String) {
    let e = c
        .batch_execute(sql)
        .await
        .expect_err(&format!("refused: {sql}"));
    let db = e.as_db_error().expect("a database error");
    (
        db.code().code().to_owned(),
        format!("{} {}", db.message(), db.detail().unwrap_or("")),
    )
}

#[tokio::test]
async fn copy_for_slots_copies_a_template_and_refuses_one_that_does_not_follow_its_rule() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "CREATE FUNCTION outbox.counted_slot0() RETURNS bigint LANGUAGE sql
             AS $$ SELECT count(*) FROM outbox.messages_0 AS m $$;
         COMMENT ON FUNCTION outbox.counted_slot0() IS 'Test: counts slot 0.';
         SELECT outbox.copy_for_slots('outbox.counted_slot0()');",
    )
    .await
    .expect("a template that follows the rule is copied");
    let row = c
        .query_one(
            "SELECT pg_get_functiondef('outbox.counted_slot2()'::regprocedure),
                    obj_description('outbox.counted_slot2()'::regprocedure, 'pg_proc')",
            &[],
        )
        .await
        .unwrap();
    let (definition, comment): (String, String) = (row.get(0), row.get(1));
    assert!(
        definition.contains("FROM outbox.messages_2 AS m") && comment == "Test: counts slot 2.",
        "{definition}\n{comment}"
    );

    // Each way of breaking the rule, refused with 42P13, naming the function and what the
    // rule expects, and copying nothing.
    let broken = [
        (
            "outbox.tally()",
            "SELECT count(*) FROM outbox.messages_0 AS m",
            "does not end in _slot0",
        ),
        (
            "outbox.unaliased_slot0()",
            "SELECT count(*) FROM outbox.messages_0 m",
            "other than as `outbox.messages_0 AS alias`",
        ),
        (
            "outbox.fixed_slot0()",
            "SELECT count(*) FROM outbox.messages_0 AS m, outbox.messages_2 AS n",
            "names messages_2, of slot 2",
        ),
        (
            "outbox.calling_slot0()",
            "SELECT outbox.counted_slot0() + outbox.counted_slot3()",
            "names counted_slot3, of slot 3",
        ),
        (
            "outbox.nothing_slot0()",
            "SELECT count(*) FROM outbox.messages AS m",
            "its copies would be the same function",
        ),
    ];
    for (function, body, expected) in broken {
        c.batch_execute(&format!(
            "CREATE FUNCTION {function} RETURNS bigint LANGUAGE sql AS $$ {body} $$"
        ))
        .await
        .unwrap();
        let (code, message) =
            refused(&c, &format!("SELECT outbox.copy_for_slots('{function}')")).await;
        assert_eq!(code, "42P13", "{function}: {message}");
        assert!(
            message.contains(function) && message.contains(expected),
            "the refusal of {function} names it and says {expected:?}: {message}"
        );
        let copies: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_proc WHERE proname ~ ('^' || $1 || '_slot[1-3]$')",
                &[&ident(&function["outbox.".len()..]).trim_end_matches("_slot0")],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(copies, 0, "{function} was not copied");
    }
    db.finish().await;
}

#[tokio::test]
async fn dispatch_for_slots_writes_the_arms_and_refuses_a_dispatch_that_does_not_follow_its_rule() {
    let db = TestDb::new().await;
    let c = db.client().await;
    c.batch_execute(
        "CREATE FUNCTION outbox.counted_slot0() RETURNS bigint LANGUAGE sql
             AS $$ SELECT count(*) FROM outbox.messages_0 AS m $$;
         COMMENT ON FUNCTION outbox.counted_slot0() IS 'Test: counts slot 0.';
         SELECT outbox.copy_for_slots('outbox.counted_slot0()');
         CREATE FUNCTION outbox.counted(p_slot integer) RETURNS bigint LANGUAGE plpgsql AS $$
         DECLARE
             v bigint;
         BEGIN
             CASE p_slot
             WHEN 0 THEN
                 v := outbox.counted_slot0();
             END CASE;
             RETURN v;
         END;
         $$;
         SELECT outbox.dispatch_for_slots('outbox.counted(integer)');",
    )
    .await
    .expect("a dispatch that follows the rule is written out");
    // The dispatch reaches each slot's copy: a message enqueued now is in the current slot.
    c.batch_execute("SELECT outbox.enqueue('t', '{}'::jsonb)")
        .await
        .unwrap();
    let row = c
        .query_one(
            "SELECT (SELECT slot::integer FROM outbox.messages), ARRAY[outbox.counted(0),
                    outbox.counted(1), outbox.counted(2), outbox.counted(3)]",
            &[],
        )
        .await
        .unwrap();
    let (slot, counts): (i32, Vec<i64>) = (row.get(0), row.get(1));
    let mut expected = vec![0; 4];
    expected[usize::try_from(slot).unwrap()] = 1;
    assert_eq!(counts, expected, "the message is in slot {slot}");
    let (code, _) = common::sqlstate(c.query("SELECT outbox.counted(4)", &[]).await);
    assert_eq!(code, "20000", "a slot outside 0 to 3 raises CASE_NOT_FOUND");
    // Written out once: a second pass finds the arms of slots 1 to 3 and refuses.
    let (code, message) = refused(
        &c,
        "SELECT outbox.dispatch_for_slots('outbox.counted(integer)')",
    )
    .await;
    assert!(
        code == "42P13" && message.contains("counted_slot1, of slot 1"),
        "{message}"
    );

    let function = |name: &str, body: &str| {
        format!(
            "CREATE FUNCTION outbox.{name}(p_slot integer) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    v bigint;
BEGIN
{body}
    RETURN v;
END;
$$"
        )
    };
    let broken = [
        (
            "by_hand",
            "    CASE p_slot\n    WHEN 0 THEN\n        v := outbox.counted_slot0();\n    WHEN 1 THEN\n        v := outbox.counted_slot1();\n    END CASE;",
            "names counted_slot1, of slot 1",
        ),
        (
            "outside",
            "    v := outbox.counted_slot0();",
            "outside a dispatch",
        ),
        ("without", "    v := 1;", "holds no slot dispatch"),
        (
            "unclosed",
            "    CASE p_slot\n    WHEN 0 THEN\n        v := outbox.counted_slot0();\n      END CASE;",
            "no `END CASE;` at its CASE's indentation",
        ),
        (
            "armless",
            "    CASE p_slot\n    WHEN 0 THEN\n        v := 0;\n    END CASE;",
            "calls no slot 0 function",
        ),
    ];
    for (name, body, expected) in broken {
        c.batch_execute(&function(name, body)).await.unwrap();
        let (code, message) = refused(
            &c,
            &format!("SELECT outbox.dispatch_for_slots('outbox.{name}(integer)')"),
        )
        .await;
        assert_eq!(code, "42P13", "{name}: {message}");
        assert!(
            message.contains(&format!("outbox.{name}(integer)")) && message.contains(expected),
            "the refusal of {name} names it and says {expected:?}: {message}"
        );
    }
    let (code, message) = refused(
        &c,
        "SELECT outbox.dispatch_for_slots('outbox.counted_slot0()')",
    )
    .await;
    assert!(
        code == "42P13" && message.contains("is a slot 0 template"),
        "{message}"
    );
    db.finish().await;
}

/// The area files write each slot rule once: no function of slots 1 to 3 is named in their
/// code (their copies are made, and their dispatch arms written, when the schema is loaded),
/// and the copies in the database are their templates renumbered, as the migrations left them.
/// One exception, named here: promote_heads promotes, in one statement, the next messages of
/// its keys in every slot they are in (a guarded UNION ALL of the four slots' promote_slotN),
/// which is not a dispatch to one slot.
#[tokio::test]
async fn each_slot_rule_is_written_once_and_its_copies_are_its_template_renumbered() {
    for file in area_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        for (n, line) in text.lines().enumerate() {
            if line.contains("SELECT outbox.promote_slot") && line.contains("= ANY (v_id_slots)") {
                continue;
            }
            let code = line.find("--").map_or(line, |at| &line[..at]);
            for slot in 1..4 {
                let name = format!("_slot{slot}");
                assert!(
                    !code.match_indices(&name).any(|(at, _)| {
                        !code[at + name.len()..]
                            .starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
                    }),
                    "{}:{}: names a function of slot {slot}; write the slot 0 template or the \
                     arm for slot 0 alone: {line}",
                    file.display(),
                    n + 1
                );
            }
        }
    }

    let db = TestDb::new().await;
    let c = db.client().await;
    let rows = c
        .query(
            "SELECT t.oid::regprocedure::text, s.slot,
                    to_regprocedure(regexp_replace(t.oid::regprocedure::text, '_slot0\\(',
                                                   '_slot' || s.slot || '(')) IS NOT NULL,
                    coalesce(pg_get_functiondef(to_regprocedure(regexp_replace(
                        t.oid::regprocedure::text, '_slot0\\(', '_slot' || s.slot || '('))), '')
                    = regexp_replace(regexp_replace(pg_get_functiondef(t.oid),
                        '\\moutbox\\.messages_0 AS ', 'outbox.messages_' || s.slot || ' AS ', 'g'),
                        '_slot0\\M', '_slot' || s.slot, 'g')
               FROM pg_proc AS t, generate_series(1, 3) AS s(slot)
              WHERE t.pronamespace = 'outbox'::regnamespace AND t.proname LIKE '%\\_slot0'",
            &[],
        )
        .await
        .unwrap();
    assert!(rows.len() >= 15, "the schema's templates: {}", rows.len());
    for r in rows {
        let (template, slot, exists, same): (String, i32, bool, bool) =
            (r.get(0), r.get(1), r.get(2), r.get(3));
        assert!(
            exists && same,
            "{template}'s copy for slot {slot} is not the template renumbered"
        );
    }
    db.finish().await;
}

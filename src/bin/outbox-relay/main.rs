//! The `outbox-relay` command line: `run` the relayer, and the operator verbs around it.
//! The binary's own tree, above the library (`outbox_relay`), which it uses and which
//! never uses it. This file holds the parser (every verb and its flags, the global options)
//! and the settings the verbs share, and hands each verb to its file: `run_verb.rs`,
//! `migrate_verb.rs`, `enqueue_verb.rs`, `status_verb.rs`, `repair_verb.rs`,
//! `dead_letters_verb.rs`, `replay_verb.rs`, `adopt_verb.rs`, `key_order_verb.rs`, `console_verb.rs`, `bench/`, `healthcheck_verb.rs`, and
//! `manual.rs` for `completions` and `man`. `all_sources.rs` is what the verbs share to
//! work across the sources of `--all-sources` or on the one of `--source NAME`;
//! `output.rs` writes standard output as Unix tools do.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Result, bail};
use clap::{CommandFactory, Parser, Subcommand};

#[macro_use]
mod output;

mod adopt_verb;
mod all_sources;
mod bench;
mod console_verb;
mod dead_letters_verb;
mod enqueue_verb;
mod healthcheck_verb;
mod key_order_verb;
mod manual;
mod migrate_verb;
mod repair_verb;
mod replay_verb;
mod run_verb;
mod status_verb;

use outbox_relay::config::{RawConfig, Settings};
use outbox_relay::secret::read_secret_file;
use outbox_relay::store::{Store, StoreError};

/// The heading of the options every verb takes, listed after the verb's own.
const GLOBAL: &str = "Global options";

#[derive(Parser)]
#[command(
    name = "outbox-relay",
    version,
    about = "Relays a Postgres transactional outbox to a destination"
)]
struct Cli {
    /// Postgres URL of the database holding the outbox; the verbs that write (migrate,
    /// enqueue, repair, replay, run) need one given [default: postgres://postgres@127.0.0.1:5432/postgres].
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true, help_heading = GLOBAL, display_order = 1000)]
    database_url: Option<String>,
    /// File holding the Postgres URL (a mounted secret); also read from OUTBOX_DATABASE_URL_FILE.
    #[arg(long, env = "DATABASE_URL_FILE", global = true, help_heading = GLOBAL, display_order = 1000)]
    database_url_file: Option<PathBuf>,
    /// TOML file with settings (the `run` flags in snake_case, plus database_url).
    #[arg(long, env = "OUTBOX_CONFIG", global = true, help_heading = GLOBAL, display_order = 1000)]
    config: Option<PathBuf>,
    /// A source of a many-source configuration, by name: the verb works on its database
    /// instead of --database-url.
    #[arg(long, global = true, help_heading = GLOBAL, display_order = 1000)]
    source: Option<String>,
    /// The schema that holds the outbox, in the database and in every source that names
    /// none of its own [default: outbox].
    #[arg(long, env = "OUTBOX_SCHEMA", global = true, help_heading = GLOBAL, display_order = 1000)]
    outbox_schema: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the relayer until SIGINT/SIGTERM.
    Run {
        #[command(flatten)]
        settings: Box<RawConfig>,
        /// Apply the schema migrations before starting.
        #[arg(long)]
        migrate: bool,
    },
    /// Apply the embedded schema migrations (idempotent); prints what it applied.
    Migrate {
        /// Migrate every source of a many-source configuration instead of --database-url,
        /// a line per source; exits non-zero when any failed.
        #[arg(long)]
        all_sources: bool,
        /// Sources migrated at once with --all-sources, 1..=64.
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
        parallel: u16,
    },
    /// Enqueue one message; prints its outbox_id.
    Enqueue(Box<enqueue_verb::Args>),
    /// Per topic: ready, delayed, in flight, expired leases, dead letters and oldest ready
    /// age; the fleet's rates; the key order rules, once one is set; what is wrong (a held
    /// MVCC horizon, dead tuples, a topic stalled) and what to do.
    Status(Box<status_verb::Args>),
    /// Run one lease repair pass and print what it did (for cron).
    Repair {
        /// Expired leases to handle in this pass (in each source with --all-sources).
        #[arg(long, default_value_t = 1000)]
        limit: i32,
        /// Repair every source of a many-source configuration instead of --database-url,
        /// a line per source with what it did; exits non-zero naming the sources that
        /// failed, after trying them all.
        #[arg(long)]
        all_sources: bool,
        /// Sources repaired at once with --all-sources, 1..=64.
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
        parallel: u16,
    },
    /// Look at dead letters: list, count, or show one in full (of every source with
    /// --all-sources).
    #[command(subcommand)]
    DeadLetters(dead_letters_verb::Verb),
    /// Move dead letters back into the outbox with a fresh attempt budget (audited in
    /// outbox.replay_log; preview with --dry-run).
    Replay(Box<replay_verb::Args>),
    /// Relay a table the application already writes (Debezium's outbox table, or any by a
    /// mapping): install (or --remove) the trigger that enqueues each inserted row; --list.
    Adopt(Box<adopt_verb::Args>),
    /// Choose the scope of a key's order per topic pattern: the whole outbox (the default)
    /// or per topic, for messages enqueued from now on; unset a choice; list them.
    #[command(subcommand)]
    KeyOrder(key_order_verb::Verb),
    /// Serve the operator console in the browser over every source (or --database-url)
    /// until SIGINT/SIGTERM: overview, messages, dead letters with an audited replay,
    /// sources, destinations (docs/console.md).
    Console(Box<console_verb::Args>),
    /// Measure drain throughput, latency and memory (see `make bench`).
    Bench(Box<bench::Options>),
    /// Ask a running relayer's /healthz (or /readyz) and exit 0 when it answers 200 (for
    /// container HEALTHCHECKs: the image has no curl).
    Healthcheck {
        /// The relayer's telemetry address [default: OUTBOX_TELEMETRY_ADDR or 127.0.0.1:9187].
        #[arg(long, env = "OUTBOX_TELEMETRY_ADDR")]
        addr: Option<String>,
        /// Ask /readyz instead of /healthz.
        #[arg(long)]
        ready: bool,
    },
    /// Print a shell completion script, e.g.
    /// `outbox-relay completions bash > /etc/bash_completion.d/outbox-relay`.
    Completions { shell: clap_complete::Shell },
    /// Print a manual page (roff): `outbox-relay man | man -l -` for the command and its
    /// files, environment and exit statuses, `outbox-relay man replay` for a verb's page.
    Man {
        /// The verb (`replay`, `dead-letters list`) [default: the top page].
        verb: Vec<String>,
        /// Write every page into this directory instead (`outbox-relay.1`,
        /// `outbox-relay-run.1`, …), e.g. for /usr/local/share/man/man1.
        #[arg(long, conflicts_with = "verb")]
        out_dir: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let role = role_needed(&cli.command);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(dispatch(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", report(&e));
            if let Some(role) = role.filter(|_| privilege_refused(&e)) {
                eprintln!(
                    "hint: this verb needs a login that is a member of {role}: as the \
                     database owner, `GRANT {role} TO <this login>;` (docs/security.md#roles)"
                );
            }
            ExitCode::from(2)
        }
    }
}

/// The role of the SQL API whose grants a verb uses, named when Postgres refuses the login
/// a privilege (SQLSTATE 42501). `migrate` is left out: it needs the schema's owner, and
/// says so itself.
fn role_needed(command: &Command) -> Option<&'static str> {
    match command {
        Command::Enqueue(_) => Some("outbox_producer"),
        Command::Run { .. }
        | Command::Repair { .. }
        | Command::Replay(_)
        | Command::DeadLetters(_)
        | Command::KeyOrder(_)
        | Command::Bench(_) => Some("outbox_relay"),
        Command::Status(_) | Command::Console(_) => Some("outbox_reader"),
        _ => None,
    }
}

/// Whether Postgres refused the login a privilege somewhere in the chain of `e`.
fn privilege_refused(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<StoreError>(),
            Some(StoreError::Database { source, .. })
                if source.code().is_some_and(|c| c.code() == "42501")
        )
    })
}

/// The error and its causes, down to the first storage error: that one already says in
/// words what its causes are (Postgres' message, SQLSTATE, the host), so the chain under it
/// would only repeat it.
fn report(e: &anyhow::Error) -> String {
    let mut parts = Vec::new();
    for cause in e.chain() {
        parts.push(cause.to_string());
        if cause.downcast_ref::<StoreError>().is_some() {
            break;
        }
    }
    parts.join(": ")
}

/// The database URL from `--database-url`/`DATABASE_URL`, or from the file named by
/// `--database-url-file`/`DATABASE_URL_FILE`/`OUTBOX_DATABASE_URL_FILE`; not both.
fn database_url(cli: &Cli) -> Result<Option<String>> {
    let file = cli.database_url_file.clone().or_else(|| {
        std::env::var_os("OUTBOX_DATABASE_URL_FILE")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    });
    match (&cli.database_url, file) {
        (Some(_), Some(_)) => bail!(
            "invalid setting database_url: give the URL (--database-url / DATABASE_URL) or a file \
             holding it (--database-url-file / DATABASE_URL_FILE / OUTBOX_DATABASE_URL_FILE), \
             not both"
        ),
        (Some(url), None) => Ok(Some(url.clone())),
        (None, Some(path)) => read_secret_file(&path)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("invalid setting database_url_file: {e}")),
        (None, None) => Ok(None),
    }
}

/// Flags and environment over the config file over defaults.
fn settings(cli: &Cli, flags: RawConfig) -> Result<Settings> {
    let mut raw = RawConfig {
        database_url: database_url(cli)?,
        outbox_schema: cli.outbox_schema.clone(),
        ..flags
    };
    if let Some(path) = &cli.config {
        raw = raw.or(RawConfig::from_file(path)?);
    }
    Ok(Settings::from_raw(raw)?)
}

async fn dispatch(cli: Cli) -> Result<()> {
    // A store for the operator verbs, once the schema is known to be what this build needs;
    // `writes` names a verb that writes, which the default database is refused to.
    let quick_store = async |cli: &Cli, writes: Option<&str>| -> Result<Store> {
        let s = settings(cli, RawConfig::default())?;
        let database = verb_database(cli).await?;
        if let Some(verb) = writes {
            database.check_named(verb)?;
        }
        let mut store = Store::connect(&database.url, 2)?;
        if database.is_default {
            store = store.on_default_database();
        }
        // The relayers' listen URL (environment or config file), for status's wake-up test.
        if let Some(url) = std::env::var("OUTBOX_LISTEN_URL").ok().or(s.listen_url) {
            store = store.with_listen_url(&url)?;
        }
        store.check_schema().await?;
        Ok(store)
    };
    match &cli.command {
        Command::Run {
            settings: flags,
            migrate,
        } => {
            if cli.source.is_some() {
                bail!(
                    "--source names a source for the operator verbs; `run` serves every \
                     source of its configuration"
                );
            }
            let settings = settings(&cli, (**flags).clone())?;
            run_verb::run(settings, *migrate).await
        }
        Command::Migrate {
            all_sources: true,
            parallel,
        } => migrate_verb::run_all(&all_sources_settings(&cli)?, usize::from(*parallel)).await,
        Command::Migrate { .. } => {
            let database = verb_database(&cli).await?;
            database.check_named("migrate")?;
            migrate_verb::run(&database.url).await
        }
        Command::Enqueue(args) => {
            let message = args.message()?;
            enqueue_verb::run(&quick_store(&cli, Some("enqueue")).await?, &message).await
        }
        Command::DeadLetters(verb) if verb.all_sources() => {
            dead_letters_verb::run_all(&all_sources_settings(&cli)?, verb).await
        }
        Command::DeadLetters(verb) => {
            dead_letters_verb::run(&quick_store(&cli, None).await?, verb).await
        }
        Command::Completions { shell } => {
            out!("{}", manual::completions(Cli::command(), *shell));
            Ok(())
        }
        Command::Man { verb, out_dir } => {
            match out_dir {
                Some(dir) => {
                    for path in manual::write_all(Cli::command(), dir)? {
                        outln!("{}", path.display());
                    }
                }
                None => out!("{}", manual::page(Cli::command(), verb)?),
            }
            Ok(())
        }
        Command::Status(args) if args.all_sources => {
            status_verb::run_all(&all_sources_settings(&cli)?, args.json).await
        }
        Command::Status(args) => status_verb::run(&quick_store(&cli, None).await?, args).await,
        Command::Repair {
            limit,
            all_sources: true,
            parallel,
        } => {
            repair_verb::run_all(&all_sources_settings(&cli)?, *limit, usize::from(*parallel)).await
        }
        Command::Repair { limit, .. } => {
            repair_verb::run(&quick_store(&cli, Some("repair")).await?, *limit).await
        }
        Command::Replay(args) if args.all_sources => {
            replay_verb::run_all(&all_sources_settings(&cli)?, args).await
        }
        Command::Replay(args) => {
            let writes = (!args.dry_run).then_some("replay");
            replay_verb::run(&quick_store(&cli, writes).await?, args).await
        }
        Command::Adopt(args) => {
            let writes = (!args.list()).then_some("adopt");
            adopt_verb::run(&quick_store(&cli, writes).await?, args).await
        }
        Command::KeyOrder(verb) => {
            let writes = (!verb.reads_only()).then_some("key-order");
            key_order_verb::run(&quick_store(&cli, writes).await?, verb).await
        }
        Command::Console(args) => {
            let settings = args.settings()?;
            // The sources of a many-source fleet are found again as the fleet finds them.
            let mut rediscover = None;
            let sources = match &cli.source {
                Some(name) => [(
                    name.clone(),
                    all_sources::one(&sources_settings(&cli)?, name).await?,
                )]
                .into(),
                None => {
                    let many = sources_settings(&cli)?;
                    if many.is_many() {
                        let found = all_sources::all(&many).await?;
                        rediscover = Some((many, found.clone()));
                        found
                    } else {
                        let database = verb_database(&cli).await?;
                        let name = outbox_relay::connection::Target::parse(&database.url)
                            .ok()
                            .and_then(|t| t.config.get_dbname().map(str::to_owned))
                            .unwrap_or_else(|| "default".to_owned());
                        [(name, database.url)].into()
                    }
                }
            };
            // The fleet's cap, as `run` reads it: its variable, or the config file.
            let cap = match std::env::var("OUTBOX_MAX_CONNECTIONS_PER_SERVER")
                .ok()
                .filter(|v| !v.is_empty())
            {
                Some(v) => Some(v.parse::<usize>().map_err(|_| {
                    anyhow::anyhow!(
                        "invalid setting OUTBOX_MAX_CONNECTIONS_PER_SERVER: {v:?} is not a \
                         number of connections"
                    )
                })?),
                None => sources_settings(&cli)?.max_connections_per_server,
            };
            let rediscovery =
                rediscover.map(|(settings, found)| outbox_relay::console::Rediscovery {
                    settings,
                    found,
                    cap,
                });
            console_verb::run(settings, sources, cap, rediscovery).await
        }
        Command::Bench(options) => {
            let s = settings(&cli, RawConfig::default())?;
            bench::run(&s.database_url, options).await
        }
        Command::Healthcheck { addr, ready } => {
            healthcheck_verb::run(addr.as_deref(), *ready).await
        }
    }
}

/// The database an operator verb works on.
struct VerbDatabase {
    url: String,
    /// No URL was given: `url` is the default, the server's `postgres` database.
    is_default: bool,
}

impl VerbDatabase {
    /// Refuses `verb`, which writes, on the default database: creating the outbox's schema
    /// and roles in the server's `postgres` database, or writing to an outbox there, is
    /// done only when that database is asked for by name.
    fn check_named(&self, verb: &str) -> Result<()> {
        if self.is_default {
            return Err(unnamed_database(verb));
        }
        Ok(())
    }
}

/// The refusal of `verb`, which writes, on the default database.
fn unnamed_database(verb: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "{verb} needs a database: set DATABASE_URL or --database-url (or --database-url-file, \
         or database_url in --config); the default connects to the server's postgres database \
         ({}), which it would write to",
        outbox_relay::config::DEFAULT_DATABASE_URL
    )
}

/// The database an operator verb works on: that of `--source NAME` (found as `run` finds
/// the sources), else `--database-url`.
async fn verb_database(cli: &Cli) -> Result<VerbDatabase> {
    match &cli.source {
        Some(name) => Ok(VerbDatabase {
            url: all_sources::one(&sources_settings(cli)?, name).await?,
            is_default: false,
        }),
        None => {
            let s = settings(cli, RawConfig::default())?;
            Ok(VerbDatabase {
                url: s.database_url,
                is_default: s.database_url_is_default,
            })
        }
    }
}

/// [`sources_settings`] for a verb given `--all-sources`, which `--source` contradicts.
fn all_sources_settings(cli: &Cli) -> Result<outbox_relay::sources::SourcesSettings> {
    if let Some(name) = &cli.source {
        bail!(
            "give --source NAME or --all-sources, not both (--source {name} works on that \
             source alone, --all-sources on every source)"
        );
    }
    sources_settings(cli)
}

/// The sources of a many-source configuration, for the verbs: the config file's, and the
/// `OUTBOX_SOURCES_*` variables.
fn sources_settings(cli: &Cli) -> Result<outbox_relay::sources::SourcesSettings> {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let raw = RawConfig {
        sources_server_url: env("OUTBOX_SOURCES_SERVER_URL"),
        sources_catalogue_url: env("OUTBOX_SOURCES_CATALOGUE_URL"),
        sources_catalogue_query: env("OUTBOX_SOURCES_CATALOGUE_QUERY"),
        ..RawConfig::default()
    };
    Ok(settings(cli, raw)?.sources)
}

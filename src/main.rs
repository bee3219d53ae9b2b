//! The `outbox-relay` command line: `run` the relayer, and the operator verbs around it.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{CommandFactory, Parser, Subcommand};
use tokio_util::sync::CancellationToken;

#[macro_use]
mod output;

mod all_sources;
mod bench;
mod dead_letters;
mod enqueue;
mod manual;
mod replay;
mod status;

use outbox_relay::config::{RawConfig, Settings};
use outbox_relay::dispatch::Dispatcher;
use outbox_relay::relay::Relay;
use outbox_relay::secret::{read_secret_file, redact_url};
use outbox_relay::store::{Store, StoreError};
use outbox_relay::{logging, observe, probes, telemetry};

/// The heading of the options every verb takes, listed after the verb's own.
const GLOBAL: &str = "Global options";

#[derive(Parser)]
#[command(
    name = "outbox-relay",
    version,
    about = "Relays a Postgres transactional outbox to a destination"
)]
struct Cli {
    /// Postgres URL of the database holding the outbox [default: postgres://postgres@127.0.0.1:5432/postgres].
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
    Enqueue(Box<enqueue::Args>),
    /// Per topic: ready, delayed, in flight, expired leases, dead letters and oldest ready
    /// age; the fleet's rates; what is wrong (a held MVCC horizon, dead tuples) and what to do.
    Status(Box<status::Args>),
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
    DeadLetters(dead_letters::Verb),
    /// Move dead letters back into the outbox with a fresh attempt budget (audited in
    /// outbox.replay_log; preview with --dry-run).
    Replay(Box<replay::Args>),
    /// Measure drain throughput, latency and memory (see `make bench`).
    Bench(bench::Options),
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
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(dispatch(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", report(&e));
            ExitCode::from(2)
        }
    }
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
    // A store for the operator verbs, once the schema is known to be what this build needs.
    let quick_store = async |cli: &Cli| -> Result<Store> {
        let s = settings(cli, RawConfig::default())?;
        let mut store = Store::connect(&verb_database_url(cli).await?, 2)?;
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
            run(settings, *migrate).await
        }
        Command::Migrate {
            all_sources: true,
            parallel,
        } => all_sources::migrate(&all_sources_settings(&cli)?, usize::from(*parallel)).await,
        Command::Migrate { .. } => migrate_one(&verb_database_url(&cli).await?).await,
        Command::Enqueue(args) => {
            let message = args.message()?;
            let id = quick_store(&cli)
                .await?
                .enqueue(&message)
                .await
                .context("enqueue")?;
            outln!("{id}");
            Ok(())
        }
        Command::DeadLetters(verb) if verb.all_sources() => {
            dead_letters::run_all(&all_sources_settings(&cli)?, verb).await
        }
        Command::DeadLetters(verb) => dead_letters::run(&quick_store(&cli).await?, verb).await,
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
            all_sources::status(&all_sources_settings(&cli)?, args.json).await
        }
        Command::Status(args) => status::run(&quick_store(&cli).await?, args).await,
        Command::Repair {
            limit,
            all_sources: true,
            parallel,
        } => {
            all_sources::repair(&all_sources_settings(&cli)?, *limit, usize::from(*parallel)).await
        }
        Command::Repair { limit, .. } => {
            let r = quick_store(&cli)
                .await?
                .repair(*limit)
                .await
                .context("repair")?;
            outln!("requeued {} dead_lettered {}", r.requeued, r.dead_lettered);
            Ok(())
        }
        Command::Replay(args) if args.all_sources => {
            replay::run_all(&all_sources_settings(&cli)?, args).await
        }
        Command::Replay(args) => replay::run(&quick_store(&cli).await?, args).await,
        Command::Bench(options) => {
            let s = settings(&cli, RawConfig::default())?;
            bench::run(&s.database_url, options).await
        }
        Command::Healthcheck { addr, ready } => {
            let addr = addr.as_deref().unwrap_or("127.0.0.1:9187");
            let path = if *ready { "/readyz" } else { "/healthz" };
            let (status, body) = probes::probe(addr, path).await?;
            out!("{body}");
            if status != 200 {
                bail!("{path} on {addr} answered HTTP {status}");
            }
            Ok(())
        }
    }
}

/// Applies the migrations to the database of `url`, a line per migration applied.
async fn migrate_one(url: &str) -> Result<()> {
    let applied = Store::connect(url, 2)?.migrate().await.context("migrate")?;
    if applied.is_empty() {
        outln!("schema is up to date");
    }
    for name in applied {
        outln!("applied {name}");
    }
    Ok(())
}

/// The database an operator verb works on: that of `--source NAME` (found as `run` finds
/// the sources), else `--database-url`.
async fn verb_database_url(cli: &Cli) -> Result<String> {
    match &cli.source {
        Some(name) => all_sources::one(&sources_settings(cli)?, name).await,
        None => Ok(settings(cli, RawConfig::default())?.database_url),
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

async fn run(settings: Settings, migrate: bool) -> Result<()> {
    logging::init(settings.log_format);
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone())?;
    if settings.sources.is_many() {
        return run_sources(settings, migrate, shutdown).await;
    }

    let mut store = Store::connect(&settings.database_url, settings.pool_size)?
        .with_statements(settings.statements);
    if let Some(url) = &settings.listen_url {
        store = store.with_listen_url(url)?;
    }
    let destinations: Vec<&str> = settings
        .dispatch
        .destinations
        .iter()
        .map(|d| d.name.as_str())
        .collect();
    tracing::info!(worker_id = %settings.relay.worker_id, database = %redact_url(&settings.database_url),
        sslmode = store.target().mode.as_str(), destinations = destinations.join(","),
        batch_size = settings.relay.batch_size, lease_secs = settings.relay.lease_secs, "starting");
    // On loopback or a Unix socket nobody can sit in the middle: no warning for a demo.
    if let Some(weakness) = store.target().weakness()
        && !local_only(&store.target().config)
    {
        tracing::warn!("{weakness}");
    }
    let metrics = telemetry::install();
    let dispatcher = Arc::new(Dispatcher::new(&settings.dispatch)?);
    tokio::spawn(report_unusable_destinations(dispatcher.clone()));
    let latest = observe::Latest::new(settings.observe);
    // The listener comes first: /healthz answers from the start (liveness must not depend on
    // the database), and /readyz says why the relayer is not ready while it waits.
    let listener = match settings.telemetry_addr {
        Some(addr) => Some(
            probes::serve(
                addr,
                metrics,
                probes::Served::One(store.clone()),
                dispatcher.clone(),
                latest.clone(),
                shutdown.clone(),
            )
            .await?,
        ),
        None => None,
    };
    wait_for_database(&store, migrate, &shutdown).await?;
    if !shutdown.is_cancelled() {
        let observer = tokio::spawn(observe::run(
            store.clone(),
            settings.relay.worker_id.clone(),
            outbox_relay::telemetry::Source::default(),
            latest,
            shutdown.clone(),
        ));
        Relay::new(settings.relay, store, dispatcher)
            .run(shutdown)
            .await;
        observer.abort();
    }
    if let Some(listener) = listener {
        listener.abort();
    }
    Ok(())
}

/// Many sources: one relay per source this process holds a slot on (see
/// [`outbox_relay::sources`]); `database_url` is not used.
async fn run_sources(settings: Settings, migrate: bool, shutdown: CancellationToken) -> Result<()> {
    if migrate {
        bail!(
            "invalid setting migrate: with many sources, migrate each source with \
             `outbox-relay migrate --database-url URL` before it is served (an unmigrated \
             source is reported and retried)"
        );
    }
    let destinations: Vec<&str> = settings
        .dispatch
        .destinations
        .iter()
        .map(|d| d.name.as_str())
        .collect();
    let s = &settings.sources;
    tracing::info!(worker_id = %settings.relay.worker_id, listed = s.listed.len(),
        server = s.server_url.as_deref().map(redact_url).unwrap_or_default(),
        catalogue = s.catalogue.as_ref().map(|(url, _)| redact_url(url)).unwrap_or_default(),
        discover_interval_secs = s.discover_interval.as_secs(),
        source_lease_secs = s.lease.as_secs(), destinations = destinations.join(","),
        batch_size = settings.relay.batch_size, "starting with many sources");
    let metrics = telemetry::install();
    let dispatcher = Arc::new(Dispatcher::new(&settings.dispatch)?);
    tokio::spawn(report_unusable_destinations(dispatcher.clone()));
    let fleet = Arc::new(
        outbox_relay::sources::Fleet::new(
            settings.sources.clone(),
            settings.relay.clone(),
            settings.statements,
            dispatcher.clone(),
        )
        .with_observe(settings.observe),
    );
    let listener = match settings.telemetry_addr {
        Some(addr) => Some(
            probes::serve(
                addr,
                metrics,
                probes::Served::Many(fleet.board.clone()),
                dispatcher,
                observe::Latest::new(settings.observe),
                shutdown.clone(),
            )
            .await?,
        ),
        None => None,
    };
    outbox_relay::sources::run(fleet, shutdown).await;
    if let Some(listener) = listener {
        listener.abort();
    }
    Ok(())
}

/// Waits until the database answers with the schema this build needs (applying the
/// migrations first when asked), logging the cause of each failure with the backoff, or
/// until shutdown. Only a failed migration is fatal.
async fn wait_for_database(
    store: &Store,
    migrate: bool,
    shutdown: &CancellationToken,
) -> Result<()> {
    let mut backoff = Duration::from_millis(200);
    loop {
        let checked = async {
            if migrate {
                let applied = store.migrate().await?;
                if let (Some(first), Some(last)) = (applied.first(), applied.last()) {
                    tracing::info!(migrations = applied.len(), first = %first, last = %last,
                        "schema migrated");
                }
            }
            let version = store.check_schema().await?;
            Ok((version, store.detect_pooling().await?))
        };
        match checked.await {
            Ok((version, pooling)) => {
                tracing::info!(
                    schema_version = version,
                    ?pooling,
                    unnamed_statements = store.unnamed_statements(),
                    "database ready"
                );
                return Ok(());
            }
            Err(e @ StoreError::Migration(_)) => return Err(e).context("migrate"),
            Err(e @ StoreError::Pooler(_)) => return Err(e.into()),
            Err(e) => tracing::warn!(error = %e, retry_in_ms = telemetry::millis(backoff),
                "database not ready yet"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// Whether every host of `config` is this machine (loopback or a Unix socket).
fn local_only(config: &tokio_postgres::Config) -> bool {
    use tokio_postgres::config::Host;
    !config.get_hosts().is_empty()
        && config.get_hosts().iter().all(|host| match host {
            Host::Unix(_) => true,
            Host::Tcp(name) => {
                name == "localhost"
                    || name
                        .parse::<std::net::IpAddr>()
                        .is_ok_and(|ip| ip.is_loopback())
            }
        })
}

/// Asks each destination once at start and says at once which cannot be used (a broker
/// that refuses the credentials, an unreachable one), instead of leaving it to the first
/// batch's retries. Not fatal: the messages wait and are retried, and /readyz and
/// /health/destinations report it until it is fixed.
async fn report_unusable_destinations(dispatcher: Arc<Dispatcher>) {
    for (name, _, ready) in dispatcher.readiness(Duration::MAX).await {
        if let Err(error) = ready {
            tracing::warn!(destination = %name, %error,
                "destination not usable at start: its messages wait and are retried; \
                 /health/destinations shows it until it is");
        }
    }
}

/// First SIGINT/SIGTERM: graceful shutdown. Second: exit at once.
fn spawn_signal_handler(shutdown: CancellationToken) -> Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!("signal received: shutting down gracefully (send another to exit at once)");
        shutdown.cancel();
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::warn!("second signal: exiting now");
        std::process::exit(130);
    });
    Ok(())
}

//! The `outbox-relay` command line: `run` the relayer, and the operator verbs around it.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use outbox_relay::config::{RawConfig, Settings};
use outbox_relay::message::{NewMessage, OutboxId};
use outbox_relay::relay::Relay;
use outbox_relay::route::Router;
use outbox_relay::store::{Store, redact_url};
use outbox_relay::{bench, http, logging, telemetry};

#[derive(Parser)]
#[command(
    name = "outbox-relay",
    version,
    about = "Relays a Postgres transactional outbox to a destination"
)]
struct Cli {
    /// Postgres URL of the database holding the outbox [default: postgres://postgres@127.0.0.1:5432/postgres].
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,
    /// TOML file with settings (the `run` flags in snake_case, plus database_url).
    #[arg(long, env = "OUTBOX_CONFIG", global = true)]
    config: Option<PathBuf>,
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
    Migrate,
    /// Enqueue one message (for trying things by hand).
    Enqueue {
        #[arg(long)]
        topic: String,
        /// Messages with the same key are delivered one at a time, in order.
        #[arg(long)]
        key: Option<String>,
        /// The payload, a JSON document.
        #[arg(long)]
        payload: String,
        /// Attempts before the message is dead-lettered.
        #[arg(long)]
        max_attempts: Option<i32>,
    },
    /// Print ready, delayed, in-flight, expired leases, dead letters and oldest ready age.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Run one lease repair pass and print what it did (for cron).
    Repair {
        /// Expired leases to handle in this pass.
        #[arg(long, default_value_t = 1000)]
        limit: i32,
    },
    /// Move dead letters back into the outbox with a fresh attempt budget.
    Replay {
        /// Dead letters to replay (repeatable).
        #[arg(long = "id")]
        ids: Vec<uuid::Uuid>,
        /// Replay the dead letters of this topic.
        #[arg(long)]
        topic: Option<String>,
        /// Replay every dead letter.
        #[arg(long, conflicts_with_all = ["ids", "topic"])]
        all: bool,
    },
    /// Measure drain throughput, latency and memory (see `make bench`).
    Bench(bench::Options),
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
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Flags and environment over the config file over defaults.
fn settings(cli: &Cli, flags: RawConfig) -> Result<Settings> {
    let mut raw = RawConfig {
        database_url: cli.database_url.clone(),
        ..flags
    };
    if let Some(path) = &cli.config {
        raw = raw.or(RawConfig::from_file(path)?);
    }
    Ok(Settings::from_raw(raw)?)
}

async fn dispatch(cli: Cli) -> Result<()> {
    let quick_store = |cli: &Cli| -> Result<Store> {
        let s = settings(cli, RawConfig::default())?;
        Ok(Store::connect(&s.database_url, 2)?)
    };
    match &cli.command {
        Command::Run {
            settings: flags,
            migrate,
        } => {
            let settings = settings(&cli, (**flags).clone())?;
            run(settings, *migrate).await
        }
        Command::Migrate => {
            let applied = quick_store(&cli)?.migrate().await.context("migrate")?;
            if applied.is_empty() {
                println!("schema is up to date");
            }
            for name in applied {
                println!("applied {name}");
            }
            Ok(())
        }
        Command::Enqueue {
            topic,
            key,
            payload,
            max_attempts,
        } => {
            let payload = serde_json::from_str(payload).context("--payload is not valid JSON")?;
            let id = quick_store(&cli)?
                .enqueue(&NewMessage {
                    topic: topic.clone(),
                    key: key.clone(),
                    payload,
                    max_attempts: *max_attempts,
                    ..NewMessage::default()
                })
                .await
                .context("enqueue")?;
            println!("{id}");
            Ok(())
        }
        Command::Status { json } => {
            let s = quick_store(&cli)?.status().await.context("status")?;
            if *json {
                println!("{}", serde_json::to_string(&s)?);
            } else {
                println!("ready            {}", s.ready);
                println!("delayed          {}", s.delayed);
                println!("in flight        {}", s.in_flight);
                println!("expired leases   {}", s.expired_leases);
                println!("dead letters     {}", s.dead_letters);
                match s.oldest_ready_age_secs {
                    Some(age) => println!("oldest ready age {age:.3}s"),
                    None => println!("oldest ready age -"),
                }
            }
            Ok(())
        }
        Command::Repair { limit } => {
            let r = quick_store(&cli)?.repair(*limit).await.context("repair")?;
            println!("requeued {} dead_lettered {}", r.requeued, r.dead_lettered);
            Ok(())
        }
        Command::Replay { ids, topic, all } => {
            if ids.is_empty() && topic.is_none() && !all {
                bail!("replay needs --id, --topic or --all");
            }
            let ids: Vec<OutboxId> = ids.iter().copied().map(OutboxId).collect();
            let n = quick_store(&cli)?
                .replay((!ids.is_empty()).then_some(&ids[..]), topic.as_deref())
                .await
                .context("replay")?;
            println!("replayed {n}");
            Ok(())
        }
        Command::Bench(options) => {
            let s = settings(&cli, RawConfig::default())?;
            bench::run(&s.database_url, options).await
        }
    }
}

async fn run(settings: Settings, migrate: bool) -> Result<()> {
    logging::init(settings.log_format);
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone())?;

    let store = Store::connect(&settings.database_url, settings.pool_size)?;
    tracing::info!(worker_id = %settings.worker_id, database = %redact_url(&settings.database_url),
        destinations = ?settings.destinations.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), batch_size = settings.batch_size, lease_secs = settings.lease_secs,
        "starting");
    wait_for_database(&store, &shutdown).await;
    if shutdown.is_cancelled() {
        return Ok(());
    }
    if migrate {
        for name in store.migrate().await.context("migrate")? {
            tracing::info!(migration = %name, "applied");
        }
    }
    let metrics = telemetry::install();
    let router = Arc::new(Router::new(
        &settings.destinations,
        settings.routes.clone(),
        settings.circuit,
    )?);
    let listener = match settings.telemetry_addr {
        Some(addr) => Some(
            http::serve(
                addr,
                metrics,
                store.clone(),
                router.clone(),
                shutdown.clone(),
            )
            .await?,
        ),
        None => None,
    };
    Relay::new(settings, store, router).run(shutdown).await;
    if let Some(listener) = listener {
        listener.abort();
    }
    Ok(())
}

/// Waits (with backoff, logging each failure) until the database answers or shutdown.
async fn wait_for_database(store: &Store, shutdown: &CancellationToken) {
    let mut backoff = Duration::from_millis(200);
    loop {
        match store.ping().await {
            Ok(()) => return,
            Err(e) => tracing::warn!(error = %e, retry_in = ?backoff, "database not reachable yet"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
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

//! The `run` verb: the relayer itself. It wires the process together (logs, metrics, the
//! probe server, the dispatcher, the observer) around one relay, or around the fleet of
//! relays of a many-source configuration; it waits for the database with a backoff, stops
//! gracefully on the first SIGINT/SIGTERM and at once on the second.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio_util::sync::CancellationToken;

use outbox_relay::config::Settings;
use outbox_relay::dispatch::Dispatcher;
use outbox_relay::relay::Relay;
use outbox_relay::secret::redact_url;
use outbox_relay::store::{Store, StoreError};
use outbox_relay::{logging, observe, probes, telemetry, traces};

/// Says at start which topics this relayer claims and which it leaves to other relayers:
/// those its routes do not cover, and those outside `topics`.
fn say_what_is_left_to_others(settings: &Settings) {
    let routes = settings.dispatch.routes.described();
    let covers_all = settings.dispatch.routes.covered().is_none();
    match (&settings.relay.topics, covers_all) {
        (None, true) => tracing::info!(
            worker_id = %settings.relay.worker_id,
            "claiming every topic (a \"*\" route covers all)"
        ),
        (None, false) => tracing::info!(
            worker_id = %settings.relay.worker_id, covers = routes.join(","),
            "claiming only the topics the routes cover; every other topic is left to other relayers"
        ),
        (Some(topics), _) => tracing::info!(
            worker_id = %settings.relay.worker_id, topics = topics.join(","), covers = routes.join(","),
            "claiming only these topics, those of them the routes cover; every other topic is left to other relayers"
        ),
    }
}

/// Runs the relayer with `settings` until SIGINT/SIGTERM: one source, or many.
pub async fn run(settings: Settings, migrate: bool) -> Result<()> {
    logging::init(settings.log_format);
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone())?;
    let exporting = traces::install(&settings.traces)?;
    if let Some(e) = &exporting {
        tracing::info!(
            endpoint = outbox_relay::secret::redact_url(e.endpoint()),
            "exporting a span per delivery attempt over OTLP"
        );
    }
    let spans = exporting.as_ref().map(traces::Exporting::spans);
    let result = if settings.sources.is_many() {
        run_sources(settings, migrate, shutdown, spans).await
    } else {
        run_one(settings, migrate, shutdown, spans).await
    };
    // The spans of the last attempts are sent before the process exits.
    if let Some(e) = exporting {
        e.shutdown().await;
    }
    result
}

/// One source: the database of `database_url`.
async fn run_one(
    settings: Settings,
    migrate: bool,
    shutdown: CancellationToken,
    spans: Option<traces::Spans>,
) -> Result<()> {
    if settings.database_url_is_default {
        let verb = if migrate { "run --migrate" } else { "run" };
        return Err(crate::unnamed_database(verb));
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
    let dispatcher = Arc::new(Dispatcher::new(&settings.dispatch)?.traced(spans));
    // After the destinations were built: a setting that is wrong is named before the
    // question of whether a catch-all is meant.
    settings.check_catch_all()?;
    say_what_is_left_to_others(&settings);
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
    if let Some(addr) = settings.console_addr {
        let name = store
            .target()
            .config
            .get_dbname()
            .unwrap_or("default")
            .to_owned();
        serve_console(
            addr,
            [(name, settings.database_url.clone())].into(),
            settings.sources.max_connections_per_server,
            None,
            &shutdown,
        )
        .await?;
    }
    wait_for_database(&store, migrate, &shutdown).await?;
    if !shutdown.is_cancelled() {
        let observer = tokio::spawn(observe::run(
            store.clone(),
            settings.relay.worker_id.clone(),
            telemetry::Source::default(),
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
async fn run_sources(
    settings: Settings,
    migrate: bool,
    shutdown: CancellationToken,
    spans: Option<traces::Spans>,
) -> Result<()> {
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
    let dispatcher = Arc::new(Dispatcher::new(&settings.dispatch)?.traced(spans));
    // After the destinations were built: a setting that is wrong is named before the
    // question of whether a catch-all is meant.
    settings.check_catch_all()?;
    say_what_is_left_to_others(&settings);
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
    if let Some(addr) = settings.console_addr {
        let sources = outbox_relay::sources::discover(&settings.sources)
            .await
            .map_err(|e| anyhow::anyhow!("finding the sources for the console: {e}"))?;
        let cap = settings.sources.max_connections_per_server;
        let rediscovery = outbox_relay::console::Rediscovery {
            settings: settings.sources.clone(),
            found: sources.clone(),
            cap,
        };
        serve_console(addr, sources, cap, Some(rediscovery), &shutdown).await?;
    }
    outbox_relay::sources::run(fleet, shutdown).await;
    if let Some(listener) = listener {
        listener.abort();
    }
    Ok(())
}

/// `console_addr`: serves the operator console over `sources` beside the relay, until
/// `shutdown`, with the console verb's defaults; read-only unless OUTBOX_CONSOLE_TOKEN is
/// set (a non-loopback address without it is refused, naming `outbox-relay console
/// --read-only` for a read-only console there). Its pools are its own: two connections a
/// source at most, opened when a page needs them, within `max_connections_per_server` on
/// each server (`cap`; refused otherwise).
async fn serve_console(
    addr: std::net::SocketAddr,
    sources: std::collections::BTreeMap<String, String>,
    cap: Option<usize>,
    rediscovery: Option<outbox_relay::console::Rediscovery>,
    shutdown: &CancellationToken,
) -> Result<()> {
    use outbox_relay::console;
    let settings = crate::console_verb::settings_from_env(addr).map_err(|e| {
        anyhow::anyhow!(
            "{e} (console_addr; for a read-only console on such an address, run \
             `outbox-relay console --read-only` beside the relayer)"
        )
    })?;
    console::check_connection_budget(&sources, settings.connections_per_source, cap)?;
    let stores = console::connect_sources(&sources, &settings)?;
    console::serve_rediscovering(settings, stores, rediscovery, shutdown.clone()).await?;
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

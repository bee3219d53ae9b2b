//! `outbox-relay console`: serves the operator console in the browser over every source the
//! fleet serves (the sources of `run`: the config file's `[sources.NAME]`, the server's
//! databases, the catalogue), or the one database of `--database-url`, until SIGINT or
//! SIGTERM. The pages, the queries and the safety rules are the library's
//! (`outbox_relay::console`); this file turns flags into its settings.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail};
use outbox_relay::console::{AdminToken, ConsoleSettings};
use outbox_relay::secret::read_secret_file;
use tokio_util::sync::CancellationToken;

#[derive(clap::Args)]
pub struct Args {
    /// Address to listen on; a non-loopback address needs a token or --read-only.
    #[arg(long, env = "OUTBOX_CONSOLE_LISTEN", default_value = "127.0.0.1:9188")]
    listen: SocketAddr,
    /// Path prefix the console is served under, behind an ingress (e.g. /console).
    #[arg(long, env = "OUTBOX_CONSOLE_BASE_PATH")]
    base_path: Option<String>,
    /// File holding the admin token that allows replays (a mounted secret); the token may
    /// also come from OUTBOX_CONSOLE_TOKEN. Without one the console is read-only.
    #[arg(long, env = "OUTBOX_CONSOLE_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Never write, even with a token; the way to listen on a non-loopback address
    /// without a token.
    #[arg(long)]
    read_only: bool,
    /// Never show payloads (they may hold personal data).
    #[arg(long, env = "OUTBOX_CONSOLE_SENSITIVE_PAYLOADS")]
    sensitive_payloads: bool,
    /// The longest any console query may run (a cancelled one says so on the page).
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    statement_timeout: Duration,
    /// Between live updates of a page; 0s: none.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    refresh: Duration,
    /// Rows per page of a list, 1..=1000.
    #[arg(long, default_value_t = 50)]
    page_size: i64,
    /// Connections of each source's pool, 1..=16 (opened when needed, closed when idle).
    #[arg(long, default_value_t = 2)]
    connections_per_source: usize,
}

/// The console's flags alone, for [`settings_from_env`].
#[derive(clap::Parser)]
struct FromEnv {
    #[command(flatten)]
    args: Args,
}

/// The settings of the console `run --console-addr` serves on `listen`: those of
/// `outbox-relay console` with its defaults and its `OUTBOX_CONSOLE_*` variables (the
/// token, its file, the base path, sensitive payloads), so that the console is the same
/// whichever way it is started.
pub fn settings_from_env(listen: SocketAddr) -> Result<ConsoleSettings> {
    let listen = listen.to_string();
    let parsed = <FromEnv as clap::Parser>::try_parse_from(["console", "--listen", &listen])
        .map_err(|e| anyhow::anyhow!("the console's OUTBOX_CONSOLE_* settings: {e}"))?;
    parsed.args.settings()
}

impl Args {
    /// The console's settings, the token read from OUTBOX_CONSOLE_TOKEN or --token-file.
    pub fn settings(&self) -> Result<ConsoleSettings> {
        let from_env = std::env::var("OUTBOX_CONSOLE_TOKEN")
            .ok()
            .filter(|v| !v.is_empty());
        let secret = match (from_env, &self.token_file) {
            (Some(_), Some(_)) => bail!(
                "invalid setting console token: give OUTBOX_CONSOLE_TOKEN or --token-file, \
                 not both"
            ),
            (Some(token), None) => Some(token),
            (None, Some(path)) => Some(
                read_secret_file(path)
                    .map_err(|e| anyhow::anyhow!("invalid setting --token-file: {e}"))?,
            ),
            (None, None) => None,
        };
        let settings = ConsoleSettings {
            listen: self.listen,
            base_path: self.base_path.clone().unwrap_or_default(),
            token: secret.as_deref().map(AdminToken::new).transpose()?,
            read_only: self.read_only,
            sensitive_payloads: self.sensitive_payloads,
            statement_timeout: self.statement_timeout,
            refresh: self.refresh,
            page_size: self.page_size,
            connections_per_source: self.connections_per_source,
        };
        settings.validate()?;
        Ok(settings)
    }
}

/// Serves the console over `sources` (name → connection string) until SIGINT/SIGTERM,
/// its pools within the fleet's `max_connections_per_server` (`cap`) on each server, the
/// sources found again as `rediscovery` says (a many-source fleet's).
pub async fn run(
    settings: ConsoleSettings,
    sources: BTreeMap<String, String>,
    cap: Option<usize>,
    rediscovery: Option<outbox_relay::console::Rediscovery>,
) -> Result<()> {
    outbox_relay::logging::init(outbox_relay::logging::LogFormat::Human);
    outbox_relay::console::check_connection_budget(&sources, settings.connections_per_source, cap)?;
    let stores = outbox_relay::console::connect_sources(&sources, &settings)?;
    let shutdown = CancellationToken::new();
    let (bound, server) = outbox_relay::console::serve_rediscovering(
        settings.clone(),
        stores,
        rediscovery,
        shutdown.clone(),
    )
    .await?;
    eprintln!(
        "console: http://{bound}{}/ ({} source(s), {})",
        settings.base_path,
        sources.len(),
        if settings.writable() {
            "replay allowed with the admin token"
        } else {
            "read-only"
        }
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    Ok(())
}

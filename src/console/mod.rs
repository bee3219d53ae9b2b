//! The operator console in the browser (`outbox-relay console`): server-rendered pages over
//! every source of the fleet (overview, messages, one message, dead letters with an
//! audited replay, sources, destinations), small scripts for live updates, safe by
//! default. It exists so that "where is order 42's event?" is answered from one page, for
//! the whole fleet, without psql.
//!
//! - this file: the settings, the sources served, the router and the listener;
//! - `pages.rs`: one handler per screen;
//! - `html.rs`: escaping, the page frame, times, the chart, failed-query panels;
//! - `params.rs`: query strings and form bodies (every filter lives in the URL);
//! - `security.rs`: the admin token, the same-origin rule, the response headers, the
//!   listen-address rule;
//! - `assets.rs`: the script and style sheet, embedded in the binary.
//!
//! Every query goes through `store` (`store/console.rs`), under the statement timeout of
//! [`ConsoleSettings::statement_timeout`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::error::ConfigError;
use crate::store::Store;

mod assets;
mod html;
mod pages;
mod params;
pub mod security;

pub use security::AdminToken;

/// The console's settings, validated ([`ConsoleSettings::validate`]).
#[derive(Clone, Debug)]
pub struct ConsoleSettings {
    /// Where it listens (127.0.0.1:9188 by default).
    pub listen: SocketAddr,
    /// A path prefix for an ingress (`/console`), or "".
    pub base_path: String,
    /// The admin token; None: the console is read-only.
    pub token: Option<AdminToken>,
    /// Read-only said explicitly: no write even with a token, and the only way to listen
    /// on a non-loopback address without a token.
    pub read_only: bool,
    /// Payloads are never shown.
    pub sensitive_payloads: bool,
    /// The longest any console statement may run.
    pub statement_timeout: Duration,
    /// Between live updates of a page (0: none).
    pub refresh: Duration,
    /// Rows per page of a list.
    pub page_size: i64,
    /// Connections of each source's pool (opened when a page needs them, closed when idle).
    pub connections_per_source: usize,
}

impl Default for ConsoleSettings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9188)),
            base_path: String::new(),
            token: None,
            read_only: false,
            sensitive_payloads: false,
            statement_timeout: Duration::from_secs(2),
            refresh: Duration::from_secs(5),
            page_size: 50,
            connections_per_source: 2,
        }
    }
}

impl ConsoleSettings {
    /// Refuses what cannot work or is unsafe, naming the setting.
    pub fn validate(&self) -> Result<(), ConfigError> {
        security::check_listen(self.listen, self.token.as_ref(), self.read_only)?;
        let base = &self.base_path;
        if !base.is_empty()
            && (!base.starts_with('/')
                || base.ends_with('/')
                || !base
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "/-_.".contains(c)))
        {
            return Err(ConfigError::new(
                "--base-path",
                format!(
                    "{base:?} must start with / and not end with one, in letters, digits and \
                     - _ . / (e.g. /console)"
                ),
            ));
        }
        if self.statement_timeout < Duration::from_millis(1) {
            return Err(ConfigError::new(
                "--statement-timeout",
                "must be at least 1 ms",
            ));
        }
        if !(1..=1000).contains(&self.page_size) {
            return Err(ConfigError::new(
                "--page-size",
                "must be between 1 and 1000",
            ));
        }
        if !(1..=16).contains(&self.connections_per_source) {
            return Err(ConfigError::new(
                "--connections-per-source",
                "must be between 1 and 16",
            ));
        }
        Ok(())
    }

    /// Whether a write (replay) may be asked for, with the token.
    pub fn writable(&self) -> bool {
        self.token.is_some() && !self.read_only
    }
}

/// The sources served, as last discovered: each one's store, by name.
pub(crate) struct Sources {
    stores: BTreeMap<String, Store>,
    names: Vec<String>,
}

impl Sources {
    fn new(stores: BTreeMap<String, Store>) -> Self {
        let names = stores.keys().cloned().collect();
        Self { stores, names }
    }

    /// The source `name` asks for, or the first one; `None` when `name` is unknown.
    fn source(&self, name: Option<&str>) -> Option<(&str, &Store)> {
        match name {
            Some(name) => self
                .stores
                .get_key_value(name)
                .map(|(n, s)| (n.as_str(), s)),
            None => self.stores.iter().next().map(|(n, s)| (n.as_str(), s)),
        }
    }
}

/// What the handlers share: the settings and the sources.
pub(crate) struct Console {
    settings: ConsoleSettings,
    /// Replaced whole by each rediscovery ([`Rediscovery`]); a request works on the
    /// sources as they were when it started.
    sources: std::sync::RwLock<Arc<Sources>>,
    /// Each source's overview section as last rendered, and when: reused for
    /// [`OVERVIEW_REUSE`], so that many operators (and their live updates) cost one pass
    /// over the views that read a whole table.
    overviews: std::sync::Mutex<BTreeMap<String, (std::time::Instant, Arc<String>)>>,
    /// The sources whose observation the console is refreshing now, in the background
    /// (one refresh at a time per source).
    refreshing: Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
}

/// How long a source's rendered overview is served again before it is computed anew.
pub(crate) const OVERVIEW_REUSE: Duration = Duration::from_secs(10);

/// A stored observation older than this is refreshed, in the background: the fleet's
/// relayers refresh it every `observe_interval_secs` (15 by default) when they run.
pub(crate) const OBSERVATION_MAX_AGE: Duration = Duration::from_secs(15);

/// The statement timeout of a background refresh of the observation, which reads the whole
/// backlog (about 0.37 s a million pending messages): no page waits for it.
pub(crate) const OBSERVATION_REFRESH_TIMEOUT: Duration = Duration::from_secs(60);

impl Console {
    /// The sources as last discovered.
    fn sources(&self) -> Arc<Sources> {
        self.sources.read().expect("not poisoned").clone()
    }
}

/// Refuses a console whose pools could hold more connections to one Postgres server (host
/// and port) than the fleet's `max_connections_per_server` (`cap`; `None`: no cap): each
/// source's pool holds up to `connections_per_source`, so the sources of one server hold
/// together up to that many times their number. The error names the server and the
/// largest `--connections-per-source` that fits, or says that the cap cannot hold one
/// connection a source.
pub fn check_connection_budget(
    sources: &BTreeMap<String, String>,
    connections_per_source: usize,
    cap: Option<usize>,
) -> Result<(), ConfigError> {
    let Some(cap) = cap else { return Ok(()) };
    let mut per_server: BTreeMap<String, usize> = BTreeMap::new();
    for url in sources.values() {
        let server =
            crate::connection::Target::parse(url).map_or_else(|_| url.clone(), |t| t.address());
        *per_server.entry(server).or_default() += 1;
    }
    for (server, n) in per_server {
        let most = n * connections_per_source;
        if most <= cap {
            continue;
        }
        let fix = if n <= cap {
            format!("give --connections-per-source {} or less", cap / n)
        } else {
            "the cap cannot hold one connection a source: serve the console over fewer \
             sources (--source NAME)"
                .to_owned()
        };
        return Err(ConfigError::new(
            "--connections-per-source",
            format!(
                "{n} source(s) on {server} with {connections_per_source} connection(s) each \
                 could hold {most} connections there, more than the fleet's \
                 max_connections_per_server of {cap}: {fix}"
            ),
        ));
    }
    Ok(())
}

/// The stores of `sources` (name → connection string), each a pool of
/// `settings.connections_per_source` opened lazily, named `outbox-relay console` in
/// `pg_stat_activity`.
pub fn connect_sources(
    sources: &BTreeMap<String, String>,
    settings: &ConsoleSettings,
) -> Result<BTreeMap<String, Store>, crate::store::StoreError> {
    sources
        .iter()
        .map(|(name, url)| {
            Store::connect_as(url, settings.connections_per_source, "outbox-relay console")
                .map(|store| (name.clone(), store))
        })
        .collect()
}

/// How the console finds its sources again while it runs: as the fleet finds them
/// (`settings`), every `settings.discover_interval`, its pools within `cap` (the fleet's
/// `max_connections_per_server`) as at its start.
#[derive(Clone, Debug)]
pub struct Rediscovery {
    pub settings: crate::sources::SourcesSettings,
    /// The connection string each source was found with (name → connection string).
    pub found: BTreeMap<String, String>,
    pub cap: Option<usize>,
}

/// Every `r.settings.discover_interval` until `shutdown`: finds the sources again and,
/// when they changed, serves the new set: a source that stays keeps its pool, a new one
/// gets one, a gone one's pool is dropped (its connections close when the requests that
/// hold them end). A discovery that fails, or a set whose pools would exceed the cap, is
/// logged and the sources stay as they were.
async fn rediscover(console: Arc<Console>, mut r: Rediscovery, shutdown: CancellationToken) {
    let every = r.settings.discover_interval.max(Duration::from_secs(1));
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        let found = match crate::sources::discover(&r.settings).await {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %e, "the console could not find its sources again; it keeps the ones it has");
                continue;
            }
        };
        if found == r.found {
            continue;
        }
        let per_source = console.settings.connections_per_source;
        if let Err(e) = check_connection_budget(&found, per_source, r.cap) {
            tracing::warn!(error = %e, "the sources found again exceed the connection cap; the console keeps the ones it has");
            continue;
        }
        let old = console.sources();
        let mut stores = BTreeMap::new();
        for (name, url) in &found {
            let kept = (r.found.get(name) == Some(url))
                .then(|| old.stores.get(name).cloned())
                .flatten();
            let store = match kept {
                Some(store) => store,
                None => match Store::connect_as(url, per_source, "outbox-relay console") {
                    Ok(store) => store,
                    Err(e) => {
                        tracing::warn!(source = %name, error = %e, "the console cannot open a source found again");
                        continue;
                    }
                },
            };
            stores.insert(name.clone(), store);
        }
        tracing::info!(
            sources = stores.len(),
            "the console serves the sources found again"
        );
        *console.sources.write().expect("not poisoned") = Arc::new(Sources::new(stores));
        r.found = found;
    }
}

fn state(settings: ConsoleSettings, sources: BTreeMap<String, Store>) -> Arc<Console> {
    Arc::new(Console {
        settings,
        sources: std::sync::RwLock::new(Arc::new(Sources::new(sources))),
        overviews: std::sync::Mutex::default(),
        refreshing: Arc::default(),
    })
}

/// The console's routes under `settings.base_path`.
pub fn router(settings: ConsoleSettings, sources: BTreeMap<String, Store>) -> Router {
    routes(state(settings, sources))
}

fn routes(state: Arc<Console>) -> Router {
    let base = state.settings.base_path.clone();
    let loopback = state.settings.listen.ip().is_loopback();
    let at = |path: &str| format!("{base}{path}");
    let mut router = Router::new()
        .route(&at("/"), get(pages::overview))
        .route(&at("/messages"), get(pages::messages))
        .route(&at("/messages/{id}"), get(pages::message))
        .route(&at("/find"), get(pages::find))
        .route(&at("/dead-letters"), get(pages::dead_letters))
        .route(
            &at("/dead-letters/replay"),
            get(pages::replay_preview).post(pages::replay),
        )
        .route(&at("/sources"), get(pages::sources))
        .route(&at("/destinations"), get(pages::destinations))
        .route(&at("/assets/{file}"), get(assets::serve));
    if !base.is_empty() {
        let to = at("/");
        router = router.route(
            &base,
            get(move || async move { axum::response::Redirect::permanent(&to) }),
        );
    }
    router
        .with_state(state)
        .layer(axum::middleware::from_fn(move |request, next| {
            security::guard(loopback, request, next)
        }))
}

/// Binds `settings.listen` now (a taken port fails the start) and serves the console until
/// `shutdown`; returns the bound address and the server's task. Idle connections of the
/// sources' pools are closed after a minute.
pub async fn serve(
    settings: ConsoleSettings,
    sources: BTreeMap<String, Store>,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    serve_rediscovering(settings, sources, None, shutdown).await
}

/// [`serve`], finding the sources again as `rediscovery` says while it runs (`None`: the
/// sources given, for good).
pub async fn serve_rediscovering(
    settings: ConsoleSettings,
    sources: BTreeMap<String, Store>,
    rediscovery: Option<Rediscovery>,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(settings.listen).await.map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("the console cannot listen on {}: {e}", settings.listen),
        )
    })?;
    let bound = listener.local_addr()?;
    let writable = settings.writable();
    let state = state(settings, sources);
    let idle = (shutdown.clone(), state.clone());
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = idle.0.cancelled() => return,
                () = tokio::time::sleep(Duration::from_secs(30)) => {}
            }
            for store in idle.1.sources().stores.values() {
                store.close_idle(Duration::from_secs(60));
            }
        }
    });
    if let Some(r) = rediscovery {
        tokio::spawn(rediscover(state.clone(), r, shutdown.clone()));
    }
    let app = routes(state);
    tracing::info!(addr = %bound, writable, "console listening");
    Ok((
        bound,
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await
            {
                tracing::warn!(error = %e, "console listener stopped");
            }
        }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sources(urls: &[&str]) -> BTreeMap<String, String> {
        urls.iter()
            .enumerate()
            .map(|(i, u)| (format!("s{i}"), (*u).to_owned()))
            .collect()
    }

    #[test]
    fn the_pools_of_one_server_stay_within_the_fleets_cap() {
        let three = sources(&[
            "postgres://a@db1:5432/one",
            "postgres://a@db1:5432/two",
            "postgres://a@db1:5432/three",
            "postgres://a@db2:5432/four",
        ]);
        // No cap: anything goes.
        assert!(check_connection_budget(&three, 16, None).is_ok());
        // Three sources of db1 at 2 each hold 6: within 6, not within 5.
        assert!(check_connection_budget(&three, 2, Some(6)).is_ok());
        let e = check_connection_budget(&three, 2, Some(5))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("db1:5432")
                && e.contains("could hold 6 connections")
                && e.contains("--connections-per-source 1 or less"),
            "{e}"
        );
        let e = check_connection_budget(&three, 1, Some(2))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot hold one connection a source"), "{e}");
    }
}

//! The probe server: the small HTTP listener through which an orchestrator, Prometheus and
//! an operator ask how this process is. Prometheus `/metrics` (this
//! process's counters, the fleet gauges of the latest observation, and with many sources
//! the backlog of each source this process serves), `/healthz` (the process is alive, from
//! the moment it starts), `/readyz` (the database answers with the schema this build needs;
//! 503 with the reason otherwise; each destination's health in the body, never failing
//! it), `/health/destinations` (each destination's circuit and connection, as JSON) and
//! `/debug/health` (the diagnosis of the latest observation, as JSON). Also the client side
//! of a probe, for container health checks (`outbox-relay healthcheck`).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::dispatch::Dispatcher;
use crate::observe::Latest;
use crate::sources::Board;
use crate::store::Store;

/// What the process serves: one database, or many sources (their states on the board).
#[derive(Clone)]
pub enum Served {
    One(Store),
    Many(Arc<Board>),
}

#[derive(Clone)]
struct Probe {
    metrics: PrometheusHandle,
    served: Served,
    dispatcher: Arc<Dispatcher>,
    latest: Arc<Latest>,
}

/// Binds `addr` now (so a taken port fails the start) and serves until `shutdown`.
pub async fn serve(
    addr: SocketAddr,
    metrics: PrometheusHandle,
    served: Served,
    dispatcher: Arc<Dispatcher>,
    latest: Arc<Latest>,
    shutdown: CancellationToken,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = TcpListener::bind(addr).await.map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!(
                "telemetry_addr {addr} cannot be bound: {e}. When several relayers run on one \
                 host, give each its own address (--telemetry-addr {}:0 picks a free port and \
                 logs it) or turn the listener off with --no-telemetry",
                addr.ip()
            ),
        )
    })?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/health/destinations", get(destinations))
        .route("/debug/health", get(health))
        .with_state(Probe {
            metrics,
            served,
            dispatcher,
            latest,
        });
    tracing::info!(addr = %bound,
        "telemetry listening (/metrics, /healthz, /readyz, /health/destinations, /debug/health)");
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
        {
            tracing::warn!(error = %e, "telemetry listener stopped");
        }
    }))
}

async fn render_metrics(State(probe): State<Probe>) -> String {
    if let Served::One(store) = &probe.served {
        let pool = store.pool_status();
        crate::telemetry::pool(pool.size, pool.available, pool.max_size);
    }
    let mut text = probe.metrics.render();
    if let Some(observation) = probe.latest.get() {
        text += &crate::observe::render(&observation, probe.latest.settings.horizon_threshold);
    }
    if let Served::Many(board) = &probe.served {
        text += &crate::observe::render_sources(&board.backlogs());
    }
    text
}

/// What the MVCC watchdog and the fleet gauges say is wrong, with advice, as JSON. Always
/// 200: a horizon held by another session is not this process's fault (`/readyz` stays
/// ready); `status` in the body says `ok`, `degraded` or `unknown`.
async fn health(State(probe): State<Probe>) -> axum::Json<serde_json::Value> {
    axum::Json(probe.latest.health())
}

/// Ready means this process can do its job or will resume it by itself: the database
/// answers with the schema this build needs. Destinations are reported in the body but do
/// not fail it: a consumer outage would otherwise make every relayer unready at once, block
/// rollouts (`maxUnavailable: 0`) and refuse node drains (the disruption budget) exactly
/// when a fix has to ship, while the relayer waits out the outage on its own (the circuit
/// holds the destination's topics back and probes after each cool-down).
///
/// With many sources the process is ready once it runs: a source that cannot be served is
/// one line of the body (and retried by itself), never the whole fleet's readiness.
async fn readyz(State(probe): State<Probe>) -> (StatusCode, String) {
    let served = async {
        match &probe.served {
            Served::One(store) => {
                let database = store.check_schema().await;
                let mut body = match &database {
                    Ok(version) => format!("database: ok (schema version {version})\n"),
                    Err(e) => format!("database: {e}\n"),
                };
                // Reported, never failing readiness: without wake-ups the relayer still
                // delivers, by polling.
                body += &format!("wake-ups: {}\n", store.listener_health().describe());
                (ready_status(&database), body)
            }
            Served::Many(board) => (StatusCode::OK, sources_lines(board)),
        }
    };
    // A destination that does not answer (a broker dropping packets) must not hold the
    // probe past its timeout: it is reported as not answering in time.
    let ((status, mut body), destinations) =
        tokio::join!(served, probe.dispatcher.readiness(DESTINATIONS_WAIT));
    let mut degraded = false;
    for (name, circuit, ready) in destinations {
        let circuit = circuit_name(circuit);
        match ready {
            Ok(()) => body += &format!("destination {name}: ok (circuit {circuit})\n"),
            Err(e) => {
                degraded = true;
                body += &format!("destination {name}: {e} (circuit {circuit})\n");
            }
        }
    }
    if degraded {
        body += "destinations do not affect readiness: delivery resumes by itself when they \
                 are back (details: /health/destinations)\n";
    }
    (status, body)
}

/// One line per source: its state, since when, who serves it.
fn sources_lines(board: &Board) -> String {
    let entries = board.entries();
    let mut body = format!("sources: {}\n", entries.len());
    for (name, entry) in entries {
        let state = match &entry.state {
            crate::sources::SourceState::Serving { slot } => format!("serving (slot {slot})"),
            crate::sources::SourceState::Down(reason) => format!("down: {reason}"),
            other => other.name().replace('_', " "),
        };
        body += &format!(
            "source {name}: {state} since {} (served by: {})\n",
            entry.since.format("%Y-%m-%dT%H:%M:%SZ"),
            if entry.holders.is_empty() {
                "nobody".to_owned()
            } else {
                entry.holders.join(", ")
            }
        );
    }
    body
}

/// How long `/readyz` and `/health/destinations` wait for each destination's own answer
/// (the probes' timeouts are a few seconds: 3 s in deploy/kubernetes).
const DESTINATIONS_WAIT: std::time::Duration = std::time::Duration::from_millis(2000);

/// Ready when the database answers with the schema this build needs.
fn ready_status<T, E>(database: &Result<T, E>) -> StatusCode {
    if database.is_ok() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// Each destination's health as JSON: `{"status": "ok" | "degraded", "destinations":
/// [{"name", "circuit": "closed" | "open" | "half-open", "ok", "problem"}]}`; 503 while any
/// is not ok, for an uptime check or a blackbox probe. Not a readiness probe (see `readyz`).
async fn destinations(State(probe): State<Probe>) -> (StatusCode, axum::Json<serde_json::Value>) {
    let mut all_ok = true;
    let listed: Vec<serde_json::Value> = probe
        .dispatcher
        .readiness(DESTINATIONS_WAIT)
        .await
        .into_iter()
        .map(|(name, circuit, ready)| {
            all_ok &= ready.is_ok();
            serde_json::json!({
                "name": name,
                "circuit": circuit_name(circuit),
                "ok": ready.is_ok(),
                "problem": ready.err(),
            })
        })
        .collect();
    let status = if all_ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "status": if all_ok { "ok" } else { "degraded" },
        "destinations": listed,
    });
    (status, axum::Json(body))
}

fn circuit_name(state: crate::dispatch::State) -> &'static str {
    use crate::dispatch::State;
    match state {
        State::Closed => "closed",
        State::Open => "open",
        State::HalfOpen => "half-open",
    }
}

/// GETs `path` from the listener at `addr` (`0.0.0.0` means this host); returns the status
/// code and body. Plain HTTP/1.0 over TCP: all a health check needs.
pub async fn probe(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let target = match addr.parse::<SocketAddr>() {
        Ok(a) if a.ip().is_unspecified() => SocketAddr::new([127, 0, 0, 1].into(), a.port()),
        Ok(a) => a,
        Err(_) => tokio::net::lookup_host(addr).await?.next().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, format!("{addr}: no address"))
        })?,
    };
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(target).await?;
        stream
            .write_all(format!("GET {path} HTTP/1.0\r\nHost: {target}\r\n\r\n").as_bytes())
            .await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        Ok::<_, std::io::Error>(response)
    };
    let response = tokio::time::timeout(std::time::Duration::from_secs(5), exchange)
        .await
        .map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("{target}: no answer in 5 s"),
            )
        })?
        .map_err(|e| std::io::Error::new(e.kind(), format!("{target}: {e}")))?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

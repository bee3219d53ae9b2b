//! The small HTTP listener: Prometheus `/metrics`, `/healthz` (the process is alive) and
//! `/readyz` (the database answers and the sink is ready; 503 with the reason otherwise).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::route::Router as Destinations;
use crate::store::Store;

#[derive(Clone)]
struct Probe {
    metrics: PrometheusHandle,
    store: Store,
    router: Arc<Destinations>,
}

/// Binds `addr` now (so a taken port fails the start) and serves until `shutdown`.
pub async fn serve(
    addr: SocketAddr,
    metrics: PrometheusHandle,
    store: Store,
    router: Arc<Destinations>,
    shutdown: CancellationToken,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = TcpListener::bind(addr).await.map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("telemetry_addr {addr} cannot be bound: {e}"),
        )
    })?;
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(Probe {
            metrics,
            store,
            router,
        });
    tracing::info!(%addr, "telemetry listening (/metrics, /healthz, /readyz)");
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
    crate::telemetry::pool(probe.store.pool_status());
    probe.metrics.render()
}

async fn readyz(State(probe): State<Probe>) -> (StatusCode, String) {
    let database = probe.store.ping().await.map_err(|e| e.to_string());
    let mut ok = database.is_ok();
    let mut body = match &database {
        Ok(()) => "database: ok\n".to_owned(),
        Err(e) => format!("database: {e}\n"),
    };
    for (name, circuit, ready) in probe.router.readiness().await {
        ok &= ready.is_ok();
        match ready {
            Ok(()) => body += &format!("destination {name}: ok (circuit {circuit:?})\n"),
            Err(e) => body += &format!("destination {name}: {e} (circuit {circuit:?})\n"),
        }
    }
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, body)
}

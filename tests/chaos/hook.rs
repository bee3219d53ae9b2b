//! The HTTP destination of the chaos scenarios that read back what each relayer sent: a
//! server at `http://ADDR/{worker}/{topic}` that records every request it takes (which
//! relayer's URL it came to, the outbox id, when) and answers 200 after a set delay.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use uuid::Uuid;

/// Each request the server took, in arrival order: the relayer whose URL it came to, the
/// outbox id, and when.
pub type Arrivals = Arc<Mutex<Vec<(String, Uuid, Instant)>>>;

/// Starts the server; returns its base URL and what it records. Each request is answered
/// `answer_after` after it arrived.
pub async fn recording_hook(answer_after: Duration) -> (String, Arrivals) {
    let arrivals: Arrivals = Arc::default();
    let seen = arrivals.clone();
    let app = axum::Router::new().route(
        "/{worker}/{topic}",
        axum::routing::post(
            move |axum::extract::Path((worker, _topic)): axum::extract::Path<(String, String)>,
                  headers: axum::http::HeaderMap| {
                let seen = seen.clone();
                async move {
                    let id = headers["idempotency-key"]
                        .to_str()
                        .ok()
                        .and_then(|s| s.parse().ok())
                        .unwrap_or_default();
                    seen.lock().unwrap().push((worker, id, Instant::now()));
                    tokio::time::sleep(answer_after).await;
                    axum::http::StatusCode::OK
                }
            },
        ),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    (format!("http://{addr}"), arrivals)
}

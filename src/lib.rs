//! A Postgres transactional-outbox relayer. Applications enqueue messages in their own
//! transaction; this crate leases them with fenced leases (the rules live in the SQL
//! functions under `schema/`) and delivers them to a destination.
//!
//! # Layout
//! - [`config`]: settings from flags, `OUTBOX_*` variables and TOML, validated once.
//! - [`message`]: domain types: ids, a claimed message, a sink's outcome.
//! - [`schema`]: the embedded SQL migrations.
//! - [`secret`]: `${NAME}`/`${file:PATH}` secrets in the config, URLs redacted for logs.
//! - [`connection`]: connection strings, libpq's sslmode over rustls, connection errors in words.
//! - [`store`]: the only module that talks SQL: pool, SQL API calls, typed errors.
//! - [`sink`]: destinations behind one small trait.
//! - [`route`]: topic → destination routing; the relay's one sink.
//! - [`circuit`]: a circuit breaker per destination.
//! - [`relay`]: the worker pool: claim, dispatch, complete, keep leases, shut down.
//! - [`retry`]: backoff with full jitter for retryable failures.
//! - [`janitor`]: periodic repair of expired leases.
//! - [`telemetry`]: metric names and one log-and-count function per event.
//! - [`http`]: the /metrics, /healthz and /readyz listener.
//! - [`logging`]: human or JSON logs on stderr.
//! - [`bench`]: the throughput and latency benchmark.

pub mod bench;
pub mod circuit;
pub mod config;
pub mod connection;
pub mod http;
pub mod janitor;
pub mod logging;
pub mod message;
pub mod relay;
pub mod retry;
pub mod route;
pub mod schema;
pub mod secret;
pub mod sink;
pub mod store;
pub mod telemetry;

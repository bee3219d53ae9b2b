//! A Postgres transactional-outbox relayer. Applications enqueue messages in their own
//! transaction; this crate leases them with fenced leases (the rules live in the SQL
//! functions under `schema/`) and delivers them to a destination.
//!
//! # Layout
//! - [`error`]: the settings-validation error every layer that owns settings returns.
//! - [`config`]: one process's settings from flags, `OUTBOX_*` variables and TOML, composed
//!   from the settings each layer owns and validated once.
//! - [`message`]: domain types: ids, a claimed message, a destination's outcome.
//! - [`schema`]: the embedded SQL migrations.
//! - [`secret`]: `${NAME}`/`${file:PATH}` secrets in the config, URLs redacted for logs.
//! - [`connection`]: connection strings, libpq's sslmode over rustls, connection errors in words.
//! - [`store`]: the only module that talks SQL: pool, SQL API calls by contract area, its own
//!   row types, typed errors.
//! - [`destination`]: one module per destination (settings, build, publish, classification)
//!   behind one small trait.
//! - [`dispatch`]: routes, circuit breakers, the claim filter, per-destination deadlines and
//!   budgets: what stands between the relay and the destinations.
//! - [`relay`]: the worker pool: claim, dispatch, complete, keep leases, shut down; and
//!   the helpers each relay runs beside it: lease repair and slot rotation (the janitor),
//!   each destination's circuit state reported to the database for `status`.
//! - [`sources`]: many outboxes, one fleet: discovery, the slots through which processes
//!   share the sources, one relay per served source.
//! - [`retry`]: backoff with full jitter for retryable failures.
//! - [`observe`]: reads `outbox.observe` into fleet gauges and the MVCC watchdog, with a
//!   diagnosis.
//! - [`telemetry`]: metric names and one log-and-count function per event, taking plain values.
//! - [`traces`]: a `send` span per delivery attempt, linked to the message's creation
//!   context, exported over OTLP when turned on.
//! - [`console`]: the operator console in the browser (`outbox-relay console`): pages over
//!   every source, the audited replay, safe by default.
//! - [`probes`]: the probe server: the /metrics, /healthz, /readyz and /debug/health listener.
//! - [`logging`]: human or JSON logs on stderr.
//!
//! The modules form layers that only point down, bottom up: `error`, `message`, `secret`,
//! `schema`, `connection`, `logging`, `retry`, `telemetry`, `traces`; `store` and `destination`;
//! `dispatch`, `observe`; `relay`; `sources`; `console`, `probes` and `config` on top.
//! `tests/model/layers.rs` fails on an import cycle between them.
//!
//! The command line is not among them: `src/bin/outbox-relay/` holds the binary (`main.rs`,
//! the parser; one `*_verb.rs` file per verb; `bench/`, `outbox-relay bench`), above every
//! layer here. It uses the library; the library never uses it.

pub mod config;
pub mod connection;
pub mod console;
pub mod destination;
pub mod dispatch;
pub mod error;
pub mod logging;
pub mod message;
pub mod observe;
pub mod probes;
pub mod relay;
pub mod retry;
pub mod schema;
pub mod secret;
pub mod sources;
pub mod store;
pub mod telemetry;
pub mod traces;

//! The built binary as operators and producers meet it, beside the servers it works with:
//! real processes, real connections, real kills. These need more than Postgres (brokers,
//! PgBouncer, shells, the producers' toolchains), which `make test` starts or installs.
//!
//! - [`relay_process`]: the relayer run, killed, frozen and restarted;
//! - [`cli`]: the operator verbs and the shells' completions;
//! - [`console`]: the operator console in the browser, over HTTP, and its safety rules;
//! - [`console_browser`]: the console in Chromium (playwright-core), with axe-core;
//! - [`deployment`]: probes, the schema version check, the telemetry port;
//! - [`key_order`]: the scope of a key's order chosen with `key-order`, honoured by a relayer;
//! - [`observability`]: alert rules and dashboards against a live `/metrics`;
//! - [`observe`]: the fleet gauges and the MVCC watchdog;
//! - [`poolers`]: the relayer, `migrate` and producers behind PgBouncer;
//! - [`postgres_tls`]: TLS to Postgres and connection errors;
//! - [`producers`]: the README's producer snippets in their own languages;
//! - [`sources_metrics`]: what a many-source process tells Prometheus (checked with
//!   promtool);
//! - [`traces`]: the whole trace of a message, producer → relayer → consumer, over OTLP.

#[path = "../common/mod.rs"]
mod common;

mod cli;
mod console;
mod console_browser;
mod deployment;
mod key_order;
mod observability;
mod observe;
mod poolers;
mod postgres_tls;
mod producers;
mod relay_process;
mod sources_metrics;
mod traces;

//! The settings as given, before validation: every field optional, from flags and
//! `OUTBOX_*` variables (clap) or a TOML file (serde, unknown keys refused, secrets
//! substituted), merged field by field with flags first.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::invalid;
use crate::dispatch::{DestinationTable, RouteConfig};
use crate::error::ConfigError;
use crate::traces::TracingTable;

/// The relayer's settings as given: flags and environment (via clap) or a TOML file.
#[derive(Clone, Debug, Default, clap::Args, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Postgres URL (from the global `--database-url` / `DATABASE_URL`, or the file).
    #[arg(skip)]
    pub database_url: Option<String>,
    /// The schema that holds the outbox, in the database and in every source that names
    /// none of its own (from the global `--outbox-schema` / `OUTBOX_SCHEMA`, or the file).
    #[arg(skip)]
    pub outbox_schema: Option<String>,
    /// Identity of this worker in leases and attempts [default: host-pid-random].
    #[arg(long, env = "OUTBOX_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Destination: stdout, file or null [default: stdout].
    #[arg(long, env = "OUTBOX_SINK", value_parser = SinkNames)]
    pub sink: Option<String>,
    /// JSON-lines file the `file` sink appends to.
    #[arg(long, env = "OUTBOX_SINK_FILE")]
    pub sink_file: Option<PathBuf>,
    /// fsync the file after every batch before reporting it delivered [default: true].
    #[arg(long, env = "OUTBOX_SINK_FILE_FSYNC", num_args = 0..=1, default_missing_value = "true")]
    pub sink_file_fsync: Option<bool>,
    /// Simulated destination latency of the `null` sink, per batch [default: 0].
    #[arg(long, env = "OUTBOX_NULL_LATENCY_MS", allow_negative_numbers = true)]
    pub null_latency_ms: Option<i64>,
    /// Let a `stdout` or `null` destination take every topic the others leave (a
    /// catch-all: `--sink null` or `stdout` without `--topics`, or a "*" route to one);
    /// without it `run` refuses, so that a quick look consumes no other relayer's messages.
    #[arg(long, env = "OUTBOX_ALL_TOPICS", num_args = 0..=1, default_missing_value = "true")]
    pub all_topics: Option<bool>,
    /// Only claim messages of these topics (comma-separated) [default: all].
    #[arg(long, env = "OUTBOX_TOPICS", value_delimiter = ',')]
    pub topics: Option<Vec<String>>,
    /// Messages per claim, 1..=10000 [default: 500].
    #[arg(long, env = "OUTBOX_BATCH_SIZE", allow_negative_numbers = true)]
    pub batch_size: Option<i64>,
    /// Byte budget of one claim: payloads of a batch add up to at most this, except that a
    /// batch always takes its first message, 1024..=1073741824 [default: 16777216].
    #[arg(long, env = "OUTBOX_MAX_BATCH_BYTES", allow_negative_numbers = true)]
    pub max_batch_bytes: Option<i64>,
    /// Largest payload relayed; a larger one is dead-lettered without being loaded,
    /// 1..=1073741824 [default: 16777216].
    #[arg(long, env = "OUTBOX_MAX_MESSAGE_BYTES", allow_negative_numbers = true)]
    pub max_message_bytes: Option<i64>,
    /// Claimed batches waiting to be taken by their destinations, 1..=64 [default: 3]; each
    /// destination then has its own budget (`max_in_flight` in its table).
    #[arg(
        long,
        env = "OUTBOX_MAX_BATCHES_IN_FLIGHT",
        allow_negative_numbers = true
    )]
    pub max_batches_in_flight: Option<i64>,
    /// Lease length in seconds, 2..=86400 [default: 30].
    #[arg(long, env = "OUTBOX_LEASE_SECS", allow_negative_numbers = true)]
    pub lease_secs: Option<i64>,
    /// Poll interval when no notification arrives, 10..=3600000 ms [default: 1000].
    #[arg(long, env = "OUTBOX_POLL_INTERVAL_MS", allow_negative_numbers = true)]
    pub poll_interval_ms: Option<i64>,
    /// First retry delay, 1..=86400000 ms [default: 1000].
    #[arg(long, env = "OUTBOX_RETRY_BASE_MS", allow_negative_numbers = true)]
    pub retry_base_ms: Option<i64>,
    /// Longest retry delay, >= retry_base_ms [default: 300000].
    #[arg(long, env = "OUTBOX_RETRY_CAP_MS", allow_negative_numbers = true)]
    pub retry_cap_ms: Option<i64>,
    /// Growth of the retry delay per attempt, 1.0..=10.0 [default: 2.0].
    #[arg(long, env = "OUTBOX_RETRY_MULTIPLIER", allow_negative_numbers = true)]
    pub retry_multiplier: Option<f64>,
    /// Seconds between lease repair passes, 1..=3600 [default: 15].
    #[arg(
        long,
        env = "OUTBOX_REPAIR_INTERVAL_SECS",
        allow_negative_numbers = true
    )]
    pub repair_interval_secs: Option<i64>,
    /// Expired leases handled per repair pass, 1..=100000 [default: 1000].
    #[arg(long, env = "OUTBOX_REPAIR_LIMIT", allow_negative_numbers = true)]
    pub repair_limit: Option<i64>,
    /// Seconds between refreshes of the fleet gauges and the MVCC watchdog (one process of
    /// the fleet computes them per interval), 1..=3600 [default: 15].
    #[arg(
        long,
        env = "OUTBOX_OBSERVE_INTERVAL_SECS",
        allow_negative_numbers = true
    )]
    pub observe_interval_secs: Option<i64>,
    /// A topic whose messages have been ready this long, claimed by no running relayer, is
    /// named (a warning, a gauge), 0..=86400 [default: 60].
    #[arg(
        long,
        env = "OUTBOX_OBSERVE_UNCOVERED_SECS",
        allow_negative_numbers = true
    )]
    pub observe_uncovered_secs: Option<i64>,
    /// Topics with their own label in the fleet gauges (the largest backlogs; the rest are
    /// summed as `other`), 1..=1000 [default: 10].
    #[arg(long, env = "OUTBOX_OBSERVE_TOP_TOPICS", allow_negative_numbers = true)]
    pub observe_top_topics: Option<i64>,
    /// Warn when a transaction, replication slot or prepared transaction has held back the
    /// MVCC horizon this many seconds, 1..=86400 [default: 300].
    #[arg(long, env = "OUTBOX_HORIZON_WARN_SECS", allow_negative_numbers = true)]
    pub horizon_warn_secs: Option<i64>,
    /// On SIGINT/SIGTERM, time to finish in-flight deliveries before releasing the rest,
    /// 0..=3600000 ms [default: 10000].
    #[arg(
        long,
        env = "OUTBOX_SHUTDOWN_TIMEOUT_MS",
        allow_negative_numbers = true
    )]
    pub shutdown_timeout_ms: Option<i64>,
    /// Direct Postgres URL used only for LISTEN, when the database URL goes through a
    /// transaction pooler (which makes LISTEN hear nothing) [default: the database URL].
    #[arg(long, env = "OUTBOX_LISTEN_URL", hide_env_values = true)]
    pub listen_url: Option<String>,
    /// How the leasing calls send statements: auto, named or unnamed (for transaction
    /// poolers; auto turns unnamed when it finds one) [default: auto].
    #[arg(long, env = "OUTBOX_STATEMENTS")]
    pub statements: Option<String>,
    /// Database connections, 2..=256 [default: 8].
    #[arg(long, env = "OUTBOX_POOL_SIZE", allow_negative_numbers = true)]
    pub pool_size: Option<i64>,
    /// Address of the /metrics, /healthz and /readyz listener [default: 127.0.0.1:9187].
    #[arg(long, env = "OUTBOX_TELEMETRY_ADDR")]
    pub telemetry_addr: Option<String>,
    /// Do not start the telemetry listener.
    #[arg(long, env = "OUTBOX_NO_TELEMETRY", num_args = 0..=1, default_missing_value = "true")]
    pub no_telemetry: Option<bool>,
    /// Also serve the operator console (read-only unless OUTBOX_CONSOLE_TOKEN is set) on
    /// this address [default: none].
    #[arg(long, env = "OUTBOX_CONSOLE_ADDR")]
    pub console_addr: Option<String>,
    /// Log format: human or json [default: human].
    #[arg(long, env = "OUTBOX_LOG_FORMAT")]
    pub log_format: Option<String>,
    /// Consecutive retryable failures that open a destination's circuit, 1..=10000 [default: 5].
    #[arg(long, env = "OUTBOX_CIRCUIT_FAILURES", allow_negative_numbers = true)]
    pub circuit_failures: Option<i64>,
    /// Time an open circuit waits before a probe, 100..=3600000 ms [default: 5000].
    #[arg(
        long,
        env = "OUTBOX_CIRCUIT_COOLDOWN_MS",
        allow_negative_numbers = true
    )]
    pub circuit_cooldown_ms: Option<i64>,
    /// Named destinations (TOML only: `[destinations.NAME]` with `type = ...`).
    #[arg(skip)]
    pub destinations: Option<BTreeMap<String, DestinationTable>>,
    /// Topic routes, first match wins (TOML only: `[[routes]]` with `topic` and `destination`).
    #[arg(skip)]
    pub routes: Option<Vec<RouteConfig>>,
    /// Outboxes to serve, by name (TOML only: `[sources.NAME]` with `database_url`).
    #[arg(skip)]
    pub sources: Option<BTreeMap<String, SourceTable>>,
    /// Span export (TOML only: `[tracing]`, under the `OTEL_*` variables; docs/tracing.md).
    #[arg(skip)]
    pub tracing: Option<TracingTable>,
    /// Serve every database on this Postgres server that holds the outbox schema (many
    /// sources, found again every sources_discover_interval_secs).
    #[arg(long, env = "OUTBOX_SOURCES_SERVER_URL", hide_env_values = true)]
    pub sources_server_url: Option<String>,
    /// A database whose sources_catalogue_query returns the sources to serve.
    #[arg(long, env = "OUTBOX_SOURCES_CATALOGUE_URL", hide_env_values = true)]
    pub sources_catalogue_url: Option<String>,
    /// SQL returning (name, connection string) of each source, and optionally a third
    /// column, its outbox schema; the connection string may be a secret reference
    /// (`${NAME}`, `${file:PATH}`).
    #[arg(long, env = "OUTBOX_SOURCES_CATALOGUE_QUERY")]
    pub sources_catalogue_query: Option<String>,
    /// Seconds between discoveries of the sources, and between the polls of a source this
    /// process does not serve, 1..=3600 [default: 10].
    #[arg(
        long,
        env = "OUTBOX_SOURCES_DISCOVER_INTERVAL_SECS",
        allow_negative_numbers = true
    )]
    pub sources_discover_interval_secs: Option<i64>,
    /// The most processes that serve one source at once, 1..=1024 [default: every process
    /// when there is one source, 1 when there are several].
    #[arg(
        long,
        env = "OUTBOX_PROCESSES_PER_SOURCE",
        allow_negative_numbers = true
    )]
    pub processes_per_source: Option<i64>,
    /// Seconds a process's slot on a source holds without renewal; a process that stops
    /// renewing loses the source to another after this, 3..=3600 [default: 15].
    #[arg(long, env = "OUTBOX_SOURCE_LEASE_SECS", allow_negative_numbers = true)]
    pub source_lease_secs: Option<i64>,
    /// Database connections of each served source, 2..=256 [default: 3].
    #[arg(long, env = "OUTBOX_SOURCE_POOL_SIZE", allow_negative_numbers = true)]
    pub source_pool_size: Option<i64>,
    /// The fleet's cap on connections to one Postgres server from its served sources,
    /// shared out evenly among the processes; what a process's fair share leaves of its
    /// part keeps the polls of other sources on open sessions, 3..=100000 [default: no cap].
    #[arg(
        long,
        env = "OUTBOX_MAX_CONNECTIONS_PER_SERVER",
        allow_negative_numbers = true
    )]
    pub max_connections_per_server: Option<i64>,
    /// Leasing calls (claims, completions, releases, lease repairs) one process runs at
    /// once on one Postgres server over all the sources it serves there, taken in turn; 0
    /// for no cap, 0..=1024 [default: 4].
    #[arg(
        long,
        env = "OUTBOX_SOURCE_CALLS_PER_SERVER",
        allow_negative_numbers = true
    )]
    pub source_calls_per_server: Option<i64>,
    /// Of those calls, how many may come from backlogged sources (whose latest claim came
    /// back full) at once; the other turns are kept for the sources that are not
    /// backlogged. 1..=1024, at most `source_calls_per_server` [default: half of
    /// source_calls_per_server, rounded up, and 1 while quiet sources flow beside a
    /// backlog].
    #[arg(
        long,
        env = "OUTBOX_SOURCE_BACKLOGGED_CALLS_PER_SERVER",
        allow_negative_numbers = true
    )]
    pub source_backlogged_calls_per_server: Option<i64>,
    /// Sources named in the `source` label of this process's metrics: the first ones it
    /// serves; the others are labelled `other`, 1..=10000 [default: 50].
    #[arg(long, env = "OUTBOX_SOURCE_LABEL_LIMIT", allow_negative_numbers = true)]
    pub source_label_limit: Option<i64>,
}

/// `--sink`'s values for completion scripts and help: the three sinks that need no table.
/// Any other word is let through to validation, which names the setting and where other
/// destinations are configured.
#[derive(Clone)]
struct SinkNames;

impl clap::builder::TypedValueParser for SinkNames {
    type Value = String;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<String, clap::Error> {
        clap::builder::StringValueParser::new().parse_ref(cmd, arg, value)
    }

    fn possible_values(
        &self,
    ) -> Option<Box<dyn Iterator<Item = clap::builder::PossibleValue> + '_>> {
        Some(Box::new(
            ["stdout", "file", "null"]
                .into_iter()
                .map(clap::builder::PossibleValue::new),
        ))
    }
}

/// One `[sources.NAME]` table.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceTable {
    /// The source's connection string (secrets allowed).
    pub database_url: String,
    /// The schema that holds the source's outbox [default: `outbox_schema`].
    pub schema: Option<String>,
}

impl RawConfig {
    /// Reads a TOML file of the same settings (snake_case keys, plus `database_url`). Any
    /// string value may refer to secrets as `${NAME}` (environment) or `${file:PATH}`; see
    /// [`crate::secret`].
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| invalid("config", format!("cannot read {}: {e}", path.display())))?;
        let mut table: toml::Table = toml::from_str(&text)
            .map_err(|e| invalid("config", format!("{}: {e}", path.display())))?;
        for (key, value) in table.iter_mut() {
            interpolate(key, value)
                .map_err(|e| invalid("config", format!("{}: {e}", path.display())))?;
        }
        toml::Value::Table(table).try_into().map_err(|e| {
            let problem = super::suggest::did_you_mean(&e.to_string());
            invalid("config", format!("{}: {problem}", path.display()))
        })
    }

    /// Field by field: `self` where set, else `fallback`.
    pub fn or(self, fallback: RawConfig) -> RawConfig {
        RawConfig {
            database_url: self.database_url.or(fallback.database_url),
            outbox_schema: self.outbox_schema.or(fallback.outbox_schema),
            worker_id: self.worker_id.or(fallback.worker_id),
            sink: self.sink.or(fallback.sink),
            sink_file: self.sink_file.or(fallback.sink_file),
            sink_file_fsync: self.sink_file_fsync.or(fallback.sink_file_fsync),
            null_latency_ms: self.null_latency_ms.or(fallback.null_latency_ms),
            all_topics: self.all_topics.or(fallback.all_topics),
            topics: self.topics.or(fallback.topics),
            batch_size: self.batch_size.or(fallback.batch_size),
            max_batch_bytes: self.max_batch_bytes.or(fallback.max_batch_bytes),
            max_message_bytes: self.max_message_bytes.or(fallback.max_message_bytes),
            max_batches_in_flight: self
                .max_batches_in_flight
                .or(fallback.max_batches_in_flight),
            lease_secs: self.lease_secs.or(fallback.lease_secs),
            poll_interval_ms: self.poll_interval_ms.or(fallback.poll_interval_ms),
            retry_base_ms: self.retry_base_ms.or(fallback.retry_base_ms),
            retry_cap_ms: self.retry_cap_ms.or(fallback.retry_cap_ms),
            retry_multiplier: self.retry_multiplier.or(fallback.retry_multiplier),
            repair_interval_secs: self.repair_interval_secs.or(fallback.repair_interval_secs),
            repair_limit: self.repair_limit.or(fallback.repair_limit),
            observe_uncovered_secs: self
                .observe_uncovered_secs
                .or(fallback.observe_uncovered_secs),
            observe_interval_secs: self
                .observe_interval_secs
                .or(fallback.observe_interval_secs),
            observe_top_topics: self.observe_top_topics.or(fallback.observe_top_topics),
            horizon_warn_secs: self.horizon_warn_secs.or(fallback.horizon_warn_secs),
            shutdown_timeout_ms: self.shutdown_timeout_ms.or(fallback.shutdown_timeout_ms),
            listen_url: self.listen_url.or(fallback.listen_url),
            statements: self.statements.or(fallback.statements),
            pool_size: self.pool_size.or(fallback.pool_size),
            telemetry_addr: self.telemetry_addr.or(fallback.telemetry_addr),
            no_telemetry: self.no_telemetry.or(fallback.no_telemetry),
            console_addr: self.console_addr.or(fallback.console_addr),
            log_format: self.log_format.or(fallback.log_format),
            circuit_failures: self.circuit_failures.or(fallback.circuit_failures),
            circuit_cooldown_ms: self.circuit_cooldown_ms.or(fallback.circuit_cooldown_ms),
            destinations: self.destinations.or(fallback.destinations),
            routes: self.routes.or(fallback.routes),
            sources: self.sources.or(fallback.sources),
            tracing: self.tracing.or(fallback.tracing),
            sources_server_url: self.sources_server_url.or(fallback.sources_server_url),
            sources_catalogue_url: self
                .sources_catalogue_url
                .or(fallback.sources_catalogue_url),
            sources_catalogue_query: self
                .sources_catalogue_query
                .or(fallback.sources_catalogue_query),
            sources_discover_interval_secs: self
                .sources_discover_interval_secs
                .or(fallback.sources_discover_interval_secs),
            processes_per_source: self.processes_per_source.or(fallback.processes_per_source),
            source_lease_secs: self.source_lease_secs.or(fallback.source_lease_secs),
            source_pool_size: self.source_pool_size.or(fallback.source_pool_size),
            source_calls_per_server: self
                .source_calls_per_server
                .or(fallback.source_calls_per_server),
            source_backlogged_calls_per_server: self
                .source_backlogged_calls_per_server
                .or(fallback.source_backlogged_calls_per_server),
            max_connections_per_server: self
                .max_connections_per_server
                .or(fallback.max_connections_per_server),
            source_label_limit: self.source_label_limit.or(fallback.source_label_limit),
        }
    }
}

/// Substitutes secrets in every string under `value`; errors name the setting's path.
fn interpolate(path: &str, value: &mut toml::Value) -> Result<(), String> {
    match value {
        toml::Value::String(text) => {
            *text = crate::secret::interpolate(text).map_err(|e| format!("{path}: {e}"))?;
        }
        toml::Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                interpolate(&format!("{path}[{i}]"), item)?;
            }
        }
        toml::Value::Table(table) => {
            for (key, item) in table.iter_mut() {
                interpolate(&format!("{path}.{key}"), item)?;
            }
        }
        _ => {}
    }
    Ok(())
}

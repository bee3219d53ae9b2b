//! The top of the settings: one process's configuration, composed from the settings each
//! layer owns (a destination's in its module, dispatch's routes and budgets, observe's
//! intervals, retry's backoff, the log format). Values come from flags, then `OUTBOX_*`
//! environment variables, then an optional TOML file (`--config`), then defaults; they are
//! read into [`RawConfig`] (every field optional, unknown TOML keys refused) and validated
//! once into [`Settings`], with errors that name the setting and its allowed range. A
//! destination's own table (`[destinations.NAME]`) is parsed and validated by that
//! destination's module, not here.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::destination::DestinationConfig;
use crate::dispatch::{
    CircuitSettings, DEFAULT_MAX_IN_FLIGHT, DEFAULT_TIMEOUT_MS, DestinationSettings,
    DestinationTable, DispatchSettings, RouteConfig, Routes, TopicPattern,
};
pub use crate::logging::LogFormat;
use crate::message::WorkerId;
use crate::observe::ObserveSettings;
pub use crate::retry::RetrySettings;

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

pub use crate::error::ConfigError;

fn invalid(setting: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError::new(setting, problem)
}

/// The relayer's settings as given: flags and environment (via clap) or a TOML file.
#[derive(Clone, Debug, Default, clap::Args, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Postgres URL (from the global `--database-url` / `DATABASE_URL`, or the file).
    #[arg(skip)]
    pub database_url: Option<String>,
    /// Identity of this worker in leases and attempts [default: host-pid-random].
    #[arg(long, env = "OUTBOX_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Destination: stdout, file or null [default: stdout].
    #[arg(long, env = "OUTBOX_SINK")]
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
    /// Database connections, 2..=256 [default: 8].
    #[arg(long, env = "OUTBOX_POOL_SIZE", allow_negative_numbers = true)]
    pub pool_size: Option<i64>,
    /// Address of the /metrics, /healthz and /readyz listener [default: 127.0.0.1:9187].
    #[arg(long, env = "OUTBOX_TELEMETRY_ADDR")]
    pub telemetry_addr: Option<String>,
    /// Do not start the telemetry listener.
    #[arg(long, env = "OUTBOX_NO_TELEMETRY", num_args = 0..=1, default_missing_value = "true")]
    pub no_telemetry: Option<bool>,
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
        toml::Value::Table(table)
            .try_into()
            .map_err(|e| invalid("config", format!("{}: {e}", path.display())))
    }

    /// Field by field: `self` where set, else `fallback`.
    pub fn or(self, fallback: RawConfig) -> RawConfig {
        RawConfig {
            database_url: self.database_url.or(fallback.database_url),
            worker_id: self.worker_id.or(fallback.worker_id),
            sink: self.sink.or(fallback.sink),
            sink_file: self.sink_file.or(fallback.sink_file),
            sink_file_fsync: self.sink_file_fsync.or(fallback.sink_file_fsync),
            null_latency_ms: self.null_latency_ms.or(fallback.null_latency_ms),
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
            observe_interval_secs: self
                .observe_interval_secs
                .or(fallback.observe_interval_secs),
            observe_top_topics: self.observe_top_topics.or(fallback.observe_top_topics),
            horizon_warn_secs: self.horizon_warn_secs.or(fallback.horizon_warn_secs),
            shutdown_timeout_ms: self.shutdown_timeout_ms.or(fallback.shutdown_timeout_ms),
            pool_size: self.pool_size.or(fallback.pool_size),
            telemetry_addr: self.telemetry_addr.or(fallback.telemetry_addr),
            no_telemetry: self.no_telemetry.or(fallback.no_telemetry),
            log_format: self.log_format.or(fallback.log_format),
            circuit_failures: self.circuit_failures.or(fallback.circuit_failures),
            circuit_cooldown_ms: self.circuit_cooldown_ms.or(fallback.circuit_cooldown_ms),
            destinations: self.destinations.or(fallback.destinations),
            routes: self.routes.or(fallback.routes),
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

/// Validated settings of one relayer process.
#[derive(Clone, Debug)]
pub struct Settings {
    pub database_url: String,
    pub worker_id: WorkerId,
    /// Destinations, routes and circuit thresholds.
    pub dispatch: DispatchSettings,
    pub topics: Option<Vec<String>>,
    pub batch_size: i32,
    pub max_batch_bytes: i64,
    pub max_message_bytes: i64,
    pub max_batches_in_flight: usize,
    pub lease_secs: i32,
    pub poll_interval: Duration,
    pub retry: RetrySettings,
    pub repair_interval: Duration,
    pub repair_limit: i32,
    pub observe: ObserveSettings,
    pub shutdown_timeout: Duration,
    pub pool_size: usize,
    pub telemetry_addr: Option<SocketAddr>,
    pub log_format: LogFormat,
}

fn in_range<T: PartialOrd + std::fmt::Display + Copy>(
    setting: &str,
    value: T,
    min: T,
    max: T,
) -> Result<T, ConfigError> {
    if value < min || value > max {
        Err(invalid(
            setting,
            format!("{value} is out of range {min}..={max}"),
        ))
    } else {
        Ok(value)
    }
}

/// A numeric setting as given (signed, so that a negative value reaches this check and is
/// reported by name) checked against its range and narrowed to the type it is used as.
fn ranged<T: TryFrom<i64>>(
    setting: &'static str,
    value: i64,
    min: i64,
    max: i64,
) -> Result<T, ConfigError> {
    let value = in_range(setting, value, min, max)?;
    T::try_from(value).map_err(|_| invalid(setting, format!("{value} is too large")))
}

impl Settings {
    pub fn from_raw(raw: RawConfig) -> Result<Settings, ConfigError> {
        let circuit = CircuitSettings {
            failures: ranged(
                "circuit_failures",
                raw.circuit_failures.unwrap_or(5),
                1,
                10_000,
            )?,
            cooldown: Duration::from_millis(ranged(
                "circuit_cooldown_ms",
                raw.circuit_cooldown_ms.unwrap_or(5000),
                100,
                3_600_000,
            )?),
        };
        let dispatch = dispatch_settings(&raw, circuit)?;
        let worker_id = match raw.worker_id {
            Some(id) if id.trim().is_empty() => {
                return Err(invalid("worker_id", "must not be empty"));
            }
            Some(id) => WorkerId::new(id),
            None => default_worker_id(),
        };
        if let Some(topics) = &raw.topics
            && (topics.is_empty() || topics.iter().any(|t| t.trim().is_empty()))
        {
            return Err(invalid("topics", "must be a list of non-empty topic names"));
        }
        let retry_base_ms: i64 = ranged(
            "retry_base_ms",
            raw.retry_base_ms.unwrap_or(1000),
            1,
            86_400_000,
        )?;
        let retry_cap_ms = raw.retry_cap_ms.unwrap_or(300_000.max(retry_base_ms));
        if retry_cap_ms < retry_base_ms || retry_cap_ms > 7 * 86_400_000 {
            return Err(invalid(
                "retry_cap_ms",
                format!(
                    "{retry_cap_ms} is out of range {retry_base_ms} (retry_base_ms)..=604800000"
                ),
            ));
        }
        let multiplier = raw.retry_multiplier.unwrap_or(2.0);
        if !(1.0..=10.0).contains(&multiplier) {
            return Err(invalid(
                "retry_multiplier",
                format!("{multiplier} is out of range 1.0..=10.0"),
            ));
        }
        let lease_secs: i32 = ranged("lease_secs", raw.lease_secs.unwrap_or(30), 2, 86_400)?;
        let telemetry_addr = if raw.no_telemetry.unwrap_or(false) {
            None
        } else {
            let addr = raw.telemetry_addr.as_deref().unwrap_or("127.0.0.1:9187");
            Some(addr.parse().map_err(|e| {
                invalid(
                    "telemetry_addr",
                    format!("{addr:?} is not a host:port address ({e})"),
                )
            })?)
        };
        let log_format = match raw.log_format.as_deref().unwrap_or("human") {
            "human" => LogFormat::Human,
            "json" => LogFormat::Json,
            other => {
                return Err(invalid(
                    "log_format",
                    format!("unknown format {other:?}; expected human or json"),
                ));
            }
        };
        Ok(Settings {
            database_url: raw
                .database_url
                .unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned()),
            worker_id,
            dispatch,
            topics: raw.topics,
            batch_size: ranged("batch_size", raw.batch_size.unwrap_or(500), 1, 10_000)?,
            max_batch_bytes: ranged(
                "max_batch_bytes",
                raw.max_batch_bytes.unwrap_or(16 << 20),
                1024,
                1 << 30,
            )?,
            max_message_bytes: ranged(
                "max_message_bytes",
                raw.max_message_bytes.unwrap_or(16 << 20),
                1,
                1 << 30,
            )?,
            max_batches_in_flight: ranged(
                "max_batches_in_flight",
                raw.max_batches_in_flight.unwrap_or(3),
                1,
                64,
            )?,
            lease_secs,
            poll_interval: Duration::from_millis(ranged(
                "poll_interval_ms",
                raw.poll_interval_ms.unwrap_or(1000),
                10,
                3_600_000,
            )?),
            retry: RetrySettings {
                base: Duration::from_millis(retry_base_ms.unsigned_abs()),
                cap: Duration::from_millis(retry_cap_ms.unsigned_abs()),
                multiplier,
            },
            repair_interval: Duration::from_secs(ranged(
                "repair_interval_secs",
                raw.repair_interval_secs.unwrap_or(15),
                1,
                3600,
            )?),
            repair_limit: ranged("repair_limit", raw.repair_limit.unwrap_or(1000), 1, 100_000)?,
            observe: ObserveSettings {
                interval: Duration::from_secs(ranged(
                    "observe_interval_secs",
                    raw.observe_interval_secs.unwrap_or(15),
                    1,
                    3600,
                )?),
                top_topics: ranged(
                    "observe_top_topics",
                    raw.observe_top_topics.unwrap_or(10),
                    1,
                    1000,
                )?,
                horizon_threshold: Duration::from_secs(ranged(
                    "horizon_warn_secs",
                    raw.horizon_warn_secs.unwrap_or(300),
                    1,
                    86_400,
                )?),
            },
            shutdown_timeout: Duration::from_millis(ranged(
                "shutdown_timeout_ms",
                raw.shutdown_timeout_ms.unwrap_or(10_000),
                0,
                3_600_000,
            )?),
            pool_size: ranged("pool_size", raw.pool_size.unwrap_or(8), 2, 256)?,
            telemetry_addr,
            log_format,
        })
    }

    /// The lease as a `Duration`.
    pub fn lease(&self) -> Duration {
        Duration::from_secs(u64::from(self.lease_secs.unsigned_abs()))
    }
}

/// The destinations and routes: from `[destinations]`/`[[routes]]` when given, otherwise
/// the one `--sink` taking every topic.
fn dispatch_settings(
    raw: &RawConfig,
    circuit: CircuitSettings,
) -> Result<DispatchSettings, ConfigError> {
    let Some(configured) = &raw.destinations else {
        if raw.routes.is_some() {
            return Err(invalid(
                "routes",
                "routes need [destinations.NAME] tables to point at",
            ));
        }
        let destination = single_sink(raw)?;
        return Ok(DispatchSettings {
            destinations: vec![DestinationSettings {
                name: destination.kind().to_owned(),
                destination,
                deadline: Duration::from_millis(DEFAULT_TIMEOUT_MS.unsigned_abs()),
                max_in_flight: usize::try_from(DEFAULT_MAX_IN_FLIGHT).unwrap_or(1),
            }],
            routes: Routes(vec![(TopicPattern::Any, 0)]),
            circuit,
        });
    };
    if raw.sink.is_some() {
        return Err(invalid(
            "sink",
            "give either --sink or [destinations] tables, not both",
        ));
    }
    if configured.is_empty() {
        return Err(invalid(
            "destinations",
            "at least one destination is needed",
        ));
    }
    let destinations = configured
        .iter()
        .map(|(name, table)| DestinationSettings::from_table(name, table))
        .collect::<Result<Vec<_>, _>>()?;
    let names: Vec<&str> = destinations.iter().map(|d| d.name.as_str()).collect();
    let routes = Routes::parse(raw.routes.as_deref().unwrap_or_default(), &names)?;
    Ok(DispatchSettings {
        destinations,
        routes,
        circuit,
    })
}

/// The destination of `--sink` (stdout, file or null) and its flags.
fn single_sink(raw: &RawConfig) -> Result<DestinationConfig, ConfigError> {
    Ok(match raw.sink.as_deref().unwrap_or("stdout") {
        "stdout" => DestinationConfig::stdout(),
        "file" => DestinationConfig::file(
            raw.sink_file
                .clone()
                .ok_or_else(|| invalid("sink_file", "is required when sink = \"file\""))?,
            raw.sink_file_fsync,
        ),
        "null" => DestinationConfig::null(Some(ranged(
            "null_latency_ms",
            raw.null_latency_ms.unwrap_or(0),
            0,
            600_000,
        )?)),
        other => {
            return Err(invalid(
                "sink",
                format!(
                    "unknown sink {other:?}; expected stdout, file or null (other destinations: [destinations] in the config file)"
                ),
            ));
        }
    })
}

/// `host-pid-random`: unique per process, readable in `outbox.in_flight`.
fn default_worker_id() -> WorkerId {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".to_owned());
    let suffix: u16 = rand::random();
    WorkerId::new(format!("{host}-{}-{suffix:04x}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(raw: RawConfig) -> Result<Settings, ConfigError> {
        Settings::from_raw(raw)
    }

    #[test]
    fn defaults_work_against_a_local_postgres() {
        let s = settings(RawConfig::default()).unwrap();
        assert_eq!(s.dispatch.destinations[0].destination.kind(), "stdout");
        assert_eq!(s.dispatch.routes, Routes(vec![(TopicPattern::Any, 0)]));
        assert_eq!((s.batch_size, s.lease_secs), (500, 30));
        assert_eq!(s.telemetry_addr, Some("127.0.0.1:9187".parse().unwrap()));
        assert!(
            s.worker_id
                .as_str()
                .contains(&std::process::id().to_string())
        );
    }

    #[test]
    fn each_bad_value_names_its_setting() {
        let cases: Vec<(RawConfig, &str)> = vec![
            (
                RawConfig {
                    batch_size: Some(0),
                    ..Default::default()
                },
                "batch_size",
            ),
            (
                RawConfig {
                    lease_secs: Some(1),
                    ..Default::default()
                },
                "lease_secs",
            ),
            (
                RawConfig {
                    sink: Some("kafka".into()),
                    ..Default::default()
                },
                "sink",
            ),
            (
                RawConfig {
                    sink: Some("file".into()),
                    ..Default::default()
                },
                "sink_file",
            ),
            (
                RawConfig {
                    retry_base_ms: Some(5000),
                    retry_cap_ms: Some(10),
                    ..Default::default()
                },
                "retry_cap_ms",
            ),
            (
                RawConfig {
                    retry_multiplier: Some(0.5),
                    ..Default::default()
                },
                "retry_multiplier",
            ),
            (
                RawConfig {
                    telemetry_addr: Some("nowhere".into()),
                    ..Default::default()
                },
                "telemetry_addr",
            ),
            (
                RawConfig {
                    worker_id: Some(" ".into()),
                    ..Default::default()
                },
                "worker_id",
            ),
            (
                RawConfig {
                    log_format: Some("xml".into()),
                    ..Default::default()
                },
                "log_format",
            ),
            (
                RawConfig {
                    topics: Some(vec![]),
                    ..Default::default()
                },
                "topics",
            ),
            (
                RawConfig {
                    pool_size: Some(1),
                    ..Default::default()
                },
                "pool_size",
            ),
        ];
        for (raw, setting) in cases {
            let err = settings(raw).unwrap_err();
            assert_eq!(err.setting, setting, "{err}");
            assert!(err.to_string().contains(setting), "{err}");
        }
    }

    #[test]
    fn flags_win_over_the_file_and_the_file_refuses_unknown_keys() {
        let dir = std::env::temp_dir().join(format!("outbox-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("relay.toml");
        std::fs::write(
            &path,
            "database_url = \"postgres://x@db/app\"\nbatch_size = 100\nlease_secs = 60\n",
        )
        .unwrap();
        let file = RawConfig::from_file(&path).unwrap();
        assert_eq!(file.database_url.as_deref(), Some("postgres://x@db/app"));
        let merged = RawConfig {
            batch_size: Some(7),
            ..Default::default()
        }
        .or(file);
        let s = settings(merged).unwrap();
        assert_eq!((s.batch_size, s.lease_secs), (7, 60));

        std::fs::write(&path, "batch_sise = 100\n").unwrap();
        let err = RawConfig::from_file(&path).unwrap_err();
        assert!(err.to_string().contains("batch_sise"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

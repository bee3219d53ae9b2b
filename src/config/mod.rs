//! The top of the settings: one process's configuration, composed from the settings each
//! layer owns (a destination's in its module, dispatch's routes and budgets, the relay's
//! claims, leases and timings, observe's intervals, retry's backoff, the log format, the
//! sources of a many-source fleet).
//! Values come from flags, then `OUTBOX_*` environment variables, then an optional TOML
//! file (`--config`), then defaults; they are read into [`RawConfig`] (every field
//! optional, unknown TOML keys refused) and validated once into [`Settings`], with errors
//! that name the setting and its allowed range. A destination's own table
//! (`[destinations.NAME]`) is parsed and validated by that destination's module, not here.
//!
//! `raw.rs` holds [`RawConfig`], the settings as given; `suggest.rs` names the key meant
//! when an unknown one is close to it; this file validates them.

mod raw;
mod suggest;

use std::net::SocketAddr;
use std::time::Duration;

use crate::destination::DestinationConfig;
use crate::dispatch::{
    CircuitSettings, DEFAULT_MAX_IN_FLIGHT, DEFAULT_TIMEOUT_MS, DestinationSettings,
    DispatchSettings, Routes, TopicPattern,
};
pub use crate::logging::LogFormat;
use crate::message::WorkerId;
use crate::observe::ObserveSettings;
use crate::relay::RelaySettings;
pub use crate::retry::RetrySettings;
use crate::sources::{MAX_SLOTS, SourcesSettings};
pub use crate::store::Statements;
use crate::traces::TraceSettings;

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

pub use crate::error::ConfigError;

fn invalid(setting: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError::new(setting, problem)
}

pub use raw::RawConfig;

/// Validated settings of one relayer process.
#[derive(Clone, Debug)]
pub struct Settings {
    pub database_url: String,
    /// No database URL was given (flag, environment or config file): `database_url` is
    /// [`DEFAULT_DATABASE_URL`], the server's `postgres` database, which nothing should be
    /// written to without being asked for by name.
    pub database_url_is_default: bool,
    /// Where the notification listener connects instead of `database_url`.
    pub listen_url: Option<String>,
    /// How the leasing calls send their statements.
    pub statements: Statements,
    /// Destinations, routes and circuit thresholds.
    pub dispatch: DispatchSettings,
    /// The worker id, claims, leases, retries, repair and shutdown.
    pub relay: RelaySettings,
    pub observe: ObserveSettings,
    pub pool_size: usize,
    pub telemetry_addr: Option<SocketAddr>,
    /// Where `run` serves the operator console too; None: it does not.
    pub console_addr: Option<SocketAddr>,
    pub log_format: LogFormat,
    /// Many sources: what to serve instead of `database_url` (empty: that one database).
    pub sources: SourcesSettings,
    /// A `stdout` or `null` destination may take every topic (`--all-topics`).
    pub all_topics: bool,
    /// Span export: off unless the `OTEL_*` variables or `[tracing]` turn it on.
    pub traces: TraceSettings,
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
        let sources = sources_settings(&raw)?;
        let schema = sources.schema.clone();
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
        if let Some(pattern) = raw.topics.iter().flatten().find(|t| t.contains('*')) {
            return Err(invalid(
                "topics",
                format!(
                    "{pattern:?} is a pattern, and topics are exact names (`orders,emails`); \
                     to relay a topic family, route it: [[routes]] topic = \"orders.*\""
                ),
            ));
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
        let console_addr = raw
            .console_addr
            .as_deref()
            .map(|addr| {
                addr.parse().map_err(|e| {
                    invalid(
                        "console_addr",
                        format!("{addr:?} is not a host:port address ({e})"),
                    )
                })
            })
            .transpose()?;
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
        let statements = match raw.statements.as_deref() {
            None => Statements::Auto,
            Some(s) => s.parse().map_err(|e: String| invalid("statements", e))?,
        };
        if let Some(url) = &raw.listen_url
            && url.trim().is_empty()
        {
            return Err(invalid("listen_url", "must not be empty"));
        }
        let traces =
            TraceSettings::from_raw(raw.tracing.as_ref(), |name| std::env::var(name).ok())?;
        Ok(Settings {
            all_topics: raw.all_topics.unwrap_or(false),
            sources,
            traces,
            database_url_is_default: raw.database_url.is_none(),
            database_url: crate::connection::with_schema(
                &raw.database_url
                    .unwrap_or_else(|| DEFAULT_DATABASE_URL.to_owned()),
                &schema,
            ),
            listen_url: raw.listen_url,
            statements,
            dispatch,
            relay: RelaySettings {
                worker_id,
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
                shutdown_timeout: Duration::from_millis(ranged(
                    "shutdown_timeout_ms",
                    raw.shutdown_timeout_ms.unwrap_or(10_000),
                    0,
                    3_600_000,
                )?),
            },
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
                uncovered_after: Duration::from_secs(ranged(
                    "observe_uncovered_secs",
                    raw.observe_uncovered_secs.unwrap_or(60),
                    0,
                    86_400,
                )?),
            },
            pool_size: ranged("pool_size", raw.pool_size.unwrap_or(8), 2, 256)?,
            telemetry_addr,
            console_addr,
            log_format,
        })
    }
}

/// `outbox_schema`, checked; `outbox` when unset.
fn outbox_schema(raw: &RawConfig) -> Result<String, ConfigError> {
    let schema = raw
        .outbox_schema
        .as_deref()
        .unwrap_or(crate::connection::DEFAULT_SCHEMA);
    crate::connection::check_schema_name(schema).map_err(|e| invalid("outbox_schema", e))?;
    Ok(schema.to_owned())
}

/// The sources to serve: `[sources.NAME]` tables, a server whose outbox databases are
/// served, a catalogue query; the discovery interval, the slots, the slot lease, the pools
/// and the connection budget.
fn sources_settings(raw: &RawConfig) -> Result<SourcesSettings, ConfigError> {
    let schema = outbox_schema(raw)?;
    let mut listed = std::collections::BTreeMap::new();
    for (name, table) in raw.sources.iter().flatten() {
        if name.trim().is_empty() {
            return Err(invalid("sources", "a source needs a non-empty name"));
        }
        if table.database_url.trim().is_empty() {
            return Err(invalid(
                format!("sources.{name}.database_url"),
                "must not be empty",
            ));
        }
        let source_schema = match &table.schema {
            Some(s) => {
                crate::connection::check_schema_name(s)
                    .map_err(|e| invalid(format!("sources.{name}.schema"), e))?;
                if let Some(named) = crate::connection::schema_of(&table.database_url)
                    && &named != s
                {
                    return Err(invalid(
                        format!("sources.{name}.schema"),
                        format!(
                            "is {s:?} but its database_url names outbox_schema={named}: give \
                             the schema once"
                        ),
                    ));
                }
                s.as_str()
            }
            None => &schema,
        };
        let url = crate::connection::with_schema(&table.database_url, source_schema);
        crate::connection::Target::parse(&url).map_err(|e| {
            invalid(
                format!("sources.{name}.database_url"),
                format!(
                    "{e} (in {})",
                    crate::secret::redact_url(&table.database_url)
                ),
            )
        })?;
        listed.insert(name.clone(), url);
    }
    let non_empty = |setting: &str, value: &Option<String>| match value {
        Some(v) if v.trim().is_empty() => Err(invalid(setting, "must not be empty")),
        other => Ok(other.clone()),
    };
    let server_url = non_empty("sources_server_url", &raw.sources_server_url)?
        .map(|url| crate::connection::with_schema(&url, &schema));
    let catalogue = match (
        non_empty("sources_catalogue_url", &raw.sources_catalogue_url)?,
        non_empty("sources_catalogue_query", &raw.sources_catalogue_query)?,
    ) {
        (Some(url), Some(query)) => Some((url, query)),
        (None, None) => None,
        (Some(_), None) => {
            return Err(invalid(
                "sources_catalogue_query",
                "sources_catalogue_url needs a query returning (name, connection string) rows",
            ));
        }
        (None, Some(_)) => {
            return Err(invalid(
                "sources_catalogue_url",
                "sources_catalogue_query needs the catalogue database it runs on",
            ));
        }
    };
    let pool_size = ranged(
        "source_pool_size",
        raw.source_pool_size.unwrap_or(3),
        2,
        256,
    )?;
    let settings = SourcesSettings {
        schema,
        listed,
        server_url,
        catalogue,
        discover_interval: Duration::from_secs(ranged(
            "sources_discover_interval_secs",
            raw.sources_discover_interval_secs.unwrap_or(10),
            1,
            3600,
        )?),
        processes_per_source: raw
            .processes_per_source
            .map(|n| ranged("processes_per_source", n, 1, i64::from(MAX_SLOTS)))
            .transpose()?,
        lease: Duration::from_secs(ranged(
            "source_lease_secs",
            raw.source_lease_secs.unwrap_or(15),
            3,
            3600,
        )?),
        pool_size,
        max_connections_per_server: raw
            .max_connections_per_server
            .map(|n| ranged("max_connections_per_server", n, 3, 100_000))
            .transpose()?,
        calls_per_server: match ranged(
            "source_calls_per_server",
            raw.source_calls_per_server.unwrap_or(4),
            0,
            1024,
        )? {
            0 => None,
            n => Some(n),
        },
        backlogged_calls_per_server: raw
            .source_backlogged_calls_per_server
            .map(|n| ranged("source_backlogged_calls_per_server", n, 1, 1024))
            .transpose()?,
        label_limit: ranged(
            "source_label_limit",
            raw.source_label_limit.unwrap_or(50),
            1,
            10_000,
        )?,
    };
    if let (Some(backlogged), Some(calls)) = (
        settings.backlogged_calls_per_server,
        settings.calls_per_server,
    ) && backlogged > calls
    {
        return Err(invalid(
            "source_backlogged_calls_per_server",
            format!("{backlogged} is more than source_calls_per_server ({calls})"),
        ));
    }
    if let Some(budget) = settings.max_connections_per_server
        && budget < settings.connections_per_source()
    {
        return Err(invalid(
            "max_connections_per_server",
            format!(
                "{budget} is less than one source needs: source_pool_size {pool_size} + 1 \
                 (its LISTEN session)"
            ),
        ));
    }
    Ok(settings)
}

impl Settings {
    /// `run`'s check that a destination that keeps nothing for anyone else to read (`null`
    /// drops every message, `stdout` prints it where no one may look) takes every topic only
    /// when asked to: a catch-all of one of them (`--sink null` or `stdout` without
    /// `--topics`, or a `*` route to one) needs `all_topics`, since it would consume the
    /// messages other relayers are there to deliver. The other verbs read the same settings
    /// without claiming anything, so the check is `run`'s alone.
    pub fn check_catch_all(&self) -> Result<(), ConfigError> {
        if self.all_topics || self.relay.topics.is_some() {
            return Ok(());
        }
        let Some(index) = self
            .dispatch
            .routes
            .0
            .iter()
            .find(|(p, _)| *p == TopicPattern::Any)
            .map(|(_, d)| *d)
        else {
            return Ok(());
        };
        let destination = &self.dispatch.destinations[index];
        let kind = destination.destination.kind();
        if kind != "stdout" && kind != "null" {
            return Ok(());
        }
        // `--sink` names its one destination after its kind; a table has a name of its own.
        let what = if self.dispatch.destinations.len() == 1 && destination.name == kind {
            format!("the {kind} sink")
        } else {
            format!(
                "the \"*\" route to {kind} destination {:?}",
                destination.name
            )
        };
        Err(invalid(
            "all_topics",
            format!(
                "{what} would take every topic, {}, including the messages other relayers \
                 are there to deliver; add --all-topics (all_topics = true, \
                 OUTBOX_ALL_TOPICS=true) if that is meant, or name the topics to take \
                 with --topics or [[routes]]",
                if kind == "null" {
                    "dropping each message as delivered"
                } else {
                    "printing each message as delivered"
                }
            ),
        ))
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
        assert_eq!((s.relay.batch_size, s.relay.lease_secs), (500, 30));
        assert_eq!(s.telemetry_addr, Some("127.0.0.1:9187".parse().unwrap()));
        assert!(
            s.relay
                .worker_id
                .as_str()
                .contains(&std::process::id().to_string())
        );
    }

    #[test]
    fn a_catch_all_stdout_or_null_sink_needs_all_topics() {
        for sink in [None, Some("null"), Some("stdout")] {
            let raw = RawConfig {
                sink: sink.map(str::to_owned),
                ..RawConfig::default()
            };
            let refused = settings(raw.clone())
                .unwrap()
                .check_catch_all()
                .unwrap_err();
            assert_eq!(refused.setting, "all_topics", "{sink:?}");
            assert!(refused.problem.contains("add --all-topics"), "{refused}");
            let asked = RawConfig {
                all_topics: Some(true),
                ..raw.clone()
            };
            assert!(settings(asked).unwrap().check_catch_all().is_ok());
            let named = RawConfig {
                topics: Some(vec!["orders".into()]),
                ..raw
            };
            assert!(settings(named).unwrap().check_catch_all().is_ok());
        }
        let file = RawConfig {
            sink: Some("file".into()),
            sink_file: Some("/tmp/x.jsonl".into()),
            ..RawConfig::default()
        };
        assert!(settings(file).unwrap().check_catch_all().is_ok());
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
    fn the_turns_per_server_default_to_four_zero_lifts_the_cap_and_a_bad_count_is_named() {
        let s = settings(RawConfig::default()).unwrap();
        assert_eq!(s.sources.calls_per_server, Some(4));
        let s = settings(RawConfig {
            source_calls_per_server: Some(0),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(s.sources.calls_per_server, None);
        for bad in [-1, 1025] {
            let err = settings(RawConfig {
                source_calls_per_server: Some(bad),
                ..Default::default()
            })
            .unwrap_err();
            assert_eq!(err.setting, "source_calls_per_server", "{err}");
            assert!(err.to_string().contains(&bad.to_string()), "{err}");
        }
    }

    #[test]
    fn backlogged_turns_default_to_half_and_more_than_the_turns_is_named() {
        let s = settings(RawConfig::default()).unwrap();
        assert_eq!(s.sources.backlogged_calls_per_server, None);
        let s = settings(RawConfig {
            source_backlogged_calls_per_server: Some(3),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(s.sources.backlogged_calls_per_server, Some(3));
        for (bad, says) in [(0, "0"), (5, "more than source_calls_per_server (4)")] {
            let err = settings(RawConfig {
                source_backlogged_calls_per_server: Some(bad),
                ..Default::default()
            })
            .unwrap_err();
            assert_eq!(err.setting, "source_backlogged_calls_per_server", "{err}");
            assert!(err.to_string().contains(says), "{err}");
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
        assert_eq!((s.relay.batch_size, s.relay.lease_secs), (7, 60));

        std::fs::write(&path, "batch_sise = 100\n").unwrap();
        let err = RawConfig::from_file(&path).unwrap_err();
        assert!(err.to_string().contains("batch_sise"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! What dispatch is configured with: a `[destinations.NAME]` table's dispatch part (its
//! deadline and budget, beside the destination's own settings) and the validated
//! destinations, routes and circuit thresholds that [`Dispatcher::new`](super::Dispatcher::new)
//! builds from.

use std::time::Duration;

use super::{CircuitSettings, Routes};
use crate::destination::DestinationConfig;
use crate::error::ConfigError;

/// One `[destinations.NAME]` table: the destination (chosen by `type`) and the dispatch
/// settings every destination has.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct DestinationTable {
    #[serde(flatten)]
    pub destination: DestinationConfig,
    /// Dispatch deadline of one batch, 1..=600000 ms [default: 30000].
    pub timeout_ms: Option<i64>,
    /// Batches of this destination published and not yet completed at once, 1..=64
    /// [default: 3].
    pub max_in_flight: Option<i64>,
}

pub const DEFAULT_TIMEOUT_MS: i64 = 30_000;
pub const DEFAULT_MAX_IN_FLIGHT: i64 = 3;

/// One destination, validated as far as dispatch is concerned (the destination's own
/// settings are checked when it is built).
#[derive(Clone, Debug)]
pub struct DestinationSettings {
    pub name: String,
    pub destination: DestinationConfig,
    pub deadline: Duration,
    pub max_in_flight: usize,
}

impl DestinationSettings {
    pub fn from_table(name: &str, table: &DestinationTable) -> Result<Self, ConfigError> {
        let ranged = |field: &str, value: Option<i64>, default: i64, min: i64, max: i64| {
            let value = value.unwrap_or(default);
            if (min..=max).contains(&value) {
                Ok(value.unsigned_abs())
            } else {
                Err(ConfigError {
                    setting: format!("destinations.{name}.{field}"),
                    problem: format!("{value} is out of range {min}..={max}"),
                })
            }
        };
        Ok(Self {
            name: name.to_owned(),
            destination: table.destination.clone(),
            deadline: Duration::from_millis(ranged(
                "timeout_ms",
                table.timeout_ms,
                DEFAULT_TIMEOUT_MS,
                1,
                600_000,
            )?),
            max_in_flight: usize::try_from(ranged(
                "max_in_flight",
                table.max_in_flight,
                DEFAULT_MAX_IN_FLIGHT,
                1,
                64,
            )?)
            .unwrap_or(1),
        })
    }
}

/// Destinations, routes and circuit thresholds, validated.
#[derive(Clone, Debug)]
pub struct DispatchSettings {
    pub destinations: Vec<DestinationSettings>,
    pub routes: Routes,
    pub circuit: CircuitSettings,
}

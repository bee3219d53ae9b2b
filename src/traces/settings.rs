//! What turns span export on and where spans go: the standard `OTEL_*` variables over the
//! config file's `[tracing]` table, validated once into [`TraceSettings`] with errors that
//! name the setting.

use std::collections::BTreeMap;

use crate::error::ConfigError;

/// `[tracing]` in the config file, as given (every key optional, unknown keys refused).
#[derive(Clone, Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingTable {
    /// `otlp` turns export on, `none` keeps it off (`OTEL_TRACES_EXPORTER`).
    pub export: Option<String>,
    /// The collector's base URL (`OTEL_EXPORTER_OTLP_ENDPOINT`).
    pub endpoint: Option<String>,
    /// `http/protobuf` or `grpc` (`OTEL_EXPORTER_OTLP_PROTOCOL`).
    pub protocol: Option<String>,
    /// `service.name` of the spans (`OTEL_SERVICE_NAME`).
    pub service_name: Option<String>,
    /// `OTEL_TRACES_SAMPLER`'s names.
    pub sampler: Option<String>,
    /// The ratio of the `traceidratio` samplers (`OTEL_TRACES_SAMPLER_ARG`).
    pub sampler_arg: Option<f64>,
    /// More resource attributes (`OTEL_RESOURCE_ATTRIBUTES`, which win per key).
    pub resource_attributes: Option<BTreeMap<String, String>>,
    /// The first attempt's `send` span is a child of the creation context (besides the link).
    pub parent_first_attempt: Option<bool>,
}

/// The wire protocol of the OTLP exporter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    HttpProtobuf,
    Grpc,
}

/// Which traces are recorded (`OTEL_TRACES_SAMPLER`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SamplerSetting {
    AlwaysOn,
    AlwaysOff,
    Ratio(f64),
    ParentBasedAlwaysOn,
    ParentBasedAlwaysOff,
    ParentBasedRatio(f64),
}

/// Where and how spans are exported.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportSettings {
    /// The collector's base URL; http/protobuf posts to `{endpoint}/v1/traces`.
    pub endpoint: String,
    pub protocol: Protocol,
    pub service_name: String,
    pub sampler: SamplerSetting,
    /// Resource attributes besides `service.name`, by name.
    pub resource: BTreeMap<String, String>,
}

/// The validated trace settings of a process.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TraceSettings {
    /// `None`: export is off (the default), and no span is made.
    pub export: Option<ExportSettings>,
    pub parent_first_attempt: bool,
}

fn invalid(setting: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError::new(setting, problem)
}

impl TraceSettings {
    /// Reads `table` (the config file's `[tracing]`) under the `OTEL_*` variables `env`
    /// returns (a variable set wins over the file's key). Export is on when
    /// `OTEL_TRACES_EXPORTER` (or `export`) is `otlp`, and off when it is `none`, is
    /// unset, or `OTEL_SDK_DISABLED` is `true`.
    pub fn from_raw(
        table: Option<&TracingTable>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<TraceSettings, ConfigError> {
        let empty = TracingTable::default();
        let table = table.unwrap_or(&empty);
        let env = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        let parent_first_attempt = match env("OUTBOX_TRACES_PARENT_FIRST_ATTEMPT") {
            Some(v) => parse_bool("OUTBOX_TRACES_PARENT_FIRST_ATTEMPT", &v)?,
            None => table.parent_first_attempt.unwrap_or(false),
        };
        let (exporter, exporter_setting) = match env("OTEL_TRACES_EXPORTER") {
            Some(v) => (Some(v), "OTEL_TRACES_EXPORTER"),
            None => (table.export.clone(), "tracing.export"),
        };
        let on = match exporter.as_deref().map(str::trim) {
            None | Some("none") => false,
            Some("otlp") => true,
            Some(other) => {
                return Err(invalid(
                    exporter_setting,
                    format!("{other:?} is not an exporter this relayer has: use otlp or none"),
                ));
            }
        };
        let disabled = match env("OTEL_SDK_DISABLED") {
            Some(v) => parse_bool("OTEL_SDK_DISABLED", &v)?,
            None => false,
        };
        if !on || disabled {
            return Ok(TraceSettings {
                export: None,
                parent_first_attempt,
            });
        }

        let (protocol, protocol_setting) = match env("OTEL_EXPORTER_OTLP_PROTOCOL") {
            Some(v) => (v, "OTEL_EXPORTER_OTLP_PROTOCOL"),
            None => (
                table
                    .protocol
                    .clone()
                    .unwrap_or_else(|| "http/protobuf".into()),
                "tracing.protocol",
            ),
        };
        let protocol = match protocol.trim() {
            "http/protobuf" => Protocol::HttpProtobuf,
            "grpc" => Protocol::Grpc,
            other => {
                return Err(invalid(
                    protocol_setting,
                    format!(
                        "{other:?} is not a protocol this relayer exports with: use http/protobuf or grpc"
                    ),
                ));
            }
        };
        let (endpoint, endpoint_setting) = match env("OTEL_EXPORTER_OTLP_ENDPOINT") {
            Some(v) => (v, "OTEL_EXPORTER_OTLP_ENDPOINT"),
            None => match &table.endpoint {
                Some(e) => (e.clone(), "tracing.endpoint"),
                None => (
                    match protocol {
                        Protocol::HttpProtobuf => "http://localhost:4318".into(),
                        Protocol::Grpc => "http://localhost:4317".into(),
                    },
                    "tracing.endpoint",
                ),
            },
        };
        let endpoint = endpoint.trim().trim_end_matches('/').to_owned();
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://"))
            || endpoint.len() <= "https://".len()
        {
            return Err(invalid(
                endpoint_setting,
                format!("{endpoint:?} is not an http:// or https:// URL"),
            ));
        }
        let service_name = env("OTEL_SERVICE_NAME")
            .or_else(|| table.service_name.clone())
            .unwrap_or_else(|| "outbox-relay".into());

        let (sampler, sampler_setting) = match env("OTEL_TRACES_SAMPLER") {
            Some(v) => (v, "OTEL_TRACES_SAMPLER"),
            None => (
                table
                    .sampler
                    .clone()
                    .unwrap_or_else(|| "parentbased_always_on".into()),
                "tracing.sampler",
            ),
        };
        let ratio = || -> Result<f64, ConfigError> {
            let (value, setting) = match env("OTEL_TRACES_SAMPLER_ARG") {
                Some(v) => (
                    v.trim().parse::<f64>().map_err(|_| {
                        invalid(
                            "OTEL_TRACES_SAMPLER_ARG",
                            format!("{v:?} is not a number from 0.0 to 1.0"),
                        )
                    })?,
                    "OTEL_TRACES_SAMPLER_ARG",
                ),
                None => (table.sampler_arg.unwrap_or(1.0), "tracing.sampler_arg"),
            };
            if (0.0..=1.0).contains(&value) {
                Ok(value)
            } else {
                Err(invalid(
                    setting,
                    format!("{value} is out of range 0.0..=1.0"),
                ))
            }
        };
        let sampler = match sampler.trim() {
            "always_on" => SamplerSetting::AlwaysOn,
            "always_off" => SamplerSetting::AlwaysOff,
            "traceidratio" => SamplerSetting::Ratio(ratio()?),
            "parentbased_always_on" => SamplerSetting::ParentBasedAlwaysOn,
            "parentbased_always_off" => SamplerSetting::ParentBasedAlwaysOff,
            "parentbased_traceidratio" => SamplerSetting::ParentBasedRatio(ratio()?),
            other => {
                return Err(invalid(
                    sampler_setting,
                    format!(
                        "{other:?} is not a sampler this relayer has: use always_on, always_off, \
                         traceidratio, parentbased_always_on, parentbased_always_off or \
                         parentbased_traceidratio"
                    ),
                ));
            }
        };

        let mut resource = table.resource_attributes.clone().unwrap_or_default();
        if let Some(list) = env("OTEL_RESOURCE_ATTRIBUTES") {
            for pair in list.split(',').filter(|p| !p.trim().is_empty()) {
                let Some((name, value)) = pair.split_once('=') else {
                    return Err(invalid(
                        "OTEL_RESOURCE_ATTRIBUTES",
                        format!(
                            "{pair:?} is not NAME=VALUE (the list is comma-separated NAME=VALUE pairs)"
                        ),
                    ));
                };
                resource.insert(name.trim().to_owned(), value.trim().to_owned());
            }
        }
        // OTEL_SERVICE_NAME (or the file's service_name) wins over a `service.name` pair.
        resource.remove("service.name");

        Ok(TraceSettings {
            export: Some(ExportSettings {
                endpoint,
                protocol,
                service_name,
                sampler,
                resource,
            }),
            parent_first_attempt,
        })
    }
}

fn parse_bool(setting: &str, value: &str) -> Result<bool, ConfigError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        other => Err(invalid(setting, format!("{other:?} is not true or false"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(
        table: Option<&TracingTable>,
        vars: &[(&str, &str)],
    ) -> Result<TraceSettings, ConfigError> {
        let vars: BTreeMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        TraceSettings::from_raw(table, |name| vars.get(name).cloned())
    }

    #[test]
    fn export_is_off_unless_an_exporter_is_named() {
        assert_eq!(settings(None, &[]).unwrap().export, None);
        // An endpoint alone does not turn it on.
        let endpoint = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")];
        assert_eq!(settings(None, &endpoint).unwrap().export, None);
        let on = [
            ("OTEL_TRACES_EXPORTER", "otlp"),
            ("OTEL_SDK_DISABLED", "true"),
        ];
        assert_eq!(settings(None, &on).unwrap().export, None);
        let none = TracingTable {
            export: Some("otlp".into()),
            ..TracingTable::default()
        };
        let off = [("OTEL_TRACES_EXPORTER", "none")];
        assert_eq!(settings(Some(&none), &off).unwrap().export, None);
    }

    #[test]
    fn the_variables_win_over_the_file_and_defaults_fill_the_rest() {
        let table = TracingTable {
            export: Some("otlp".into()),
            endpoint: Some("http://file:4318/".into()),
            service_name: Some("from-file".into()),
            resource_attributes: Some(BTreeMap::from([
                ("deployment.environment.name".into(), "staging".into()),
                ("team".into(), "payments".into()),
            ])),
            ..TracingTable::default()
        };
        let from_file = settings(Some(&table), &[]).unwrap().export.unwrap();
        assert_eq!(from_file.endpoint, "http://file:4318");
        assert_eq!(from_file.protocol, Protocol::HttpProtobuf);
        assert_eq!(from_file.service_name, "from-file");
        assert_eq!(from_file.sampler, SamplerSetting::ParentBasedAlwaysOn);

        let vars = [
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://env:4317"),
            ("OTEL_SERVICE_NAME", "relay-eu"),
            ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
            ("OTEL_RESOURCE_ATTRIBUTES", "team=orders, region=eu-west-1"),
        ];
        let export = settings(Some(&table), &vars).unwrap().export.unwrap();
        assert_eq!(export.endpoint, "https://env:4317");
        assert_eq!(export.protocol, Protocol::Grpc);
        assert_eq!(export.service_name, "relay-eu");
        assert_eq!(export.sampler, SamplerSetting::ParentBasedRatio(0.25));
        assert_eq!(export.resource["team"], "orders");
        assert_eq!(export.resource["region"], "eu-west-1");
        assert_eq!(export.resource["deployment.environment.name"], "staging");

        let grpc = [
            ("OTEL_TRACES_EXPORTER", "otlp"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ];
        let export = settings(None, &grpc).unwrap().export.unwrap();
        assert_eq!(export.endpoint, "http://localhost:4317");
    }

    #[test]
    fn bad_values_name_their_setting() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (
                &[("OTEL_TRACES_EXPORTER", "jaeger")],
                "OTEL_TRACES_EXPORTER",
            ),
            (
                &[
                    ("OTEL_TRACES_EXPORTER", "otlp"),
                    ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
                ],
                "OTEL_EXPORTER_OTLP_PROTOCOL",
            ),
            (
                &[
                    ("OTEL_TRACES_EXPORTER", "otlp"),
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318"),
                ],
                "OTEL_EXPORTER_OTLP_ENDPOINT",
            ),
            (
                &[
                    ("OTEL_TRACES_EXPORTER", "otlp"),
                    ("OTEL_TRACES_SAMPLER", "sometimes"),
                ],
                "OTEL_TRACES_SAMPLER",
            ),
            (
                &[
                    ("OTEL_TRACES_EXPORTER", "otlp"),
                    ("OTEL_TRACES_SAMPLER", "traceidratio"),
                    ("OTEL_TRACES_SAMPLER_ARG", "1.5"),
                ],
                "OTEL_TRACES_SAMPLER_ARG",
            ),
            (
                &[
                    ("OTEL_TRACES_EXPORTER", "otlp"),
                    ("OTEL_RESOURCE_ATTRIBUTES", "team"),
                ],
                "OTEL_RESOURCE_ATTRIBUTES",
            ),
            (
                &[("OUTBOX_TRACES_PARENT_FIRST_ATTEMPT", "maybe")],
                "OUTBOX_TRACES_PARENT_FIRST_ATTEMPT",
            ),
        ];
        for (vars, setting) in cases {
            let e = settings(None, vars).unwrap_err();
            assert_eq!(e.setting, *setting, "{vars:?}: {e}");
        }
        let table = TracingTable {
            export: Some("zipkin".into()),
            ..TracingTable::default()
        };
        assert_eq!(
            settings(Some(&table), &[]).unwrap_err().setting,
            "tracing.export"
        );
    }
}

//! The CloudEvents 1.0 envelope, opt-in per destination (`envelope = "cloudevents"`), so
//! that consumers built on a CloudEvents SDK read the relayer's messages as events. This
//! module owns the attribute mapping (`id` = outbox_id, `source` and `type` from templates,
//! `time` = the enqueue time, `datacontenttype` = the message's content type, the
//! `partitionkey` extension = the message key, the distributed-tracing extension's
//! `traceparent` and `tracestate` = the message's creation trace context) and both content
//! modes: binary (the
//! attributes beside the payload, each protocol binding naming them its own way, which the
//! destinations pass as a prefix) and structured (the JSON event format: one JSON object
//! holding the attributes and the payload as `data`). The destinations decide where the
//! result goes; nothing here knows a protocol.

use base64::Engine;
use chrono::SecondsFormat;

use super::Setting;
use crate::error::ConfigError;
use crate::message::ClaimedMessage;

/// The media type of the JSON event format (structured mode).
pub(super) const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json; charset=UTF-8";

/// How the event travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// The payload as it is; the attributes as the protocol's headers.
    Binary,
    /// One JSON event (attributes and `data`) as the payload.
    Structured,
}

/// A destination's envelope settings, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Envelope {
    pub(super) mode: Mode,
    source: String,
    kind: String,
}

/// The envelope settings every destination with a CloudEvents binding takes, as written.
pub(super) struct Settings<'a> {
    pub envelope: Option<&'a str>,
    pub mode: Option<&'a str>,
    pub source: Option<&'a str>,
    pub kind: Option<&'a str>,
}

impl Envelope {
    /// The envelope the settings ask for (`None`: the payload goes as it is), or the error
    /// naming the setting that is wrong.
    pub(super) fn from_settings(
        at: Setting<'_>,
        s: &Settings<'_>,
    ) -> Result<Option<Envelope>, ConfigError> {
        match s.envelope.unwrap_or("none") {
            "none" => {
                let stray = [
                    ("cloudevents_mode", s.mode),
                    ("cloudevents_source", s.source),
                    ("cloudevents_type", s.kind),
                ];
                if let Some((field, _)) = stray.iter().find(|(_, v)| v.is_some()) {
                    return Err(at.invalid(field, "is used only with envelope = \"cloudevents\""));
                }
                Ok(None)
            }
            "cloudevents" => {
                let mode = match s.mode.unwrap_or("binary") {
                    "binary" => Mode::Binary,
                    "structured" => Mode::Structured,
                    other => {
                        return Err(at.invalid(
                            "cloudevents_mode",
                            format!(
                                "{other:?} is not a content mode: \"binary\" or \"structured\""
                            ),
                        ));
                    }
                };
                let source = s.source.unwrap_or("/outbox-relay");
                if source.trim().is_empty() {
                    return Err(at.invalid("cloudevents_source", "must not be empty"));
                }
                let kind = s.kind.unwrap_or("{topic}");
                if kind.trim().is_empty() {
                    return Err(at.invalid("cloudevents_type", "must not be empty"));
                }
                Ok(Some(Envelope {
                    mode,
                    source: source.to_owned(),
                    kind: kind.to_owned(),
                }))
            }
            other => Err(at.invalid(
                "envelope",
                format!(
                    "{other:?} is not an envelope this relayer knows: \"none\" or \"cloudevents\""
                ),
            )),
        }
    }

    /// The context attributes of `m`, in the order of the spec: `specversion`, `id`,
    /// `source`, `type`, `time`, `datacontenttype`, then `partitionkey` when it has a key,
    /// then `traceparent` (and `tracestate`) when it has a creation trace context
    /// ([`ClaimedMessage::trace_context`]). The distributed-tracing extension carries the
    /// trace where the event started, whatever hops follow; the protocol's own headers
    /// (`traceparent` over HTTP, NATS, Kafka, …) carry the current hop.
    pub(super) fn attributes(&self, m: &ClaimedMessage) -> Vec<(&'static str, String)> {
        let mut attributes = vec![
            ("specversion", "1.0".to_owned()),
            ("id", m.id.to_string()),
            ("source", self.source.replace("{topic}", &m.topic)),
            ("type", self.kind.replace("{topic}", &m.topic)),
            (
                "time",
                m.created_at.to_rfc3339_opts(SecondsFormat::Micros, true),
            ),
            ("datacontenttype", m.content_type.clone()),
        ];
        if let Some(key) = &m.key {
            attributes.push(("partitionkey", key.clone()));
        }
        if let Some(trace) = m.creation_context() {
            attributes.push(("traceparent", trace.traceparent));
            if let Some(state) = trace.tracestate {
                attributes.push(("tracestate", state));
            }
        }
        attributes
    }

    /// Binary mode's headers: every attribute under `prefix` + its name, but
    /// `datacontenttype` when the protocol's own content type carries it.
    pub(super) fn headers(
        &self,
        m: &ClaimedMessage,
        prefix: &str,
        datacontenttype_in_headers: bool,
    ) -> Vec<(String, String)> {
        self.attributes(m)
            .into_iter()
            .filter(|(name, _)| datacontenttype_in_headers || *name != "datacontenttype")
            .map(|(name, value)| (format!("{prefix}{name}"), value))
            .collect()
    }

    /// Structured mode's payload: the JSON event format. A JSON payload is `data` as JSON,
    /// other UTF-8 text `data` as a string, anything else `data_base64`; a payload whose
    /// content type says JSON but that does not parse is refused (the reason says why).
    pub(super) fn structured(&self, m: &ClaimedMessage) -> Result<Vec<u8>, String> {
        let mut event = serde_json::Map::new();
        for (name, value) in self.attributes(m) {
            event.insert(name.to_owned(), serde_json::Value::String(value));
        }
        if is_json(&m.content_type) {
            let data: serde_json::Value = serde_json::from_slice(&m.payload).map_err(|e| {
                format!(
                    "the payload is not JSON though its content type is {}: {e}",
                    m.content_type
                )
            })?;
            event.insert("data".into(), data);
        } else if let Ok(text) = std::str::from_utf8(&m.payload) {
            event.insert("data".into(), serde_json::Value::String(text.to_owned()));
        } else {
            event.insert(
                "data_base64".into(),
                serde_json::Value::String(
                    base64::engine::general_purpose::STANDARD.encode(&m.payload),
                ),
            );
        }
        Ok(serde_json::to_vec(&event).expect("a JSON map serializes"))
    }
}

/// `application/json`, or a `+json` media type, parameters aside.
fn is_json(content_type: &str) -> bool {
    let media = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    media == "application/json" || media.ends_with("+json")
}

/// A header value as the HTTP and NATS bindings write it: space, `"`, `%` and everything
/// outside printable ASCII percent-encoded (its UTF-8 bytes, upper-case hex).
pub(super) fn percent_encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if (0x21..=0x7e).contains(&byte) && byte != b'"' && byte != b'%' {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope(mode: &str, source: Option<&str>, kind: Option<&str>) -> Envelope {
        Envelope::from_settings(
            Setting("d"),
            &Settings {
                envelope: Some("cloudevents"),
                mode: Some(mode),
                source,
                kind,
            },
        )
        .unwrap()
        .unwrap()
    }

    fn message(key: Option<&str>, content_type: &str, payload: &[u8]) -> ClaimedMessage {
        let mut m = ClaimedMessage::example(serde_json::Value::Null);
        m.topic = "orders.created".into();
        m.key = key.map(str::to_owned);
        m.content_type = content_type.into();
        m.payload = payload.to_vec();
        m.created_at = "2026-03-01T12:34:56.789012Z".parse().unwrap();
        m
    }

    #[test]
    fn each_attribute_comes_from_its_part_of_the_message() {
        let e = envelope("binary", Some("/shop/{topic}"), None);
        let m = message(Some("order-7"), "application/json", b"{}");
        assert_eq!(
            e.attributes(&m),
            vec![
                ("specversion", "1.0".to_owned()),
                ("id", m.id.to_string()),
                ("source", "/shop/orders.created".to_owned()),
                ("type", "orders.created".to_owned()),
                ("time", "2026-03-01T12:34:56.789012Z".to_owned()),
                ("datacontenttype", "application/json".to_owned()),
                ("partitionkey", "order-7".to_owned()),
            ]
        );
        let unkeyed = message(None, "text/plain", b"x");
        let e = envelope("binary", None, Some("com.example.{topic}"));
        let attributes = e.attributes(&unkeyed);
        assert!(attributes.iter().all(|(n, _)| *n != "partitionkey"));
        assert!(attributes.contains(&("type", "com.example.orders.created".to_owned())));
        assert!(attributes.contains(&("source", "/outbox-relay".to_owned())));
    }

    #[test]
    fn the_creation_trace_context_is_the_distributed_tracing_extension() {
        const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let e = envelope("binary", None, None);
        let mut m = message(None, "application/json", b"{}");
        m.headers = serde_json::json!({"traceparent": TRACEPARENT, "tracestate": "congo=t61"});
        let attributes = e.attributes(&m);
        assert_eq!(
            attributes[attributes.len() - 2..],
            [
                ("traceparent", TRACEPARENT.to_owned()),
                ("tracestate", "congo=t61".to_owned())
            ]
        );
        assert!(
            e.headers(&m, "ce-", false)
                .contains(&("ce-traceparent".into(), TRACEPARENT.into()))
        );
        let structured = envelope("structured", None, None);
        let event: serde_json::Value =
            serde_json::from_slice(&structured.structured(&m).unwrap()).unwrap();
        assert_eq!(event["traceparent"], TRACEPARENT);
        assert_eq!(event["tracestate"], "congo=t61");
        m.headers = serde_json::json!({"traceparent": "00-not-one-01"});
        assert!(
            e.attributes(&m)
                .iter()
                .all(|(n, _)| *n != "traceparent" && *n != "tracestate"),
            "no context, no extension"
        );
    }

    #[test]
    fn binary_headers_carry_the_prefix_and_leave_the_content_type_to_the_protocol() {
        let e = envelope("binary", None, None);
        let m = message(Some("k"), "application/json", b"{}");
        let headers = e.headers(&m, "ce_", false);
        let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "ce_specversion",
                "ce_id",
                "ce_source",
                "ce_type",
                "ce_time",
                "ce_partitionkey"
            ]
        );
        let with = e.headers(&m, "ce-", true);
        assert!(with.contains(&("ce-datacontenttype".into(), "application/json".into())));
    }

    #[test]
    fn structured_mode_nests_json_and_carries_text_and_bytes() {
        let e = envelope("structured", None, None);
        let m = message(Some("k"), "application/json", br#"{"total": 12}"#);
        let event: serde_json::Value = serde_json::from_slice(&e.structured(&m).unwrap()).unwrap();
        assert_eq!(event["data"], serde_json::json!({"total": 12}));
        assert_eq!(event["id"], m.id.to_string());
        assert_eq!(event["specversion"], "1.0");
        assert_eq!(event["partitionkey"], "k");
        assert_eq!(event["time"], "2026-03-01T12:34:56.789012Z");
        let text = message(None, "text/plain", b"hello");
        let event: serde_json::Value =
            serde_json::from_slice(&e.structured(&text).unwrap()).unwrap();
        assert_eq!(event["data"], "hello");
        let bytes = message(None, "application/octet-stream", &[0xff, 0x00]);
        let event: serde_json::Value =
            serde_json::from_slice(&e.structured(&bytes).unwrap()).unwrap();
        assert_eq!(event["data_base64"], "/wA=");
        assert!(event.get("data").is_none());
        let broken = message(None, "application/vnd.x+json", b"{not json");
        assert!(e.structured(&broken).unwrap_err().contains("not JSON"));
    }

    #[test]
    fn header_values_are_percent_encoded_where_the_bindings_say() {
        assert_eq!(percent_encode("/a/b-c_d.e"), "/a/b-c_d.e");
        assert_eq!(
            percent_encode("Euro € 😀"),
            "Euro%20%E2%82%AC%20%F0%9F%98%80"
        );
        assert_eq!(percent_encode("50% \"x\""), "50%25%20%22x%22");
    }

    #[test]
    fn bad_settings_name_their_setting() {
        let err = |s: Settings<'_>| Envelope::from_settings(Setting("d"), &s).unwrap_err();
        let e = err(Settings {
            envelope: Some("cloudevent"),
            mode: None,
            source: None,
            kind: None,
        });
        assert_eq!(e.setting, "destinations.d.envelope");
        assert!(e.problem.contains("cloudevent"), "{e}");
        let e = err(Settings {
            envelope: Some("cloudevents"),
            mode: Some("batch"),
            source: None,
            kind: None,
        });
        assert_eq!(e.setting, "destinations.d.cloudevents_mode");
        let e = err(Settings {
            envelope: None,
            mode: None,
            source: Some("/x"),
            kind: None,
        });
        assert_eq!(e.setting, "destinations.d.cloudevents_source");
        let none = Envelope::from_settings(
            Setting("d"),
            &Settings {
                envelope: None,
                mode: None,
                source: None,
                kind: None,
            },
        );
        assert_eq!(none.unwrap(), None, "without the setting nothing changes");
    }
}

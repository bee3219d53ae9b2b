//! The `debezium` envelope of the `kafka` destination: each message written as Debezium's
//! outbox event router writes an outbox row, so that consumers built for Debezium read the
//! relayer's records unchanged (docs/from-debezium.md). What the router documents, and
//! this writes:
//!
//! - the record key is the message key (the row's `aggregateid`), none when it has none;
//! - the header `id` is the outbox_id (the row's `id`), and the headers the placement list
//!   names (`type:header:eventType` puts the message header `type` in the record header
//!   `eventType`; no alias keeps the name); no other header: not the outbox metadata, not
//!   `content-type`, not the message's unplaced headers;
//! - the value is the payload alone: as JSON (`expand.json.payload`, the default here),
//!   compacted with its keys in their stored order; or as a JSON string holding the stored
//!   text, as Debezium's JSON converter writes an unexpanded payload (`value = "string"`);
//!   a payload of bytes (`application/octet-stream`, an adopted bytea column: Avro,
//!   Protobuf) as its bytes, as Debezium's `BinaryDataConverter` writes it;
//!   with envelope placements (`type:envelope:eventType`) the value is an object holding
//!   `payload` and those fields;
//! - an empty payload is a tombstone (no value) when asked (`route.tombstone.on.empty.payload`);
//! - the record's timestamp is the enqueue time (the insert, where Debezium takes the
//!   transaction's commit).
//!
//! The topic is the destination's template, `outbox.event.{topic}` by default (Debezium's
//! `outbox.event.${routedByValue}`, the message topic being the row's `aggregatetype`).

use crate::destination::Setting;
use crate::error::ConfigError;
use crate::message::ClaimedMessage;

/// The content type of a payload of bytes (an adopted bytea column): written as it is.
const BYTES: &str = "application/octet-stream";

/// Debezium's default `route.topic.replacement`, in the destination's template syntax.
pub(super) const DEFAULT_TOPIC: &str = "outbox.event.{topic}";

/// Where a placed field goes.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Place {
    Header,
    Envelope,
}

/// One entry of the placement list: the message header `field` as `alias` in `place`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Placement {
    field: String,
    place: Place,
    alias: String,
}

/// How the payload becomes the record value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Value {
    /// The payload as JSON (Debezium's `table.expand.json.payload = true`).
    Json,
    /// A JSON string holding the payload's text (Debezium's JSON converter, unexpanded).
    String,
}

/// The envelope's settings, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Debezium {
    placement: Vec<Placement>,
    value: Value,
    tombstone: bool,
}

/// One record's parts, as the router writes them.
pub(super) struct Record {
    pub key: Option<String>,
    /// None: a tombstone.
    pub value: Option<Vec<u8>>,
    pub headers: Vec<(String, String)>,
    /// Milliseconds since the epoch.
    pub timestamp: i64,
}

impl Debezium {
    /// The settings `debezium_placement` (Debezium's `table.fields.additional.placement`
    /// syntax: `field:header|envelope[:alias]`, comma-separated), `debezium_value` (`json`
    /// or `string`) and `debezium_tombstone_on_empty_payload`.
    pub(super) fn from_settings(
        at: Setting<'_>,
        placement: Option<&str>,
        value: Option<&str>,
        tombstone: Option<bool>,
    ) -> Result<Self, ConfigError> {
        let mut entries = Vec::new();
        for entry in placement
            .unwrap_or("")
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
        {
            let parts: Vec<&str> = entry.split(':').map(str::trim).collect();
            let (field, place, alias) = match parts.as_slice() {
                [field, place] => (*field, *place, *field),
                [field, place, alias] => (*field, *place, *alias),
                _ => {
                    return Err(at.invalid(
                        "debezium_placement",
                        format!("{entry:?} is not field:header|envelope[:alias]"),
                    ));
                }
            };
            let place = match place {
                "header" => Place::Header,
                "envelope" => Place::Envelope,
                "partition" => {
                    return Err(at.invalid(
                        "debezium_placement",
                        format!(
                            "{entry:?}: partition placement is not supported: the record's \
                             partition follows its key, which keeps each aggregate's order"
                        ),
                    ));
                }
                other => {
                    return Err(at.invalid(
                        "debezium_placement",
                        format!("{entry:?}: {other:?} is not header or envelope"),
                    ));
                }
            };
            if field.is_empty() || alias.is_empty() {
                return Err(at.invalid(
                    "debezium_placement",
                    format!("{entry:?}: the field and its alias must not be empty"),
                ));
            }
            if place == Place::Header && alias == "id" {
                return Err(at.invalid(
                    "debezium_placement",
                    format!("{entry:?}: the header id is the event id"),
                ));
            }
            if place == Place::Envelope && alias == "payload" {
                return Err(at.invalid(
                    "debezium_placement",
                    format!("{entry:?}: the envelope's payload is the payload"),
                ));
            }
            entries.push(Placement {
                field: field.to_owned(),
                place,
                alias: alias.to_owned(),
            });
        }
        let value = match value.unwrap_or("json") {
            "json" => Value::Json,
            "string" => Value::String,
            other => {
                return Err(at.invalid(
                    "debezium_value",
                    format!("{other:?} is not json (the payload expanded) or string"),
                ));
            }
        };
        Ok(Debezium {
            placement: entries,
            value,
            tombstone: tombstone.unwrap_or(false),
        })
    }

    /// The record of `m`; an error (which makes the message permanent) for a payload that
    /// is not UTF-8 where the value needs text.
    pub(super) fn record(&self, m: &ClaimedMessage) -> Result<Record, String> {
        let header = |name: &str| -> Option<String> {
            match m.headers.get(name)? {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Null => None,
                other => Some(other.to_string()),
            }
        };
        let mut headers = vec![("id".to_owned(), m.id.to_string())];
        let mut fields = Vec::new();
        for p in &self.placement {
            let Some(value) = header(&p.field) else {
                continue;
            };
            match p.place {
                Place::Header => headers.push((p.alias.clone(), value)),
                Place::Envelope => fields.push((p.alias.clone(), value)),
            }
        }
        let value = if m.payload.is_empty() && self.tombstone {
            None
        } else {
            let payload = self.payload(m)?;
            Some(if fields.is_empty() {
                payload
            } else {
                let mut out = b"{\"payload\":".to_vec();
                out.extend_from_slice(&payload);
                for (name, value) in &fields {
                    out.push(b',');
                    out.extend_from_slice(json_string(name).as_bytes());
                    out.push(b':');
                    out.extend_from_slice(json_string(value).as_bytes());
                }
                out.push(b'}');
                out
            })
        };
        Ok(Record {
            key: m.key.clone(),
            value,
            headers,
            timestamp: m.created_at.timestamp_millis(),
        })
    }

    /// The payload as the value's JSON: expanded (compacted, keys in stored order; text that
    /// is not JSON goes as a JSON string, as Debezium keeps a payload it cannot expand), or
    /// as a JSON string of its text.
    fn payload(&self, m: &ClaimedMessage) -> Result<Vec<u8>, String> {
        if m.payload.is_empty() {
            return Ok(b"null".to_vec());
        }
        if m.content_type == BYTES {
            // A bytea column (Avro, Protobuf, …): its bytes as they are, as Debezium's
            // BinaryDataConverter writes them.
            return Ok(m.payload.clone());
        }
        let text = std::str::from_utf8(&m.payload).map_err(|e| {
            format!(
                "the debezium envelope writes the payload as JSON text, and it is not UTF-8: {e}"
            )
        })?;
        match self.value {
            Value::Json if serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok() => {
                Ok(compact(text).into_bytes())
            }
            Value::Json | Value::String => Ok(json_string(text).into_bytes()),
        }
    }
}

fn json_string(s: &str) -> String {
    serde_json::Value::String(s.to_owned()).to_string()
}

/// Valid JSON `text` without the white space between its tokens (keys stay in their order).
fn compact(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_string = false;
    let mut escaped = false;
    for c in text.chars() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
            out.push(c);
        } else if !c.is_whitespace() {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope(placement: &str, value: &str, tombstone: bool) -> Debezium {
        Debezium::from_settings(Setting("k"), Some(placement), Some(value), Some(tombstone))
            .unwrap()
    }

    fn message(payload: &str) -> ClaimedMessage {
        let mut m = ClaimedMessage::example(
            serde_json::json!({"type": "OrderCreated", "tracingspancontext": "x"}),
        );
        m.payload = payload.as_bytes().to_vec();
        m.key = Some("42".into());
        m
    }

    #[test]
    fn only_the_id_and_the_placed_headers_go_with_the_payload_alone() {
        let m = message(r#"{"b": 1, "a": "x y", "c": [1, {"d": null}]}"#);
        let r = envelope("type:header:eventType", "json", false)
            .record(&m)
            .unwrap();
        assert_eq!(r.key.as_deref(), Some("42"));
        assert_eq!(
            r.headers,
            vec![
                ("id".to_owned(), m.id.to_string()),
                ("eventType".to_owned(), "OrderCreated".to_owned())
            ]
        );
        assert_eq!(
            String::from_utf8(r.value.unwrap()).unwrap(),
            r#"{"b":1,"a":"x y","c":[1,{"d":null}]}"#
        );
    }

    #[test]
    fn the_string_form_and_the_envelope_and_the_tombstone() {
        let m = message(r#"{"a": 1}"#);
        let r = envelope("", "string", false).record(&m).unwrap();
        assert_eq!(r.value.unwrap(), br#""{\"a\": 1}""#.to_vec());
        let r = envelope("type:envelope:eventType", "json", false)
            .record(&m)
            .unwrap();
        assert_eq!(
            r.value.unwrap(),
            br#"{"payload":{"a":1},"eventType":"OrderCreated"}"#.to_vec()
        );
        let mut avro = message("");
        avro.payload = vec![0x00, 0xff, 0x10];
        avro.content_type = BYTES.into();
        assert_eq!(
            envelope("", "json", false).record(&avro).unwrap().value,
            Some(vec![0x00, 0xff, 0x10]),
            "bytes as they are"
        );
        let empty = message("");
        assert_eq!(
            envelope("", "json", true).record(&empty).unwrap().value,
            None
        );
        assert_eq!(
            envelope("", "json", false).record(&empty).unwrap().value,
            Some(b"null".to_vec())
        );
    }

    #[test]
    fn bad_settings_name_their_field() {
        for (placement, value) in [
            ("type:partition", "json"),
            ("type", "json"),
            ("type:header:id", "json"),
            ("", "avro"),
        ] {
            let err = Debezium::from_settings(Setting("k"), Some(placement), Some(value), None)
                .unwrap_err();
            assert!(err.setting.starts_with("destinations.k.debezium_"), "{err}");
        }
    }
}

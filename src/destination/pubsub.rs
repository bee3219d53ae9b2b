//! The `pubsub` destination: Google Cloud Pub/Sub through its REST API (`topics.publish`),
//! authenticated with Application Default Credentials by Google's official
//! `google-cloud-auth` crate, or without credentials against the emulator
//! (`PUBSUB_EMULATOR_HOST`).
//!
//! A batch is grouped by Pub/Sub topic (the message topic put into a topic-name template)
//! and each group goes out as `topics.publish` requests of at most 1,000 messages and
//! 10 MB; the answer lists one message id per message, in order, so each message is
//! delivered only once Pub/Sub answered its id. A request is taken or refused whole.
//!
//! Keys: the message key is the `orderingKey`, and Pub/Sub keeps the order of one ordering
//! key's messages within a publish request and across requests in the order they were
//! published, so the destination takes a key's run in one call
//! ([`Destination::keeps_key_order`]): a run goes in one request where it fits, else in
//! requests one after the other (see `calls`). The payload is the message's `data`; the
//! outbox metadata (`outbox-id` and the others) and the message's own headers are its
//! attributes, with `content-type`; the message key is its `orderingKey`. A message with a
//! creation trace context also carries its traceparent as `googclient_traceparent`, where
//! Google's client libraries (with OpenTelemetry on) look for the publisher's context. A message
//! Pub/Sub would refuse for its own sake (over 10 MB, too many or too long attributes, a
//! topic name Pub/Sub does not allow) is permanent before anything is sent, and a request
//! refused as invalid is sent again one message per request, so that only the message at
//! fault is dead-lettered. The window is checked before each request.
//!
//! Why REST and not the official `google-cloud-pubsub` client (1.7, which has a batching
//! `Publisher`): that publisher sends from a background task when its own batching decides,
//! so the window cannot be checked before each call; a message handed to it is sent even
//! after its caller gave up, and one queued behind a stalled ordering key goes out when the
//! stall ends, after its lease may be another relayer's; a request refused because of one
//! message fails every message in it. It also adds gRPC, protobuf and OpenTelemetry to the
//! build (docs/destinations.md has the figures). The REST API is what that client's REST
//! transport calls, and reqwest is already here.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine;
use futures_util::future::BoxFuture;
use google_cloud_auth::credentials::{CacheableResource, Credentials};

use super::calls::{self, Call, Entry};
use super::{Destination, Setting, Window, install_tls_provider, metadata, user_headers};
use crate::error::ConfigError;
use crate::message::{ClaimedMessage, Outcome};

/// The service's endpoint when neither `endpoint` nor the emulator is set.
const SERVICE: &str = "https://pubsub.googleapis.com";
/// The scope of the access token.
const SCOPE: &str = "https://www.googleapis.com/auth/pubsub";
/// Pub/Sub's limits (cloud.google.com/pubsub/quotas#resource_limits): messages and bytes
/// of one publish request, bytes of one message (data, attributes and ordering key),
/// attributes of a message, bytes of an attribute's name and value, and of an ordering key.
const MAX_REQUEST_MESSAGES: usize = 1000;
const MAX_REQUEST_BYTES: usize = 10_000_000;
const MAX_MESSAGE_BYTES: usize = 10_000_000;
const MAX_ATTRIBUTES: usize = 100;
const MAX_ATTRIBUTE_NAME_BYTES: usize = 256;
const MAX_ATTRIBUTE_VALUE_BYTES: usize = 1024;
const MAX_ORDERING_KEY_BYTES: usize = 1024;
/// Requests of one batch in flight at once (one batch may span several topics).
const CONCURRENCY: usize = 16;

/// `type = "pubsub"`.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PubsubConfig {
    /// The Google Cloud project of the topics.
    pub project: String,
    /// Topic name template; `{topic}` is replaced by the message topic [default: `{topic}`].
    pub topic: Option<String>,
    /// The service endpoint [default: https://pubsub.googleapis.com], e.g. a regional one.
    pub endpoint: Option<String>,
    /// `host:port` of the Pub/Sub emulator: plain HTTP, no credentials
    /// [default: `$PUBSUB_EMULATOR_HOST`].
    pub emulator_host: Option<String>,
}

impl PubsubConfig {
    pub(super) fn build(&self, at: Setting<'_>, deadline: Duration) -> Result<PubSub, ConfigError> {
        install_tls_provider();
        let project = self.project.trim();
        if project.is_empty() || project.contains('/') {
            return Err(at.invalid(
                "project",
                format!("{project:?} must be a Google Cloud project id (no `/`)"),
            ));
        }
        let template = self.topic.clone().unwrap_or_else(|| "{topic}".to_owned());
        if template.is_empty() {
            return Err(at.invalid("topic", "must not be empty"));
        }
        if !template.contains("{topic}") {
            topic_name(&template, "").map_err(|e| at.invalid("topic", e))?;
        }
        let env = std::env::var("PUBSUB_EMULATOR_HOST").ok();
        let target = target(
            self.endpoint.as_deref(),
            self.emulator_host.as_deref(),
            env.as_deref(),
        )
        .map_err(|(field, problem)| at.invalid(field, problem))?;
        let credentials = match &target {
            Target::Emulator(_) => None,
            Target::Service(_) => Some(
                google_cloud_auth::credentials::Builder::default()
                    .with_scopes([SCOPE])
                    .build()
                    .map_err(|e| {
                        at.invalid(
                            "project",
                            format!("Application Default Credentials: {}", chain(&e)),
                        )
                    })?,
            ),
        };
        // A request never outlives the batch's dispatch deadline.
        let client = reqwest::Client::builder()
            .timeout(deadline)
            .connect_timeout(deadline)
            .build()
            .map_err(|e| at.invalid("endpoint", e.to_string()))?;
        let base = match &target {
            Target::Emulator(url) | Target::Service(url) => {
                format!(
                    "{}/v1/projects/{project}/topics/",
                    url.trim_end_matches('/')
                )
            }
        };
        Ok(PubSub {
            client,
            base,
            template,
            credentials,
        })
    }
}

/// Where requests go.
#[derive(Debug, PartialEq)]
enum Target {
    /// The emulator at this URL, without credentials.
    Emulator(String),
    /// The service (or a proxy of it) at this URL, with Application Default Credentials.
    Service(String),
}

/// The endpoint from the settings and `PUBSUB_EMULATOR_HOST` (`env`): the emulator when
/// `emulator_host` or the variable names one (the setting first), else `endpoint` or the
/// service; a bad value is `(field, problem)`.
fn target(
    endpoint: Option<&str>,
    emulator_host: Option<&str>,
    env: Option<&str>,
) -> Result<Target, (&'static str, String)> {
    let emulator = emulator_host
        .map(|h| ("emulator_host", h))
        .or_else(|| env.filter(|h| !h.is_empty()).map(|h| ("emulator_host", h)));
    if let Some((field, host)) = emulator {
        if endpoint.is_some() {
            return Err((
                "endpoint",
                "set either endpoint or the emulator (emulator_host, PUBSUB_EMULATOR_HOST), not both"
                    .to_owned(),
            ));
        }
        if host.is_empty() || host.contains('/') {
            return Err((
                field,
                format!("{host:?} must be host:port, e.g. 127.0.0.1:8085"),
            ));
        }
        return Ok(Target::Emulator(format!("http://{host}")));
    }
    let url = endpoint.unwrap_or(SERVICE);
    if !(url.starts_with("https://") || url.starts_with("http://")) {
        return Err((
            "endpoint",
            format!("{url:?} must start with https:// (or http://)"),
        ));
    }
    Ok(Target::Service(url.to_owned()))
}

/// The Pub/Sub topic name for message topic `topic`, or why Pub/Sub would refuse it: 3-255
/// characters, letters, digits and `-_.~+%`, starting with a letter, not with `goog`.
fn topic_name(template: &str, topic: &str) -> Result<String, String> {
    let name = template.replace("{topic}", topic);
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-_.~+%".contains(c);
    if !(3..=255).contains(&name.len())
        || !name.starts_with(|c: char| c.is_ascii_alphabetic())
        || !name.chars().all(allowed)
        || name.to_ascii_lowercase().starts_with("goog")
    {
        return Err(format!(
            "{name:?} is not a Pub/Sub topic name (3-255 letters, digits and -_.~+%, starting \
             with a letter, not with \"goog\")"
        ));
    }
    Ok(name)
}

pub struct PubSub {
    client: reqwest::Client,
    /// `ENDPOINT/v1/projects/PROJECT/topics/`.
    base: String,
    template: String,
    credentials: Option<Credentials>,
}

/// The attribute in which Google's Pub/Sub client libraries carry the publisher's W3C
/// traceparent (the one name under `goog` a publisher sets).
const GOOGLE_TRACEPARENT: &str = "googclient_traceparent";

/// A message of the batch ready to send, or its outcome already known.
/// The entry is the message as `topics.publish` takes it, with its size as Pub/Sub counts
/// it; its target is the Pub/Sub topic.
fn prepare(
    template: &str,
    at: usize,
    m: &ClaimedMessage,
) -> Result<Entry<serde_json::Value>, Outcome> {
    let permanent = |reason: String| Outcome::Permanent { reason };
    let topic = topic_name(template, &m.topic).map_err(permanent)?;
    if let Some(key) = m.key.as_ref().filter(|k| k.len() > MAX_ORDERING_KEY_BYTES) {
        return Err(permanent(format!(
            "the message key is {} bytes; a Pub/Sub ordering key is at most {MAX_ORDERING_KEY_BYTES}",
            key.len()
        )));
    }
    let mut attributes = BTreeMap::new();
    for (name, value) in user_headers(m).map_err(permanent)? {
        attributes.insert(name.to_owned(), value);
    }
    attributes.insert("content-type".to_owned(), m.content_type.clone());
    for (name, value) in metadata(m) {
        attributes.insert(name.to_owned(), value);
    }
    if let Some(trace) = m.trace_context() {
        attributes.insert(GOOGLE_TRACEPARENT.to_owned(), trace.traceparent);
    }
    if attributes.len() > MAX_ATTRIBUTES {
        return Err(permanent(format!(
            "{} attributes: Pub/Sub takes at most {MAX_ATTRIBUTES} (the headers and the outbox's 4-5)",
            attributes.len()
        )));
    }
    let mut bytes = m.payload.len();
    for (name, value) in &attributes {
        if name.is_empty()
            || name.len() > MAX_ATTRIBUTE_NAME_BYTES
            || (name.starts_with("goog") && name != GOOGLE_TRACEPARENT)
        {
            return Err(permanent(format!(
                "header {name:?}: a Pub/Sub attribute name is 1-{MAX_ATTRIBUTE_NAME_BYTES} bytes, not starting with \"goog\""
            )));
        }
        if value.len() > MAX_ATTRIBUTE_VALUE_BYTES {
            return Err(permanent(format!(
                "header {name:?}: its value is {} bytes; a Pub/Sub attribute value is at most {MAX_ATTRIBUTE_VALUE_BYTES}",
                value.len()
            )));
        }
        bytes += name.len() + value.len();
    }
    let mut json = serde_json::json!({
        "data": base64::engine::general_purpose::STANDARD.encode(&m.payload),
        "attributes": attributes,
    });
    if let Some(key) = &m.key {
        bytes += key.len();
        json["orderingKey"] = serde_json::Value::String(key.clone());
    }
    if bytes > MAX_MESSAGE_BYTES {
        return Err(permanent(format!(
            "the message is {bytes} bytes (payload, attributes and key); Pub/Sub takes at most {MAX_MESSAGE_BYTES}"
        )));
    }
    Ok(Entry {
        at,
        target: topic,
        key: m.key.clone(),
        bytes,
        item: json,
    })
}

/// An error and its causes, `: `-separated (reqwest's own text leaves out why).
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

/// What Pub/Sub's error answer means for the messages of its request: retryable (throttled,
/// unavailable, timed out, a server error, an access token to renew), or permanent (the
/// topic does not exist, no permission, an invalid request).
fn classify(status: u16, body: &str) -> (bool, String) {
    #[derive(serde::Deserialize)]
    struct Answer {
        error: Error,
    }
    #[derive(serde::Deserialize)]
    struct Error {
        #[serde(default)]
        message: String,
        #[serde(default)]
        status: String,
    }
    let (code, message) = match serde_json::from_str::<Answer>(body) {
        Ok(a) => (a.error.status, a.error.message),
        Err(_) => (String::new(), body.chars().take(200).collect()),
    };
    const RETRYABLE: [&str; 6] = [
        "RESOURCE_EXHAUSTED",
        "UNAVAILABLE",
        "DEADLINE_EXCEEDED",
        "INTERNAL",
        "ABORTED",
        "UNAUTHENTICATED",
    ];
    let retryable =
        RETRYABLE.contains(&code.as_str()) || matches!(status, 401 | 408 | 429) || status >= 500;
    let code = if code.is_empty() {
        String::new()
    } else {
        format!(" {code}")
    };
    (
        retryable,
        format!("HTTP {status}{code}: {message}")
            .trim_end()
            .to_owned(),
    )
}

/// How one request ended.
enum Answered {
    /// One message id per message.
    Published,
    /// Refused as invalid: some message of it is at fault.
    Invalid(String),
    Failed(Outcome),
}

impl PubSub {
    async fn auth(&self) -> Result<reqwest::header::HeaderMap, String> {
        let Some(credentials) = &self.credentials else {
            return Ok(reqwest::header::HeaderMap::new());
        };
        match credentials.headers(http::Extensions::new()).await {
            Ok(CacheableResource::New { data, .. }) => Ok(data),
            Ok(CacheableResource::NotModified) => {
                Err("Application Default Credentials gave no headers".to_owned())
            }
            Err(e) => Err(format!("Application Default Credentials: {}", chain(&e))),
        }
    }

    /// Sends one `topics.publish` request.
    async fn send(&self, topic: &str, messages: &[&Entry<serde_json::Value>]) -> Answered {
        let retry = |reason: String| {
            Answered::Failed(Outcome::Retryable {
                reason,
                retry_after: None,
            })
        };
        let headers = match self.auth().await {
            Ok(h) => h,
            Err(reason) => return retry(reason),
        };
        let body = serde_json::json!({
            "messages": messages.iter().map(|p| &p.item).collect::<Vec<_>>(),
        });
        let url = format!("{}{topic}:publish", self.base);
        let what = format!("Pub/Sub publish to {topic}");
        let response = self
            .client
            .post(&url)
            .headers(headers)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string())
            .send()
            .await;
        let response = match response {
            Ok(r) => r,
            Err(e) => return retry(format!("{what}: {}", chain(&e.without_url()))),
        };
        let status = response.status();
        let text = match response.text().await {
            Ok(t) => t,
            Err(e) => return retry(format!("{what}: {}", chain(&e.without_url()))),
        };
        if status.is_success() {
            #[derive(serde::Deserialize)]
            #[serde(rename_all = "camelCase")]
            struct Published {
                #[serde(default)]
                message_ids: Vec<String>,
            }
            return match serde_json::from_str::<Published>(&text) {
                Ok(p) if p.message_ids.len() == messages.len() => Answered::Published,
                // Not an answer of Pub/Sub's: whether it published is unknown, so again.
                _ => retry(format!(
                    "{what}: HTTP {status} without one message id per message: {}",
                    text.chars().take(200).collect::<String>()
                )),
            };
        }
        let (retryable, reason) = classify(status.as_u16(), &text);
        let reason = format!("{what}: {reason}");
        if retryable {
            retry(reason)
        } else if status.as_u16() == 400 {
            Answered::Invalid(reason)
        } else {
            Answered::Failed(Outcome::Permanent { reason })
        }
    }

    /// Publishes the messages of one request, and answers each `(place, outcome)`. A request
    /// refused as invalid is sent again one message at a time, so that only the messages
    /// at fault are permanent (a key's messages after one that was not delivered are not
    /// sent again); the window is checked before every request.
    async fn publish_request(
        &self,
        request: Call<serde_json::Value>,
        window: &Window,
    ) -> Vec<(usize, Outcome)> {
        let topic = request.target.clone();
        let request = request.entries;
        let all = |outcome: Outcome| request.iter().map(|p| (p.at, outcome.clone())).collect();
        if let Err(not_sent) = window.check() {
            return all(not_sent);
        }
        let messages: Vec<&Entry<serde_json::Value>> = request.iter().collect();
        match self.send(&topic, &messages).await {
            Answered::Published => all(Outcome::Delivered),
            Answered::Failed(outcome) => all(outcome),
            Answered::Invalid(reason) if request.len() == 1 => all(Outcome::Permanent { reason }),
            Answered::Invalid(_) => {
                let mut out = Vec::with_capacity(request.len());
                let mut stopped = std::collections::HashSet::new();
                for p in &request {
                    let outcome = match (&p.key, window.check()) {
                        (Some(k), _) if stopped.contains(k) => Outcome::behind_undelivered(k),
                        (_, Err(not_sent)) => not_sent,
                        (_, Ok(())) => match self.send(&topic, &[p]).await {
                            Answered::Published => Outcome::Delivered,
                            Answered::Invalid(reason) => Outcome::Permanent { reason },
                            Answered::Failed(outcome) => outcome,
                        },
                    };
                    if let Some(k) = &p.key
                        && outcome != Outcome::Delivered
                    {
                        stopped.insert(k.clone());
                    }
                    out.push((p.at, outcome));
                }
                out
            }
        }
    }
}

impl Destination for PubSub {
    /// One `topics.publish` request per topic of the batch (more when it exceeds 1,000
    /// messages or 10 MB, or a key's run does not fit in one), up to 16 at once; the window
    /// is checked before each.
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
            let mut prepared = Vec::with_capacity(batch.len());
            for (at, m) in batch.iter().enumerate() {
                match prepare(&self.template, at, m) {
                    Ok(p) => prepared.push(p),
                    Err(outcome) => outcomes[at] = Some(outcome),
                }
            }
            let prepared = calls::behind_refused(batch, &mut outcomes, prepared);
            let requests = calls::plan(prepared, MAX_REQUEST_MESSAGES, MAX_REQUEST_BYTES);
            let answered = calls::in_rounds(requests, CONCURRENCY, |request| {
                self.publish_request(request, window)
            })
            .await;
            for (at, outcome) in answered {
                outcomes[at] = Some(outcome);
            }
            outcomes
                .into_iter()
                .map(|o| o.expect("an outcome for every message of the batch"))
                .collect()
        })
    }

    /// Ready when an access token can be had (always, against the emulator).
    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move { self.auth().await.map(|_| ()) })
    }

    fn keeps_key_order(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_emulator_is_the_setting_or_else_the_variable_and_goes_without_credentials() {
        assert_eq!(
            target(None, None, None).unwrap(),
            Target::Service(SERVICE.into())
        );
        assert_eq!(
            target(None, None, Some("127.0.0.1:8085")).unwrap(),
            Target::Emulator("http://127.0.0.1:8085".into())
        );
        assert_eq!(
            target(None, Some("localhost:9000"), Some("127.0.0.1:8085")).unwrap(),
            Target::Emulator("http://localhost:9000".into())
        );
        assert_eq!(
            target(
                Some("https://europe-west1-pubsub.googleapis.com"),
                None,
                Some("")
            )
            .unwrap(),
            Target::Service("https://europe-west1-pubsub.googleapis.com".into())
        );
        assert_eq!(
            target(Some("https://x"), None, Some("127.0.0.1:8085"))
                .unwrap_err()
                .0,
            "endpoint"
        );
        assert_eq!(
            target(Some("ftp://x"), None, None).unwrap_err().0,
            "endpoint"
        );
        assert_eq!(
            target(None, Some("http://h:1"), None).unwrap_err().0,
            "emulator_host"
        );
    }

    #[test]
    fn topic_names_follow_pubsub_rules() {
        assert_eq!(
            topic_name("outbox.{topic}", "orders").unwrap(),
            "outbox.orders"
        );
        assert!(topic_name("{topic}", "orders/created").is_err());
        assert!(topic_name("{topic}", "1orders").is_err());
        assert!(topic_name("{topic}", "ab").is_err());
        assert!(topic_name("{topic}", "google-x").is_err());
        assert!(topic_name("{topic}", &"a".repeat(256)).is_err());
    }

    #[test]
    fn a_message_pubsub_would_refuse_is_permanent_with_the_reason() {
        let reason = |m: &ClaimedMessage| match prepare("{topic}", 0, m) {
            Err(Outcome::Permanent { reason }) => reason,
            Err(other) => panic!("{other:?}"),
            Ok(_) => panic!("accepted"),
        };
        let mut m = ClaimedMessage::example(serde_json::json!({}));
        m.topic = "orders".into();
        assert!(prepare("{topic}", 0, &m).is_ok());
        m.payload = vec![b'x'; MAX_MESSAGE_BYTES];
        assert!(reason(&m).contains("Pub/Sub takes at most 10000000"));
        m.payload.clear();
        m.key = Some("k".repeat(1025));
        assert!(reason(&m).contains("ordering key"));
        m.key = None;
        m.headers = serde_json::json!({ "x": "v".repeat(1025) });
        assert!(reason(&m).contains("\"x\""));
        m.headers = serde_json::json!({ "googx": "v" });
        assert!(reason(&m).contains("\"googx\""));
        m.topic = "o".into();
        m.headers = serde_json::json!({});
        assert!(reason(&m).contains("not a Pub/Sub topic name"));
    }

    #[test]
    fn requests_hold_one_topic_and_at_most_a_thousand_messages_or_ten_megabytes() {
        let p = |at, topic: &str, bytes| Entry {
            at,
            target: topic.into(),
            key: None,
            bytes,
            item: serde_json::Value::Null,
        };
        let mut prepared: Vec<Entry<serde_json::Value>> =
            (0..1500).map(|i| p(i, "a", 10)).collect();
        prepared.push(p(1500, "b", 10));
        prepared.extend((0..3).map(|i| p(1501 + i, "c", 4_000_000)));
        let sizes: Vec<(String, usize)> =
            calls::plan(prepared, MAX_REQUEST_MESSAGES, MAX_REQUEST_BYTES)
                .iter()
                .map(|r| (r.target.clone(), r.entries.len()))
                .collect();
        assert_eq!(
            sizes,
            [
                ("a".into(), 1000),
                ("a".into(), 500),
                ("b".into(), 1),
                ("c".into(), 2),
                ("c".into(), 1)
            ]
        );
    }

    #[test]
    fn errors_are_classified_by_status() {
        let body = |status: &str| {
            format!("{{\"error\":{{\"code\":0,\"message\":\"m\",\"status\":\"{status}\"}}}}")
        };
        for (http, status, retryable) in [
            (429, "RESOURCE_EXHAUSTED", true),
            (503, "UNAVAILABLE", true),
            (504, "DEADLINE_EXCEEDED", true),
            (500, "INTERNAL", true),
            (401, "UNAUTHENTICATED", true),
            (400, "INVALID_ARGUMENT", false),
            (404, "NOT_FOUND", false),
            (403, "PERMISSION_DENIED", false),
        ] {
            let (r, reason) = classify(http, &body(status));
            assert_eq!(r, retryable, "{status}");
            assert!(
                reason.contains(status) && reason.ends_with(": m"),
                "{reason}"
            );
        }
        assert!(classify(502, "<html>bad gateway</html>").0);
        assert!(!classify(404, "not json").0);
    }
}

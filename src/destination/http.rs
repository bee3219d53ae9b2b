//! The `http` destination: one POST per message to a URL template (`{topic}` replaced by
//! the topic, percent-encoded, so a topic can never rewrite the path or the query), with the
//! outbox_id as `Idempotency-Key` and, when a secret is configured, signed the Standard
//! Webhooks way (`webhook-id`, `webhook-timestamp`, `webhook-signature: v1,<base64
//! HMAC-SHA256 of "id.timestamp.body">`) so receivers can verify with the existing libraries.
//! The message's own headers (W3C `traceparent`/`tracestate` among them) become request
//! headers, with the outbox metadata (`outbox-id`, `outbox-topic`, `outbox-key`,
//! `outbox-seq`, `outbox-attempt`) beside them; a header HTTP cannot carry makes that message permanent.
//! 2xx is delivered; 408, 429, 5xx and transport errors are retryable (honouring
//! `Retry-After` seconds); any other status is permanent. With the CloudEvents envelope, the
//! attributes go as `ce-` headers (binary) or the body is the JSON event (structured).

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine;
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use hmac::{Hmac, Mac};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use sha2::Sha256;

use super::cloudevents::{self, Envelope, Mode, STRUCTURED_CONTENT_TYPE, percent_encode};
use super::{
    DEADLINE_PASSED, Destination, Setting, Window, install_tls_provider, metadata, user_headers,
};
use crate::error::ConfigError;
use crate::message::{ClaimedMessage, Outcome};
use crate::secret::redact_url;

/// `type = "http"`.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// `http://` or `https://`; `{topic}` is replaced by the percent-encoded topic.
    pub url: String,
    /// Standard Webhooks signing secret (`whsec_` + base64).
    pub signing_secret: Option<String>,
    /// Headers sent with every request.
    pub headers: Option<BTreeMap<String, String>>,
    /// Requests of one batch in flight at once, 1..=1024 [default: 64].
    pub concurrency: Option<i64>,
    /// `"cloudevents"` to send each message as a CloudEvent [default: none].
    pub envelope: Option<String>,
    /// `"binary"` or `"structured"` [default: binary].
    pub cloudevents_mode: Option<String>,
    /// The CloudEvents `source` template [default: /outbox-relay].
    pub cloudevents_source: Option<String>,
    /// The CloudEvents `type` template [default: `{topic}`].
    pub cloudevents_type: Option<String>,
}

impl HttpConfig {
    pub(super) fn build(&self, at: Setting<'_>, deadline: Duration) -> Result<Http, ConfigError> {
        install_tls_provider();
        let url = &self.url;
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(at.invalid(
                "url",
                format!("{:?} must start with http:// or https://", redact_url(url)),
            ));
        }
        let secret = self
            .signing_secret
            .as_deref()
            .map(|s| {
                let encoded = s.strip_prefix("whsec_").unwrap_or(s);
                base64::engine::general_purpose::STANDARD
                    .decode(encoded)
                    .map_err(|e| {
                        at.invalid(
                            "signing_secret",
                            format!("must be whsec_ followed by base64 ({e})"),
                        )
                    })
            })
            .transpose()?;
        let concurrency = at.ranged("concurrency", self.concurrency, 64, 1, 1024)?;
        let envelope = Envelope::from_settings(
            at,
            &cloudevents::Settings {
                envelope: self.envelope.as_deref(),
                mode: self.cloudevents_mode.as_deref(),
                source: self.cloudevents_source.as_deref(),
                kind: self.cloudevents_type.as_deref(),
            },
        )?;
        let concurrency = usize::try_from(concurrency).unwrap_or(64);
        let mut map = HeaderMap::new();
        for (name, value) in self.headers.iter().flatten() {
            let header = HeaderName::try_from(name.as_str())
                .map_err(|e| at.invalid("headers", format!("header name {name:?}: {e}")))?;
            let value = HeaderValue::try_from(value.as_str())
                .map_err(|e| at.invalid("headers", format!("header {name} value: {e}")))?;
            map.insert(header, value);
        }
        // A request never outlives the batch's dispatch deadline.
        let client = reqwest::Client::builder()
            .timeout(deadline)
            .connect_timeout(deadline)
            .pool_max_idle_per_host(concurrency)
            .build()
            .map_err(|e| at.invalid("url", e.to_string()))?;
        Ok(Http {
            client,
            url: url.clone(),
            secret,
            headers: map,
            concurrency,
            envelope,
        })
    }
}

pub struct Http {
    client: reqwest::Client,
    url: String,
    secret: Option<Vec<u8>>,
    headers: HeaderMap,
    concurrency: usize,
    envelope: Option<Envelope>,
}

impl Http {
    /// The request headers of `m` with `body`: the configured ones, the message's own, the
    /// CloudEvents attributes (binary mode), then the outbox metadata; or why the message's
    /// own cannot be sent.
    fn headers(&self, m: &ClaimedMessage, id: &str, body: &[u8]) -> Result<HeaderMap, String> {
        let mut headers = self.headers.clone();
        for (name, value) in user_headers(m)? {
            let header = HeaderName::try_from(name)
                .map_err(|_| format!("header name {name:?} is not valid in HTTP"))?;
            let value = HeaderValue::try_from(value)
                .map_err(|_| format!("header {name:?}: the value is not valid in HTTP"))?;
            headers.insert(header, value);
        }
        let mut set = |name: &str, value: &str| -> Result<(), String> {
            let n = HeaderName::try_from(name)
                .map_err(|_| format!("header name {name:?} is not valid in HTTP"))?;
            let v = HeaderValue::try_from(value)
                .map_err(|_| format!("{name} {value:?} is not a valid HTTP header value"))?;
            headers.insert(n, v);
            Ok(())
        };
        match &self.envelope {
            Some(e) if e.mode == Mode::Structured => set("content-type", STRUCTURED_CONTENT_TYPE)?,
            Some(e) => {
                // The HTTP binding: `ce-` headers, `datacontenttype` as Content-Type.
                set("content-type", &m.content_type)?;
                for (name, value) in e.headers(m, "ce-", false) {
                    set(&name, &percent_encode(&value))?;
                }
            }
            None => set("content-type", &m.content_type)?,
        }
        set("idempotency-key", id)?;
        for (name, value) in metadata(m) {
            set(name, &value)?;
        }
        if let Some(secret) = &self.secret {
            let timestamp = chrono::Utc::now().timestamp().to_string();
            set("webhook-id", id)?;
            set("webhook-timestamp", &timestamp)?;
            set(
                "webhook-signature",
                &format!("v1,{}", sign(secret, id, &timestamp, body)),
            )?;
        }
        Ok(headers)
    }

    /// One request for `m`, waiting for its answer at most `within` (the time left before
    /// the call's dispatch deadline) when given.
    async fn send(&self, m: &ClaimedMessage, within: Option<Duration>) -> Outcome {
        let id = m.id.to_string();
        let body = match &self.envelope {
            Some(e) if e.mode == Mode::Structured => match e.structured(m) {
                Ok(body) => body,
                Err(reason) => return Outcome::Permanent { reason },
            },
            _ => m.payload.clone(),
        };
        let headers = match self.headers(m, &id, &body) {
            Ok(h) => h,
            Err(reason) => return Outcome::Permanent { reason },
        };
        let url = match url_for(&self.url, &m.topic) {
            Ok(url) => url,
            Err(reason) => return Outcome::Permanent { reason },
        };
        let mut request = self.client.post(&url).headers(headers).body(body);
        if let Some(within) = within {
            request = request.timeout(within);
        }
        let response = request.send().await;
        match response {
            // A connection that was never made sent nothing; anything else (a timeout, a
            // connection lost after the request went out) may have arrived.
            Err(e) if e.is_connect() => Outcome::Retryable {
                reason: format!("POST {}: {}", redact_url(&url), cause(e)),
                retry_after: None,
            },
            Err(e) => Outcome::Unanswered {
                reason: format!("POST {}: {}", redact_url(&url), cause(e)),
            },
            Ok(r) => {
                let status = r.status();
                if status.is_success() {
                    return Outcome::Delivered;
                }
                let retry_after = r
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map(Duration::from_secs);
                let body: String = r
                    .text()
                    .await
                    .unwrap_or_default()
                    .chars()
                    .take(200)
                    .collect();
                let reason = format!("POST {}: HTTP {status} {body}", redact_url(&url))
                    .trim_end()
                    .to_owned();
                if status.as_u16() == 408 || status.as_u16() == 429 || status.is_server_error() {
                    Outcome::Retryable {
                        reason,
                        retry_after,
                    }
                } else {
                    Outcome::Permanent { reason }
                }
            }
        }
    }
}

/// Below this much time before the call's deadline, a request is not started.
const MIN_REQUEST_TIME: Duration = Duration::from_millis(10);

/// The URL for `topic`: `{topic}` replaced by the topic percent-encoded as one path segment
/// (every byte but RFC 3986's unreserved characters), so `/`, `?`, `#` and `%` in a topic
/// stay inside it. `.` and `..` are refused: URL parsers resolve them even when encoded.
fn url_for(template: &str, topic: &str) -> Result<String, String> {
    if !template.contains("{topic}") {
        return Ok(template.to_owned());
    }
    if topic == "." || topic == ".." {
        return Err(format!("topic {topic:?} cannot be a URL path segment"));
    }
    let mut encoded = String::with_capacity(topic.len());
    for b in topic.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            encoded.push(char::from(b));
        } else {
            encoded.push_str(&format!("%{b:02X}"));
        }
    }
    Ok(template.replace("{topic}", &encoded))
}

/// base64(HMAC-SHA256(secret, "id.timestamp.body")), the Standard Webhooks `v1` signature.
fn sign(secret: &[u8], id: &str, timestamp: &str, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(body);
    base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
}

impl Destination for Http {
    /// One request per message, up to `concurrency` at once; the window is checked as each
    /// request starts, and each waits for its answer only until the call's deadline, so that
    /// what was delivered before the deadline is answered as delivered.
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(
            futures_util::stream::iter(batch)
                .map(move |m| async move {
                    match window.check() {
                        // Too little time left for a request to go out: it is not sent
                        // (a timeout while it waits for a connection would otherwise count
                        // as an unanswered attempt).
                        Ok(()) => match window.remaining() {
                            Some(left) if left < MIN_REQUEST_TIME => Outcome::NotAttempted {
                                reason: DEADLINE_PASSED.to_owned(),
                            },
                            left => self.send(m, left).await,
                        },
                        Err(not_sent) => not_sent,
                    }
                })
                .buffered(self.concurrency)
                .collect(),
        )
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
}

/// Why a request got no answer, in words an operator can group and act on: a timeout, a
/// refused or failed connection with the operating system's or the resolver's reason, a
/// TLS refusal with rustls's; never the URL (the caller names it, redacted) and never
/// reqwest's generic "error sending request" alone.
fn cause(e: reqwest::Error) -> String {
    if e.is_timeout() {
        return "timed out: no answer within the batch's dispatch deadline (timeout_ms)".into();
    }
    // The sources under reqwest's own sentence, each once: hyper's ("client error
    // (Connect)"), then the connector's (a DNS error, rustls's alert, an io::Error).
    let mut causes: Vec<String> = Vec::new();
    let mut source = std::error::Error::source(&e);
    while let Some(cause) = source {
        let text = cause.to_string();
        if !causes.iter().any(|c| c.contains(&text)) {
            causes.push(text);
        }
        source = cause.source();
    }
    let kind = if e.is_connect() {
        "cannot connect"
    } else if e.is_request() {
        "request failed"
    } else {
        "failed"
    };
    let detail: Vec<&str> = causes
        .iter()
        .map(String::as_str)
        .filter(|c| !c.starts_with("client error ("))
        .collect();
    if detail.is_empty() {
        format!("{kind}: {}", e.without_url())
    } else {
        format!("{kind}: {}", detail.join(": "))
    }
}

#[cfg(test)]
mod tests {
    use super::{cause, url_for};

    /// The reason a POST to `url` failed, from a client set up as the destination's is.
    async fn failure(url: &str) -> String {
        super::install_tls_provider();
        let deadline = std::time::Duration::from_millis(500);
        let client = reqwest::Client::builder()
            .timeout(deadline)
            .connect_timeout(deadline)
            .build()
            .unwrap();
        match client.post(url).body("{}").send().await {
            Ok(r) => panic!("{url} answered {}", r.status()),
            Err(e) => cause(e),
        }
    }

    #[tokio::test]
    async fn a_request_without_an_answer_names_its_cause() {
        // Refused: a port nobody listens on.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let refused = failure(&format!("http://127.0.0.1:{port}/")).await;
        assert!(
            refused.starts_with("cannot connect: ") && refused.contains("Connection refused"),
            "{refused}"
        );
        // Silent: a listener that accepts and never answers.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let silent_port = silent.local_addr().unwrap().port();
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((socket, _)) = silent.accept().await {
                open.push(socket);
            }
        });
        let timed_out = failure(&format!("http://127.0.0.1:{silent_port}/")).await;
        assert!(timed_out.starts_with("timed out"), "{timed_out}");
        // TLS spoken to a server that does not: rustls's own reason.
        let tls = failure(&format!("https://127.0.0.1:{silent_port}/")).await;
        assert!(tls.starts_with("timed out"), "{tls}");
        let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let plain_port = plain.local_addr().unwrap().port();
        let answers = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            while let Ok((mut socket, _)) = plain.accept().await {
                let _ = socket
                    .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
                    .await;
            }
        });
        let tls = failure(&format!("https://127.0.0.1:{plain_port}/")).await;
        assert!(tls.starts_with("cannot connect: "), "{tls}");
        for reason in [&refused, &timed_out, &tls] {
            assert!(!reason.contains("error sending request"), "{reason}");
            assert!(
                !reason.contains("127.0.0.1"),
                "the caller names the URL: {reason}"
            );
        }
        assert_ne!(refused, tls);
        eprintln!("refused: {refused}\ntimed out: {timed_out}\ntls: {tls}");
        held.abort();
        answers.abort();
    }

    #[test]
    fn a_topic_stays_one_path_segment() {
        assert_eq!(
            url_for("http://h/hooks/{topic}?v=1", "a/../b?x#y").unwrap(),
            "http://h/hooks/a%2F..%2Fb%3Fx%23y?v=1"
        );
        assert_eq!(
            url_for("http://h/{topic}", "orders.created-v1_x~").unwrap(),
            "http://h/orders.created-v1_x~"
        );
        assert_eq!(
            url_for("http://h/{topic}", "100%").unwrap(),
            "http://h/100%25"
        );
        assert!(url_for("http://h/{topic}", "..").is_err());
        assert_eq!(url_for("http://h/fixed", "..").unwrap(), "http://h/fixed");
    }
}

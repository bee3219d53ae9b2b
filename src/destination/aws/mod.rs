//! The AWS destinations (`sqs`, `sns`, `eventbridge`, `kinesis`; cargo feature `aws`), one
//! file per service, and what they share: the settings every one of them has (`region`,
//! `endpoint_url`), the one SDK config loader (credentials from the SDK's default chain,
//! never logged; the HTTP client on rustls with the ring provider; no SDK retries, so that
//! the relayer's own retry policy, circuit and deadline decide), the classification of what
//! AWS answered into retryable and permanent, the mapping of headers to message attributes
//! (SQS, SNS), and the sending of a batch as calls of a service's batch size, each checked
//! against the publish window.

mod eventbridge;
mod kinesis;
mod sns;
mod sqs;

pub use eventbridge::EventBridgeConfig;
pub use kinesis::KinesisConfig;
pub use sns::SnsConfig;
pub use sqs::SqsConfig;

use std::future::Future;
use std::time::Duration;

use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, Region, SdkConfig};
use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
use aws_smithy_http_client::tls;

use super::calls::{self, Entry};
use super::{Setting, Window, metadata, user_headers};
use crate::error::ConfigError;
use crate::message::{ClaimedMessage, Outcome};
use crate::secret::redact_url;

/// Where an AWS destination sends: the region and an endpoint override, as given in its
/// table (`region`, `endpoint_url`). Neither is required: the SDK's default chain
/// (`AWS_REGION`, the profile) supplies the region, the service's own endpoint is used.
#[derive(Clone, Debug)]
struct Endpoint {
    region: Option<String>,
    endpoint_url: Option<String>,
    timeout: Duration,
}

impl Endpoint {
    fn new(
        at: Setting<'_>,
        region: Option<&str>,
        endpoint_url: Option<&str>,
        timeout: Duration,
    ) -> Result<Self, ConfigError> {
        if let Some(r) = region
            && (r.is_empty() || !r.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
        {
            return Err(at.invalid(
                "region",
                format!("{r:?} is not an AWS region name (such as eu-west-1)"),
            ));
        }
        if let Some(url) = endpoint_url
            && !(url.starts_with("http://") || url.starts_with("https://"))
        {
            return Err(at.invalid(
                "endpoint_url",
                format!("{:?} is not an http:// or https:// URL", redact_url(url)),
            ));
        }
        Ok(Endpoint {
            region: region.map(str::to_owned),
            endpoint_url: endpoint_url.map(str::to_owned),
            timeout,
        })
    }

    /// The SDK config: the default chain for credentials and region, this endpoint's
    /// overrides, one attempt per call within the dispatch deadline. Fails without a region.
    async fn load(&self) -> Result<SdkConfig, String> {
        sdk_config(
            self.region.as_deref(),
            self.endpoint_url.as_deref(),
            self.timeout,
        )
        .await
    }
}

/// The SDK config every AWS destination uses: the default chain for credentials and region,
/// the given overrides, the HTTP client on rustls with the ring provider, no SDK retries,
/// each call within `timeout`. Fails without a region. Public for the benchmarks, which
/// create their queue, topic and stream with the same client settings.
pub async fn sdk_config(
    region: Option<&str>,
    endpoint_url: Option<&str>,
    timeout: Duration,
) -> Result<SdkConfig, String> {
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(
            tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https();
    let mut loader = aws_config::defaults(BehaviorVersion::latest())
        .http_client(http)
        .retry_config(RetryConfig::disabled())
        .timeout_config(
            TimeoutConfig::builder()
                .operation_timeout(timeout)
                .connect_timeout(timeout.min(Duration::from_secs(5)))
                .build(),
        );
    if let Some(region) = region {
        loader = loader.region(Region::new(region.to_owned()));
    }
    if let Some(url) = endpoint_url {
        loader = loader.endpoint_url(url);
    }
    let config = loader.load().await;
    if config.region().is_none() {
        return Err(
            "no AWS region: set `region` in the destination's table, or AWS_REGION, \
             or a region in the AWS profile"
                .to_owned(),
        );
    }
    Ok(config)
}

/// A service client, made on first use (loading the config may read files and ask the
/// instance metadata service) and kept: the SDK reconnects by itself.
struct Lazy<C> {
    endpoint: Endpoint,
    client: tokio::sync::OnceCell<C>,
}

impl<C: Clone> Lazy<C> {
    fn new(endpoint: Endpoint) -> Self {
        Lazy {
            endpoint,
            client: tokio::sync::OnceCell::new(),
        }
    }

    async fn get(&self, make: impl FnOnce(&SdkConfig) -> C) -> Result<C, String> {
        self.client
            .get_or_try_init(|| async { self.endpoint.load().await.map(|c| make(&c)) })
            .await
            .cloned()
    }
}

/// `{topic}` in `template` replaced by the message's topic.
fn expand(template: &str, m: &ClaimedMessage) -> String {
    template.replace("{topic}", &m.topic)
}

/// A whole call that failed: the outcome of each of its messages, and whether the refusal
/// may concern one entry only (then each entry is sent again on its own, so that one bad
/// message does not fail the others of its call).
struct Failure {
    outcome: Outcome,
    split: bool,
}

/// Error codes AWS services answer when they are busy or failing: retried.
const RETRYABLE_CODES: [&str; 26] = [
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "Throttled",
    "RequestThrottled",
    "RequestThrottledException",
    "TooManyRequestsException",
    "ProvisionedThroughputExceededException",
    "LimitExceededException",
    "RequestLimitExceeded",
    "BandwidthLimitExceeded",
    "SlowDown",
    "KmsThrottled",
    "KMSThrottlingException",
    "InternalFailure",
    "InternalError",
    "InternalServerError",
    "InternalException",
    "ServiceUnavailable",
    "ServiceUnavailableException",
    "RequestTimeout",
    "RequestTimeoutException",
    "ExpiredToken",
    "ExpiredTokenException",
    "RequestExpired",
    "IDPCommunicationError",
];

/// Error codes that say the relayer's credentials are wrong (not the message): retried, so
/// that messages wait in the outbox, behind an open circuit, until the credentials are
/// fixed, instead of being dead-lettered.
const CREDENTIAL_CODES: [&str; 6] = [
    "InvalidClientTokenId",
    "UnrecognizedClientException",
    "SignatureDoesNotMatch",
    "IncompleteSignature",
    "MissingAuthenticationToken",
    "InvalidSignatureException",
];

/// The code without the `AWS.SimpleQueueService.` style prefix some services give it.
fn short(code: &str) -> &str {
    code.rsplit('.').next().unwrap_or(code)
}

/// Whether an entry's error `code` is retryable: throttling, an internal failure, expired
/// or refused credentials.
fn retryable_code(code: &str) -> bool {
    let code = short(code);
    RETRYABLE_CODES.contains(&code) || CREDENTIAL_CODES.contains(&code)
}

/// A refusal of a resource rather than of a message (no such queue, topic or stream; access
/// denied; its KMS key): every message of the call is refused, none is sent again alone.
fn refuses_the_resource(code: &str) -> bool {
    let code = short(code);
    [
        "NotFound",
        "NonExistent",
        "DoesNotExist",
        "AccessDenied",
        "Authorization",
    ]
    .iter()
    .any(|part| code.contains(part))
        || code.starts_with("Kms")
        || code.starts_with("KMS")
}

/// The outcome of one entry the service refused within a batch call: `sender_fault` (or, for
/// services that do not say, the code) decides.
/// The outcomes of a call whose answer has one result per entry, in the order of the
/// request (PutEvents, PutRecords): each result's error code, absent when the entry was
/// taken, and message, paired with the batch index `ids` gives for that entry.
fn positional<'r>(
    what: &str,
    ids: Vec<usize>,
    results: impl Iterator<Item = (Option<&'r str>, Option<&'r str>)>,
) -> Vec<(usize, Outcome)> {
    ids.into_iter()
        .zip(results)
        .map(|(i, (code, message))| match code {
            None => (i, Outcome::Delivered),
            Some(code) => (i, entry_refused(what, code, message, true)),
        })
        .collect()
}

fn entry_refused(what: &str, code: &str, message: Option<&str>, sender_fault: bool) -> Outcome {
    let reason = match message {
        Some(m) if !m.is_empty() => format!("{what}: {code}: {m}"),
        _ => format!("{what}: {code}"),
    };
    if retryable_code(code) || !sender_fault {
        Outcome::Retryable {
            reason,
            retry_after: None,
        }
    } else {
        Outcome::Permanent { reason }
    }
}

/// An error and its sources, each once, as one line (`service error: QueueDoesNotExist:
/// …`, `dispatch failure: io error: … Connection refused`).
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let next = s.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = s.source();
    }
    text
}

/// A failed call in words that group: `{what}: Code: message` for a refusal by the service
/// (its request id, different on every call, goes to the debug log only), else the error
/// and its sources (`dispatch failure: io error: … Connection refused`).
fn reason_of<E>(what: &str, e: &SdkError<E>) -> String
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    match (e, e.code()) {
        (SdkError::ServiceError(_), Some(code)) => {
            tracing::debug!(call = what, error = %chain(e), "the service refused a call");
            match e.message().filter(|m| !m.is_empty()) {
                Some(message) => format!("{what}: {code}: {message}"),
                None => format!("{what}: {code}"),
            }
        }
        _ => format!("{what}: {}", chain(e)),
    }
}

/// What a failed call means for its messages: throttling, 5xx, timeouts and connection
/// failures are retryable; another refusal by the service (4xx: invalid parameter, message
/// too long, access denied, no such queue) is permanent.
fn call_failed<E>(what: &str, e: &SdkError<E>) -> Failure
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let reason = reason_of(what, e);
    let retry = |reason: String| Failure {
        outcome: Outcome::Retryable {
            reason,
            retry_after: None,
        },
        split: false,
    };
    match e {
        // Sent, and the answer did not come or could not be read: the service may have
        // taken the entries, so each is an attempt.
        SdkError::TimeoutError(_) | SdkError::ResponseError(_) => {
            return Failure {
                outcome: Outcome::Unanswered { reason },
                split: false,
            };
        }
        SdkError::ServiceError(_) => {}
        _ => return retry(reason),
    }
    let code = e.code().unwrap_or("");
    let status = e.raw_response().map(|r| r.status().as_u16());
    let busy = status.is_some_and(|s| s >= 500 || s == 408 || s == 429);
    if retryable_code(code) || busy || (code.is_empty() && status.is_none()) {
        return retry(reason);
    }
    Failure {
        outcome: Outcome::Permanent { reason },
        split: !refuses_the_resource(code),
    }
}

/// The message attributes of `m` for SQS and SNS, at most [`MAX_ATTRIBUTES`]: the outbox
/// metadata and `content-type` first, then the message's own headers in name order while
/// they fit; headers that do not fit, or whose name or value an attribute cannot carry, go
/// together in one `outbox-headers` attribute, a JSON object of names to text.
fn attributes(m: &ClaimedMessage) -> Result<Vec<(String, String)>, String> {
    let own = user_headers(m)?;
    let mut out: Vec<(String, String)> = metadata(m)
        .into_iter()
        .map(|(n, v)| (n.to_owned(), v))
        .collect();
    out.push(("content-type".to_owned(), m.content_type.clone()));
    let reserved: Vec<String> = out.iter().map(|(n, _)| n.clone()).collect();
    let own: Vec<(&str, String)> = own
        .into_iter()
        .filter(|(n, _)| !reserved.iter().any(|r| r == n) && *n != OVERFLOW)
        .collect();
    let free = MAX_ATTRIBUTES - out.len();
    let fits = |(n, v): &(&str, String)| attribute_name_ok(n) && attribute_value_ok(v);
    let all_fit = own.len() <= free && own.iter().all(fits);
    let slots = if all_fit { free } else { free - 1 };
    let mut rest = serde_json::Map::new();
    let mut taken = 0;
    for (name, value) in own {
        if taken < slots && fits(&(name, value.clone())) {
            taken += 1;
            out.push((name.to_owned(), value));
        } else {
            rest.insert(name.to_owned(), serde_json::Value::String(value));
        }
    }
    if !rest.is_empty() {
        out.push((
            OVERFLOW.to_owned(),
            serde_json::Value::Object(rest).to_string(),
        ));
    }
    Ok(out)
}

/// SQS and SNS carry at most 10 message attributes (SNS passes no more on to SQS).
const MAX_ATTRIBUTES: usize = 10;

/// The attribute holding the headers that are not attributes of their own.
const OVERFLOW: &str = "outbox-headers";

/// A name SQS and SNS take for a message attribute: up to 256 letters, digits, `_`, `-` and
/// `.`, no leading, trailing or double `.`, not starting with `AWS.` or `Amazon.`.
fn attribute_name_ok(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    !name.is_empty()
        && name.len() <= 256
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
        && !lower.starts_with("aws.")
        && !lower.starts_with("amazon.")
}

/// A value SQS and SNS take for a `String` attribute: not empty, and only the characters
/// SQS allows in message text.
fn attribute_value_ok(value: &str) -> bool {
    !value.is_empty() && value.chars().all(text_char_ok)
}

/// The characters SQS allows in a message body and attribute (XML 1.0's).
fn text_char_ok(c: char) -> bool {
    matches!(c, '\u{9}' | '\u{a}' | '\u{d}' | '\u{20}'..='\u{d7ff}' | '\u{e000}'..='\u{fffd}' | '\u{10000}'..)
}

/// The message's payload as the text body SQS and SNS carry; a payload that is not UTF-8
/// cannot be sent (permanent).
fn text_body(m: &ClaimedMessage) -> Result<String, String> {
    String::from_utf8(m.payload.clone()).map_err(|_| {
        format!(
            "the payload is not UTF-8 text (content type {}), and a message body of this \
             service is text",
            m.content_type
        )
    })
}

/// One message ready for a batch call: its index in the batch, its size as the service
/// counts it, and the service's entry.
struct Prepared<T> {
    index: usize,
    bytes: usize,
    entry: T,
}

/// Sends `prepared` (each bound for one target: a queue, topic, bus or stream) in calls of
/// at most `max_count` entries and `max_bytes` bytes, cut and sent in rounds as
/// [`calls`](super::calls) says (a key's run of `batch` in one call where it fits), up to
/// `concurrency` calls at once, each call checked against `window` before it is sent.
/// Within the dispatch deadline (`deadline`): no call starts after 70 % of it (its messages
/// are given back unattempted), and a call unanswered at 90 % is given up (an attempt of
/// each of its messages: they may have arrived), so that the calls that were answered
/// settle their messages instead of the whole batch timing out and being sent again.
/// `call` sends one call's entries and answers each entry's outcome by its batch index, or
/// the call's [`Failure`]; a failure that may concern one entry sends each entry again
/// alone (a key's entries after one not delivered are then not sent). Fills `outcomes`.
#[allow(clippy::too_many_arguments)]
async fn send_in_calls<T, F, Fut>(
    outcomes: &mut [Option<Outcome>],
    batch: &[ClaimedMessage],
    prepared: Vec<(String, Prepared<T>)>,
    max_count: usize,
    max_bytes: usize,
    concurrency: usize,
    deadline: Duration,
    window: &Window,
    call: F,
) where
    T: Clone,
    F: Fn(String, Vec<(usize, T)>) -> Fut,
    Fut: Future<Output = Result<Vec<(usize, Outcome)>, Failure>>,
{
    let entries = prepared
        .into_iter()
        .map(|(target, p)| Entry {
            at: p.index,
            target,
            key: batch[p.index].key.clone(),
            bytes: p.bytes,
            item: p.entry,
        })
        .collect();
    let entries = calls::behind_refused(batch, outcomes, entries);
    let planned = calls::plan(entries, max_count, max_bytes);
    let started = tokio::time::Instant::now();
    let last_start = started + deadline.mul_f64(0.7);
    let give_up = started + deadline.mul_f64(0.9);
    // Never sent: given back without an attempt.
    let late = || Outcome::NotAttempted {
        reason: format!(
            "not sent: the batch's dispatch deadline ({} ms) was near",
            deadline.as_millis()
        ),
    };
    // Sent and not answered: the service may have it; an attempt.
    let unanswered = || Failure {
        outcome: Outcome::Unanswered {
            reason: format!(
                "timed out: no answer within 90 % of the dispatch deadline ({} ms)",
                deadline.as_millis()
            ),
        },
        split: false,
    };
    let send = &call;
    let call = |target: String, entries: Vec<(usize, T)>| async move {
        if tokio::time::Instant::now() > last_start {
            return Ok(entries.iter().map(|(i, _)| (*i, late())).collect());
        }
        tokio::time::timeout_at(give_up, send(target, entries))
            .await
            .unwrap_or_else(|_| Err(unanswered()))
    };
    let call = &call;
    let results = calls::in_rounds(planned, concurrency, |planned| async move {
        let target = planned.target;
        let entries = planned.entries;
        let indexed = |e: &Entry<T>| (e.at, e.item.clone());
        if let Err(not_sent) = window.check() {
            return entries.iter().map(|e| (e.at, not_sent.clone())).collect();
        }
        match call(target.clone(), entries.iter().map(indexed).collect()).await {
            Ok(answered) => answered,
            Err(Failure { outcome, split }) if !split || entries.len() == 1 => {
                entries.iter().map(|e| (e.at, outcome.clone())).collect()
            }
            Err(_) => {
                let mut answered: Vec<(usize, Outcome)> = Vec::with_capacity(entries.len());
                let mut stopped = std::collections::HashSet::new();
                for e in &entries {
                    let outcome = match (&e.key, window.check()) {
                        (Some(k), _) if stopped.contains(k) => Outcome::behind_undelivered(k),
                        (_, Err(not_sent)) => not_sent,
                        (_, Ok(())) => match call(target.clone(), vec![indexed(e)]).await {
                            Ok(mut one) => one.pop().map_or_else(
                                || Outcome::Retryable {
                                    reason: format!(
                                        "{target}: the answer did not mention this message"
                                    ),
                                    retry_after: None,
                                },
                                |(_, o)| o,
                            ),
                            Err(f) => f.outcome,
                        },
                    };
                    if let Some(k) = &e.key
                        && outcome != Outcome::Delivered
                    {
                        stopped.insert(k.clone());
                    }
                    answered.push((e.at, outcome));
                }
                answered
            }
        }
    })
    .await;
    for (index, outcome) in results {
        outcomes[index] = Some(outcome);
    }
}

/// The outcomes in batch order; a message the service's answer did not mention is
/// retryable (it may or may not have arrived: the outbox_id lets a consumer tell).
fn finish(what: &str, outcomes: Vec<Option<Outcome>>) -> Vec<Outcome> {
    outcomes
        .into_iter()
        .map(|o| {
            o.unwrap_or_else(|| Outcome::Retryable {
                reason: format!("{what}: the answer did not mention this message"),
                retry_after: None,
            })
        })
        .collect()
}

/// `concurrency` of a destination: calls in flight per batch, 1..=64 [default: 8].
fn concurrency(at: Setting<'_>, value: Option<i64>) -> Result<usize, ConfigError> {
    at.ranged("concurrency", value, 8, 1, 64)
        .map(|n| usize::try_from(n).unwrap_or(8))
}

/// A name template must not be empty.
fn template(
    at: Setting<'_>,
    field: &str,
    value: Option<&str>,
    default: &str,
) -> Result<String, ConfigError> {
    let t = value.unwrap_or(default);
    if t.trim().is_empty() {
        return Err(at.invalid(field, "must not be empty"));
    }
    Ok(t.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_fill_the_attributes_after_the_outbox_ones_and_the_rest_go_as_json() {
        let mut m = ClaimedMessage::example(serde_json::json!({
            "traceparent": "00-ab-cd-01", "x-a": "1", "x-b": "2"
        }));
        m.key = Some("k".into());
        let a = attributes(&m).unwrap();
        // The outbox's six (id, topic, attempt, key, seq, content-type), then the three own.
        assert_eq!(a.len(), 6 + 3, "{a:?}");
        assert!(a.iter().all(|(n, _)| n != OVERFLOW));

        let many: serde_json::Map<_, _> = (0..8)
            .map(|i| (format!("h{i}"), serde_json::Value::String(i.to_string())))
            .chain([("bad name".to_owned(), serde_json::json!("v"))])
            .collect();
        let m = ClaimedMessage::example(serde_json::Value::Object(many));
        let a = attributes(&m).unwrap();
        assert_eq!(a.len(), MAX_ATTRIBUTES, "{a:?}");
        let names: Vec<&str> = a.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            &names[..4],
            [
                "outbox-id",
                "outbox-topic",
                "outbox-attempt",
                "content-type"
            ]
        );
        let overflow: serde_json::Value = serde_json::from_str(&a.last().unwrap().1).unwrap();
        assert_eq!(a.last().unwrap().0, OVERFLOW);
        // 10 attributes: 4 of the outbox, 5 headers, the overflow with the other 4.
        assert_eq!(overflow.as_object().unwrap().len(), 4, "{overflow}");
        assert_eq!(overflow["bad name"], "v");
    }

    #[test]
    fn attribute_names_follow_the_services_rules() {
        for ok in ["traceparent", "x-tenant", "a.b", "A_1"] {
            assert!(attribute_name_ok(ok), "{ok}");
        }
        for bad in ["", "a b", ".a", "a.", "a..b", "AWS.x", "amazon.y", "é"] {
            assert!(!attribute_name_ok(bad), "{bad}");
        }
        assert!(!attribute_value_ok(""));
        assert!(!attribute_value_ok("a\u{1}b"));
    }

    #[test]
    fn codes_sort_into_retryable_and_permanent() {
        assert!(retryable_code("ThrottlingException"));
        assert!(retryable_code("AWS.SimpleQueueService.RequestThrottled"));
        assert!(retryable_code("InternalFailure"));
        assert!(!retryable_code("InvalidParameterValue"));
        assert!(refuses_the_resource(
            "AWS.SimpleQueueService.NonExistentQueue"
        ));
        assert!(refuses_the_resource("QueueDoesNotExist"));
        assert!(refuses_the_resource("ResourceNotFoundException"));
        assert!(refuses_the_resource("AccessDenied"));
        assert!(!refuses_the_resource("InvalidParameterValue"));
        assert_eq!(
            entry_refused("sqs", "InvalidMessageContents", Some("bad"), true),
            Outcome::Permanent {
                reason: "sqs: InvalidMessageContents: bad".into()
            }
        );
        assert!(matches!(
            entry_refused("sqs", "InternalError", None, false),
            Outcome::Retryable { .. }
        ));
    }
}

//! The `sqs` destination: Amazon SQS `SendMessageBatch` to a queue named by URL or by name
//! (`{topic}` in either replaced), in calls of at most 10 entries and 256 KiB. Each entry's
//! result is its own message's outcome. The outbox metadata and the message's headers are
//! message attributes (see [`super::attributes`]). On a FIFO queue (a name ending in
//! `.fifo`) the `MessageDeduplicationId` is the outbox_id, so SQS drops a redelivery within
//! its 5-minute deduplication interval, and the `MessageGroupId` is the message key (or
//! `unkeyed_group_id`, or else the outbox_id, for a message without one), so a key's
//! messages are received in order. By default a key's messages go one call after the
//! other, each only once its predecessor was accepted. SQS writes a FIFO batch's entries in
//! the order of the batch, so with `runs_in_one_call` on a queue named `….fifo` in the
//! `queue` setting a key's run goes in one `SendMessageBatch` (up to 10 entries, later
//! calls one after the other); SQS answers per entry, and an entry refused while a later
//! one of its group is accepted lets that later one be received before the refused one's
//! retry.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use futures_util::future::BoxFuture;

use super::{
    Endpoint, Failure, Lazy, Prepared, attributes, call_failed, concurrency, entry_refused, expand,
    finish, send_in_calls, template, text_body,
};
use crate::destination::{Destination, Setting, Window};
use crate::error::ConfigError;
use crate::message::{ClaimedMessage, Outcome};

/// Entries per `SendMessageBatch` call.
const MAX_ENTRIES: usize = 10;
/// Bytes per call, bodies and attributes together (SQS's batch limit).
const MAX_BATCH_BYTES: usize = 256 * 1024;

/// `type = "sqs"`.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SqsConfig {
    /// Queue URL or name, `{topic}` replaced [default: `{topic}`].
    pub queue: Option<String>,
    /// AWS region [default: the SDK's chain: AWS_REGION, the profile].
    pub region: Option<String>,
    /// Endpoint override (a local SQS-compatible server, a VPC endpoint).
    pub endpoint_url: Option<String>,
    /// FIFO queues: the MessageGroupId of unkeyed messages [default: the outbox_id].
    pub unkeyed_group_id: Option<String>,
    /// SendMessageBatch calls in flight per batch, 1..=64 [default: 8].
    pub concurrency: Option<i64>,
    /// On a FIFO queue named in `queue`, send a key's run of messages in one
    /// SendMessageBatch call instead of one call per message of the key [default: false].
    pub runs_in_one_call: Option<bool>,
}

impl SqsConfig {
    pub(in crate::destination) fn build(
        &self,
        at: Setting<'_>,
        deadline: Duration,
    ) -> Result<Sqs, ConfigError> {
        let queue = template(at, "queue", self.queue.as_deref(), "{topic}")?;
        if let Some(g) = &self.unkeyed_group_id
            && (g.is_empty() || g.len() > 128)
        {
            return Err(at.invalid("unkeyed_group_id", "must be 1 to 128 characters"));
        }
        Ok(Sqs {
            client: Lazy::new(Endpoint::new(
                at,
                self.region.as_deref(),
                self.endpoint_url.as_deref(),
                deadline,
            )?),
            queue,
            unkeyed_group_id: self.unkeyed_group_id.clone(),
            concurrency: concurrency(at, self.concurrency)?,
            deadline,
            urls: tokio::sync::Mutex::new(HashMap::new()),
            runs_in_one_call: self.runs_in_one_call.unwrap_or(false),
        })
    }
}

pub struct Sqs {
    client: Lazy<Client>,
    queue: String,
    unkeyed_group_id: Option<String>,
    concurrency: usize,
    /// The dispatch deadline of a batch.
    deadline: Duration,
    /// Queue URLs of the queue names seen so far.
    urls: tokio::sync::Mutex<HashMap<String, String>>,
    /// `runs_in_one_call`: a key's run goes in one call on a FIFO queue.
    runs_in_one_call: bool,
}

fn is_url(queue: &str) -> bool {
    queue.starts_with("https://") || queue.starts_with("http://")
}

impl Sqs {
    async fn client(&self) -> Result<Client, String> {
        self.client.get(Client::new).await
    }

    /// The URL of `queue` (a URL already, or a name looked up once with GetQueueUrl).
    async fn url(&self, client: &Client, queue: &str) -> Result<String, Failure> {
        if is_url(queue) {
            return Ok(queue.to_owned());
        }
        if let Some(url) = self.urls.lock().await.get(queue) {
            return Ok(url.clone());
        }
        let answer = client
            .get_queue_url()
            .queue_name(queue)
            .send()
            .await
            .map_err(|e| call_failed(&format!("sqs GetQueueUrl {queue}"), &e))?;
        let url = answer.queue_url().unwrap_or_default().to_owned();
        self.urls.lock().await.insert(queue.to_owned(), url.clone());
        Ok(url)
    }

    /// The entry of `m` (id: its index in the batch) and its size, or why it cannot be sent.
    fn entry(
        &self,
        index: usize,
        m: &ClaimedMessage,
        fifo: bool,
    ) -> Result<Prepared<SendMessageBatchRequestEntry>, String> {
        let body = text_body(m)?;
        let mut bytes = body.len();
        let mut attrs = HashMap::new();
        for (name, value) in attributes(m)? {
            bytes += name.len() + "String".len() + value.len();
            let v = MessageAttributeValue::builder()
                .data_type("String")
                .string_value(value)
                .build()
                .map_err(|e| format!("attribute {name:?}: {e}"))?;
            attrs.insert(name, v);
        }
        let mut entry = SendMessageBatchRequestEntry::builder()
            .id(index.to_string())
            .message_body(body)
            .set_message_attributes(Some(attrs));
        if fifo {
            let group = match (&m.key, &self.unkeyed_group_id) {
                (Some(key), _) => key.clone(),
                (None, Some(constant)) => constant.clone(),
                (None, None) => m.id.to_string(),
            };
            entry = entry
                .message_deduplication_id(m.id.to_string())
                .message_group_id(group);
        }
        Ok(Prepared {
            index,
            bytes,
            entry: entry.build().map_err(|e| e.to_string())?,
        })
    }
}

impl Destination for Sqs {
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let client = match self.client().await {
                Ok(c) => c,
                Err(reason) => {
                    return vec![
                        Outcome::Retryable {
                            reason,
                            retry_after: None
                        };
                        batch.len()
                    ];
                }
            };
            let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
            let mut prepared = Vec::with_capacity(batch.len());
            for (index, m) in batch.iter().enumerate() {
                let queue = expand(&self.queue, m);
                let url = match self.url(&client, &queue).await {
                    Ok(url) => url,
                    Err(f) => {
                        outcomes[index] = Some(f.outcome);
                        continue;
                    }
                };
                let fifo = url.trim_end_matches('/').ends_with(".fifo");
                match self.entry(index, m, fifo) {
                    Ok(p) => prepared.push((url, p)),
                    Err(reason) => outcomes[index] = Some(Outcome::Permanent { reason }),
                }
            }
            send_in_calls(
                &mut outcomes,
                batch,
                prepared,
                MAX_ENTRIES,
                MAX_BATCH_BYTES,
                self.concurrency,
                self.deadline,
                window,
                |url, entries| {
                    let client = client.clone();
                    async move {
                        let ids: Vec<usize> = entries.iter().map(|(i, _)| *i).collect();
                        let answer = client
                            .send_message_batch()
                            .queue_url(&url)
                            .set_entries(Some(entries.into_iter().map(|(_, e)| e).collect()))
                            .send()
                            .await
                            .map_err(|e| call_failed(&format!("sqs SendMessageBatch {url}"), &e))?;
                        let index = |id: &str| id.parse::<usize>().ok().filter(|i| ids.contains(i));
                        let mut answered = Vec::with_capacity(ids.len());
                        for ok in answer.successful() {
                            if let Some(i) = index(ok.id()) {
                                answered.push((i, Outcome::Delivered));
                            }
                        }
                        for failed in answer.failed() {
                            if let Some(i) = index(failed.id()) {
                                answered.push((
                                    i,
                                    entry_refused(
                                        "sqs SendMessageBatch",
                                        failed.code(),
                                        failed.message(),
                                        failed.sender_fault(),
                                    ),
                                ));
                            }
                        }
                        Ok(answered)
                    }
                },
            )
            .await;
            finish("sqs SendMessageBatch", outcomes)
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            // The region and credentials resolve; the queue itself is checked by sending.
            self.client().await.map(|_| ())
        })
    }

    /// A FIFO queue keeps the order of a message group's messages within a
    /// `SendMessageBatch` (in the order of its entries) and across calls: true when
    /// `runs_in_one_call` is set and the `queue` setting names one (ends with `.fifo`). A
    /// standard queue keeps no order, and a template whose name ends only after `{topic}` is
    /// expanded may name either, so those take a key's messages one call after the other.
    fn keeps_key_order(&self) -> bool {
        self.runs_in_one_call && self.queue.trim_end_matches('/').ends_with(".fifo")
    }
}

//! The `sns` destination: Amazon SNS `PublishBatch` to a topic ARN (`{topic}` replaced), in
//! calls of at most 10 entries and 256 KiB, each entry's result its own message's outcome.
//! The outbox metadata and the message's headers are message attributes (see
//! [`super::attributes`]). On a FIFO topic (an ARN ending in `.fifo`) the
//! `MessageDeduplicationId` is the outbox_id and the `MessageGroupId` the message key (or
//! `unkeyed_group_id`, or else the outbox_id), as for SQS.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_sns::Client;
use aws_sdk_sns::types::{MessageAttributeValue, PublishBatchRequestEntry};
use futures_util::future::BoxFuture;

use super::{
    Endpoint, Lazy, Prepared, attributes, call_failed, concurrency, entry_refused, expand, finish,
    send_in_calls, text_body,
};
use crate::destination::{Destination, Setting, Window};
use crate::error::ConfigError;
use crate::message::{ClaimedMessage, Outcome};

/// Entries per `PublishBatch` call.
const MAX_ENTRIES: usize = 10;
/// Bytes per call, messages and attributes together (SNS's batch limit).
const MAX_BATCH_BYTES: usize = 256 * 1024;

/// `type = "sns"`.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnsConfig {
    /// Topic ARN, `{topic}` replaced.
    pub topic_arn: String,
    /// AWS region [default: the SDK's chain: AWS_REGION, the profile].
    pub region: Option<String>,
    /// Endpoint override (a local SNS-compatible server, a VPC endpoint).
    pub endpoint_url: Option<String>,
    /// FIFO topics: the MessageGroupId of unkeyed messages [default: the outbox_id].
    pub unkeyed_group_id: Option<String>,
    /// PublishBatch calls in flight per batch, 1..=64 [default: 8].
    pub concurrency: Option<i64>,
}

impl SnsConfig {
    pub(in crate::destination) fn build(
        &self,
        at: Setting<'_>,
        deadline: Duration,
    ) -> Result<Sns, ConfigError> {
        if !self.topic_arn.starts_with("arn:") {
            return Err(at.invalid(
                "topic_arn",
                format!(
                    "{:?} is not an ARN (arn:aws:sns:REGION:ACCOUNT:NAME)",
                    self.topic_arn
                ),
            ));
        }
        if let Some(g) = &self.unkeyed_group_id
            && (g.is_empty() || g.len() > 128)
        {
            return Err(at.invalid("unkeyed_group_id", "must be 1 to 128 characters"));
        }
        Ok(Sns {
            client: Lazy::new(Endpoint::new(
                at,
                self.region.as_deref(),
                self.endpoint_url.as_deref(),
                deadline,
            )?),
            topic_arn: self.topic_arn.clone(),
            unkeyed_group_id: self.unkeyed_group_id.clone(),
            concurrency: concurrency(at, self.concurrency)?,
            deadline,
        })
    }
}

pub struct Sns {
    client: Lazy<Client>,
    topic_arn: String,
    unkeyed_group_id: Option<String>,
    concurrency: usize,
    /// The dispatch deadline of a batch.
    deadline: Duration,
}

impl Sns {
    /// The entry of `m` (id: its index in the batch) and its size, or why it cannot be sent.
    fn entry(
        &self,
        index: usize,
        m: &ClaimedMessage,
        fifo: bool,
    ) -> Result<Prepared<PublishBatchRequestEntry>, String> {
        let body = text_body(m)?;
        if body.is_empty() {
            return Err("the payload is empty, and an SNS message must not be".to_owned());
        }
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
        let mut entry = PublishBatchRequestEntry::builder()
            .id(index.to_string())
            .message(body)
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

impl Destination for Sns {
    fn publish<'a>(
        &'a self,
        batch: &'a [ClaimedMessage],
        window: &'a Window,
    ) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let client = match self.client.get(Client::new).await {
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
                let arn = expand(&self.topic_arn, m);
                match self.entry(index, m, arn.ends_with(".fifo")) {
                    Ok(p) => prepared.push((arn, p)),
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
                |arn, entries| {
                    let client = client.clone();
                    async move {
                        let ids: Vec<usize> = entries.iter().map(|(i, _)| *i).collect();
                        let answer = client
                            .publish_batch()
                            .topic_arn(&arn)
                            .set_publish_batch_request_entries(Some(
                                entries.into_iter().map(|(_, e)| e).collect(),
                            ))
                            .send()
                            .await
                            .map_err(|e| call_failed(&format!("sns PublishBatch {arn}"), &e))?;
                        let index = |id: &str| id.parse::<usize>().ok().filter(|i| ids.contains(i));
                        let mut answered = Vec::with_capacity(ids.len());
                        for ok in answer.successful() {
                            if let Some(i) = ok.id().and_then(index) {
                                answered.push((i, Outcome::Delivered));
                            }
                        }
                        for failed in answer.failed() {
                            if let Some(i) = index(failed.id()) {
                                answered.push((
                                    i,
                                    entry_refused(
                                        "sns PublishBatch",
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
            finish("sns PublishBatch", outcomes)
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move { self.client.get(Client::new).await.map(|_| ()) })
    }
}

//! The `kinesis` destination: Amazon Kinesis Data Streams `PutRecords` to a stream
//! (`{topic}` in its name replaced), in calls of at most 500 records and 5 MiB, each
//! record's result its own message's outcome. The partition key is the message key, or the
//! outbox_id for an unkeyed message; the record's data is the message as one JSON object, the
//! same as a line of the `file` destination (outbox_id, topic, key, attempt, content type,
//! headers, payload), since a Kinesis record has no headers.
//!
//! Order: Kinesis orders records by sequence number within a shard, and a partition key
//! always maps to one shard while the stream is not resharded. By default a key's messages
//! go one call after the other, each only once its predecessor was written, so a key's first
//! deliveries reach the stream in enqueue order. With `runs_in_one_call`, a key's run goes
//! in one `PutRecords` call, in enqueue order ([`Destination::keeps_key_order`]), or in calls
//! one after the other when it does not fit in one: faster keyed traffic, a weaker order.
//! `PutRecords` answers per record and does not stop at a refused one
//! (`ProvisionedThroughputExceededException`, `InternalFailure`): the records of the key
//! after a refused one may have been written. The relayer counts those not delivered (an
//! attempt, sent again after the refused one), so that in the stream a key's messages can
//! appear early, once, before the refused one's retry, and then again in order: a consumer
//! that keeps, per key, the highest `seq` it has processed, processes each message once and
//! in order only if it waits for the missing `seq` instead of skipping it. A message retried
//! after a lost acknowledgement may appear twice, never only after its successor. Across a
//! reshard a key moves to a child shard, and a consumer keeps the order only by finishing the
//! parent shard first (the KCL does).

use std::time::Duration;

use aws_sdk_kinesis::Client;
use aws_sdk_kinesis::primitives::Blob;
use aws_sdk_kinesis::types::PutRecordsRequestEntry;
use futures_util::future::BoxFuture;

use super::{
    Endpoint, Lazy, Prepared, call_failed, concurrency, expand, finish, positional, send_in_calls,
    template,
};
use crate::destination::jsonl::envelope;
use crate::destination::{Destination, Setting, Window};
use crate::error::ConfigError;
use crate::message::{ClaimedMessage, Outcome};

/// Records per `PutRecords` call.
const MAX_RECORDS: usize = 500;
/// Bytes per call, data and partition keys together.
const MAX_CALL_BYTES: usize = 5 * 1024 * 1024;
/// The longest partition key Kinesis takes, in characters.
const MAX_KEY_CHARS: usize = 256;

/// `type = "kinesis"`.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KinesisConfig {
    /// Stream name, `{topic}` replaced [default: `{topic}`].
    pub stream: Option<String>,
    /// AWS region [default: the SDK's chain: AWS_REGION, the profile].
    pub region: Option<String>,
    /// Endpoint override (a local Kinesis-compatible server, a VPC endpoint).
    pub endpoint_url: Option<String>,
    /// PutRecords calls in flight per batch, 1..=64 [default: 8].
    pub concurrency: Option<i64>,
    /// Send a key's run of messages in one PutRecords call instead of one call per message
    /// of the key [default: false]. PutRecords answers per record and goes on after a
    /// refused one, so a refused record lets the later records of its key in that call
    /// reach the stream before its retry.
    pub runs_in_one_call: Option<bool>,
}

impl KinesisConfig {
    pub(in crate::destination) fn build(
        &self,
        at: Setting<'_>,
        deadline: Duration,
    ) -> Result<Kinesis, ConfigError> {
        Ok(Kinesis {
            stream: template(at, "stream", self.stream.as_deref(), "{topic}")?,
            client: Lazy::new(Endpoint::new(
                at,
                self.region.as_deref(),
                self.endpoint_url.as_deref(),
                deadline,
            )?),
            concurrency: concurrency(at, self.concurrency)?,
            deadline,
            runs_in_one_call: self.runs_in_one_call.unwrap_or(false),
        })
    }
}

pub struct Kinesis {
    client: Lazy<Client>,
    stream: String,
    concurrency: usize,
    /// `runs_in_one_call`: a key's run goes in one call.
    runs_in_one_call: bool,
    /// The dispatch deadline of a batch.
    deadline: Duration,
}

/// The record of `m` and its size, or why it cannot be sent.
fn record(index: usize, m: &ClaimedMessage) -> Result<Prepared<PutRecordsRequestEntry>, String> {
    let key = match &m.key {
        Some(k) if k.chars().count() > MAX_KEY_CHARS => {
            return Err(format!(
                "the message key has {} characters, and a Kinesis partition key at most {MAX_KEY_CHARS}",
                k.chars().count()
            ));
        }
        Some(k) => k.clone(),
        None => m.id.to_string(),
    };
    let data = envelope(m)?;
    let bytes = data.len() + key.len();
    let entry = PutRecordsRequestEntry::builder()
        .data(Blob::new(data))
        .partition_key(key)
        .build()
        .map_err(|e| e.to_string())?;
    Ok(Prepared {
        index,
        bytes,
        entry,
    })
}

impl Destination for Kinesis {
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
                match record(index, m) {
                    Ok(p) => prepared.push((expand(&self.stream, m), p)),
                    Err(reason) => outcomes[index] = Some(Outcome::Permanent { reason }),
                }
            }
            send_in_calls(
                &mut outcomes,
                batch,
                prepared,
                MAX_RECORDS,
                MAX_CALL_BYTES,
                self.concurrency,
                self.deadline,
                window,
                |stream, entries| {
                    let client = client.clone();
                    async move {
                        let ids: Vec<usize> = entries.iter().map(|(i, _)| *i).collect();
                        let answer = client
                            .put_records()
                            .stream_name(&stream)
                            .set_records(Some(entries.into_iter().map(|(_, e)| e).collect()))
                            .send()
                            .await
                            .map_err(|e| {
                                call_failed(&format!("kinesis PutRecords {stream}"), &e)
                            })?;
                        // One result per record, in the order of the request.
                        Ok(positional(
                            "kinesis PutRecords",
                            ids,
                            answer
                                .records()
                                .iter()
                                .map(|r| (r.error_code(), r.error_message())),
                        ))
                    }
                },
            )
            .await;
            finish("kinesis PutRecords", outcomes)
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move { self.client.get(Client::new).await.map(|_| ()) })
    }

    fn keeps_key_order(&self) -> bool {
        self.runs_in_one_call
    }
}

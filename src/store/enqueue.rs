//! `outbox.enqueue`: how producers (and `outbox-relay enqueue`) add a message, on a
//! connection of the pool or on the caller's own transaction.

use tokio_postgres::types::{ToSql, Type};

use super::{Result, Store, StoreError};
use crate::message::{NewMessage, OutboxId, Payload};

impl Store {
    /// `outbox.enqueue` on a connection of the pool, in a transaction of its own.
    pub async fn enqueue(&self, message: &NewMessage) -> Result<OutboxId> {
        let client = self.client().await?;
        Ok(enqueue_into(&**client, self.schema(), message).await?)
    }
}

/// `outbox.enqueue` on the caller's own connection or transaction, so the message commits
/// (and wakes the relayers) with the caller's other writes, or not at all. Takes a
/// `tokio_postgres::Transaction` or `Client`; from a `deadpool_postgres` pool, pass
/// `&*transaction` or `&**client`. The login needs the `outbox_producer` role.
///
/// ```no_run
/// # async fn order_placed(pool: deadpool_postgres::Pool) -> anyhow::Result<()> {
/// use outbox_relay::message::{NewMessage, TraceContext};
///
/// let mut client = pool.get().await?;
/// let tx = client.transaction().await?;
/// tx.execute("UPDATE orders SET state = 'placed' WHERE id = $1", &[&42_i64]).await?;
/// let id = outbox_relay::store::enqueue(
///     &*tx,
///     &NewMessage {
///         topic: "orders.placed".into(),
///         key: Some("order-42".into()),
///         payload: serde_json::json!({"order_id": 42}).into(),
///         // the request's span, as its W3C traceparent (docs/tracing.md)
///         trace: TraceContext::parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", None),
///         ..NewMessage::default()
///     },
/// )
/// .await?;
/// tx.commit().await?; // the order and its message, together
/// println!("enqueued {id}");
/// # Ok(())
/// # }
/// ```
pub async fn enqueue(
    client: &impl tokio_postgres::GenericClient,
    message: &NewMessage,
) -> std::result::Result<OutboxId, tokio_postgres::Error> {
    enqueue_into(client, crate::connection::DEFAULT_SCHEMA, message).await
}

/// [`enqueue`] into the outbox held by `schema` (an outbox migrated with `outbox_schema`
/// set to that name). A name that is not a valid outbox schema name
/// ([`crate::connection::check_schema_name`]) is refused before anything is sent.
pub async fn enqueue_in(
    client: &impl tokio_postgres::GenericClient,
    schema: &str,
    message: &NewMessage,
) -> Result<OutboxId> {
    crate::connection::check_schema_name(schema).map_err(StoreError::InvalidArgument)?;
    Ok(enqueue_into(client, schema, message).await?)
}

/// The statement of [`enqueue`] and [`enqueue_in`], `schema` checked.
async fn enqueue_into(
    client: &impl tokio_postgres::GenericClient,
    schema: &str,
    message: &NewMessage,
) -> std::result::Result<OutboxId, tokio_postgres::Error> {
    let traceparent = message.trace.as_ref().map(|t| t.traceparent.as_str());
    let tracestate = message.trace.as_ref().and_then(|t| t.tracestate.as_deref());
    let common: [(&(dyn ToSql + Sync), Type); 8] = [
        (&message.topic, Type::TEXT),
        (&message.key, Type::TEXT),
        (&message.headers, Type::JSONB),
        (&message.available_at, Type::TIMESTAMPTZ),
        (&message.id.map(|id| id.0), Type::UUID),
        (&message.max_attempts, Type::INT4),
        (&traceparent, Type::TEXT),
        (&tracestate, Type::TEXT),
    ];
    // Unnamed, with the parameter types given: one round trip, and nothing left on the
    // server connection, so it works through a transaction pooler.
    let row = match &message.payload {
        Payload::Json(json) => client
            .query_typed_one(
                &super::naming::in_schema(
                    "SELECT outbox.enqueue($1, $9::jsonb, $2, coalesce($3::jsonb, '{}'), $4, $5, \
                     coalesce($6, 10), $7, $8)",
                    schema,
                ),
                &[&common[..], &[(json, Type::JSONB)]].concat(),
            )
            .await?,
        Payload::Bytes { data, content_type } => client
            .query_typed_one(
                &super::naming::in_schema(
                    "SELECT outbox.enqueue($1, $9::bytea, $2, coalesce($3::jsonb, '{}'), $4, $5, \
                     coalesce($6, 10), $10, $7, $8)",
                    schema,
                ),
                &[
                    &common[..],
                    &[(data, Type::BYTEA), (content_type, Type::TEXT)],
                ]
                .concat(),
            )
            .await?,
    };
    Ok(OutboxId(row.get(0)))
}

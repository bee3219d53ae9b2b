//! Synthetic messages for `outbox-relay bench` and the tests: many rows in one `INSERT`
//! straight into `outbox.messages` (not through `outbox.enqueue`, so a million cost seconds,
//! not minutes). It needs the schema owner's rights; producers use [`super::enqueue`].

use tokio_postgres::Client;

use crate::connection::DEFAULT_SCHEMA;

/// Inserts $2 messages on topic $1 in one statement, numbered i = $6, $6 + 1, …. The
/// payload is `{"n": i}`, padded with a `pad` field to about $5 bytes when that is larger;
/// with $3 = k, every message whose i is a multiple of k gets the key `'k' || (i % $4)`
/// (k = 10 and $4 = 1,000 give 100 keys, each taken in turn as i goes on).
const FILL: &str = "INSERT INTO outbox.messages (topic, message_key, payload) \
     SELECT $1, CASE WHEN i % $3::bigint = 0 THEN 'k' || (i % $4::bigint) END, \
            convert_to(CASE WHEN $5::int > 0 \
                            THEN json_build_object('n', i, 'pad', repeat('x', greatest($5::int - 20 - length(i::text), 0))) \
                            ELSE json_build_object('n', i) END::text, 'UTF8') \
       FROM generate_series($6::bigint, $6::bigint + $2::bigint - 1) AS i";

/// Inserts `n` messages on `topic` (see [`FILL`] for the payload and the keys).
pub async fn fill_messages(
    c: &Client,
    topic: &str,
    n: i64,
    keyed_every: Option<i64>,
    keys: i64,
    payload_bytes: i32,
) -> Result<u64, tokio_postgres::Error> {
    fill_messages_numbered(c, topic, 1, n, keyed_every, keys, payload_bytes).await
}

/// [`fill_messages`], numbering the messages from `first`: a producer that fills in many
/// small statements passes how many it has filled so far plus one, so that its keys go
/// round all of them instead of the few that the first numbers of each statement give.
pub async fn fill_messages_numbered(
    c: &Client,
    topic: &str,
    first: i64,
    n: i64,
    keyed_every: Option<i64>,
    keys: i64,
    payload_bytes: i32,
) -> Result<u64, tokio_postgres::Error> {
    c.execute(
        FILL,
        &[&topic, &n, &keyed_every, &keys, &payload_bytes, &first],
    )
    .await
}

/// [`fill_messages`], returning the ids in enqueue order.
pub async fn fill_messages_returning_ids(
    c: &Client,
    topic: &str,
    n: i64,
    keyed_every: Option<i64>,
    keys: i64,
    payload_bytes: i32,
) -> Result<Vec<uuid::Uuid>, tokio_postgres::Error> {
    fill_messages_returning_ids_in(
        c,
        DEFAULT_SCHEMA,
        topic,
        n,
        keyed_every,
        keys,
        payload_bytes,
    )
    .await
}

/// [`fill_messages_returning_ids`] into the outbox held by `schema`.
///
/// # Panics
///
/// When `schema` is not a valid outbox schema name
/// ([`crate::connection::check_schema_name`]).
pub async fn fill_messages_returning_ids_in(
    c: &Client,
    schema: &str,
    topic: &str,
    n: i64,
    keyed_every: Option<i64>,
    keys: i64,
    payload_bytes: i32,
) -> Result<Vec<uuid::Uuid>, tokio_postgres::Error> {
    crate::connection::check_schema_name(schema).unwrap_or_else(|e| panic!("{e}"));
    let rows = c
        .query(
            &*super::naming::in_schema(&format!("{FILL} RETURNING outbox_id"), schema),
            &[&topic, &n, &keyed_every, &keys, &payload_bytes, &1_i64],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

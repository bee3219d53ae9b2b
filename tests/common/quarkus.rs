//! The outbox table of Debezium's Quarkus outbox extension, and the statements the
//! extension sends, as an application using it writes them: what the adoption of a table
//! (`schema/10_adopt.sql`) is tested with, in the SQL API's tests and against a broker.

/// The table the extension documents (`OutboxEvent`), with the payload as jsonb (its
/// PostgreSQL setting, `quarkus.debezium-outbox.payload.type=jsonb`).
pub const TABLE: &str = "CREATE TABLE public.outboxevent (
    id uuid NOT NULL,
    aggregatetype varchar(255) NOT NULL,
    aggregateid varchar(255) NOT NULL,
    type varchar(255) NOT NULL,
    timestamp timestamp NOT NULL,
    payload jsonb,
    tracingspancontext varchar(256),
    PRIMARY KEY (id)
)";

/// The extension's insert, in Hibernate's column order: aggregatetype, aggregateid, type,
/// timestamp, payload, tracingspancontext, id.
pub const INSERT: &str = "INSERT INTO outboxevent \
    (aggregatetype, aggregateid, type, timestamp, payload, tracingspancontext, id) \
    VALUES ($1, $2, $3, $4, $5, $6, $7)";

/// Its delete of the row just inserted, in the same transaction (`remove-after-insert`,
/// the default), which keeps the table empty.
pub const DELETE: &str = "DELETE FROM outboxevent WHERE id = $1";

/// A trace context as the extension writes it (`java.util.Properties`), with a W3C
/// traceparent.
pub const TRACE: &str = "#\n#Sat Nov 28 16:00:00 UTC 2026\n\
    traceparent=00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\n";

/// The traceparent of [`TRACE`].
pub const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

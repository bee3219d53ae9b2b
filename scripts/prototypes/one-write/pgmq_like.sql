-- A pgmq-shaped queue (pgmq 1.x's queue table and the statements of its read and delete),
-- written out here because the prototypes' run has no pgmq install: a message row with a
-- visibility time in an index, read by an UPDATE of that time over the first rows
-- FOR UPDATE SKIP LOCKED, and deleted by id. No lease token, no attempt log, no key order.
CREATE SCHEMA pgmq_like;

CREATE TABLE pgmq_like.q (
    msg_id       bigint      PRIMARY KEY GENERATED ALWAYS AS IDENTITY,
    read_ct      integer     NOT NULL DEFAULT 0,
    enqueued_at  timestamptz NOT NULL DEFAULT now(),
    last_read_at timestamptz,
    vt           timestamptz NOT NULL DEFAULT clock_timestamp(),
    message      jsonb,
    headers      jsonb
);
CREATE INDEX q_vt_idx ON pgmq_like.q (vt ASC);

CREATE FUNCTION pgmq_like.read(p_vt integer, p_qty integer) RETURNS SETOF pgmq_like.q
LANGUAGE sql AS $$
    WITH cte AS (
        SELECT msg_id FROM pgmq_like.q
         WHERE vt <= clock_timestamp()
         ORDER BY msg_id ASC
         LIMIT p_qty
           FOR UPDATE SKIP LOCKED)
    UPDATE pgmq_like.q AS m
       SET last_read_at = clock_timestamp(),
           vt = clock_timestamp() + make_interval(secs => p_vt),
           read_ct = read_ct + 1
      FROM cte
     WHERE m.msg_id = cte.msg_id
    RETURNING m.*
$$;

CREATE FUNCTION pgmq_like.delete(p_ids bigint[]) RETURNS SETOF bigint
LANGUAGE sql AS $$
    DELETE FROM pgmq_like.q WHERE msg_id = ANY (p_ids) RETURNING msg_id
$$;

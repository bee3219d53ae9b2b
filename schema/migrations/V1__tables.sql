-- Tables of the outbox: pending work, the append-only attempt log and dead letters.
--
-- Everything lives in schema `outbox`. Applications never touch these tables directly:
-- producers call `outbox.enqueue`, workers call the leasing functions (V2), operators read
-- the views (V3). Role grants are in V4.

CREATE SCHEMA IF NOT EXISTS outbox;

-- Outcome of one attempt at delivering a message.
--   DISPATCHED      the destination acknowledged it (terminal: the message is deleted)
--   FAILED          the destination rejected it for good (terminal: dead-lettered)
--   RETRYABLE       a transient failure; tried again at `available_at`
--   ZOMBIE_REQUEUE  the lease expired without a completion (written by repair only)
CREATE TYPE outbox.attempt_state AS ENUM ('DISPATCHED', 'FAILED', 'RETRYABLE', 'ZOMBIE_REQUEUE');

-- Time-ordered UUID (version 7: 48-bit Unix milliseconds, then random bits), so outbox ids
-- sort roughly by creation and index inserts stay at the right edge of the b-tree.
-- PostgreSQL 15 has no built-in uuidv7(); this sets the timestamp and version bits of a v4.
CREATE FUNCTION outbox.uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$
    SELECT encode(
        set_bit(
            set_bit(
                overlay(uuid_send(gen_random_uuid())
                        PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                        FROM 1 FOR 6),
                52, 1),
            53, 1),
        'hex')::uuid
$$;

-- Pending work: one row per undelivered message. The table is a queue (insert, lease by
-- UPDATE, delete), so its layout is chosen for that churn:
--
-- * The lease columns (claimed_by, lease_token, lease_expires_at) are in no index. A claim,
--   a heartbeat and a release then change no indexed column and are HOT updates: the new
--   row version stays on the same page and no index entry is written or left dead.
-- * fillfactor 70 keeps room on each page for those HOT versions.
-- * Autovacuum is per table and aggressive: a queue produces dead tuples as fast as it
--   delivers, and under the default (20% of the table before a vacuum) they pile up at the
--   head of the ready index and every claim has to step over them. A fixed threshold with
--   no scale factor and no cost delay keeps the head of the index clean at any backlog.
CREATE TABLE outbox.messages (
    outbox_id        uuid        NOT NULL DEFAULT outbox.uuid_v7(),
    -- enqueue order; decides which message is the head of its key
    seq              bigint      NOT NULL GENERATED ALWAYS AS IDENTITY,
    topic            text        NOT NULL,
    message_key      text,
    payload          bytea       NOT NULL,
    content_type     text        NOT NULL DEFAULT 'application/json',
    headers          jsonb       NOT NULL DEFAULT '{}',
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- not before: delays and retry backoff
    available_at     timestamptz NOT NULL DEFAULT now(),
    -- attempts recorded so far; the next attempt is number attempt_count + 1
    attempt_count    integer     NOT NULL DEFAULT 0,
    -- attempts recorded before the last replay from dead letters
    attempt_base     integer     NOT NULL DEFAULT 0,
    -- attempts allowed per life (a replay starts a new life)
    max_attempts     integer     NOT NULL DEFAULT 10,
    claimed_by       text,
    lease_token      uuid,
    lease_expires_at timestamptz,
    last_error       text,
    CONSTRAINT messages_pkey PRIMARY KEY (outbox_id),
    CONSTRAINT messages_topic_not_empty CHECK (topic <> ''),
    CONSTRAINT messages_max_attempts_positive CHECK (max_attempts >= 1),
    CONSTRAINT messages_headers_object CHECK (jsonb_typeof(headers) = 'object'),
    -- a lease is all three fields or none
    CONSTRAINT messages_lease_complete CHECK (
        (claimed_by IS NULL) = (lease_token IS NULL)
        AND (lease_token IS NULL) = (lease_expires_at IS NULL))
) WITH (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 20000,
    autovacuum_vacuum_cost_delay = 0
);

-- The claim walks this index from the oldest ready message. Leased rows stay in it (their
-- available_at is in the past) and are filtered by the heap check; that costs at most the
-- number of messages in flight, independent of the backlog.
CREATE INDEX messages_ready_idx ON outbox.messages (available_at, seq);

-- "Is there an earlier message with my key?" for per-key ordering: one index probe.
CREATE INDEX messages_key_seq_idx ON outbox.messages (message_key, seq)
    WHERE message_key IS NOT NULL;

-- Append-only outcome log: one row per attempt, numbered 1, 2, 3 … per message.
CREATE TABLE outbox.attempts (
    outbox_id   uuid                 NOT NULL,
    attempt_no  integer              NOT NULL,
    state       outbox.attempt_state NOT NULL,
    worker_id   text                 NOT NULL,
    lease_token uuid                 NOT NULL,
    error       text,
    created_at  timestamptz          NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT attempts_pkey PRIMARY KEY (outbox_id, attempt_no),
    CONSTRAINT attempts_attempt_no_positive CHECK (attempt_no >= 1)
) WITH (
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 100000
);

-- Time-range scans (retention, rates) over an insert-ordered log: a BRIN index is tiny and
-- costs almost nothing per insert.
CREATE INDEX attempts_created_at_brin ON outbox.attempts USING brin (created_at);

-- Failures are rare and read newest first (`outbox.recent_failures`).
CREATE INDEX attempts_failures_idx ON outbox.attempts (created_at DESC)
    WHERE state <> 'DISPATCHED';

-- Messages that ran out of attempts or were rejected for good, kept with everything needed
-- to replay them (`outbox.replay_dead_letters`).
CREATE TABLE outbox.dead_letters (
    outbox_id        uuid        NOT NULL,
    topic            text        NOT NULL,
    message_key      text,
    payload          bytea       NOT NULL,
    content_type     text        NOT NULL,
    headers          jsonb       NOT NULL,
    created_at       timestamptz NOT NULL,
    attempt_count    integer     NOT NULL,
    max_attempts     integer     NOT NULL,
    last_error       text,
    dead_lettered_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT dead_letters_pkey PRIMARY KEY (outbox_id)
);

CREATE INDEX dead_letters_topic_idx ON outbox.dead_letters (topic);

-- Enqueue: the producers' API.
--
-- An application writes a message into the outbox in the same transaction as its business
-- change, by calling one of:
--   outbox.enqueue(text, bytea, text, jsonb, timestamptz, uuid, integer, text)   any bytes
--   outbox.enqueue(text, jsonb, text, jsonb, timestamptz, uuid, integer)         JSON
-- Callers: logins in outbox_producer (applications) and outbox_relay (the relayer's
-- `enqueue` verb). Neither role has any right on the tables: the bytea form is SECURITY
-- DEFINER; the jsonb form is a plain SQL function that calls it.
--
-- Conventions of both:
-- * They run inside the caller's transaction and commit or roll back with it: the message
--   exists for the relayers exactly when the business change does. They never commit,
--   open a transaction, or keep anything in the session, so they work through a
--   transaction-mode connection pooler.
-- * Defaults: a NULL argument means its default (a new id, now, 10 attempts, no headers),
--   except p_topic and p_payload, which are required.
-- * The relayers are woken by NOTIFY outbox_new (empty payload) at the caller's commit; a
--   delayed message is found by the relayers' poll instead.
-- * Errors: P7001 for a refused argument, 23505 for a reused outbox_id (see 02_errors.sql).


-- outbox.enqueue (bytea payload): inserts one message and returns its outbox_id.
--
-- Inputs:     p_topic         required, non-empty; routes the message to a destination.
--             p_payload       required (not NULL); any bytes, stored as given.
--             p_message_key   default NULL (no order: delivered in parallel with any other
--                             message). Messages sharing a non-NULL key are delivered one at
--                             a time, in the order they were enqueued; transactions that
--                             enqueue under one key at the same time get no order between
--                             them.
--             p_headers       a JSON object of the message's headers; default and NULL: {}.
--             p_available_at  not before; default and NULL: the clock at the insert
--                             (clock_timestamp()). A time in the future delays the
--                             message; a time in the past makes it ready at once, and
--                             at the commit lowers its shard's claim floor to it
--                             (04_claim.sql).
--             p_outbox_id     the producer's own id; default and NULL: a new UUIDv7. Every
--                             delivery of the message carries it.
--             p_max_attempts  attempts before the message is dead-lettered, at least 1;
--                             default and NULL: 10.
--             p_content_type  default and NULL: application/octet-stream.
-- Returns:    the message's outbox_id.
-- Locks:      with p_outbox_id given: the pending message with that id, if any, FOR KEY
--             SHARE, which waits for a transaction that is deleting it (a completion, a
--             dead-lettering) or holds it FOR UPDATE (a claim), so that the checks that
--             follow see its outcome; before that, a transaction-scoped advisory lock of
--             the id, which a second enqueue of the same id waits for until this
--             transaction ends, and then finds its row (under READ COMMITTED: a
--             REPEATABLE READ or SERIALIZABLE caller keeps its snapshot, and two such
--             enqueues of one id into two slots, on either side of a rotation, are not
--             kept apart; in one slot, messages_pkey keeps them apart). The new row. For a
--             keyed message, at commit,
--             the nearest earlier message of its key FOR KEY SHARE SKIP LOCKED (trigger
--             settle_behind): never a wait. For a message ready now, a transaction-scoped
--             advisory lock of the current 2 ms window, tried without waiting.
-- Guarantees: the message is visible to the relayers when the caller's transaction commits,
--             and never before; then it is delivered at least once, every time with the
--             same outbox_id, or dead-lettered with its payload. A keyed message is not
--             claimed while an earlier message of its key is pending. The caller's commit
--             notifies outbox_new at most once per transaction, and under load about once
--             per 2 ms window for all producers; a transaction that lost its window is
--             picked up by the winner's wake-up, the relayer's re-check shortly after it,
--             or at worst the relayer's poll interval.
-- Raises:     P7001 when p_topic is NULL or empty, p_payload is NULL, p_headers is not a
--             JSON object, or p_max_attempts is below 1. 23505 when p_outbox_id is pending,
--             dead-lettered, or has attempts (its message was delivered or tried; after
--             prune_attempts removed a delivered message's history, its id is accepted
--             again); the message names the id and which, DETAIL is the id.
-- Crash:      nothing of its own: everything it does is part of the caller's transaction. A
--             crash or rollback before the commit removes the message with the business
--             change, and no notification is sent.
-- Shape:      one PL/pgSQL call, SECURITY DEFINER with a fixed search_path (outbox_producer
--             has no rights on the table). The id checks run only for an id the producer
--             gives; they probe every slot's primary key. enable_seqscan is off, so that a
--             plan made while a slot is empty never reads it sequentially once it fills
--             (01_tables.sql). The wake-up is written in the body, not in a function of its own, which
--             would be a second call and a second search_path set per message. Postgres
--             makes transactions that notify commit one at a time (a database-wide lock
--             held through the WAL flush), so only the first transaction of each 2 ms
--             window notifies: with every enqueue notifying, 16 connections reached 4,150
--             msg/s, with the window 11,000. CPU per enqueue transaction: 112–117 µs against
--             79–87 µs for the plain INSERT (SECURITY DEFINER with its search_path about
--             5 µs, the wake-up about 5 µs); throughput 0.82–0.88×, 0.79–0.82× and
--             0.76–0.86× the plain INSERT's at 1, 16 and 64 connections.
CREATE OR REPLACE FUNCTION outbox.enqueue(
    p_topic text,
    p_payload bytea,
    p_message_key text DEFAULT NULL,
    p_headers jsonb DEFAULT '{}',
    p_available_at timestamptz DEFAULT NULL,
    p_outbox_id uuid DEFAULT NULL,
    p_max_attempts integer DEFAULT 10,
    p_content_type text DEFAULT 'application/octet-stream'
) RETURNS uuid
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_id uuid := coalesce(p_outbox_id, outbox.uuid_v7());
    v_used text;
BEGIN
    IF p_topic IS NULL OR p_topic = '' THEN
        PERFORM outbox.invalid_argument('p_topic', 'must be a non-empty string');
    END IF;
    IF p_payload IS NULL THEN
        PERFORM outbox.invalid_argument('p_payload', 'must not be NULL');
    END IF;
    IF p_headers IS NOT NULL AND jsonb_typeof(p_headers) <> 'object' THEN
        PERFORM outbox.invalid_argument('p_headers', 'must be a JSON object');
    END IF;
    IF p_max_attempts IS NOT NULL AND p_max_attempts < 1 THEN
        PERFORM outbox.invalid_argument('p_max_attempts', format('must be at least 1, got %s', p_max_attempts));
    END IF;

    IF p_outbox_id IS NOT NULL THEN
        -- One enqueue of a given id at a time: the key of outbox.messages holds the slot,
        -- so two producers inserting one id into two slots (on either side of a rotation)
        -- would not wait for each other on it. The second waits here for the first's
        -- commit and then finds its row below.
        PERFORM pg_advisory_xact_lock(hashtext('outbox.id'), hashtext(v_id::text));
        -- Waits for a transaction that is completing or dead-lettering this id; each later
        -- statement then sees what it committed.
        PERFORM 1 FROM outbox.messages AS m WHERE m.outbox_id = v_id FOR KEY SHARE;
        IF FOUND THEN
            v_used := 'a message with this id is pending';
        ELSIF EXISTS (SELECT 1 FROM outbox.dead_letters AS d WHERE d.outbox_id = v_id) THEN
            v_used := 'a message with this id is dead-lettered (replay it with replay_dead_letters)';
        ELSIF EXISTS (SELECT 1 FROM outbox.attempts AS a WHERE a.outbox_id = v_id) THEN
            v_used := 'a message with this id was already delivered or attempted';
        END IF;
        IF v_used IS NOT NULL THEN
            RAISE EXCEPTION 'outbox_id % was used before: %', v_id, v_used
                USING ERRCODE = 'unique_violation', DETAIL = v_id::text,
                      HINT = 'every message needs its own outbox_id; if this is a retry of your own enqueue, the message is already in the outbox';
        END IF;
    END IF;

    INSERT INTO outbox.messages (outbox_id, topic, message_key, payload, content_type, headers,
                                 available_at, max_attempts)
    VALUES (v_id, p_topic, p_message_key, p_payload,
            coalesce(p_content_type, 'application/octet-stream'),
            coalesce(p_headers, '{}'), coalesce(p_available_at, clock_timestamp()),
            coalesce(p_max_attempts, 10));

    -- Wake the relayers at commit (NOTIFY outbox_new), unless this transaction already
    -- asked or another transaction of the current 2 ms window does: the window's
    -- transaction-scoped advisory lock, taken without waiting, picks one.
    IF (p_available_at IS NULL OR p_available_at <= clock_timestamp())
       AND current_setting('outbox.woken', true) IS DISTINCT FROM 'yes' THEN
        IF pg_try_advisory_xact_lock(
               hashtext('outbox.wake_relayers'),
               ((extract(epoch FROM clock_timestamp()) * 500)::bigint % 2147483647)::integer) THEN
            PERFORM pg_notify('outbox_new', '');
            PERFORM set_config('outbox.woken', 'yes', true);
        END IF;
    END IF;
    RETURN v_id;
END;
$$;

COMMENT ON FUNCTION outbox.enqueue(text, bytea, text, jsonb, timestamptz, uuid, integer, text) IS
    'Inserts one message (bytea payload) in the caller''s transaction and returns its outbox_id; wakes the relayers at commit; P7001 on a bad argument, 23505 on a reused outbox_id.';

REVOKE ALL ON FUNCTION outbox.enqueue(text, bytea, text, jsonb, timestamptz, uuid, integer, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.enqueue(text, bytea, text, jsonb, timestamptz, uuid, integer, text) TO outbox_producer;
GRANT EXECUTE ON FUNCTION outbox.enqueue(text, bytea, text, jsonb, timestamptz, uuid, integer, text) TO outbox_relay;


-- outbox.enqueue (jsonb payload): enqueue(bytea) with the JSON as UTF-8 text and content
-- type application/json.
--
-- Inputs:     as enqueue(bytea), without p_content_type. p_payload is required (SQL NULL is
--             refused; the JSON value null is a payload like any other). It is stored as
--             jsonb prints it (keys in jsonb's order, a repeated key once, whitespace
--             normalised), not as the caller's original text.
-- Returns:    the message's outbox_id.
-- Locks:      those of enqueue(bytea).
-- Guarantees: those of enqueue(bytea).
-- Raises:     what enqueue(bytea) raises: P7001, 23505.
-- Crash:      nothing of its own (the caller's transaction).
-- Shape:      a SQL function with no SECURITY DEFINER and no SET clause, which Postgres
--             inlines into the caller's statement (tests/sql_api/enqueue.rs checks it with EXPLAIN
--             VERBOSE): the statement then makes the one definer call of enqueue(bytea).
--             It runs with the caller's rights and search_path, which decide nothing but the
--             conversion of the caller's own payload (every name in it is qualified).
--             Measured against a plain INSERT: 0.81–0.84×, 0.80–0.83× and 0.62–0.73× at 1,
--             16 and 64 connections (it also parses the JSON and prints it back).
CREATE OR REPLACE FUNCTION outbox.enqueue(
    p_topic text,
    p_payload jsonb,
    p_message_key text DEFAULT NULL,
    p_headers jsonb DEFAULT '{}',
    p_available_at timestamptz DEFAULT NULL,
    p_outbox_id uuid DEFAULT NULL,
    p_max_attempts integer DEFAULT 10
) RETURNS uuid
LANGUAGE sql VOLATILE SECURITY INVOKER
AS $$
    SELECT outbox.enqueue(p_topic, pg_catalog.convert_to(p_payload::pg_catalog.text, 'UTF8'),
                          p_message_key, p_headers, p_available_at, p_outbox_id, p_max_attempts,
                          'application/json');
$$;

COMMENT ON FUNCTION outbox.enqueue(text, jsonb, text, jsonb, timestamptz, uuid, integer) IS
    'Inserts one message (JSON payload, stored as UTF-8 with content type application/json) through enqueue(bytea), inlined into the caller''s statement; returns its outbox_id; P7001, 23505 as enqueue(bytea).';

REVOKE ALL ON FUNCTION outbox.enqueue(text, jsonb, text, jsonb, timestamptz, uuid, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.enqueue(text, jsonb, text, jsonb, timestamptz, uuid, integer) TO outbox_producer;
GRANT EXECUTE ON FUNCTION outbox.enqueue(text, jsonb, text, jsonb, timestamptz, uuid, integer) TO outbox_relay;

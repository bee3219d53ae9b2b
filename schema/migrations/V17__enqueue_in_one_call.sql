-- V17: an enqueue is one function call.
--
-- The producers' statement is the applications' own cost, so it should cost little more
-- than the INSERT it makes. Two calls were nested in it:
--
-- * enqueue(bytea) called wake_relayers (V10), a function of its own with its own
--   search_path: a second call, and a second search_path set and reset, per message.
--   The wake-up is now written inside enqueue, unchanged (one notification per
--   transaction, and per 2 ms window for all producers), and wake_relayers is dropped.
-- * enqueue(jsonb), the form the README shows, was a SECURITY DEFINER function with its
--   own search_path that called enqueue(bytea): two definer calls per message, and a
--   function Postgres cannot inline. It needs no table rights (enqueue(bytea) has them), so
--   it is now a plain SQL function, which the planner inlines into the caller's statement:
--   the caller's statement calls enqueue(bytea) directly. It runs with the caller's rights
--   and search_path, which decide nothing but the conversion of the caller's own payload.
--
-- `bench --enqueue-connections 1,16,64` (one message per transaction, synchronous commit,
-- 256-byte payloads, two rounds each): enqueue(bytea) against the same plain INSERT went
-- from 0.74–1.01× / 0.75–0.82× / 0.72–0.80× (1 / 16 / 64 connections) to 0.82–0.88× /
-- 0.79–0.82× / 0.76–0.86×; enqueue(jsonb) is now within a few per cent of enqueue(bytea)
-- at 1 and 16 connections (it parses and prints the JSON), where it paid for a second
-- definer call. Arguments, results, errors and grants are unchanged.

-- enqueue (bytea payload): as in V10, with the wake-up of wake_relayers written in.
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
AS $$
DECLARE
    v_id uuid := coalesce(p_outbox_id, outbox.uuid_v7());
    v_available_at timestamptz := coalesce(p_available_at, now());
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
            coalesce(p_headers, '{}'), v_available_at, coalesce(p_max_attempts, 10));

    -- Wake the relayers at commit (NOTIFY outbox_new), unless this transaction already
    -- asked or another transaction of the current 2 ms window does: the window's
    -- transaction-scoped advisory lock, taken without waiting, picks one (see V10).
    IF v_available_at <= now() AND current_setting('outbox.woken', true) IS DISTINCT FROM 'yes' THEN
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

DROP FUNCTION outbox.wake_relayers();

-- enqueue (jsonb payload): enqueue(bytea) with the JSON text as UTF-8 and content type
-- application/json, inlined into the caller's statement (see the header). Not SECURITY
-- DEFINER and no SET clause: either would stop the inlining.
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

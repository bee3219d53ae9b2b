-- V10: enqueue wakes the relayers without making producers' commits take turns.
--
-- A transaction that called pg_notify takes a database-wide lock when it commits and holds
-- it through its WAL flush, so notifying transactions commit one at a time. With every
-- enqueue notifying, 32 producer connections on synchronous commit queued on that lock and
-- topped out near 600 msg/s, and one enqueue per transaction ran at 0.37–0.76× the rate of
-- the same insert without a notification: the cost fell on the applications' own
-- transactions.
--
-- Now enqueue calls outbox.wake_relayers, and in each 2 ms window only the first
-- transaction that asks sends the notification (it takes that window's transaction-scoped
-- advisory lock without waiting; the window's other transactions do not notify and commit
-- without the lock). A transaction notifies at most once, however many messages it
-- enqueues. At low load every enqueue is alone in its window and wakes the relayers at
-- commit, as before. Under load a notification still comes every 2 ms or so. A transaction
-- that lost its window and commits after the window's winner is picked up by the next
-- notification, by the relayer's re-check shortly after every wake-up, or at worst by its
-- poll interval. The notification's payload is empty (it was the topic; relayers never
-- read it).

-- wake_relayers: NOTIFY outbox_new at commit, unless this transaction already did or another
-- transaction of the current 2 ms window does. Internal: called by enqueue.
CREATE FUNCTION outbox.wake_relayers() RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF current_setting('outbox.woken', true) = 'yes' THEN
        RETURN;
    END IF;
    IF pg_try_advisory_xact_lock(
           hashtext('outbox.wake_relayers'),
           ((extract(epoch FROM clock_timestamp()) * 500)::bigint % 2147483647)::integer) THEN
        PERFORM pg_notify('outbox_new', '');
        PERFORM set_config('outbox.woken', 'yes', true);
    END IF;
END;
$$;
REVOKE ALL ON FUNCTION outbox.wake_relayers() FROM PUBLIC;

-- enqueue (bytea payload): as in V6, waking the relayers through wake_relayers.
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

    IF v_available_at <= now() THEN
        PERFORM outbox.wake_relayers();
    END IF;
    RETURN v_id;
END;
$$;

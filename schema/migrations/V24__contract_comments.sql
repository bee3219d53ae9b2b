-- Every function, table, view and type of schema outbox gets its one-line contract as a
-- COMMENT (psql's \df+ and \dv+ show it; docs/sql-api.md lists them), and the functions
-- whose bodies carried comments about earlier versions get their current bodies, with the
-- same code. The full contract of each object is in its area file under schema/.

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
    -- transaction-scoped advisory lock, taken without waiting, picks one.
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

CREATE OR REPLACE FUNCTION outbox.claim_outbox_batch(
    p_batch_size integer,
    p_worker_id text,
    p_lease_seconds integer,
    p_topics text[] DEFAULT NULL,
    p_exclude_topics text[] DEFAULT NULL,
    p_max_bytes bigint DEFAULT NULL,
    p_max_message_bytes bigint DEFAULT NULL
) RETURNS TABLE (
    outbox_id uuid,
    lease_token uuid,
    topic text,
    message_key text,
    payload bytea,
    content_type text,
    headers jsonb,
    attempt_no integer,
    created_at timestamptz,
    lease_expires_at timestamptz,
    payload_bytes bigint
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_custom_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET jit = off
AS $$
DECLARE
    v_start integer;
    v_shard integer;
    v_busy integer;
    v_turns integer := 0;
    v_ids uuid[] := '{}';
    v_ctids tid[] := '{}';
    v_bytes bigint := 0;
BEGIN
    IF p_batch_size IS NULL OR p_batch_size < 1 OR p_batch_size > 10000 THEN
        PERFORM outbox.invalid_argument('p_batch_size', format('must be between 1 and 10000, got %s', p_batch_size));
    END IF;
    PERFORM outbox.check_worker_id(p_worker_id);
    IF p_lease_seconds IS NULL OR p_lease_seconds < 1 OR p_lease_seconds > 86400 THEN
        PERFORM outbox.invalid_argument('p_lease_seconds', format('must be between 1 and 86400, got %s', p_lease_seconds));
    END IF;
    IF p_max_bytes IS NOT NULL AND p_max_bytes < 1 THEN
        PERFORM outbox.invalid_argument('p_max_bytes', format('must be at least 1 or NULL, got %s', p_max_bytes));
    END IF;
    IF p_max_message_bytes IS NOT NULL AND p_max_message_bytes < 1 THEN
        PERFORM outbox.invalid_argument('p_max_message_bytes', format('must be at least 1 or NULL, got %s', p_max_message_bytes));
    END IF;
    PERFORM set_config('synchronous_commit', 'off', true);

    -- The shards in turn from a random one. Each is probed for a ready entry before its
    -- turn is taken, so that an idle queue costs no turn; the probe is a hint only (it
    -- stops at the first entry, leased or not): the shard is read again under its turn.
    -- Shards that other claims hold are skipped. Only when pass 1 took no turn while some
    -- shard has work (all such shards are held) does pass 2 wait, for the turn of the first
    -- shard it found with work, and then go on round the others, skipping those held.
    v_start := floor(random() * 16)::integer;
    FOR v_pass IN 1 .. 2 LOOP
        EXIT WHEN v_turns > 0 OR (v_pass = 2 AND v_busy IS NULL);
        FOR v_i IN 0 .. 15 LOOP
            v_shard := (v_start + v_i) % 16;
            IF v_pass = 2 AND v_shard = v_busy THEN
                PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'claim:' || v_shard FOR UPDATE;
            ELSE
                CONTINUE WHEN NOT EXISTS (
                    SELECT 1
                      FROM outbox.messages AS c
                     WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = v_shard
                       AND NOT c.behind
                       AND c.available_at <= now()
                       AND (p_topics IS NULL OR c.topic = ANY (p_topics))
                       AND (p_exclude_topics IS NULL OR NOT c.topic LIKE ANY (p_exclude_topics)));
                v_busy := coalesce(v_busy, v_shard);
                PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'claim:' || v_shard FOR UPDATE SKIP LOCKED;
                CONTINUE WHEN NOT FOUND;
            END IF;
            v_turns := v_turns + 1;
            SELECT v_ids || s.ids, v_ctids || s.ctids, v_bytes + s.bytes
              INTO v_ids, v_ctids, v_bytes
              FROM outbox.claim_shard_candidates(v_shard, p_batch_size - cardinality(v_ids), v_bytes,
                                                 p_topics, p_exclude_topics, p_max_bytes,
                                                 p_max_message_bytes) AS s;
            EXIT WHEN cardinality(v_ids) >= p_batch_size
                   OR (p_max_bytes IS NOT NULL AND v_bytes >= p_max_bytes);
        END LOOP;
    END LOOP;

    RETURN QUERY
    WITH leased AS (
        UPDATE outbox.messages AS m
           SET claimed_by = p_worker_id,
               lease_token = gen_random_uuid(),
               lease_expires_at = now() + make_interval(secs => p_lease_seconds)
         WHERE m.ctid = ANY (v_ctids)
           -- a check, not a way in: written so that it cannot drive an index scan
           AND (m.outbox_id = ANY (v_ids)) IS TRUE
           AND m.lease_token IS NULL
        RETURNING m.seq, m.outbox_id, m.lease_token, m.topic, m.message_key,
                  CASE WHEN octet_length(m.payload) > p_max_message_bytes THEN NULL ELSE m.payload END
                      AS payload,
                  m.content_type, m.headers, m.attempt_count + 1 AS attempt_no, m.created_at,
                  m.lease_expires_at, octet_length(m.payload)::bigint AS payload_bytes
    )
    SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
           l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes
      FROM leased AS l
     ORDER BY l.seq;
END;
$$;

CREATE OR REPLACE FUNCTION outbox.complete_outbox_batch(
    p_worker_id text,
    p_outbox_ids uuid[],
    p_lease_tokens uuid[],
    p_states outbox.attempt_state[],
    p_errors text[],
    p_retry_ats timestamptz[]
) RETURNS TABLE (outbox_id uuid, attempt_no integer, lease_lost boolean, dead_lettered boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_custom_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    v_ids uuid[];
    v_nos integer[];
    v_ords bigint[];
    v_states outbox.attempt_state[];
    v_tokens uuid[];
    v_errors text[];
    v_retry_ats timestamptz[];
    v_exhausted boolean[];
    v_keys text[];
    v_mixed boolean;
    v_reused boolean := false;
BEGIN
    PERFORM outbox.check_worker_id(p_worker_id);
    PERFORM outbox.check_leases(p_outbox_ids, p_lease_tokens);
    IF p_states IS NULL OR cardinality(p_states) <> cardinality(p_outbox_ids) THEN
        PERFORM outbox.invalid_argument('p_states', 'must have one state per outbox id');
    END IF;
    IF array_position(p_states, NULL) IS NOT NULL THEN
        PERFORM outbox.invalid_argument('p_states', 'must not contain NULL');
    END IF;
    IF 'ZOMBIE_REQUEUE' = ANY (p_states) THEN
        PERFORM outbox.invalid_argument('p_states',
            'ZOMBIE_REQUEUE is recorded by repair_expired_leases, not by a completion');
    END IF;
    IF p_errors IS NOT NULL AND cardinality(p_errors) <> cardinality(p_outbox_ids) THEN
        PERFORM outbox.invalid_argument('p_errors', 'must be NULL or have one element per outbox id');
    END IF;
    IF p_retry_ats IS NOT NULL AND cardinality(p_retry_ats) <> cardinality(p_outbox_ids) THEN
        PERFORM outbox.invalid_argument('p_retry_ats', 'must be NULL or have one element per outbox id');
    END IF;
    IF EXISTS (SELECT 1
                 FROM unnest(p_states, p_retry_ats) AS u(state, retry_at)
                WHERE u.retry_at IS NOT NULL AND u.state <> 'RETRYABLE') THEN
        PERFORM outbox.invalid_argument('p_retry_ats',
            'a retry time is only allowed with state RETRYABLE, not with a terminal state');
    END IF;

    IF 'DISPATCHED' = ALL (p_states) THEN
        BEGIN
            -- The fence is the deletion: this worker, the token listed with the id, an
            -- unexpired lease; a row changed by a concurrent commit (a repair, another
            -- claim) is checked again after the wait. The attempts are inserted in the
            -- call's order (ord).
            WITH gone AS (
                DELETE FROM outbox.messages AS m
                 WHERE m.outbox_id = ANY (p_outbox_ids)
                   AND m.lease_token = ANY (p_lease_tokens)
                   AND m.claimed_by = p_worker_id
                   AND m.lease_expires_at > now()
                RETURNING m.outbox_id, m.attempt_count + 1 AS attempt_no, m.lease_token,
                          m.message_key
            ), done AS (
                SELECT u.ord, g.outbox_id, g.attempt_no, g.lease_token, g.message_key, u.error,
                       g.lease_token <> u.token AS mixed
                  FROM gone AS g
                  JOIN unnest(p_outbox_ids, p_lease_tokens, p_errors)
                           WITH ORDINALITY AS u(id, token, error, ord)
                    ON u.id = g.outbox_id
            ), recorded AS (
                INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token, error)
                SELECT d.outbox_id, d.attempt_no, 'DISPATCHED', p_worker_id, d.lease_token, d.error
                  FROM done AS d
                 ORDER BY d.ord
            )
            SELECT array_agg(d.ord), array_agg(d.attempt_no),
                   array_agg(DISTINCT d.message_key) FILTER (WHERE d.message_key IS NOT NULL),
                   coalesce(bool_or(d.mixed), false)
              INTO v_ords, v_nos, v_keys, v_mixed
              FROM done AS d;
        EXCEPTION WHEN unique_violation THEN
            -- An id with an earlier history: the deletion is undone with the INSERT, and
            -- the call goes the general way below, once its pairs are checked as the
            -- deletion checks them.
            v_reused := true;
            v_mixed := EXISTS (
                SELECT 1
                  FROM unnest(p_outbox_ids, p_lease_tokens) AS u(id, token)
                  JOIN outbox.messages AS m ON m.outbox_id = u.id
                 WHERE m.lease_token <> u.token
                   AND m.lease_token = ANY (p_lease_tokens)
                   AND m.claimed_by = p_worker_id
                   AND m.lease_expires_at > now());
        END;

        IF v_mixed THEN
            -- The caller mixed up its pairs (tokens are random): the call fails and its
            -- deletions are undone.
            PERFORM outbox.invalid_argument('p_lease_tokens',
                'a lease token is listed with the id of another message');
        END IF;
        IF NOT v_reused THEN
            IF v_keys IS NOT NULL THEN
                PERFORM outbox.promote_heads(v_keys);
            END IF;
            RETURN QUERY
            SELECT u.id, h.attempt_no, h.ord IS NULL, false
              FROM unnest(p_outbox_ids) WITH ORDINALITY AS u(id, ord)
              LEFT JOIN unnest(v_ords, v_nos) AS h(ord, attempt_no) ON h.ord = u.ord
             ORDER BY u.ord;
            RETURN;
        END IF;
    END IF;

    -- Fence: lock only the rows this worker still holds with these tokens and an
    -- unexpired lease, one primary-key probe per listed id, in id order. Under READ
    -- COMMITTED a row changed by a concurrent commit (repair, another claim) is re-checked
    -- against these conditions after the lock is granted. The rows locked are then listed
    -- in the order of the call (ord), which is the order their attempts are written in.
    SELECT array_agg(h.outbox_id ORDER BY i.ord), array_agg(h.attempt_no ORDER BY i.ord),
           array_agg(i.state ORDER BY i.ord), array_agg(h.lease_token ORDER BY i.ord),
           array_agg(i.error ORDER BY i.ord), array_agg(i.retry_at ORDER BY i.ord),
           array_agg(h.exhausted ORDER BY i.ord)
      INTO v_ids, v_nos, v_states, v_tokens, v_errors, v_retry_ats, v_exhausted
      FROM (SELECT *
              FROM unnest(p_outbox_ids, p_lease_tokens, p_states, p_errors, p_retry_ats)
                       WITH ORDINALITY AS u(id, token, state, error, retry_at, ord)
             ORDER BY u.id) AS i
     CROSS JOIN LATERAL (
            SELECT m.outbox_id,
                   m.attempt_count + 1 AS attempt_no,
                   m.lease_token,
                   m.attempt_count + 1 >= m.attempt_base + m.max_attempts AS exhausted
              FROM outbox.messages AS m
             WHERE m.outbox_id = i.id
               AND m.lease_token = i.token
               AND m.claimed_by = p_worker_id
               AND m.lease_expires_at > now()
               FOR NO KEY UPDATE) AS h;

    IF v_ids IS NOT NULL THEN
        PERFORM outbox.apply_outcomes(v_ids, v_nos, v_states,
                                      array_fill(p_worker_id, ARRAY[cardinality(v_ids)]),
                                      v_tokens, v_errors, v_retry_ats, v_exhausted);
    END IF;

    RETURN QUERY
    SELECT u.id, h.attempt_no, h.id IS NULL,
           coalesce(h.state = 'FAILED' OR (h.state = 'RETRYABLE' AND h.exhausted), false)
      FROM unnest(p_outbox_ids) WITH ORDINALITY AS u(id, ord)
      LEFT JOIN unnest(v_ids, v_nos, v_states, v_exhausted) AS h(id, attempt_no, state, exhausted)
             ON h.id = u.id
     ORDER BY u.ord;
END;
$$;

CREATE OR REPLACE FUNCTION outbox.observation(p_top_topics integer)
RETURNS jsonb
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
WITH clock AS (
    SELECT clock_timestamp() AS now
), pending AS (
    SELECT m.topic,
           count(*) FILTER (WHERE m.lease_token IS NULL AND m.available_at <= c.now) AS ready,
           count(*) FILTER (WHERE m.lease_token IS NULL AND m.available_at > c.now)  AS delayed,
           count(*) FILTER (WHERE m.lease_expires_at > c.now)                        AS in_flight,
           count(*) FILTER (WHERE m.lease_expires_at <= c.now)                       AS expired_leases,
           min(m.available_at) FILTER (WHERE m.lease_token IS NULL
                                         AND m.available_at <= c.now)                AS oldest_ready_at
      FROM outbox.messages AS m, clock AS c
     GROUP BY m.topic
), dead AS (
    SELECT d.topic, count(*) AS dead_letters
      FROM outbox.dead_letters AS d
     GROUP BY d.topic
), topics AS (
    SELECT coalesce(p.topic, d.topic)  AS topic,
           coalesce(p.ready, 0)        AS ready,
           coalesce(p.delayed, 0)      AS delayed,
           coalesce(p.in_flight, 0)    AS in_flight,
           coalesce(p.expired_leases, 0) AS expired_leases,
           coalesce(d.dead_letters, 0) AS dead_letters,
           p.oldest_ready_at
      FROM pending AS p
      FULL JOIN dead AS d ON d.topic = p.topic
), ranked AS (
    SELECT t.*,
           row_number() OVER (ORDER BY t.ready + t.delayed + t.in_flight + t.expired_leases DESC,
                                       t.dead_letters DESC, t.topic) AS rank
      FROM topics AS t
), labelled AS (
    -- a topic really named 'other' shares its label with the remainder
    SELECT CASE WHEN r.rank <= p_top_topics THEN r.topic ELSE 'other' END AS label,
           sum(r.ready)::bigint          AS ready,
           sum(r.delayed)::bigint        AS delayed,
           sum(r.in_flight)::bigint      AS in_flight,
           sum(r.expired_leases)::bigint AS expired_leases,
           sum(r.dead_letters)::bigint   AS dead_letters,
           min(r.oldest_ready_at)        AS oldest_ready_at
      FROM ranked AS r
     GROUP BY 1
), attempts AS (
    -- attempts_created_at_idx (a B-tree) reads only the last minute of the attempt log
    SELECT a.state::text AS state, count(*) AS attempts
      FROM outbox.attempts AS a, clock AS c
     WHERE a.created_at > c.now - interval '1 minute'
     GROUP BY a.state
), holders AS (
    -- Sessions of this database whose snapshot (backend_xmin) or transaction id holds back
    -- what vacuum may remove from outbox.messages. The query text is the statement's text
    -- (placeholders, never bound parameters), cut to 100 characters.
    SELECT 'session'::text AS kind,
           a.pid,
           a.application_name AS name,
           a.state,
           extract(epoch FROM c.now - coalesce(a.xact_start, a.query_start, a.backend_start))::float8
                                                         AS age_seconds,
           greatest(age(a.backend_xmin), age(a.backend_xid)) AS xid_age,
           left(a.query, 100)                              AS query
      FROM pg_stat_activity AS a, clock AS c
     WHERE a.datname = current_database()
       AND a.pid <> pg_backend_pid()
       AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
    UNION ALL
    -- Physical slots (hot_standby_feedback) hold back every database; a logical slot holds
    -- back only the catalogs (catalog_xmin), not outbox.messages. No age in time is known.
    SELECT 'replication slot', s.active_pid, s.slot_name::text,
           CASE WHEN s.active THEN 'active' ELSE 'inactive' END,
           NULL, age(s.xmin), NULL
      FROM pg_replication_slots AS s
     WHERE s.xmin IS NOT NULL
       AND (s.database IS NULL OR s.database = current_database())
    UNION ALL
    SELECT 'prepared transaction', NULL, p.gid, 'prepared',
           extract(epoch FROM c.now - p.prepared)::float8, age(p.transaction), NULL
      FROM pg_prepared_xacts AS p, clock AS c
     WHERE p.database = current_database()
), vacuum AS (
    SELECT s.n_live_tup, s.n_dead_tup, greatest(s.last_autovacuum, s.last_vacuum) AS last_vacuum,
           s.last_autovacuum
      FROM pg_stat_user_tables AS s
     WHERE s.relid = 'outbox.messages'::regclass
)
SELECT jsonb_build_object(
    'topics', coalesce((
        SELECT jsonb_agg(jsonb_build_object(
                   'topic', l.label,
                   'ready', l.ready,
                   'delayed', l.delayed,
                   'in_flight', l.in_flight,
                   'expired_leases', l.expired_leases,
                   'dead_letters', l.dead_letters,
                   'oldest_ready_age_seconds',
                       extract(epoch FROM c.now - l.oldest_ready_at)::float8)
                   ORDER BY l.ready + l.delayed + l.in_flight + l.expired_leases DESC, l.label)
          FROM labelled AS l, clock AS c), '[]'),
    'attempts_last_minute', coalesce((
        SELECT jsonb_object_agg(a.state, a.attempts) FROM attempts AS a), '{}'),
    'horizon_holders', coalesce((
        SELECT jsonb_agg(to_jsonb(h) ORDER BY h.xid_age DESC) FROM holders AS h), '[]'),
    'messages_table', (
        SELECT jsonb_build_object(
                   'live_tuples', v.n_live_tup,
                   'dead_tuples', v.n_dead_tup,
                   'last_autovacuum', v.last_autovacuum,
                   'last_vacuum', v.last_vacuum)
          FROM vacuum AS v)
)
$$;

COMMENT ON SCHEMA outbox IS
    'The transactional outbox: pending messages, attempt log, dead letters, and the SQL API that is the only way to change them (schema/ holds its contract by area).';

COMMENT ON TYPE outbox.attempt_state IS
    'Outcome of one attempt: DISPATCHED (delivered), FAILED (refused for good), RETRYABLE (tried again or, if last, dead-lettered), ZOMBIE_REQUEUE (lease expired without a completion; repair only).';

COMMENT ON FUNCTION outbox.uuid_v7() IS
    'Internal: a version 7 UUID (48-bit Unix milliseconds, then random bits); the default of messages.outbox_id and the id enqueue gives a message. Not granted.';

COMMENT ON TABLE outbox.messages IS
    'Pending work, one row per undelivered message, with its lease while in flight; written only by the SQL API, owner only (read it through the views).';

COMMENT ON COLUMN outbox.messages.behind IS
    'an earlier message of the same message_key is pending; not a claim candidate';

COMMENT ON FUNCTION outbox.mark_behind() IS
    'Internal (trigger messages_mark_behind, before insert of a keyed message): marks the message behind when an earlier message of its key is pending. Not granted.';

COMMENT ON FUNCTION outbox.settle_behind() IS
    'Internal (deferred trigger messages_settle_behind, at commit): locks the nearest earlier message of the key FOR KEY SHARE SKIP LOCKED, or clears the new message''s own mark. Not granted.';

COMMENT ON TABLE outbox.attempts IS
    'Append-only outcome log: one row per attempt, numbered 1, 2, 3 … per message with no gap; written by completions and repair, pruned by prune_attempts; owner only.';

COMMENT ON TABLE outbox.dead_letters IS
    'Messages out of attempts or refused for good, with payload, headers and last error, until replayed (replay_dead_letters, start_replay/replay_step); owner only.';

COMMENT ON TABLE outbox.turns IS
    'Rows locked by claim_outbox_batch, repair_expired_leases and observe to take turns; owner only.';

COMMENT ON TABLE outbox.observations IS
    'The latest observation snapshot (one row), written by observe under its turn and read through observe; owner only.';

COMMENT ON TABLE outbox.replays IS
    'Audit of dead-letter replays: who, when, why, the filter, how many; one row per replay; written by start_replay and replay_step, read through outbox.replay_log; owner only.';

COMMENT ON FUNCTION outbox.invalid_argument(text, text) IS
    'Internal: raises P7001 "invalid argument <p_argument>: <p_problem>" with DETAIL p_argument; the one place the API raises P7001. Not granted.';

COMMENT ON FUNCTION outbox.check_worker_id(text) IS
    'Internal: P7001 (p_worker_id) unless the worker id is a non-empty string other than white space. Not granted.';

COMMENT ON FUNCTION outbox.check_leases(uuid[], uuid[]) IS
    'Internal: P7001 unless p_outbox_ids and p_lease_tokens are both non-NULL, of equal length, without NULL elements, and without a repeated id. Not granted.';

COMMENT ON FUNCTION outbox.enqueue(text, bytea, text, jsonb, timestamptz, uuid, integer, text) IS
    'Inserts one message (bytea payload) in the caller''s transaction and returns its outbox_id; wakes the relayers at commit; P7001 on a bad argument, 23505 on a reused outbox_id.';

COMMENT ON FUNCTION outbox.enqueue(text, jsonb, text, jsonb, timestamptz, uuid, integer) IS
    'Inserts one message (JSON payload, stored as UTF-8 with content type application/json) through enqueue(bytea), inlined into the caller''s statement; returns its outbox_id; P7001, 23505 as enqueue(bytea).';

COMMENT ON FUNCTION outbox.claim_outbox_batch(integer, text, integer, text[], text[], bigint, bigint) IS
    'Leases up to p_batch_size ready messages (unkeyed ones, heads of keys, and the runs behind keyed heads) to p_worker_id for p_lease_seconds, within the topic filters and byte budget; rows in enqueue order; P7001 on a bad argument.';

COMMENT ON FUNCTION outbox.claim_shard_candidates(integer, integer, bigint, text[], text[], bigint, bigint) IS
    'Internal (claim_outbox_batch, under the shard''s turn): locks up to p_room heads of one shard and returns their ids, tuple addresses and counted bytes, then the runs behind the keyed heads, within the room and budget left.';

COMMENT ON FUNCTION outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) IS
    'Records each listed outcome (DISPATCHED, FAILED, RETRYABLE) whose lease p_worker_id still holds with that token; returns per id, in call order, attempt_no, lease_lost and dead_lettered; a lost lease changes nothing; P7001 on a bad argument.';

COMMENT ON FUNCTION outbox.complete_outbox_attempt(uuid, uuid, text, outbox.attempt_state, text, timestamptz) IS
    'Records one message''s outcome (DISPATCHED, FAILED, RETRYABLE) under the lease p_worker_id holds with p_lease_token and returns its attempt number; P7002 (LEASE_LOST) when that lease is not held, P7001 on a bad argument.';

COMMENT ON FUNCTION outbox.extend_outbox_leases(text, uuid[], uuid[], integer) IS
    'Heartbeat: sets lease_expires_at = now() + p_lease_seconds on the listed leases p_worker_id still holds and returns them; a missing id is a lost lease; P7001 on a bad argument.';

COMMENT ON FUNCTION outbox.release_outbox_leases(text, uuid[], uuid[]) IS
    'Gives back the listed leases p_worker_id still holds, unattempted: lease cleared, no attempt recorded, ready at once; returns how many; notifies outbox_new; P7001 on a bad argument.';

COMMENT ON FUNCTION outbox.apply_outcomes(uuid[], integer[], outbox.attempt_state[], text[], uuid[], text[], timestamptz[], boolean[]) IS
    'Internal (complete_outbox_batch, repair_expired_leases): records the attempts of rows the caller has locked and fenced, then deletes, dead-letters (or parks) or requeues each and promotes keys'' next heads; returns the number dead-lettered.';

COMMENT ON FUNCTION outbox.record_attempts(uuid[], integer[], outbox.attempt_state[], text[], uuid[], text[]) IS
    'Internal (apply_outcomes): appends one attempt per element in the arrays'' order; an attempt number its id already has is written under the next free number, with a WARNING.';

COMMENT ON FUNCTION outbox.promote_heads(text[]) IS
    'Internal (complete_outbox_batch, apply_outcomes): marks the first pending message of each listed key as its head (behind = false).';

COMMENT ON FUNCTION outbox.repair_expired_leases(integer) IS
    'Requeues up to p_limit messages whose lease expired (a ZOMBIE_REQUEUE attempt each) and dead-letters those out of attempts; one pass at a time (''repair'' turn, else (0, 0) at once); returns (requeued, dead_lettered); P7001 on a bad limit.';

COMMENT ON FUNCTION outbox.prune_attempts(interval, bigint) IS
    'Deletes up to p_limit (NULL: all) of the oldest attempts older than p_older_than of messages neither pending nor dead-lettered; returns how many; call again while it returns p_limit; P7001 on a bad argument.';

COMMENT ON FUNCTION outbox.dead_letters_matching(uuid[], text, timestamptz, text) IS
    'The dead letters selected by ids, topic, dead-lettered since, and error text (case-insensitive); each NULL matches all; the one filter used to list, count and replay.';

COMMENT ON FUNCTION outbox.start_replay(uuid[], text, timestamptz, text, text) IS
    'Records the audit row of a replay of the dead letters the filter selects (each NULL: any), dead-lettered up to now, with a reason; returns its replay_id; moves nothing (replay_step does).';

COMMENT ON FUNCTION outbox.replay_step(bigint, integer) IS
    'Moves up to p_limit (NULL: all) more of this login''s replay p_replay_id''s dead letters back to outbox.messages, oldest first, with a fresh attempt budget; returns how many (0: done); P7001 on a bad limit or replay id.';

COMMENT ON FUNCTION outbox.replay_dead_letters(uuid[], text, timestamptz, text, text) IS
    'Moves the dead letters the filter selects (all NULL: all) back to outbox.messages with a fresh attempt budget, in one transaction, audited in outbox.replays with p_reason; returns how many.';

COMMENT ON VIEW outbox.replay_log IS
    'Audit of dead-letter replays, newest first: who (login role), when, why, the filter, how many moved, when finished.';

COMMENT ON VIEW outbox.status IS
    'One row: pending messages ready, delayed, in flight and with an expired lease, dead letters, and the age of the oldest ready message; reads outbox.messages whole.';

COMMENT ON VIEW outbox.in_flight IS
    'Every leased message: who holds it (claimed_by), with which token, until when, whether the lease expired, and the attempt in progress.';

COMMENT ON VIEW outbox.topic_lag IS
    'Per topic: ready, delayed, leased and dead-lettered counts, and lag (age of the oldest pending message); reads outbox.messages and outbox.dead_letters whole.';

COMMENT ON VIEW outbox.worker_activity IS
    'Per worker id: leases held and the next to expire, and attempts by state in the last 5 minutes with the latest one''s time.';

COMMENT ON VIEW outbox.recent_failures IS
    'The 100 latest attempts that did not deliver, newest first, with topic, worker, error, and where the message is now (pending, dead_letter, delivered).';

COMMENT ON VIEW outbox.attempt_rates IS
    'Attempts per minute and state over the last hour, newest minute first.';

COMMENT ON FUNCTION outbox.observation(integer) IS
    'Internal (observe, under the ''observe'' turn): computes the observation snapshot (topics, attempts in the last minute, MVCC horizon holders, outbox.messages tuples and vacuum); reads the whole backlog. Not granted.';

COMMENT ON FUNCTION outbox.observe(integer, interval) IS
    'The fleet''s observation snapshot (backlog per topic, attempts last minute, MVCC horizon holders, vacuum of outbox.messages), recomputed by one caller at a time when older than p_max_age; P7001 on a bad argument.';

COMMENT ON FUNCTION outbox.schema_version() IS
    'Version of the newest applied migration; compared by the relayer with the version it needs.';

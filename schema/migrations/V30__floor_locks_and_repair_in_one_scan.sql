-- Claim floors under a floor lock, and repair in one scan.
-- * raise_claim_floor raises a shard's floor only from the value its claim read, under the
--   shard's floor lock tried without waiting, and only under READ COMMITTED (the claims);
--   lower_claim_floor takes all 16 floor locks in shard order and keeps them until its
--   commit, so no claim raises a floor over a lowering it could not see. A message lowers
--   its floor when dated more than the bound's margin before its insert. The bound's mark
--   reads its time before the setval that gives the claim its id.
-- * The completions (complete_outbox_batch, apply_outcomes) pass promote_heads only the
--   deleted heads, not messages that were behind.
-- * repair_expired_leases finds the expired leases and the messages below their floor in
--   one sequential scan that locks nothing, then locks each by tuple address and checks it
--   again on the row's newest version (two scans before: 2.3-2.4 s a pass at 739 MB under
--   a held horizon, 0.2-0.3 s in one).
-- The full contracts are in the area files (04_claim.sql, 05_completion.sql,
-- 06_repair_retention.sql).

DROP FUNCTION outbox.raise_claim_floor(integer, timestamptz);


CREATE OR REPLACE FUNCTION outbox.raise_claim_floor(p_shard integer, p_from timestamptz, p_to timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_floor regclass := ('outbox.claim_floor_' || p_shard)::regclass;
    v_now bigint;
BEGIN
    IF p_to <= timestamptz 'epoch'
       OR NOT pg_try_advisory_xact_lock(hashtext('outbox.floor'), p_shard + 1) THEN
        RETURN p_from;
    END IF;
    v_now := coalesce(pg_sequence_last_value(v_floor), 0);
    IF v_now <> (CASE WHEN p_from = '-infinity' THEN 0
                      ELSE (extract(epoch FROM p_from) * 1000000)::bigint END) THEN
        RETURN (CASE WHEN v_now = 0 THEN timestamptz '-infinity'
                     ELSE timestamptz 'epoch' + v_now * interval '1 microsecond' END);
    END IF;
    PERFORM setval(v_floor, (extract(epoch FROM p_to) * 1000000)::bigint);
    RETURN p_to;
END;
$$;

COMMENT ON FUNCTION outbox.raise_claim_floor(integer, timestamptz, timestamptz) IS
    'Internal (claims): raises the claim floor of one shard from the value the claim read, under the shard''s floor lock tried without waiting; not transactional. Not granted.';

REVOKE ALL ON FUNCTION outbox.raise_claim_floor(integer, timestamptz, timestamptz) FROM PUBLIC;


CREATE OR REPLACE FUNCTION outbox.claim_floor_bound() RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_bound bigint;
    v_at bigint;
    v_xid bigint;
    v_now bigint := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
BEGIN
    SELECT b.last_value, a.last_value
      INTO v_bound, v_at
      FROM outbox.claim_floor_bound AS b, outbox.claim_floor_mark_at AS a;
    IF v_now - v_at >= 50000
       AND current_setting('transaction_isolation') = 'read committed'
       AND pg_current_xact_id_if_assigned() IS NULL
       AND pg_try_advisory_xact_lock(hashtext('outbox.floor'), 0) THEN
        SELECT b.last_value, a.last_value, x.last_value
          INTO v_bound, v_at, v_xid
          FROM outbox.claim_floor_bound AS b, outbox.claim_floor_mark_at AS a,
               outbox.claim_floor_mark_xid AS x;
        -- The mark is taken up only once every id below its own has ended, and replaced
        -- only then: a transaction that holds an id for long keeps the bound where it was.
        IF v_now - v_at >= 50000
           AND (v_at = 0 OR pg_snapshot_xmin(pg_current_snapshot())::text::bigint >= v_xid) THEN
            -- The new mark's time first: the first setval gives this transaction its id.
            v_now := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
            IF v_at > 0 THEN
                v_bound := greatest(v_bound, v_at - 200000);
                PERFORM setval('outbox.claim_floor_bound', v_bound);
            END IF;
            PERFORM setval('outbox.claim_floor_mark_xid', pg_current_xact_id()::text::bigint);
            PERFORM setval('outbox.claim_floor_mark_at', v_now);
        END IF;
    END IF;
    RETURN timestamptz 'epoch' + v_bound * interval '1 microsecond';
END;
$$;

COMMENT ON FUNCTION outbox.claim_floor_bound() IS
    'Internal (claims): the time no entry still to be written is below, moved up at most every 50 ms once the transactions that held ids at its mark have ended. Not granted.';

REVOKE ALL ON FUNCTION outbox.claim_floor_bound() FROM PUBLIC;


CREATE OR REPLACE FUNCTION outbox.lower_claim_floor() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_shard integer := hashtext(coalesce(NEW.message_key, NEW.outbox_id::text)) & 15;
BEGIN
    -- Every shard's floor lock, in shard order, so that two transactions lowering floors of
    -- several shards never wait for each other in a cycle.
    FOR v_lock IN 1 .. 16 LOOP
        PERFORM pg_advisory_xact_lock(hashtext('outbox.floor'), v_lock);
    END LOOP;
    IF NEW.available_at < (outbox.claim_floors())[v_shard + 1] THEN
        PERFORM setval(('outbox.claim_floor_' || v_shard)::regclass,
                       (extract(epoch FROM greatest(NEW.available_at, timestamptz 'epoch')) * 1000000)::bigint);
    END IF;
    RETURN NULL;
END;
$$;

COMMENT ON FUNCTION outbox.lower_claim_floor() IS
    'Internal (deferred triggers messages_lower_claim_floor_on_insert and _on_update, for a message dated in the past): lowers the shard''s claim floor to the message at commit. Not granted.';

REVOKE ALL ON FUNCTION outbox.lower_claim_floor() FROM PUBLIC;


DROP TRIGGER messages_lower_claim_floor_on_insert ON outbox.messages;

CREATE CONSTRAINT TRIGGER messages_lower_claim_floor_on_insert
    AFTER INSERT ON outbox.messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.available_at < clock_timestamp() - interval '200 milliseconds')
    EXECUTE FUNCTION outbox.lower_claim_floor();


CREATE OR REPLACE FUNCTION outbox.claim_outbox_batch_seq(
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
    payload_bytes bigint,
    seq bigint
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
    v_now timestamptz := clock_timestamp();
    v_floors timestamptz[];
    v_bound timestamptz;
    v_first timestamptz;
    v_raised timestamptz;
    -- each statement reads a snapshot newer than the bound: floors may be raised
    v_fresh boolean := current_setting('transaction_isolation') = 'read committed';
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
    v_floors := outbox.claim_floors();
    v_bound := outbox.claim_floor_bound();

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
                -- The shard's first entry from its floor, leased or not: it raises the floor
                -- (claim_floor_bound), and no entry due by now means no work.
                v_first := (SELECT c.available_at
                              FROM outbox.messages AS c
                             WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = v_shard
                               AND NOT c.behind
                               AND c.available_at >= v_floors[v_shard + 1]
                             ORDER BY c.available_at, c.seq
                             LIMIT 1);
                v_raised := least(coalesce(v_first, 'infinity'), v_bound);
                IF v_raised > v_floors[v_shard + 1] AND v_fresh THEN
                    v_floors[v_shard + 1] := outbox.raise_claim_floor(v_shard, v_floors[v_shard + 1], v_raised);
                END IF;
                CONTINUE WHEN v_first IS NULL OR v_first > v_now;
                CONTINUE WHEN (p_topics IS NOT NULL OR p_exclude_topics IS NOT NULL) AND NOT EXISTS (
                    SELECT 1
                      FROM outbox.messages AS c
                     WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = v_shard
                       AND NOT c.behind
                       AND c.available_at >= v_floors[v_shard + 1]
                       AND c.available_at <= v_now
                       AND (p_topics IS NULL OR c.topic = ANY (p_topics))
                       AND (p_exclude_topics IS NULL OR NOT c.topic LIKE ANY (p_exclude_topics)));
                v_busy := coalesce(v_busy, v_shard);
                PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'claim:' || v_shard FOR UPDATE SKIP LOCKED;
                CONTINUE WHEN NOT FOUND;
            END IF;
            v_turns := v_turns + 1;
            SELECT v_ids || s.ids, v_ctids || s.ctids, v_bytes + s.bytes
              INTO v_ids, v_ctids, v_bytes
              FROM outbox.claim_shard_candidates(v_shard, v_floors[v_shard + 1], v_now,
                                                 p_batch_size - cardinality(v_ids), v_bytes,
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
           l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes, l.seq
      FROM leased AS l
     ORDER BY l.seq;
END;
$$;

COMMENT ON FUNCTION outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint) IS
    'Leases up to p_batch_size ready messages (unkeyed ones, heads of keys, and the runs behind keyed heads) to p_worker_id for p_lease_seconds, within the topic filters and byte budget; rows in enqueue order, each with its seq; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint) TO outbox_relay;


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
    v_now timestamptz := clock_timestamp();
    v_floors timestamptz[];
    v_bound timestamptz;
    v_first timestamptz;
    v_raised timestamptz;
    -- each statement reads a snapshot newer than the bound: floors may be raised
    v_fresh boolean := current_setting('transaction_isolation') = 'read committed';
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
    v_floors := outbox.claim_floors();
    v_bound := outbox.claim_floor_bound();

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
                -- The shard's first entry from its floor, leased or not: it raises the floor
                -- (claim_floor_bound), and no entry due by now means no work.
                v_first := (SELECT c.available_at
                              FROM outbox.messages AS c
                             WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = v_shard
                               AND NOT c.behind
                               AND c.available_at >= v_floors[v_shard + 1]
                             ORDER BY c.available_at, c.seq
                             LIMIT 1);
                v_raised := least(coalesce(v_first, 'infinity'), v_bound);
                IF v_raised > v_floors[v_shard + 1] AND v_fresh THEN
                    v_floors[v_shard + 1] := outbox.raise_claim_floor(v_shard, v_floors[v_shard + 1], v_raised);
                END IF;
                CONTINUE WHEN v_first IS NULL OR v_first > v_now;
                CONTINUE WHEN (p_topics IS NOT NULL OR p_exclude_topics IS NOT NULL) AND NOT EXISTS (
                    SELECT 1
                      FROM outbox.messages AS c
                     WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = v_shard
                       AND NOT c.behind
                       AND c.available_at >= v_floors[v_shard + 1]
                       AND c.available_at <= v_now
                       AND (p_topics IS NULL OR c.topic = ANY (p_topics))
                       AND (p_exclude_topics IS NULL OR NOT c.topic LIKE ANY (p_exclude_topics)));
                v_busy := coalesce(v_busy, v_shard);
                PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'claim:' || v_shard FOR UPDATE SKIP LOCKED;
                CONTINUE WHEN NOT FOUND;
            END IF;
            v_turns := v_turns + 1;
            SELECT v_ids || s.ids, v_ctids || s.ctids, v_bytes + s.bytes
              INTO v_ids, v_ctids, v_bytes
              FROM outbox.claim_shard_candidates(v_shard, v_floors[v_shard + 1], v_now,
                                                 p_batch_size - cardinality(v_ids), v_bytes,
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

COMMENT ON FUNCTION outbox.claim_outbox_batch(integer, text, integer, text[], text[], bigint, bigint) IS
    'Kept for relayers of the previous release: claim_outbox_batch_seq without the seq column (same leases, rows in enqueue order; P7001 on a bad argument). Dropped by a later release.';

REVOKE ALL ON FUNCTION outbox.claim_outbox_batch(integer, text, integer, text[], text[], bigint, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.claim_outbox_batch(integer, text, integer, text[], text[], bigint, bigint) TO outbox_relay;


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
    v_after timestamptz[];
    v_seqs bigint[];
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

    -- One completion at a time per key, so that promote_heads sees what the key's other
    -- completions did.
    PERFORM outbox.lock_keys(p_outbox_ids);

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
                          m.message_key, m.available_at, m.seq, m.behind
            ), done AS (
                SELECT u.ord, g.outbox_id, g.attempt_no, g.lease_token, g.message_key,
                       g.available_at, g.seq, g.behind, u.error,
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
                   array_agg(d.message_key) FILTER (WHERE d.message_key IS NOT NULL AND NOT d.behind),
                   array_agg(d.available_at) FILTER (WHERE d.message_key IS NOT NULL AND NOT d.behind),
                   array_agg(d.seq) FILTER (WHERE d.message_key IS NOT NULL AND NOT d.behind),
                   coalesce(bool_or(d.mixed), false)
              INTO v_ords, v_nos, v_keys, v_after, v_seqs, v_mixed
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
                PERFORM outbox.promote_heads(v_keys, v_after, v_seqs);
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

COMMENT ON FUNCTION outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) IS
    'Records each listed outcome (DISPATCHED, FAILED, RETRYABLE) whose lease p_worker_id still holds with that token; returns per id, in call order, attempt_no, lease_lost and dead_lettered; a lost lease changes nothing; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) TO outbox_relay;


CREATE OR REPLACE FUNCTION outbox.apply_outcomes(
    p_outbox_ids uuid[],
    p_attempt_nos integer[],
    p_states outbox.attempt_state[],
    p_worker_ids text[],
    p_lease_tokens uuid[],
    p_errors text[],
    p_retry_ats timestamptz[],
    p_exhausted boolean[]
) RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_dead uuid[];
    v_done uuid[];
    v_retry uuid[];
    v_parked uuid[];
    v_keys text[] := '{}';
    v_after timestamptz[] := '{}';
    v_seqs bigint[] := '{}';
BEGIN
    PERFORM outbox.record_attempts(p_outbox_ids, p_attempt_nos, p_states, p_worker_ids,
                                   p_lease_tokens, p_errors);

    SELECT coalesce(array_agg(u.id) FILTER (WHERE u.state = 'DISPATCHED'), '{}'),
           coalesce(array_agg(u.id) FILTER (WHERE u.state = 'FAILED'
                                            OR (u.state <> 'DISPATCHED' AND u.exhausted)), '{}'),
           coalesce(array_agg(u.id) FILTER (WHERE u.state IN ('RETRYABLE', 'ZOMBIE_REQUEUE')
                                            AND NOT u.exhausted), '{}')
      INTO v_done, v_dead, v_retry
      FROM unnest(p_outbox_ids, p_states, p_exhausted) AS u(id, state, exhausted);

    IF cardinality(v_done) > 0 THEN
        WITH gone AS (
            DELETE FROM outbox.messages WHERE outbox_id = ANY (v_done)
            RETURNING message_key, available_at, seq, behind
        )
        SELECT coalesce(array_agg(g.message_key) FILTER (WHERE g.message_key IS NOT NULL AND NOT g.behind), '{}'),
               coalesce(array_agg(g.available_at) FILTER (WHERE g.message_key IS NOT NULL AND NOT g.behind), '{}'),
               coalesce(array_agg(g.seq) FILTER (WHERE g.message_key IS NOT NULL AND NOT g.behind), '{}')
          INTO v_keys, v_after, v_seqs
          FROM gone AS g;
    END IF;

    IF cardinality(v_dead) > 0 THEN
        SELECT coalesce(array_agg(d.outbox_id), '{}')
          INTO v_parked
          FROM outbox.dead_letters AS d
         WHERE d.outbox_id = ANY (v_dead);
        IF cardinality(v_parked) > 0 THEN
            UPDATE outbox.messages AS m
               SET claimed_by = NULL, lease_token = NULL, lease_expires_at = NULL,
                   attempt_count = u.attempt_no,
                   available_at = 'infinity',
                   last_error = format('parked instead of dead-lettered: a dead letter with this id exists '
                                       '(delete or replay it, then set available_at); last error: %s', u.error)
              FROM unnest(p_outbox_ids, p_attempt_nos, p_errors) AS u(id, attempt_no, error)
             WHERE m.outbox_id = ANY (v_parked)
               AND m.outbox_id = u.id;
            v_dead := ARRAY(SELECT x FROM unnest(v_dead) AS x WHERE x <> ALL (v_parked));
        END IF;

        WITH gone AS (
            DELETE FROM outbox.messages WHERE outbox_id = ANY (v_dead)
            RETURNING *
        ), buried AS (
            INSERT INTO outbox.dead_letters (outbox_id, topic, message_key, payload, content_type, headers,
                                             created_at, attempt_count, max_attempts, last_error)
            SELECT g.outbox_id, g.topic, g.message_key, g.payload, g.content_type, g.headers,
                   g.created_at, u.attempt_no, g.max_attempts, u.error
              FROM gone AS g
              JOIN unnest(p_outbox_ids, p_attempt_nos, p_errors) AS u(id, attempt_no, error)
                ON u.id = g.outbox_id
        )
        SELECT v_keys || coalesce(array_agg(g.message_key) FILTER (WHERE g.message_key IS NOT NULL AND NOT g.behind), '{}'),
               v_after || coalesce(array_agg(g.available_at) FILTER (WHERE g.message_key IS NOT NULL AND NOT g.behind), '{}'),
               v_seqs || coalesce(array_agg(g.seq) FILTER (WHERE g.message_key IS NOT NULL AND NOT g.behind), '{}')
          INTO v_keys, v_after, v_seqs
          FROM gone AS g;
    END IF;

    IF cardinality(v_retry) > 0 THEN
        UPDATE outbox.messages AS m
           SET claimed_by = NULL,
               lease_token = NULL,
               lease_expires_at = NULL,
               attempt_count = u.attempt_no,
               available_at = greatest(coalesce(u.retry_at, now()), now()),
               last_error = u.error
          FROM unnest(p_outbox_ids, p_attempt_nos, p_errors, p_retry_ats) AS u(id, attempt_no, error, retry_at)
         WHERE m.outbox_id = ANY (v_retry)
           AND m.outbox_id = u.id;
    END IF;

    IF cardinality(v_keys) > 0 THEN
        PERFORM outbox.promote_heads(v_keys, v_after, v_seqs);
    END IF;

    RETURN cardinality(v_dead);
END;
$$;

COMMENT ON FUNCTION outbox.apply_outcomes(uuid[], integer[], outbox.attempt_state[], text[], uuid[], text[], timestamptz[], boolean[]) IS
    'Internal (complete_outbox_batch, repair_expired_leases): records the attempts of rows the caller has locked and fenced, then deletes, dead-letters (or parks) or requeues each and promotes keys'' next heads; returns the number dead-lettered.';

REVOKE ALL ON FUNCTION outbox.apply_outcomes(uuid[], integer[], outbox.attempt_state[], text[], uuid[], text[], timestamptz[], boolean[]) FROM PUBLIC;


CREATE OR REPLACE FUNCTION outbox.repair_expired_leases(p_limit integer DEFAULT 1000)
RETURNS TABLE (requeued integer, dead_lettered integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    v_ids uuid[];
    v_nos integer[];
    v_workers text[];
    v_tokens uuid[];
    v_errors text[];
    v_exhausted boolean[];
    v_dead integer;
    v_lifted integer;
    v_floors timestamptz[];
    v_low tid[];
    v_expired tid[];
BEGIN
    IF p_limit IS NULL OR p_limit < 1 THEN
        PERFORM outbox.invalid_argument('p_limit', format('must be at least 1, got %s', p_limit));
    END IF;
    PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'repair' FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 0, 0;
        RETURN;
    END IF;

    -- One sequential scan finds both kinds of work, without locking: the messages ready to
    -- claim below their shard's claim floor (the floors' safety net, 04_claim.sql) and the
    -- first p_limit expired leases in scan order. Each kind is then locked by tuple address
    -- and its conditions checked again on the newest version of the row: a row updated
    -- since the scan (its version moved) or held by another transaction is left for the
    -- next pass.
    v_floors := outbox.claim_floors();
    SELECT coalesce(array_agg(f.ctid) FILTER (WHERE NOT f.expired), '{}'),
           coalesce(array_agg(f.ctid) FILTER (WHERE f.expired AND f.nth <= p_limit), '{}')
      INTO v_low, v_expired
      FROM (SELECT b.ctid, b.expired,
                   count(*) FILTER (WHERE b.expired) OVER (ROWS UNBOUNDED PRECEDING) AS nth
              FROM (SELECT c.ctid, coalesce(c.lease_expires_at <= now(), false) AS expired
                      FROM outbox.messages AS c
                     WHERE c.lease_expires_at <= now()
                        OR (c.lease_token IS NULL
                            AND NOT c.behind
                            AND c.available_at < v_floors[(hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) + 1])) AS b) AS f;

    -- The safety net: a message below its floor moves up to the clock, where the claims'
    -- walks find it.
    IF cardinality(v_low) > 0 THEN
        UPDATE outbox.messages AS m
           SET available_at = clock_timestamp()
         WHERE m.ctid = ANY (ARRAY(
                   SELECT b.ctid
                     FROM outbox.messages AS b
                    WHERE b.ctid = ANY (v_low)
                      AND b.lease_token IS NULL
                      AND NOT b.behind
                      AND b.available_at < v_floors[(hashtext(coalesce(b.message_key, b.outbox_id::text)) & 15) + 1]
                      FOR UPDATE SKIP LOCKED))
           AND m.lease_token IS NULL
           AND NOT m.behind;
        GET DIAGNOSTICS v_lifted = ROW_COUNT;
        IF v_lifted > 0 THEN
            RAISE WARNING 'outbox: % message(s) were below their shard''s claim floor and were moved up to now', v_lifted
                USING HINT = 'a message dated in the past committed while a claim raised its floor, or the server clock went back';
            PERFORM pg_notify('outbox_new', 'repaired');
        END IF;
    END IF;

    IF cardinality(v_expired) = 0 THEN
        RETURN QUERY SELECT 0, 0;
        RETURN;
    END IF;
    SELECT array_agg(z.outbox_id), array_agg(z.attempt_no), array_agg(z.claimed_by),
           array_agg(z.lease_token), array_agg(z.error), array_agg(z.exhausted)
      INTO v_ids, v_nos, v_workers, v_tokens, v_errors, v_exhausted
      FROM (SELECT m.outbox_id,
                   m.attempt_count + 1 AS attempt_no,
                   m.claimed_by,
                   m.lease_token,
                   format('lease expired at %s without a completion from worker %s',
                          m.lease_expires_at, m.claimed_by) AS error,
                   m.attempt_count + 1 >= m.attempt_base + m.max_attempts AS exhausted
              FROM outbox.messages AS m
             WHERE m.ctid = ANY (v_expired)
               AND m.lease_expires_at <= now()
               FOR UPDATE SKIP LOCKED) AS z;

    IF v_ids IS NULL THEN
        RETURN QUERY SELECT 0, 0;
        RETURN;
    END IF;

    v_dead := outbox.apply_outcomes(
        v_ids, v_nos, array_fill('ZOMBIE_REQUEUE'::outbox.attempt_state, ARRAY[cardinality(v_ids)]),
        v_workers, v_tokens, v_errors, NULL, v_exhausted);
    PERFORM pg_notify('outbox_new', 'repaired');
    RETURN QUERY SELECT cardinality(v_ids) - v_dead, v_dead;
END;
$$;

COMMENT ON FUNCTION outbox.repair_expired_leases(integer) IS
    'Requeues up to p_limit messages whose lease expired (a ZOMBIE_REQUEUE attempt each) and dead-letters those out of attempts; one pass at a time (''repair'' turn, else (0, 0) at once); returns (requeued, dead_lettered); P7001 on a bad limit.';

REVOKE ALL ON FUNCTION outbox.repair_expired_leases(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.repair_expired_leases(integer) TO outbox_relay;

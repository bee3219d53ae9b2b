-- Cheaper idle claims: a claim that finds nothing cost about 1 ms of the server's time, and
-- every served source makes one each poll interval when idle. The probe of a shard before
-- its turn moves to claim_probe, whose plan is generic and kept for the session (the claims
-- planned it on every call, 16 times in an idle claim); claim_floors becomes one PL/pgSQL
-- expression planned once per session (a SQL function's 16-way UNION was planned on every
-- call); a claim that chose nothing returns before its UPDATE is planned. The claims'
-- contracts are unchanged; 04_claim.sql holds them in full.

CREATE OR REPLACE FUNCTION outbox.claim_floors() RETURNS timestamptz[]
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- pg_sequence_last_value is NULL for a floor never set (its start value, 0)
    RETURN ARRAY(SELECT CASE WHEN coalesce(f.micros, 0) = 0 THEN timestamptz '-infinity'
                             ELSE timestamptz 'epoch' + f.micros * interval '1 microsecond' END
                   FROM unnest(ARRAY[
                            pg_sequence_last_value('outbox.claim_floor_0'),
                            pg_sequence_last_value('outbox.claim_floor_1'),
                            pg_sequence_last_value('outbox.claim_floor_2'),
                            pg_sequence_last_value('outbox.claim_floor_3'),
                            pg_sequence_last_value('outbox.claim_floor_4'),
                            pg_sequence_last_value('outbox.claim_floor_5'),
                            pg_sequence_last_value('outbox.claim_floor_6'),
                            pg_sequence_last_value('outbox.claim_floor_7'),
                            pg_sequence_last_value('outbox.claim_floor_8'),
                            pg_sequence_last_value('outbox.claim_floor_9'),
                            pg_sequence_last_value('outbox.claim_floor_10'),
                            pg_sequence_last_value('outbox.claim_floor_11'),
                            pg_sequence_last_value('outbox.claim_floor_12'),
                            pg_sequence_last_value('outbox.claim_floor_13'),
                            pg_sequence_last_value('outbox.claim_floor_14'),
                            pg_sequence_last_value('outbox.claim_floor_15')])
                        WITH ORDINALITY AS f(micros, shard)
                  ORDER BY f.shard);
END;
$$;

COMMENT ON FUNCTION outbox.claim_floors() IS
    'Internal (claims, repair_expired_leases): the claim floors of shards 0 to 15, as timestamps. Not granted.';

REVOKE ALL ON FUNCTION outbox.claim_floors() FROM PUBLIC;


CREATE OR REPLACE FUNCTION outbox.claim_probe(p_shard integer, p_floor timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN (SELECT c.available_at
              FROM outbox.messages AS c
             WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
               AND NOT c.behind
               AND c.available_at >= p_floor
             ORDER BY c.available_at, c.seq
             LIMIT 1);
END;
$$;

COMMENT ON FUNCTION outbox.claim_probe(integer, timestamptz) IS
    'Internal (claim_outbox_batch_seq and claim_outbox_batch): the available_at of a shard''s first entry of messages_shard_heads_idx from its floor, leased or not; a hint taken before the shard''s turn. Not granted.';

REVOKE ALL ON FUNCTION outbox.claim_probe(integer, timestamptz) FROM PUBLIC;


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
                v_first := outbox.claim_probe(v_shard, v_floors[v_shard + 1]);
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

    -- Nothing chosen: nothing to lease (and no UPDATE to plan).
    IF cardinality(v_ids) = 0 THEN
        RETURN;
    END IF;
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
                v_first := outbox.claim_probe(v_shard, v_floors[v_shard + 1]);
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

    -- Nothing chosen: nothing to lease (and no UPDATE to plan).
    IF cardinality(v_ids) = 0 THEN
        RETURN;
    END IF;
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

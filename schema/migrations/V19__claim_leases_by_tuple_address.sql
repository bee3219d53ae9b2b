-- V19: a claim leases its rows by their tuple address.
--
-- claim_outbox_batch found its candidates (claim_shard_candidates, by the shard's index)
-- and then leased them with `outbox_id = ANY (ids)`: a second descent of the primary key
-- per message, for rows it had just read. Measured with pg_stat_statements (200,000
-- messages, batch 500, 2 clients calling claim and complete): the lease's UPDATE took
-- 4.3–4.9 of a claim's 10 ms, and a primary-key scan of 500 ids took 2.7 ms where a scan
-- by tuple address took 1.5 ms.
--
-- Now the candidates come back with their tuple addresses (ctid), and the UPDATE reads
-- the rows there (a TID scan), still requiring the listed id and no lease. A head's
-- address cannot change before the claim commits: the claim holds it locked FOR UPDATE. A
-- run's message is not locked, and only the claim holding its head takes it (V11); if it
-- was updated meanwhile, its old address no longer holds a live version, so the UPDATE
-- leaves it out of the batch (it is taken by a later claim), and if the address was
-- reused by another message, the id check leaves that one out. Either way a message is
-- leased only when it is one the claim chose.
--
-- claim_shard_candidates returns the addresses as well (a new OUT argument: dropped and
-- created again, internal as before); claim_outbox_batch keeps its signature, results and
-- grants.

DROP FUNCTION outbox.claim_shard_candidates(integer, integer, bigint, text[], text[], bigint, bigint);

-- claim_shard_candidates (internal, called by claim_outbox_batch while it holds the
-- shard's turn): as in V12, with the candidates' tuple addresses.
CREATE FUNCTION outbox.claim_shard_candidates(
    p_shard integer,
    p_room integer,
    p_used bigint,
    p_topics text[],
    p_exclude_topics text[],
    p_max_bytes bigint,
    p_max_message_bytes bigint,
    OUT ids uuid[],
    OUT ctids tid[],
    OUT bytes bigint
)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_custom_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET jit = off
AS $$
DECLARE
    v_keys text[];
    v_seqs bigint[];
    v_topics text[];
    v_room integer;
    v_run uuid[];
    v_run_ctids tid[];
    v_run_bytes bigint;
BEGIN
    -- Heads. The budget is a running sum over the candidates in claim order; rows past it
    -- were locked by the inner scan and are left untouched.
    SELECT coalesce(array_agg(b.outbox_id), '{}'),
           coalesce(array_agg(b.ctid), '{}'),
           coalesce(sum(b.counted), 0),
           array_agg(b.message_key) FILTER (WHERE b.message_key IS NOT NULL),
           array_agg(b.seq) FILTER (WHERE b.message_key IS NOT NULL),
           array_agg(b.topic) FILTER (WHERE b.message_key IS NOT NULL)
      INTO ids, ctids, bytes, v_keys, v_seqs, v_topics
      FROM (SELECT w.*,
                   sum(w.counted) OVER (ROWS UNBOUNDED PRECEDING) - w.counted AS before
              FROM (SELECT c.outbox_id, c.ctid, c.message_key, c.seq, c.topic,
                           CASE WHEN octet_length(c.payload) > p_max_message_bytes THEN 0
                                ELSE octet_length(c.payload)::bigint END AS counted
                      FROM outbox.messages AS c
                     WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
                       AND NOT c.behind
                       AND c.available_at <= now()
                       AND c.lease_token IS NULL
                       AND (p_topics IS NULL OR c.topic = ANY (p_topics))
                       AND (p_exclude_topics IS NULL OR NOT c.topic LIKE ANY (p_exclude_topics))
                       AND (c.message_key IS NULL OR NOT EXISTS (
                               SELECT 1
                                 FROM outbox.messages AS e
                                WHERE e.message_key = c.message_key
                                  AND e.seq < c.seq))
                     ORDER BY c.available_at, c.seq
                     LIMIT p_room
                       FOR UPDATE SKIP LOCKED) AS w) AS b
     WHERE p_max_bytes IS NULL OR p_used + b.before < p_max_bytes;

    -- Runs: for each keyed head, in the heads' order, the messages that follow it in its
    -- key while each is claimable; at most the room left, within the budget.
    v_room := p_room - cardinality(ids);
    IF v_keys IS NOT NULL AND v_room > 0 AND (p_max_bytes IS NULL OR p_used + bytes < p_max_bytes) THEN
        SELECT array_agg(r.outbox_id), array_agg(r.ctid), sum(r.len)
          INTO v_run, v_run_ctids, v_run_bytes
          FROM (SELECT q.outbox_id, q.ctid, q.len,
                       count(*) OVER o AS nth,
                       sum(q.len) OVER o - q.len AS before
                  FROM (SELECT h.ord, x.outbox_id, x.ctid, x.seq, x.len
                          FROM unnest(v_keys, v_seqs, v_topics) WITH ORDINALITY AS h(key, seq, topic, ord)
                         CROSS JOIN LATERAL (
                                SELECT y.outbox_id, y.ctid, y.seq, y.len
                                  FROM (SELECT n.outbox_id, n.ctid, n.seq,
                                               octet_length(n.payload)::bigint AS len,
                                               bool_and(n.available_at <= now()
                                                        AND n.lease_token IS NULL
                                                        AND n.topic = h.topic
                                                        AND (p_max_message_bytes IS NULL
                                                             OR octet_length(n.payload) <= p_max_message_bytes))
                                                   OVER (ORDER BY n.seq ROWS UNBOUNDED PRECEDING) AS unbroken
                                          FROM outbox.messages AS n
                                         WHERE n.message_key = h.key
                                           AND n.seq > h.seq
                                         ORDER BY n.seq
                                         LIMIT v_room) AS y
                                 WHERE y.unbroken) AS x) AS q
                WINDOW o AS (ORDER BY q.ord, q.seq ROWS UNBOUNDED PRECEDING)) AS r
         WHERE r.nth <= v_room
           AND (p_max_bytes IS NULL OR p_used + bytes + r.before < p_max_bytes);
        ids := ids || coalesce(v_run, '{}');
        ctids := ctids || coalesce(v_run_ctids, '{}');
        bytes := bytes + coalesce(v_run_bytes, 0);
    END IF;
END;
$$;
REVOKE ALL ON FUNCTION outbox.claim_shard_candidates(integer, integer, bigint, text[], text[], bigint, bigint)
    FROM PUBLIC;


-- claim_outbox_batch: as in V12, leasing by tuple address (see the header).
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
    v_shards integer[];
    v_shard integer;
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

    -- The shards that have a claimable message, the one with the oldest first: one
    -- statement of 16 index probes, so that an idle queue costs no turn and no per-shard
    -- statement. A hint only: each shard is read again under its turn.
    SELECT coalesce(array_agg(f.shard ORDER BY f.available_at, f.seq), '{}')
      INTO v_shards
      FROM generate_series(0, 15) AS g(shard)
     CROSS JOIN LATERAL (
            SELECT g.shard, c.available_at, c.seq
              FROM outbox.messages AS c
             WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = g.shard
               AND NOT c.behind
               AND c.available_at <= now()
               AND c.lease_token IS NULL
               AND (p_topics IS NULL OR c.topic = ANY (p_topics))
               AND (p_exclude_topics IS NULL OR NOT c.topic LIKE ANY (p_exclude_topics))
             ORDER BY c.available_at, c.seq
             LIMIT 1) AS f;

    -- Pass 1 skips the shards other claims hold. Only when it took no turn at all (every
    -- shard with work is held) does pass 2 wait for the first shard's turn, as claims
    -- waited for the single turn before, and then go on skipping the others.
    FOR v_pass IN 1 .. 2 LOOP
        EXIT WHEN v_turns > 0 OR cardinality(v_shards) = 0;
        FOREACH v_shard IN ARRAY v_shards LOOP
            IF v_pass = 2 AND v_shard = v_shards[1] THEN
                PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'claim:' || v_shard FOR UPDATE;
            ELSE
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

-- V12: claims take turns per shard, so a fleet does not queue on one lock.
--
-- Since V2 every claim took one turn for the whole database (V6: a row of outbox.turns),
-- because two claims running at once lock each other's freshly leased rows (see V2). With
-- a fleet, the turn became the queue: at 4 relays (2 cores) about half of the database
-- sessions' active time was spent waiting for it, and one slow claim held up all others.
--
-- Now the ready messages are split into 16 shards by a hash of their key (of their id when
-- unkeyed), so all messages of a key share a shard and per-key order needs nothing new.
-- Each shard has its own turn. A claim finds the shards with claimable messages, takes the
-- turns of those no other claim holds (SKIP LOCKED: it never waits for a turn it can skip),
-- the shard with the oldest claimable message first, and takes heads and runs from each
-- until its batch is full; it waits for a turn only when every shard with work is taken.
-- Two claims therefore never walk the same shard at once, which is what the single turn
-- ensured, and claims no longer wait for each other while there are free shards.
--
-- Order across shards: a batch takes a shard's heads and runs before the next shard's, so
-- it holds the oldest ready message of the table (when no other claim holds its shard) but
-- not necessarily the oldest few hundred. Unkeyed messages never had an order; keyed ones
-- keep theirs (one shard per key).

-- A message's shard is `hashtext(coalesce(message_key, outbox_id::text)) & 15`, written out
-- in the index and in the claim alike (the planner matches the index by the expression).
-- 16 shards serve fleets up to 16 relays with a free shard for each claim. The claim's walk
-- per shard replaces messages_heads_idx: one index entry per unkeyed message or key head,
-- as before.
CREATE INDEX messages_shard_heads_idx
    ON outbox.messages ((hashtext(coalesce(message_key, outbox_id::text)) & 15), available_at, seq)
    WHERE NOT behind;
DROP INDEX outbox.messages_heads_idx;

-- The shards' turns replace the single 'claim' turn, which nothing takes any more.
INSERT INTO outbox.turns (name)
SELECT 'claim:' || s FROM generate_series(0, 15) AS s;
DELETE FROM outbox.turns WHERE name = 'claim';

-- claim_outbox_batch: as in V11 (arguments, results, heads and runs, budget and payload
-- limit), per shard; see the header. Rows come back in enqueue order (seq). Crash cost: as
-- in V2 (synchronous_commit off: a claim lost in a crash only makes its messages
-- claimable again).
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
            SELECT v_ids || s.ids, v_bytes + s.bytes
              INTO v_ids, v_bytes
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
         WHERE m.outbox_id = ANY (v_ids)
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

-- claim_shard_candidates (internal, called by claim_outbox_batch while it holds the
-- shard's turn): the ids a claim takes from one shard, at most p_room of them, and their
-- payload bytes as counted against the budget (p_used already spent). As V11's claim did
-- for the whole table: heads from the shard's walk of messages_shard_heads_idx (locked FOR
-- UPDATE SKIP LOCKED, with the probe for an earlier message of the key), then runs after
-- the keyed heads in the room left. A run needs no lock of its own: it is reached only
-- through its head, which this transaction holds locked.
CREATE FUNCTION outbox.claim_shard_candidates(
    p_shard integer,
    p_room integer,
    p_used bigint,
    p_topics text[],
    p_exclude_topics text[],
    p_max_bytes bigint,
    p_max_message_bytes bigint,
    OUT ids uuid[],
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
    v_run_bytes bigint;
BEGIN
    -- Heads. The budget is a running sum over the candidates in claim order; rows past it
    -- were locked by the inner scan and are left untouched.
    SELECT coalesce(array_agg(b.outbox_id), '{}'),
           coalesce(sum(b.counted), 0),
           array_agg(b.message_key) FILTER (WHERE b.message_key IS NOT NULL),
           array_agg(b.seq) FILTER (WHERE b.message_key IS NOT NULL),
           array_agg(b.topic) FILTER (WHERE b.message_key IS NOT NULL)
      INTO ids, bytes, v_keys, v_seqs, v_topics
      FROM (SELECT w.*,
                   sum(w.counted) OVER (ROWS UNBOUNDED PRECEDING) - w.counted AS before
              FROM (SELECT c.outbox_id, c.message_key, c.seq, c.topic,
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
        SELECT array_agg(r.outbox_id), sum(r.len)
          INTO v_run, v_run_bytes
          FROM (SELECT q.outbox_id, q.len,
                       count(*) OVER o AS nth,
                       sum(q.len) OVER o - q.len AS before
                  FROM (SELECT h.ord, x.outbox_id, x.seq, x.len
                          FROM unnest(v_keys, v_seqs, v_topics) WITH ORDINALITY AS h(key, seq, topic, ord)
                         CROSS JOIN LATERAL (
                                SELECT y.outbox_id, y.seq, y.len
                                  FROM (SELECT n.outbox_id, n.seq,
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
        bytes := bytes + coalesce(v_run_bytes, 0);
    END IF;
END;
$$;
REVOKE ALL ON FUNCTION outbox.claim_shard_candidates(integer, integer, bigint, text[], text[], bigint, bigint)
    FROM PUBLIC;

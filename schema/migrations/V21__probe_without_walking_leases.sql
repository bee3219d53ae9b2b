-- V21: a claim's probe stops at a shard's first ready entry, leased or not.
--
-- Since V20 a claim asks, before it takes a shard's turn, whether the shard holds a
-- claimable message. That probe required `lease_token IS NULL`, and leased messages stay in
-- the shard's index until they are completed (their key and time do not change, so the
-- lease is a HOT update that touches no index). The probe therefore walked every leased
-- message at the front of the shard, fetching each row to read its lease, before it found
-- an unleased one, and did so again for every shard it passed: with 16 relays × 3 batches
-- of 500 in flight (24,000 leased messages, about 1,500 per shard), a claim probed 8 shards
-- on average, most of them held by other claims, each probe reading about 430 buffers
-- (pg_stat_statements, 300,000 messages): 31 of the claims' 112 s of database time.
--
-- Now the probe asks only whether the shard has a ready entry at all, which its first
-- entry answers (a claim that names topics still steps over other topics' entries, as
-- before). A shard held by another claim is passed over at that cost, and the
-- leased messages are walked once, by the candidate scan of the claim that holds the turn
-- (as before; see claim_shard_candidates). What changes:
--
-- * A shard whose ready messages are all leased counts as having work: a claim takes its
--   turn (when free) and finds nothing in it, or, when every shard with work is held,
--   waits for the first of them as before. An empty outbox, or one whose messages are all
--   delayed, still costs no turn.
-- * Nothing changes in what a claim returns: the probe was a hint, and the candidates are
--   read under the turn with every condition.
--
-- Measured (bench --fleet 2,16 --messages 300000: batch 500, 3 batches in flight per
-- relay, 10 % keyed; PostgreSQL 15, defaults; three interleaved rounds, V20 → V21): 16
-- relays 39,300–40,800 → 41,800–49,400 msg/s (medians 39,600 → 47,100); 2 relays
-- 59,300–66,900 → 58,300–67,400 (medians 60,100 → 59,400, within the spread).
--
-- claim_outbox_batch keeps its signature, results and grants (CREATE OR REPLACE).

-- claim_outbox_batch: as in V20, with the probe stopping at the shard's first ready entry
-- (see the header).
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

    -- The shards in turn from a random one (see V20). Each is probed for a ready entry
    -- before its turn is taken, so that an idle queue costs no turn; the probe is a hint
    -- only (it stops at the first entry, leased or not): the shard is read again under its
    -- turn. Shards that other claims hold are skipped. Only when pass 1 took no turn while
    -- some shard has work (all such shards are held) does pass 2 wait, for the turn of the
    -- first shard it found with work, as claims waited for the single turn before, and then
    -- go on round the others, skipping those held.
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

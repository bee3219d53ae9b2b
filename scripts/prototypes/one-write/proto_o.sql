-- Prototype O (issue 58): a claim of one statement per shard and slot, with no turn.
-- Today's claim (04_claim.sql) probes each shard it visits, takes the shard's turn, locks
-- each head it chooses (FOR UPDATE SKIP LOCKED), computes the runs, and then leases the
-- chosen rows by tuple address in a second statement. Here one UPDATE chooses and
-- leases a shard's heads at once:
--
--     UPDATE messages_0 m SET claimed_by, lease_token, lease_expires_at
--      WHERE m.ctid = ANY (ARRAY(SELECT ctid … NOT behind, due, unleased, no earlier
--                                message of the key pending … ORDER BY available_at, seq
--                                LIMIT room FOR UPDATE SKIP LOCKED))
--        AND m.lease_token IS NULL
--     RETURNING …
--
-- and a second UPDATE of the same shape leases the runs behind the keyed heads it took,
-- only when it took any. The shards are walked from a random one, each probed and its
-- claim floor raised as today (so the held-horizon bound stays), until the batch is full
-- (with outbox.claim_by_shard() false, proto_o1.sql: one statement over the whole slot,
-- with no shard, no probe and no floor).
--
-- What it keeps: the lease and its token (same shape: slot and keyed bits), fencing (the
-- completion is today's), key order (only a key's head is a candidate: NOT behind and no
-- earlier message of its key pending in any slot; a run is leased only behind a head this
-- statement holds, and the messages of a run are `behind`, which no other claim can take),
-- the topic filters, p_max_message_bytes (payload NULL, a run stops before it), two claims
-- kept apart by SKIP LOCKED, and the rows in seq order.
-- What it drops:
--   * the shards' turns: two claims may walk one shard at once. A claim that reaches a row
--     another claim leased and committed after the first one's snapshot locks that row's
--     new version before the recheck rejects it (Postgres keeps the lock), so the other
--     claim's completion of it waits for this claim's end;
--   * the byte budget p_max_bytes (ignored);
--   * the second pass that waits for a held turn (there are none).
-- Loaded over a copy of the released schema (run.sh rewrites `outbox.` to the copy's name).

-- Whether the claim walks the shards (this file) or the whole slot (proto_o1.sql).
CREATE FUNCTION outbox.claim_by_shard() RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$ SELECT true $$;

-- A claimed message, as the claim returns it.
CREATE TYPE outbox.claim_row AS (
    outbox_id uuid, lease_token uuid, topic text, message_key text, payload bytea,
    content_type text, headers jsonb, attempt_no integer, created_at timestamptz,
    lease_expires_at timestamptz, payload_bytes bigint, seq bigint
);

-- One slot's heads in one statement: chosen, locked and leased. p_shard NULL: every shard
-- (needs proto_o1.sql's index on (available_at, seq) WHERE NOT behind).
CREATE FUNCTION outbox.claim_heads_slot0(
    p_shard integer,
    p_floor timestamptz,
    p_now timestamptz,
    p_room integer,
    p_worker_id text,
    p_lease_seconds integer,
    p_topics text[],
    p_exclude_topics text[],
    p_include_topics text[],
    p_max_message_bytes bigint,
    p_other_slots boolean
) RETURNS SETOF outbox.claim_row
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF p_shard IS NULL THEN
        RETURN QUERY
        UPDATE outbox.messages_0 AS m
           SET claimed_by = p_worker_id,
               lease_token = (left(gen_random_uuid()::text, 35)
                              || (m.slot + CASE WHEN m.message_key IS NULL THEN 0 ELSE 4 END)::text)::uuid,
               lease_expires_at = now() + make_interval(secs => p_lease_seconds)
         WHERE m.ctid = ANY (ARRAY(
                   SELECT c.ctid
                     FROM outbox.messages_0 AS c
                    WHERE NOT c.behind
                      AND c.available_at <= p_now
                      AND c.lease_token IS NULL
                      AND (p_topics IS NULL OR c.topic = ANY (p_topics))
                      AND (p_include_topics IS NULL OR c.topic LIKE ANY (p_include_topics))
                      AND (p_exclude_topics IS NULL OR NOT c.topic LIKE ANY (p_exclude_topics))
                      AND (c.message_key IS NULL OR NOT (
                              EXISTS (SELECT 1 FROM outbox.messages_0 AS e
                                       WHERE e.message_key = c.message_key AND e.seq < c.seq)
                              OR (p_other_slots AND outbox.key_pending_before(c.message_key, c.seq))))
                    ORDER BY c.available_at, c.seq
                    LIMIT p_room
                      FOR UPDATE SKIP LOCKED))
           AND m.lease_token IS NULL
        RETURNING m.outbox_id, m.lease_token, m.topic, m.message_key,
                  CASE WHEN octet_length(m.payload) > p_max_message_bytes THEN NULL ELSE m.payload END,
                  m.content_type, m.headers, m.attempt_count + 1, m.created_at,
                  m.lease_expires_at, octet_length(m.payload)::bigint, m.seq;
    ELSE
        RETURN QUERY
        UPDATE outbox.messages_0 AS m
           SET claimed_by = p_worker_id,
               lease_token = (left(gen_random_uuid()::text, 35)
                              || (m.slot + CASE WHEN m.message_key IS NULL THEN 0 ELSE 4 END)::text)::uuid,
               lease_expires_at = now() + make_interval(secs => p_lease_seconds)
         WHERE m.ctid = ANY (ARRAY(
                   SELECT c.ctid
                     FROM outbox.messages_0 AS c
                    WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
                      AND NOT c.behind
                      AND c.available_at >= p_floor
                      AND c.available_at <= p_now
                      AND c.lease_token IS NULL
                      AND (p_topics IS NULL OR c.topic = ANY (p_topics))
                      AND (p_include_topics IS NULL OR c.topic LIKE ANY (p_include_topics))
                      AND (p_exclude_topics IS NULL OR NOT c.topic LIKE ANY (p_exclude_topics))
                      AND (c.message_key IS NULL OR NOT (
                              EXISTS (SELECT 1 FROM outbox.messages_0 AS e
                                       WHERE e.message_key = c.message_key AND e.seq < c.seq)
                              OR (p_other_slots AND outbox.key_pending_before(c.message_key, c.seq))))
                    ORDER BY c.available_at, c.seq
                    LIMIT p_room
                      FOR UPDATE SKIP LOCKED))
           AND m.lease_token IS NULL
        RETURNING m.outbox_id, m.lease_token, m.topic, m.message_key,
                  CASE WHEN octet_length(m.payload) > p_max_message_bytes THEN NULL ELSE m.payload END,
                  m.content_type, m.headers, m.attempt_count + 1, m.created_at,
                  m.lease_expires_at, octet_length(m.payload)::bigint, m.seq;
    END IF;
END;
$$;
SELECT outbox.copy_for_slots('outbox.claim_heads_slot0(integer, timestamptz, timestamptz, integer, text, integer, text[], text[], text[], bigint, boolean)');

-- The runs behind keyed heads this transaction just leased, in one statement: for each
-- head, in the heads' order, the messages that follow it in its key while each is due,
-- unleased, on the head's topic and within the payload limit; at most p_room in all.
CREATE FUNCTION outbox.lease_runs_slot0(
    p_keys text[],
    p_seqs bigint[],
    p_topics text[],
    p_now timestamptz,
    p_room integer,
    p_worker_id text,
    p_lease_seconds integer,
    p_max_message_bytes bigint
) RETURNS SETOF outbox.claim_row
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RETURN QUERY
    UPDATE outbox.messages_0 AS m
       SET claimed_by = p_worker_id,
           lease_token = (left(gen_random_uuid()::text, 35)
                          || (m.slot + CASE WHEN m.message_key IS NULL THEN 0 ELSE 4 END)::text)::uuid,
           lease_expires_at = now() + make_interval(secs => p_lease_seconds)
     WHERE m.ctid = ANY (ARRAY(
               SELECT x.ctid
                 FROM unnest(p_keys, p_seqs, p_topics) WITH ORDINALITY AS h(key, seq, topic, ord)
                CROSS JOIN LATERAL (
                       SELECT y.ctid, y.seq
                         FROM (SELECT n.ctid, n.seq,
                                      bool_and(n.available_at <= p_now
                                               AND n.lease_token IS NULL
                                               AND n.topic = h.topic
                                               AND (p_max_message_bytes IS NULL
                                                    OR octet_length(n.payload) <= p_max_message_bytes))
                                          OVER (ORDER BY n.seq ROWS UNBOUNDED PRECEDING) AS unbroken
                                 FROM outbox.messages_0 AS n
                                WHERE n.message_key = h.key
                                  AND n.seq > h.seq
                                ORDER BY n.seq
                                LIMIT p_room) AS y
                        WHERE y.unbroken) AS x
                ORDER BY h.ord, x.seq
                LIMIT p_room))
       AND m.lease_token IS NULL
    RETURNING m.outbox_id, m.lease_token, m.topic, m.message_key, m.payload,
              m.content_type, m.headers, m.attempt_count + 1, m.created_at,
              m.lease_expires_at, octet_length(m.payload)::bigint, m.seq;
END;
$$;
SELECT outbox.copy_for_slots('outbox.lease_runs_slot0(text[], bigint[], text[], timestamptz, integer, text, integer, bigint)');

CREATE OR REPLACE FUNCTION outbox.claim_outbox_batch_seq(
    p_batch_size integer,
    p_worker_id text,
    p_lease_seconds integer,
    p_topics text[],
    p_exclude_topics text[],
    p_max_bytes bigint,
    p_max_message_bytes bigint,
    p_include_topics text[]
) RETURNS TABLE (
    outbox_id uuid, lease_token uuid, topic text, message_key text, payload bytea,
    content_type text, headers jsonb, attempt_no integer, created_at timestamptz,
    lease_expires_at timestamptz, payload_bytes bigint, seq bigint
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_custom_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := clock_timestamp();
    v_ring integer[] := outbox.ring();
    v_floors timestamptz[];
    v_bound timestamptz;
    -- with no shards (proto_o1.sql): every slot is walked, and keys checked in all of them
    v_probes timestamptz[] := ARRAY[v_now, v_now, v_now, v_now];
    v_first timestamptz;
    v_raised timestamptz;
    v_fresh boolean := current_setting('transaction_isolation') = 'read committed';
    v_by_shard boolean := outbox.claim_by_shard();
    v_start integer := floor(random() * 16)::integer;
    v_shard integer;
    v_slot integer;
    v_rows outbox.claim_row[] := '{}';
    v_heads outbox.claim_row[];
    v_keys text[];
    v_seqs bigint[];
    v_topics text[];
BEGIN
    IF p_batch_size IS NULL OR p_batch_size < 1 OR p_batch_size > 10000 THEN
        PERFORM outbox.invalid_argument('p_batch_size', format('must be between 1 and 10000, got %s', p_batch_size));
    END IF;
    PERFORM outbox.check_worker_id(p_worker_id);
    IF p_lease_seconds IS NULL OR p_lease_seconds < 1 OR p_lease_seconds > 86400 THEN
        PERFORM outbox.invalid_argument('p_lease_seconds', format('must be between 1 and 86400, got %s', p_lease_seconds));
    END IF;
    PERFORM set_config('synchronous_commit', 'off', true);
    IF v_by_shard THEN
        v_floors := outbox.claim_floors();
        v_bound := outbox.claim_floor_bound();
    END IF;
    -- Shard by shard from a random one (or, with no shards, once over each slot), as today
    -- with the probe of each shard and the raise of its floor, but no turn; then slot by
    -- slot in ring order (oldest first), where the probe found a due entry, one statement
    -- for the heads and one for the runs behind its keyed heads, until the batch is full.
    -- As today, a keyed head's earlier messages are looked for in the other slots only
    -- when the probe found entries of the shard in more than one.
    FOR v_i IN 0 .. CASE WHEN v_by_shard THEN 15 ELSE 0 END LOOP
        EXIT WHEN cardinality(v_rows) >= p_batch_size;
        IF v_by_shard THEN
            v_shard := (v_start + v_i) % 16;
            v_probes := outbox.claim_probe_slots(v_shard, v_floors[v_shard + 1]);
            v_first := least(v_probes[1], v_probes[2], v_probes[3], v_probes[4]);
            v_raised := least(coalesce(v_first, 'infinity'), v_bound);
            IF v_raised > v_floors[v_shard + 1] AND v_fresh THEN
                v_floors[v_shard + 1] := outbox.raise_claim_floor(v_shard, v_floors[v_shard + 1], v_raised);
            END IF;
            CONTINUE WHEN v_first IS NULL OR v_first > v_now;
        END IF;
        FOREACH v_slot IN ARRAY v_ring LOOP
            EXIT WHEN cardinality(v_rows) >= p_batch_size;
            CONTINUE WHEN v_probes[v_slot + 1] IS NULL OR v_probes[v_slot + 1] > v_now;
            -- the arm for slot 0; outbox.dispatch_for_slots writes the others
            CASE v_slot
            WHEN 0 THEN
                v_heads := ARRAY(SELECT h FROM outbox.claim_heads_slot0(v_shard, coalesce(v_floors[v_shard + 1], '-infinity'),
                                                                        v_now, p_batch_size - cardinality(v_rows),
                                                                        p_worker_id, p_lease_seconds, p_topics,
                                                                        p_exclude_topics, p_include_topics,
                                                                        p_max_message_bytes,
                                                                        num_nonnulls(v_probes[1], v_probes[2], v_probes[3], v_probes[4]) > 1) AS h);
                v_rows := v_rows || v_heads;
                SELECT array_agg(h.message_key), array_agg(h.seq), array_agg(h.topic)
                  INTO v_keys, v_seqs, v_topics
                  FROM unnest(v_heads) AS h
                 WHERE h.message_key IS NOT NULL;
                IF v_keys IS NOT NULL AND cardinality(v_rows) < p_batch_size THEN
                    v_rows := v_rows || ARRAY(SELECT r FROM outbox.lease_runs_slot0(v_keys, v_seqs, v_topics, v_now,
                                                                                   p_batch_size - cardinality(v_rows),
                                                                                   p_worker_id, p_lease_seconds,
                                                                                   p_max_message_bytes) AS r);
                END IF;
            END CASE;
        END LOOP;
    END LOOP;
    RETURN QUERY SELECT u.* FROM unnest(v_rows) AS u ORDER BY u.seq;
END;
$$;
SELECT outbox.dispatch_for_slots('outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint, text[])');

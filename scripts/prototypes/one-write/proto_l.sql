-- Prototype L (issue 58): today's walk of a shard without its lock of each head (FOR
-- UPDATE SKIP LOCKED), which writes a Heap/LOCK record per message before the lease's
-- HOT update writes the row again. The claim still holds the shard's turn, so no other
-- claim walks the shard meanwhile; the lease's UPDATE locks the rows it leases, checks
-- `lease_token IS NULL` again on the newest version after a wait, and skips a row a
-- concurrent transaction moved (its tuple address no longer matches). What it gives up:
-- a head that another transaction holds (a repair, a release, a producer's FOR KEY SHARE
-- at its commit) is waited for by the lease instead of skipped by the walk.
-- Loaded over a copy of the released schema (run.sh rewrites `outbox.` to the copy's name).

CREATE OR REPLACE FUNCTION outbox.claim_shard_candidates_slot0(
    p_shard integer,
    p_floor timestamptz,
    p_now timestamptz,
    p_room integer,
    p_used bigint,
    p_topics text[],
    p_exclude_topics text[],
    p_include_topics text[],
    p_max_bytes bigint,
    p_max_message_bytes bigint,
    p_other_slots boolean,
    OUT ids uuid[],
    OUT ctids tid[],
    OUT bytes bigint
)
LANGUAGE plpgsql VOLATILE
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
                               EXISTS (SELECT 1
                                         FROM outbox.messages_0 AS e
                                        WHERE e.message_key = c.message_key
                                          AND e.seq < c.seq)
                               OR (p_other_slots AND outbox.key_pending_before(c.message_key, c.seq))))
                     ORDER BY c.available_at, c.seq
                     LIMIT p_room) AS w) AS b
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

SELECT outbox.copy_for_slots('outbox.claim_shard_candidates_slot0(integer, timestamptz, timestamptz, integer, bigint, text[], text[], text[], bigint, bigint, boolean)');

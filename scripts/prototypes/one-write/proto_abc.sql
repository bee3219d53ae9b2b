-- Prototype ABC (issue 58), loaded after proto_ac.sql: a delivered message without a key
-- is left in its slot for the ring's truncation instead of deleted. It keeps its lease,
-- and its batch row's bit says it was delivered: the completion locks the batch rows (the
-- fence a repair would take too), reads the messages without writing them, and sets the
-- bits. Keyed messages are deleted as today (their key's next message is promoted). The
-- claim's probe passes delivered messages, so the floors rise past them. Per delivered
-- unkeyed message: one row write of its own, the claim's lease.
-- What it leaves out: repair_expired_leases (it would lock the batch row and skip delivered
-- messages), rotate_messages (a slot whose undelivered messages are all gone is empty),
-- and the views (outbox.messages_pending below is what outbox.messages would show).

CREATE OR REPLACE FUNCTION outbox.complete_outbox_batch_slot0(
    p_worker_id text,
    p_outbox_ids uuid[],
    p_lease_tokens uuid[],
    p_states outbox.attempt_state[],
    p_errors text[],
    p_retry_ats timestamptz[]
) RETURNS TABLE (outbox_id uuid, attempt_no integer, lease_lost boolean, dead_lettered boolean)
LANGUAGE plpgsql VOLATILE
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
    -- One completion at a time per key, so that promote_heads sees what the key's other
    -- completions did.
    PERFORM outbox.lock_keys_slot0(ARRAY(SELECT u.id
                                           FROM unnest(p_outbox_ids, p_lease_tokens) AS u(id, token)
                                          WHERE outbox.token_keyed(u.token)));

    IF 'DISPATCHED' = ALL (p_states) THEN
        -- PROTOTYPE ABC: the batches' lease rows, locked in batch order: the fence of the
        -- messages left in their slot
        PERFORM 1
           FROM outbox.lease_batches AS b
          WHERE b.batch = ANY (ARRAY(SELECT DISTINCT outbox.token_batch(t) FROM unnest(p_lease_tokens) AS t))
          ORDER BY b.batch
            FOR NO KEY UPDATE;
        BEGIN
            -- The fence is the deletion: this worker, the token listed with the id, an
            -- unexpired lease; a row changed by a concurrent commit (a repair, another
            -- claim) is checked again after the wait. The attempts are inserted in the
            -- call's order (ord).
            WITH gone AS (
                -- PROTOTYPE ABC: keyed messages are deleted as today (their key's next
                -- message is promoted, and the key checks read messages_key_seq_idx)
                DELETE FROM outbox.messages_0 AS m
                 WHERE m.outbox_id = ANY (p_outbox_ids)
                   AND m.message_key IS NOT NULL
                   AND m.lease_token = ANY (p_lease_tokens)
                   AND m.claimed_by = p_worker_id
                   AND m.lease_expires_at > now()
                RETURNING m.outbox_id, m.attempt_count + 1 AS attempt_no, m.lease_token,
                          m.message_key, m.available_at, m.seq, m.behind
            ), kept AS (
                -- PROTOTYPE ABC: unkeyed messages stay in their slot; read, not written:
                -- the fence is the batch row locked above, which repair would lock too.
                -- One primary-key probe per listed id.
                SELECT u.ord, m.outbox_id, m.attempt_count + 1 AS attempt_no, m.lease_token,
                       m.message_key, m.available_at, m.seq, m.behind, u.error,
                       m.lease_token <> u.token AS mixed
                  FROM unnest(p_outbox_ids, p_lease_tokens, p_errors)
                           WITH ORDINALITY AS u(id, token, error, ord)
                  JOIN outbox.messages_0 AS m ON m.outbox_id = u.id
                  JOIN outbox.lease_batches AS b ON b.batch = outbox.token_batch(m.lease_token)
                 WHERE m.message_key IS NULL
                   AND m.lease_token = ANY (p_lease_tokens)
                   AND m.claimed_by = p_worker_id
                   AND m.lease_expires_at > now()
                   AND get_bit(b.done, outbox.token_ord(m.lease_token) - 1) = 0
            ), done AS (
                SELECT u.ord, g.outbox_id, g.attempt_no, g.lease_token, g.message_key,
                       g.available_at, g.seq, g.behind, u.error,
                       g.lease_token <> u.token AS mixed
                  FROM gone AS g
                  JOIN unnest(p_outbox_ids, p_lease_tokens, p_errors)
                           WITH ORDINALITY AS u(id, token, error, ord)
                    ON u.id = g.outbox_id
                UNION ALL
                SELECT * FROM kept
            ), recorded AS (
                -- PROTOTYPE: the delivered attempts are bits of their batch's lease row
                UPDATE outbox.lease_batches AS b
                   SET done = outbox.set_bits(b.done, x.ords), completed_at = clock_timestamp()
                  FROM (SELECT outbox.token_batch(d.lease_token) AS batch,
                               array_agg(outbox.token_ord(d.lease_token)) AS ords
                          FROM done AS d
                         GROUP BY 1) AS x
                 WHERE b.batch = x.batch
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
                  JOIN outbox.messages_0 AS m ON m.outbox_id = u.id
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
              FROM outbox.messages_0 AS m
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



SELECT outbox.copy_for_slots('outbox.complete_outbox_batch_slot0(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[])');

-- PROTOTYPE ABC: whether a token's message was delivered (its bit in its batch's row).
CREATE FUNCTION outbox.token_delivered(p_token uuid) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT get_bit(b.done, outbox.token_ord(p_token) - 1) = 1
                       FROM outbox.lease_batches AS b
                      WHERE b.batch = outbox.token_batch(p_token)), false)
$$;

-- PROTOTYPE ABC: the probe passes the delivered messages left in their slot, so that the
-- floors rise past them as they rise past the dead entries of deleted ones today.
CREATE OR REPLACE FUNCTION outbox.claim_probe_slots(p_shard integer, p_floor timestamptz)
RETURNS timestamptz[]
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN ARRAY[
        (SELECT c.available_at FROM outbox.messages_0 c
          WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
            AND NOT c.behind AND c.available_at >= p_floor
            AND (c.lease_token IS NULL OR NOT outbox.token_delivered(c.lease_token))
          ORDER BY c.available_at, c.seq LIMIT 1),
        (SELECT c.available_at FROM outbox.messages_1 c
          WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
            AND NOT c.behind AND c.available_at >= p_floor
            AND (c.lease_token IS NULL OR NOT outbox.token_delivered(c.lease_token))
          ORDER BY c.available_at, c.seq LIMIT 1),
        (SELECT c.available_at FROM outbox.messages_2 c
          WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
            AND NOT c.behind AND c.available_at >= p_floor
            AND (c.lease_token IS NULL OR NOT outbox.token_delivered(c.lease_token))
          ORDER BY c.available_at, c.seq LIMIT 1),
        (SELECT c.available_at FROM outbox.messages_3 c
          WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
            AND NOT c.behind AND c.available_at >= p_floor
            AND (c.lease_token IS NULL OR NOT outbox.token_delivered(c.lease_token))
          ORDER BY c.available_at, c.seq LIMIT 1)];
END;
$$;

-- A psql user's outbox.messages: the rows not delivered.
CREATE VIEW outbox.messages_pending AS
SELECT m.* FROM outbox.messages AS m
 WHERE m.lease_token IS NULL OR NOT outbox.token_delivered(m.lease_token);

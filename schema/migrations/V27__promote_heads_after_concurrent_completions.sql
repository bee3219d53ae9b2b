-- The completions of one key run one after the other: complete_outbox_batch first takes
-- a transaction-scoped advisory lock per key of the messages it lists (lock_keys, new), in
-- one order. promote_heads looks a key up again when the message it was promoting was
-- deleted while it waited for it. Two completions of one key at once (two heads of a key
-- held by two workers, or a run's messages completed as each is delivered) could each see
-- the other's message as the key's head and leave the key with its remaining messages
-- marked behind, which no claim takes. Then every key whose first pending message is
-- marked behind gets its head back. Expand only: one new internal function, two re-created
-- with their signatures. The full contract of each is in its area file (05_completion.sql).

CREATE OR REPLACE FUNCTION outbox.lock_keys(p_outbox_ids uuid[]) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    v_hash integer;
BEGIN
    FOR v_hash IN
        SELECT DISTINCT hashtext(m.message_key)
          FROM unnest(p_outbox_ids) AS u(id)
         CROSS JOIN LATERAL (
                SELECT x.message_key
                  FROM outbox.messages AS x
                 WHERE x.outbox_id = u.id
                 LIMIT 1) AS m
         WHERE m.message_key IS NOT NULL
         ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock(hashtext('outbox.key'), v_hash);
    END LOOP;
END;
$$;

COMMENT ON FUNCTION outbox.lock_keys(uuid[]) IS
    'Internal (complete_outbox_batch): takes the transaction-scoped completion lock of the key of each listed message, in one order.';

REVOKE ALL ON FUNCTION outbox.lock_keys(uuid[]) FROM PUBLIC;


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


CREATE OR REPLACE FUNCTION outbox.promote_heads(p_keys text[]) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = auto
SET enable_seqscan = off
AS $$
DECLARE
    v_keys     text[] := ARRAY(SELECT DISTINCT k.key
                                 FROM unnest(p_keys) AS k(key)
                                WHERE k.key IS NOT NULL);
    v_ids      uuid[];  -- the first pending message of a key, still marked behind
    v_id_keys  text[];  -- its key
    v_promoted text[];  -- the keys whose message this round's UPDATE changed
BEGIN
    WHILE cardinality(v_keys) > 0 LOOP
        SELECT array_agg(f.outbox_id), array_agg(k.key)
          INTO v_ids, v_id_keys
          FROM unnest(v_keys) AS k(key)
         CROSS JOIN LATERAL (
                SELECT n.outbox_id, n.behind
                  FROM outbox.messages AS n
                 WHERE n.message_key = k.key
                 ORDER BY n.seq
                 LIMIT 1) AS f
         WHERE f.behind;
        EXIT WHEN v_ids IS NULL;

        WITH promoted AS (
            UPDATE outbox.messages AS m
               SET behind = false
             WHERE m.outbox_id = ANY (v_ids)
               AND m.behind
            RETURNING m.message_key
        )
        SELECT coalesce(array_agg(p.message_key), '{}')
          INTO v_promoted
          FROM promoted AS p;

        -- A message not updated was deleted (or made a head) by another transaction while
        -- this one waited for it: its key is looked up again.
        v_keys := ARRAY(SELECT unnest(v_id_keys) EXCEPT SELECT unnest(v_promoted));
    END LOOP;
END;
$$;

COMMENT ON FUNCTION outbox.promote_heads(text[]) IS
    'Internal (complete_outbox_batch, apply_outcomes): marks the first pending message of each listed key as its head (behind = false).';

REVOKE ALL ON FUNCTION outbox.promote_heads(text[]) FROM PUBLIC;


-- Keys whose first pending message is marked behind: that message becomes the head. One
-- pass over the messages marked behind, one probe of messages_key_seq_idx each.
UPDATE outbox.messages AS m
   SET behind = false
 WHERE m.behind
   AND NOT EXISTS (SELECT 1
                     FROM outbox.messages AS e
                    WHERE e.message_key = m.message_key
                      AND e.seq < m.seq);

-- V22: a completion that reports every message delivered is one statement.
--
-- Since V18 such a completion deletes its messages by its fence and writes their attempts.
-- It did so in four steps: delete_delivered (a function of its own, for its planner
-- settings) returned the deleted rows through a tuplestore; an aggregate put them back
-- in the call's order, with one sort per array; record_attempts unnested those arrays
-- again to insert the attempts; and promote_heads, a SQL function, was planned afresh on
-- every call. Measured with pg_stat_statements (track = all; 300,000 messages, 10 % keyed,
-- claim_outbox_batch + complete_outbox_batch of 500 from 2 pgbench clients, PostgreSQL 15):
-- of a completion's 3.7 ms, the deletion took 1.4 ms and the attempts' INSERT 1.2 ms;
-- the steps around them took about 1 ms, promote_heads 0.3 ms of it.
--
-- Now the deletion, the join with the call's arrays and the attempts' INSERT are one
-- statement (data-modifying CTEs): the deleted rows are joined with the listed pairs once
-- and inserted in the call's order (V14), and the statement returns the keys, the attempt
-- numbers and whether a token was listed with another message's id. The fence is the
-- same DELETE as in V18, with the same conditions, planner settings (now the function's
-- own) and locking order (a scan of the primary key for the listed ids, in id order);
-- promote_heads is PL/pgSQL, so its plan is kept between calls.
--
-- An id used before (V6) makes the attempts' INSERT fail on the primary key. The statement
-- runs in a subtransaction, as the INSERT did in record_attempts, and such a failure
-- undoes the deletion as well: the call then goes the general way (the fence, then
-- apply_outcomes), which records the attempt under the next free number, as it did for
-- every other state. A reused id is rare; the cost is one more pass over the batch. Before
-- it, the pairs are checked as the deletion checks them, so that a token listed with
-- another message's id still fails the call with P7001 (V18), reused id or not.
--
-- Measured (bench --fleet 2,16 --messages 300000: batch 500, 3 batches in flight per
-- relay, 10 % keyed; PostgreSQL 15, defaults; five interleaved rounds, V21 → V22): 2 relays
-- 71,200–83,300 → 82,600–87,700 msg/s (medians 76,800 → 85,000); 16 relays 54,500–63,200
-- → 55,300–63,400 (medians 59,000 → 61,900). In the pgbench measurement above the
-- completion took 3.4 ms against 3.7 ms, and promote_heads 0.19 ms against 0.30 ms.
--
-- Signatures, results, errors and grants are unchanged. delete_delivered is no longer
-- called and is dropped.

-- promote_heads (internal): as in V18, in PL/pgSQL so that its plan is cached (the
-- completion's force_custom_plan is not inherited: the statement reads its array at run
-- time, through the primary key, whatever the array holds).
CREATE OR REPLACE FUNCTION outbox.promote_heads(p_keys text[]) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = auto
SET enable_seqscan = off
AS $$
BEGIN
    UPDATE outbox.messages AS m
       SET behind = false
     WHERE m.outbox_id = ANY (ARRAY(
               SELECT f.outbox_id
                 FROM (SELECT DISTINCT k.key FROM unnest(p_keys) AS k(key)) AS k
                CROSS JOIN LATERAL (
                       SELECT n.outbox_id
                         FROM outbox.messages AS n
                        WHERE n.message_key = k.key
                        ORDER BY n.seq
                        LIMIT 1) AS f))
       AND m.behind;
END;
$$;

DROP FUNCTION outbox.delete_delivered(text, uuid[], uuid[]);

-- complete_outbox_batch: as in V18, with a call that reports every message delivered
-- made one statement (see the header). The planner settings are delete_delivered's (V18):
-- each statement is planned with the call's arrays as constants, so that the tokens are
-- checked against a hashed list, and the deletion walks the primary key in id order
-- whatever the statistics say (a bitmap or sequential scan would lock in page order).
-- Crash cost: as in V2 (a completion lost in a crash leaves its messages leased until
-- their leases expire, and they are delivered again).
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

    -- Fence (as in V14): lock only the rows this worker still holds with these tokens and
    -- an unexpired lease, one primary-key probe per listed id, in id order. Under READ
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

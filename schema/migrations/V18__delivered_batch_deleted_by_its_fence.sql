-- V18: a completion that reports every message delivered deletes them with its fence.
--
-- Almost every completion reports a whole batch delivered. Such a completion made three
-- passes over the batch's rows in outbox.messages: the fence locked each row (a primary-key
-- probe, a lock written to the WAL and the row's page dirtied), then apply_outcomes
-- deleted each (the same probes again), then it wrote the attempts. Measured with
-- pg_stat_statements (200,000 messages, batch 500, 2 clients calling claim and complete,
-- no relayer): of a completion's 9.6 ms, the fence took 3.2 ms and the deletion 1.6 ms.
--
-- Now, when every state of the call is DISPATCHED, the fence is the deletion: one DELETE
-- with the same conditions as the fence (this worker, the token listed with the id, an
-- unexpired lease), one scan of the primary key for the listed ids, in id order (see
-- delete_delivered). A row that a concurrent transaction changed (a repair, another
-- claim) is checked again after the wait, as the fence's lock did, and is reported
-- lease_lost when it no longer matches. The attempts are then written in the call's
-- order, and the next message of each key that lost one becomes its head, as before.
-- Other calls (any state other than DISPATCHED) take the fence and apply_outcomes as in
-- V14. One difference: a call that lists a message's current token with another
-- message's id (a caller's mix-up; tokens are random) now fails with P7001 where the
-- fence reported both lease_lost.
--
-- Locks: the DELETE locks the rows in id order, like the fence, so two completions still
-- never deadlock; and it waits for a producer's FOR KEY SHARE lock on a row (V11, V13) for
-- the instant of the producer's commit, as the deletion did before. Producers never wait
-- for it (they skip locked rows), so that wait cannot close a cycle.
--
-- With the attempts written without ON CONFLICT (see record_attempts), a completion of
-- 500 delivered messages went from 9.6 ms to 5.7 ms in the measurement above.
--
-- The attempts' writing and the promotion of keys' next heads are taken out of
-- apply_outcomes into two internal functions, so both paths share them; apply_outcomes is
-- otherwise as in V16. Signatures, results and grants of the public functions are
-- unchanged.

-- record_attempts (internal): append one attempt per row, in the arrays' order. An
-- outbox_id with an earlier history (V6) gets its attempt under the next free number.
--
-- The rows are written with a plain INSERT, in a subtransaction that a duplicate
-- (outbox_id, attempt_no) rolls back; only then are they written again the careful way, by
-- INSERT … ON CONFLICT DO NOTHING and the search for the rows it skipped. ON CONFLICT
-- costs a speculative insertion per row (a probe of the key before the insert and one more
-- WAL record after it): 4.3–5.1 ms for 500 attempts against 2.7–3.0 ms plainly, and 20 %
-- more WAL. A duplicate needs a reused id, which is rare.
CREATE FUNCTION outbox.record_attempts(
    p_outbox_ids uuid[],
    p_attempt_nos integer[],
    p_states outbox.attempt_state[],
    p_worker_ids text[],
    p_lease_tokens uuid[],
    p_errors text[]
) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_recorded integer;
BEGIN
    BEGIN
        INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token, error)
        SELECT * FROM unnest(p_outbox_ids, p_attempt_nos, p_states, p_worker_ids, p_lease_tokens, p_errors);
        RETURN;
    EXCEPTION WHEN unique_violation THEN
        -- An id with an earlier history is among them: written again below.
    END;

    INSERT INTO outbox.attempts AS a (outbox_id, attempt_no, state, worker_id, lease_token, error)
    SELECT * FROM unnest(p_outbox_ids, p_attempt_nos, p_states, p_worker_ids, p_lease_tokens, p_errors)
    ON CONFLICT ON CONSTRAINT attempts_pkey DO NOTHING;
    GET DIAGNOSTICS v_recorded = ROW_COUNT;

    IF v_recorded < cardinality(p_outbox_ids) THEN
        -- Find the rows whose attempt was not recorded by this call and append theirs
        -- after the last number their id has.
        INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token, error)
        SELECT u.id,
               (SELECT max(a.attempt_no) FROM outbox.attempts AS a WHERE a.outbox_id = u.id) + 1,
               u.state, u.worker, u.token, u.error
          FROM unnest(p_outbox_ids, p_attempt_nos, p_states, p_worker_ids, p_lease_tokens, p_errors)
                   AS u(id, no, state, worker, token, error)
         WHERE NOT EXISTS (SELECT 1
                             FROM outbox.attempts AS a
                            WHERE a.outbox_id = u.id
                              AND a.attempt_no = u.no
                              AND a.lease_token = u.token
                              AND a.state = u.state);
        RAISE WARNING 'outbox: % attempt(s) recorded under a later number: their outbox_id had an earlier history',
                      cardinality(p_outbox_ids) - v_recorded;
    END IF;
END;
$$;
REVOKE ALL ON FUNCTION outbox.record_attempts(uuid[], integer[], outbox.attempt_state[], text[], uuid[], text[])
    FROM PUBLIC;

-- promote_heads (internal): the next pending message of each of these keys is its head.
-- The heads are found first (one key-index probe per key), then updated by primary key
-- (V16: joined in one statement, the planner could walk all of outbox.messages). Called in
-- a statement after the deletion, so its snapshot sees a producer's message whose commit
-- the deletion waited for (V11).
CREATE FUNCTION outbox.promote_heads(p_keys text[]) RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
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
$$;
REVOKE ALL ON FUNCTION outbox.promote_heads(text[]) FROM PUBLIC;

-- apply_outcomes (internal): as in V16, writing attempts and promoting heads through the
-- two functions above.
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
    v_keys text[];
    v_dead_keys text[];
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
            RETURNING message_key
        )
        SELECT array_agg(DISTINCT g.message_key) FILTER (WHERE g.message_key IS NOT NULL)
          INTO v_keys
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
            RETURNING message_key
        )
        SELECT array_agg(DISTINCT b.message_key) FILTER (WHERE b.message_key IS NOT NULL)
          INTO v_dead_keys
          FROM buried AS b;
        v_keys := coalesce(v_keys, '{}') || coalesce(v_dead_keys, '{}');
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
        PERFORM outbox.promote_heads(v_keys);
    END IF;

    RETURN cardinality(v_dead);
END;
$$;

-- delete_delivered (internal, the fence of a completion that reports every message
-- delivered): delete the listed messages that this worker holds under one of the listed
-- tokens with an unexpired lease, and return them. The rows are found by one scan of the
-- primary key for the listed ids, which a B-tree walks in id order (it sorts the array),
-- so the rows are locked in id order, like the fence's; the tokens are checked against a
-- hashed list. Whether each row's token is the one listed with its id is checked by the
-- caller, which has the pairs. The planner settings keep that plan whatever the statistics
-- say (V9): a bitmap or sequential scan would lock in page order.
CREATE FUNCTION outbox.delete_delivered(
    p_worker_id text,
    p_outbox_ids uuid[],
    p_lease_tokens uuid[]
) RETURNS TABLE (outbox_id uuid, attempt_no integer, lease_token uuid, message_key text)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_custom_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
BEGIN
    RETURN QUERY
    WITH gone AS (
        DELETE FROM outbox.messages AS m
         WHERE m.outbox_id = ANY (p_outbox_ids)
           AND m.lease_token = ANY (p_lease_tokens)
           AND m.claimed_by = p_worker_id
           AND m.lease_expires_at > now()
        RETURNING m.outbox_id, m.attempt_count + 1, m.lease_token, m.message_key
    )
    SELECT * FROM gone;
END;
$$;
REVOKE ALL ON FUNCTION outbox.delete_delivered(text, uuid[], uuid[]) FROM PUBLIC;

-- complete_outbox_batch: as in V14, with a call that reports every message delivered
-- deleting them by its fence (see the header). Crash cost: as in V2 (a completion lost in a crash leaves its messages leased
-- until their leases expire, and they are delivered again).
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
AS $$
DECLARE
    v_ids uuid[];
    v_nos integer[];
    v_states outbox.attempt_state[];
    v_tokens uuid[];
    v_errors text[];
    v_retry_ats timestamptz[];
    v_exhausted boolean[];
    v_keys text[];
    v_mixed boolean;
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
        -- The fence is the deletion (see the header); the rows deleted are listed in the
        -- call's order for their attempts. A row whose token was listed with another id
        -- means the caller mixed up its pairs: the call fails and its deletions are undone.
        SELECT array_agg(d.outbox_id ORDER BY u.ord), array_agg(d.attempt_no ORDER BY u.ord),
               array_agg(d.lease_token ORDER BY u.ord), array_agg(u.error ORDER BY u.ord),
               array_agg(DISTINCT d.message_key) FILTER (WHERE d.message_key IS NOT NULL),
               coalesce(bool_or(d.lease_token <> u.token), false)
          INTO v_ids, v_nos, v_tokens, v_errors, v_keys, v_mixed
          FROM outbox.delete_delivered(p_worker_id, p_outbox_ids, p_lease_tokens) AS d
          JOIN unnest(p_outbox_ids, p_lease_tokens, p_errors) WITH ORDINALITY AS u(id, token, error, ord)
            ON u.id = d.outbox_id;
        IF v_mixed THEN
            PERFORM outbox.invalid_argument('p_lease_tokens',
                'a lease token is listed with the id of another message');
        END IF;
        IF v_ids IS NOT NULL THEN
            PERFORM outbox.record_attempts(v_ids, v_nos,
                                           array_fill('DISPATCHED'::outbox.attempt_state, ARRAY[cardinality(v_ids)]),
                                           array_fill(p_worker_id, ARRAY[cardinality(v_ids)]),
                                           v_tokens, v_errors);
        END IF;
        IF v_keys IS NOT NULL THEN
            PERFORM outbox.promote_heads(v_keys);
        END IF;

        RETURN QUERY
        SELECT u.id, h.attempt_no, h.id IS NULL, false
          FROM unnest(p_outbox_ids) WITH ORDINALITY AS u(id, ord)
          LEFT JOIN unnest(v_ids, v_nos) AS h(id, attempt_no) ON h.id = u.id
         ORDER BY u.ord;
        RETURN;
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

-- V14: a completion records its attempts in the order the relayer reported them, and no
-- lease fence waits for a producer.
--
-- complete_outbox_batch locks the batch's rows in outbox_id order (so that two fences
-- never deadlock, V9) and passed them on in that order, so the attempts of one completion
-- were written, and stamped by clock_timestamp(), in id order. For a run of one key that
-- is not the order of delivery when ids do not sort like enqueue order (ids given by the
-- producer, or UUIDv7s made within one millisecond): the attempt log then showed a key's
-- messages delivered out of order while they were not, and an audit reading it could not
-- tell. Now the rows are still locked in id order, and their outcomes are applied, and the
-- attempts written, in the order of the call's arrays. The relayer reports a batch in the
-- order it was claimed, which is enqueue order, and delivers a run in that order.
--
-- The lease fences of complete_outbox_batch, extend_outbox_leases and
-- release_outbox_leases lock FOR NO KEY UPDATE instead of FOR UPDATE: they change lease
-- columns and never a key, and FOR UPDATE also conflicted with the FOR KEY SHARE lock a
-- committing producer holds on the message it enqueued behind (V11, V13). A fence then
-- waited for that producer while holding locks on other rows of its batch, and the
-- producer, following the update chain of a message the fence held, waited for the fence
-- (Postgres waits there even under SKIP LOCKED): a deadlock, seen twice in a 10-minute run
-- at 10,000 msg/s with 10 % keyed traffic. Now a fence never waits for a producer; the
-- deletion of a completed message still does, for the instant of the producer's commit,
-- as V11 intends. The fences still exclude each other, a repair and a claim.
-- Arguments, results and fencing are otherwise unchanged.

-- complete_outbox_batch: as in V9, applying outcomes in the caller's order, with the
-- fence's lock FOR NO KEY UPDATE.
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

    -- Fence: lock only the rows this worker still holds with these tokens and an unexpired
    -- lease, one primary-key probe per listed id, in id order. Under READ COMMITTED a row
    -- changed by a concurrent commit (repair, another claim) is re-checked against these
    -- conditions after the lock is granted. The rows locked are then listed in the order
    -- of the call (ord), which is the order their attempts are written in.
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

-- extend_outbox_leases: as in V9, with the fence's lock FOR NO KEY UPDATE.
CREATE OR REPLACE FUNCTION outbox.extend_outbox_leases(
    p_worker_id text,
    p_outbox_ids uuid[],
    p_lease_tokens uuid[],
    p_lease_seconds integer
) RETURNS TABLE (outbox_id uuid, lease_expires_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox.check_worker_id(p_worker_id);
    PERFORM outbox.check_leases(p_outbox_ids, p_lease_tokens);
    IF p_lease_seconds IS NULL OR p_lease_seconds < 1 OR p_lease_seconds > 86400 THEN
        PERFORM outbox.invalid_argument('p_lease_seconds', format('must be between 1 and 86400, got %s', p_lease_seconds));
    END IF;

    RETURN QUERY
    UPDATE outbox.messages AS m
       SET lease_expires_at = now() + make_interval(secs => p_lease_seconds)
     WHERE m.outbox_id = ANY (ARRAY(
               SELECT h.outbox_id
                 FROM (SELECT * FROM unnest(p_outbox_ids, p_lease_tokens) AS u(id, token)
                        ORDER BY u.id) AS i
                CROSS JOIN LATERAL (
                       SELECT l.outbox_id
                         FROM outbox.messages AS l
                        WHERE l.outbox_id = i.id
                          AND l.lease_token = i.token
                          AND l.claimed_by = p_worker_id
                          AND l.lease_expires_at > now()
                          FOR NO KEY UPDATE) AS h))
    RETURNING m.outbox_id, m.lease_expires_at;
END;
$$;

-- release_outbox_leases: as in V9, with the fence's lock FOR NO KEY UPDATE.
CREATE OR REPLACE FUNCTION outbox.release_outbox_leases(
    p_worker_id text,
    p_outbox_ids uuid[],
    p_lease_tokens uuid[]
) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_released integer;
BEGIN
    PERFORM outbox.check_worker_id(p_worker_id);
    PERFORM outbox.check_leases(p_outbox_ids, p_lease_tokens);

    UPDATE outbox.messages AS m
       SET claimed_by = NULL, lease_token = NULL, lease_expires_at = NULL
     WHERE m.outbox_id = ANY (ARRAY(
               SELECT h.outbox_id
                 FROM (SELECT * FROM unnest(p_outbox_ids, p_lease_tokens) AS u(id, token)
                        ORDER BY u.id) AS i
                CROSS JOIN LATERAL (
                       SELECT l.outbox_id
                         FROM outbox.messages AS l
                        WHERE l.outbox_id = i.id
                          AND l.lease_token = i.token
                          AND l.claimed_by = p_worker_id
                          AND l.lease_expires_at > now()
                          FOR NO KEY UPDATE) AS h));
    GET DIAGNOSTICS v_released = ROW_COUNT;
    IF v_released > 0 THEN
        PERFORM pg_notify('outbox_new', 'released');
    END IF;
    RETURN v_released;
END;
$$;

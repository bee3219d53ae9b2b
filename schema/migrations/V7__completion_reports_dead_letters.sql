-- V7: complete_outbox_batch says which rows it dead-lettered.
--
-- A RETRYABLE outcome on a message's last attempt moves it to outbox.dead_letters; until
-- now only the database knew, so the relayer's dead-letter counter missed those messages.
-- The function gains a fourth output column, dead_lettered: true for a row applied as
-- FAILED, or as RETRYABLE with its attempts exhausted (a message parked instead because a
-- dead letter with its id already exists, see apply_outcomes in V6, is reported the same
-- way). Arguments, fencing and the other columns are unchanged. complete_outbox_attempt
-- reads the columns by name and needs no change.
--
-- A changed result type needs DROP + CREATE, and the grants again.

DROP FUNCTION IF EXISTS outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]);

-- complete_outbox_batch: reports the outcome of a whole batch in one round trip.
--   p_states      DISPATCHED, FAILED or RETRYABLE per message (ZOMBIE_REQUEUE is repair's)
--   p_errors      optional, per message
--   p_retry_ats   optional, per message, only for RETRYABLE (NULL = retry now)
-- A row is applied only if p_worker_id holds it with that token and the lease has not
-- expired, checked under the row lock; otherwise it is reported with lease_lost = true and
-- nothing is written for it. Lost leases never abort the other rows. Invalid arguments
-- raise P7001.
-- Returns one row per input, in input order: outbox_id, the attempt number recorded (NULL
-- when the lease was lost), lease_lost, and dead_lettered (the row went to dead letters).
CREATE FUNCTION outbox.complete_outbox_batch(
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
    -- lease. Under READ COMMITTED a row changed by a concurrent commit (repair, another
    -- claim) is re-checked against these conditions after the lock is granted.
    SELECT array_agg(h.outbox_id), array_agg(h.attempt_no), array_agg(h.state),
           array_agg(h.lease_token), array_agg(h.error), array_agg(h.retry_at),
           array_agg(h.exhausted)
      INTO v_ids, v_nos, v_states, v_tokens, v_errors, v_retry_ats, v_exhausted
      FROM (SELECT m.outbox_id,
                   m.attempt_count + 1 AS attempt_no,
                   i.state,
                   m.lease_token,
                   i.error,
                   i.retry_at,
                   m.attempt_count + 1 >= m.attempt_base + m.max_attempts AS exhausted
              FROM unnest(p_outbox_ids, p_lease_tokens, p_states, p_errors, p_retry_ats)
                       AS i(id, token, state, error, retry_at)
              JOIN outbox.messages AS m ON m.outbox_id = i.id
             WHERE m.lease_token = i.token
               AND m.claimed_by = p_worker_id
               AND m.lease_expires_at > now()
             ORDER BY m.outbox_id
               FOR UPDATE OF m) AS h;

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

REVOKE ALL ON FUNCTION outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[])
    TO outbox_relay;

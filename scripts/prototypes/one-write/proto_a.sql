-- Prototype A (issue 58): a completion records its delivered attempts as one row of
-- arrays per call (outbox.attempt_batches) instead of one row per attempt; the messages are
-- deleted as today. outbox.attempts_all shows both with the columns of outbox.attempts.
-- Loaded over a copy of the released schema (run.sh rewrites `outbox.` to the copy's name).
-- What it leaves out: the attempt log's primary key refused a second attempt with the same
-- number in a slot (the reused-id path relies on it); a batch row refuses nothing.

CREATE TABLE outbox.attempt_batches (
    worker_id    text        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    slot         smallint    NOT NULL,
    outbox_ids   uuid[]      NOT NULL,
    attempt_nos  integer[]   NOT NULL,
    lease_tokens uuid[]      NOT NULL,
    errors       text[]
);
CREATE INDEX attempt_batches_created_at_idx ON outbox.attempt_batches (created_at);
-- GIN=1 adds the index a per-message read by id needs (enqueue's id check, the console)
-- :GIN CREATE INDEX attempt_batches_ids_idx ON outbox.attempt_batches USING gin (outbox_ids);

CREATE VIEW outbox.attempts_all AS
SELECT a.outbox_id, a.attempt_no, a.state, a.worker_id, a.lease_token, a.error, a.created_at
  FROM outbox.attempts AS a
UNION ALL
SELECT u.outbox_id, u.attempt_no, 'DISPATCHED'::outbox.attempt_state, b.worker_id, u.lease_token,
       u.error, b.created_at
  FROM outbox.attempt_batches AS b
 CROSS JOIN LATERAL unnest(b.outbox_ids, b.attempt_nos, b.lease_tokens, b.errors)
           AS u(outbox_id, attempt_no, lease_token, error);

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
        BEGIN
            -- The fence is the deletion: this worker, the token listed with the id, an
            -- unexpired lease; a row changed by a concurrent commit (a repair, another
            -- claim) is checked again after the wait. The attempts are inserted in the
            -- call's order (ord).
            WITH gone AS (
                DELETE FROM outbox.messages_0 AS m
                 WHERE m.outbox_id = ANY (p_outbox_ids)
                   AND m.lease_token = ANY (p_lease_tokens)
                   AND m.claimed_by = p_worker_id
                   AND m.lease_expires_at > now()
                RETURNING m.outbox_id, m.attempt_count + 1 AS attempt_no, m.lease_token,
                          m.message_key, m.available_at, m.seq, m.behind
            ), done AS (
                SELECT u.ord, g.outbox_id, g.attempt_no, g.lease_token, g.message_key,
                       g.available_at, g.seq, g.behind, u.error,
                       g.lease_token <> u.token AS mixed
                  FROM gone AS g
                  JOIN unnest(p_outbox_ids, p_lease_tokens, p_errors)
                           WITH ORDINALITY AS u(id, token, error, ord)
                    ON u.id = g.outbox_id
            ), recorded AS (
                -- PROTOTYPE A: the call's delivered attempts as ONE row of arrays, in the
                -- call's order, instead of one row per attempt
                INSERT INTO outbox.attempt_batches (worker_id, slot, outbox_ids, attempt_nos, lease_tokens, errors)
                SELECT p_worker_id, outbox.attempt_slot(),
                       array_agg(d.outbox_id ORDER BY d.ord), array_agg(d.attempt_no ORDER BY d.ord),
                       array_agg(d.lease_token ORDER BY d.ord),
                       CASE WHEN bool_or(d.error IS NOT NULL) THEN array_agg(d.error ORDER BY d.ord) END
                  FROM done AS d
                HAVING count(*) > 0
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

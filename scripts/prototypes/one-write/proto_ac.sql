-- Prototype AC (issue 58): a batch lease row (outbox.lease_batches) that the claim writes
-- once and each completion updates once, which is also the record of the batch's delivered
-- attempts (outbox.attempts_all shows them with the columns of outbox.attempts). Each
-- message is still leased by its own HOT update and deleted by the completion's fenced
-- DELETE as today: per delivered message two row writes of its own, and no attempt row.
-- Loaded over a copy of the released schema (run.sh rewrites `outbox.` to the copy's name).

-- The batch lease row, written once by the claim (lease_slot0 and its copies) and
-- updated once by each completion: the ids and attempt numbers of its messages by place,
-- and which of them are delivered (done). A message's lease token is the batch's id with
-- its place (4 hex digits) and the token's usual last digit.
CREATE TABLE outbox.lease_batches (
    batch        uuid        NOT NULL PRIMARY KEY,
    worker_id    text        NOT NULL,
    -- the attempt ring's slot when written (retention would truncate with the ring)
    slot         smallint    NOT NULL,
    -- the messages' slot
    mslot        smallint    NOT NULL,
    claimed_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    completed_at timestamptz,
    outbox_ids   uuid[]      NOT NULL,
    attempt_nos  integer[]   NOT NULL,
    keyed        varbit      NOT NULL,
    done         varbit      NOT NULL
);
CREATE INDEX lease_batches_completed_at_idx ON outbox.lease_batches (completed_at);

CREATE FUNCTION outbox.token_batch(p_token uuid) RETURNS uuid
LANGUAGE sql IMMUTABLE STRICT AS $$ SELECT (left(p_token::text, 31) || '00000')::uuid $$;
CREATE FUNCTION outbox.token_ord(p_token uuid) RETURNS integer
LANGUAGE sql IMMUTABLE STRICT AS $$ SELECT ('x' || substr(p_token::text, 32, 4))::bit(16)::integer $$;
CREATE FUNCTION outbox.batch_token(p_batch uuid, p_ord integer, p_last integer) RETURNS uuid
LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT (left(p_batch::text, 31) || lpad(to_hex(p_ord), 4, '0') || to_hex(p_last))::uuid $$;
CREATE FUNCTION outbox.set_bits(p_bits varbit, p_ords integer[]) RETURNS varbit
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_ord integer;
BEGIN
    FOREACH v_ord IN ARRAY p_ords LOOP
        p_bits := set_bit(p_bits, v_ord - 1, 1);
    END LOOP;
    RETURN p_bits;
END;
$$;

-- outbox.attempts as readers see it: today's rows and the delivered bits of the batches,
-- with the columns of outbox.attempts
CREATE VIEW outbox.attempts_all AS
SELECT a.outbox_id, a.attempt_no, a.state, a.worker_id, a.lease_token, a.error, a.created_at
  FROM outbox.attempts AS a
UNION ALL
SELECT u.outbox_id, u.attempt_no, 'DISPATCHED'::outbox.attempt_state, b.worker_id,
       outbox.batch_token(b.batch, u.ord::integer, b.mslot + 4 * get_bit(b.keyed, u.ord::integer - 1)),
       NULL::text, b.completed_at
  FROM outbox.lease_batches AS b
 CROSS JOIN LATERAL unnest(b.outbox_ids, b.attempt_nos) WITH ORDINALITY AS u(outbox_id, attempt_no, ord)
 WHERE get_bit(b.done, u.ord::integer - 1) = 1;

CREATE OR REPLACE FUNCTION outbox.lease_slot0(
    p_ids uuid[],
    p_ctids tid[],
    p_worker_id text,
    p_lease_seconds integer,
    p_max_message_bytes bigint
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
    payload_bytes bigint,
    seq bigint
)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    -- PROTOTYPE: the batch's id; each message's token is it with the message's place in
    -- the batch (4 hex digits) and today's last digit (the slot, 4 when keyed)
    v_batch text := left(gen_random_uuid()::text, 31);
BEGIN
    RETURN QUERY
    WITH leased AS (
        UPDATE outbox.messages_0 AS m
           SET claimed_by = p_worker_id,
               lease_token = (v_batch || lpad(to_hex(u.ord::integer), 4, '0')
                              || (m.slot + CASE WHEN m.message_key IS NULL THEN 0 ELSE 4 END)::text)::uuid,
               lease_expires_at = now() + make_interval(secs => p_lease_seconds)
          FROM unnest(p_ctids) WITH ORDINALITY AS u(ctid, ord)
         WHERE m.ctid = u.ctid
           -- a check, not a way in: written so that it cannot drive an index scan
           AND (m.outbox_id = ANY (p_ids)) IS TRUE
           AND m.lease_token IS NULL
        RETURNING u.ord, m.slot, m.outbox_id, m.lease_token, m.topic, m.message_key,
                  CASE WHEN octet_length(m.payload) > p_max_message_bytes THEN NULL ELSE m.payload END AS payload,
                  m.content_type, m.headers, m.attempt_count + 1 AS attempt_no, m.created_at,
                  m.lease_expires_at, octet_length(m.payload)::bigint AS payload_bytes, m.seq
    ), batch AS (
        -- PROTOTYPE: the batch's lease row, written once: ids and attempt numbers by place
        INSERT INTO outbox.lease_batches (batch, worker_id, slot, mslot, outbox_ids, attempt_nos, keyed, done)
        SELECT (v_batch || '00000')::uuid, p_worker_id, outbox.attempt_slot(), min(l.slot), p_ids,
               array_agg(l.attempt_no ORDER BY g.g),
               string_agg(CASE WHEN l.message_key IS NOT NULL THEN '1' ELSE '0' END, '' ORDER BY g.g)::varbit,
               repeat('0', cardinality(p_ids))::varbit
          FROM generate_series(1, cardinality(p_ids)) AS g(g)
          LEFT JOIN leased AS l ON l.ord = g.g
        HAVING count(l.ord) > 0
    )
    SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type, l.headers,
           l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes, l.seq
      FROM leased AS l;
END;
$$;

SELECT outbox.copy_for_slots('outbox.lease_slot0(uuid[], tid[], text, integer, bigint)');

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

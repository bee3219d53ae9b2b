-- Hardening of the SQL API against ordinary producer habits and hostile logins:
--
-- * Turns that only the schema owner can hold. Claims and repair passes used to take turns
--   on advisory locks with well-known keys; advisory locks need no privilege, so any login
--   of the database (even one with no outbox role) could hold the key and stop every claim
--   and every repair. They now take turns on rows of `outbox.turns`, a table no other role
--   can read, lock or write: only the SECURITY DEFINER functions below reach it.
-- * A reused outbox_id is refused. An id whose message was delivered or dead-lettered
--   already has attempts (and maybe a dead letter); enqueueing it again used to collide
--   with that history on the next completion, failing the whole batch and every repair
--   pass. `enqueue` now refuses such an id by name, and no single row can make a
--   completion, a repair pass or a replay fail for the others.
-- * Claims take a byte budget and a payload limit (`p_max_bytes`, `p_max_message_bytes`),
--   so that a relayer's memory is bounded by its settings, not by what producers write.

-- One row per kind of turn. Locking a row needs UPDATE on the table, which only the owner
-- has; a transaction that holds the row lock holds the turn until it ends.
CREATE TABLE outbox.turns (
    name text NOT NULL,
    CONSTRAINT turns_pkey PRIMARY KEY (name)
);
INSERT INTO outbox.turns (name) VALUES ('claim'), ('repair');
REVOKE ALL ON outbox.turns FROM PUBLIC;

COMMENT ON TABLE outbox.turns IS
    'Rows locked by claim_outbox_batch and repair_expired_leases to take turns; owner only.';

-- Messages enqueued before this migration under an id that already had attempts continue
-- their history instead of colliding with it: the next attempt gets the next free number,
-- and the earlier life's attempts do not count against this life's budget.
UPDATE outbox.messages AS m
   SET attempt_base = m.attempt_base + (h.last_no - m.attempt_count),
       attempt_count = h.last_no
  FROM (SELECT a.outbox_id, max(a.attempt_no) AS last_no
          FROM outbox.attempts AS a
         GROUP BY a.outbox_id) AS h
 WHERE h.outbox_id = m.outbox_id
   AND h.last_no > m.attempt_count;

-- enqueue (bytea payload): as in V2, and an id that was used before is refused.
--   p_outbox_id      the producer's own id (default a new UUIDv7). An id that is pending,
--                    has attempts (its message was delivered or tried) or is dead-lettered
--                    raises 23505 naming the id, so a producer retrying its own enqueue
--                    recognises it. After an attempt log prune, a delivered message's id
--                    is no longer known and is accepted again.
-- A completion that is deleting the same id at this moment is waited for (the row lock
-- below), so a reuse racing with the earlier life's last attempt is refused too.
CREATE OR REPLACE FUNCTION outbox.enqueue(
    p_topic text,
    p_payload bytea,
    p_message_key text DEFAULT NULL,
    p_headers jsonb DEFAULT '{}',
    p_available_at timestamptz DEFAULT NULL,
    p_outbox_id uuid DEFAULT NULL,
    p_max_attempts integer DEFAULT 10,
    p_content_type text DEFAULT 'application/octet-stream'
) RETURNS uuid
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id uuid := coalesce(p_outbox_id, outbox.uuid_v7());
    v_available_at timestamptz := coalesce(p_available_at, now());
    v_used text;
BEGIN
    IF p_topic IS NULL OR p_topic = '' THEN
        PERFORM outbox.invalid_argument('p_topic', 'must be a non-empty string');
    END IF;
    IF p_payload IS NULL THEN
        PERFORM outbox.invalid_argument('p_payload', 'must not be NULL');
    END IF;
    IF p_headers IS NOT NULL AND jsonb_typeof(p_headers) <> 'object' THEN
        PERFORM outbox.invalid_argument('p_headers', 'must be a JSON object');
    END IF;
    IF p_max_attempts IS NOT NULL AND p_max_attempts < 1 THEN
        PERFORM outbox.invalid_argument('p_max_attempts', format('must be at least 1, got %s', p_max_attempts));
    END IF;

    IF p_outbox_id IS NOT NULL THEN
        -- Waits for a transaction that is completing or dead-lettering this id; each later
        -- statement then sees what it committed.
        PERFORM 1 FROM outbox.messages AS m WHERE m.outbox_id = v_id FOR KEY SHARE;
        IF FOUND THEN
            v_used := 'a message with this id is pending';
        ELSIF EXISTS (SELECT 1 FROM outbox.dead_letters AS d WHERE d.outbox_id = v_id) THEN
            v_used := 'a message with this id is dead-lettered (replay it with replay_dead_letters)';
        ELSIF EXISTS (SELECT 1 FROM outbox.attempts AS a WHERE a.outbox_id = v_id) THEN
            v_used := 'a message with this id was already delivered or attempted';
        END IF;
        IF v_used IS NOT NULL THEN
            RAISE EXCEPTION 'outbox_id % was used before: %', v_id, v_used
                USING ERRCODE = 'unique_violation', DETAIL = v_id::text,
                      HINT = 'every message needs its own outbox_id; if this is a retry of your own enqueue, the message is already in the outbox';
        END IF;
    END IF;

    INSERT INTO outbox.messages (outbox_id, topic, message_key, payload, content_type, headers,
                                 available_at, max_attempts)
    VALUES (v_id, p_topic, p_message_key, p_payload,
            coalesce(p_content_type, 'application/octet-stream'),
            coalesce(p_headers, '{}'), v_available_at, coalesce(p_max_attempts, 10));

    IF v_available_at <= now() THEN
        PERFORM pg_notify('outbox_new', p_topic);
    END IF;
    RETURN v_id;
END;
$$;

-- claim_outbox_batch: as in V2 (see its comment for the plan and the locks), plus:
--   p_max_bytes          byte budget of the batch: messages are taken in claim order while
--                        the payloads taken so far stay under it; the first message is
--                        always taken, whatever its size (NULL = no budget)
--   p_max_message_bytes  a message whose payload is larger is still leased and returned,
--                        but with payload NULL, so the caller can dead-letter it without
--                        loading it; it does not count towards the budget (NULL = no limit)
--   payload_bytes        (returned) the payload's size, read from the stored datum's
--                        header without fetching or decompressing it
-- Turns: claims queue on the 'claim' row of outbox.turns instead of an advisory lock, so no
-- login without the owner's rights can hold them up.
DROP FUNCTION IF EXISTS outbox.claim_outbox_batch(integer, text, integer, text[], text[]);
CREATE FUNCTION outbox.claim_outbox_batch(
    p_batch_size integer,
    p_worker_id text,
    p_lease_seconds integer,
    p_topics text[] DEFAULT NULL,
    p_exclude_topics text[] DEFAULT NULL,
    p_max_bytes bigint DEFAULT NULL,
    p_max_message_bytes bigint DEFAULT NULL
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
    payload_bytes bigint
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_custom_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET jit = off
AS $$
BEGIN
    IF p_batch_size IS NULL OR p_batch_size < 1 OR p_batch_size > 10000 THEN
        PERFORM outbox.invalid_argument('p_batch_size', format('must be between 1 and 10000, got %s', p_batch_size));
    END IF;
    PERFORM outbox.check_worker_id(p_worker_id);
    IF p_lease_seconds IS NULL OR p_lease_seconds < 1 OR p_lease_seconds > 86400 THEN
        PERFORM outbox.invalid_argument('p_lease_seconds', format('must be between 1 and 86400, got %s', p_lease_seconds));
    END IF;
    IF p_max_bytes IS NOT NULL AND p_max_bytes < 1 THEN
        PERFORM outbox.invalid_argument('p_max_bytes', format('must be at least 1 or NULL, got %s', p_max_bytes));
    END IF;
    IF p_max_message_bytes IS NOT NULL AND p_max_message_bytes < 1 THEN
        PERFORM outbox.invalid_argument('p_max_message_bytes', format('must be at least 1 or NULL, got %s', p_max_message_bytes));
    END IF;

    PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'claim' FOR UPDATE;
    -- See V2: a claim lost in a crash only makes its messages claimable again.
    PERFORM set_config('synchronous_commit', 'off', true);

    RETURN QUERY
    UPDATE outbox.messages AS m
       SET claimed_by = p_worker_id,
           lease_token = gen_random_uuid(),
           lease_expires_at = now() + make_interval(secs => p_lease_seconds)
     WHERE m.outbox_id = ANY (ARRAY(
               -- The budget is a running sum over the candidates in claim order; the rows
               -- past it were locked by the inner scan and are left untouched.
               SELECT b.outbox_id
                 FROM (SELECT w.outbox_id,
                              sum(w.counted) OVER (ROWS UNBOUNDED PRECEDING) - w.counted AS before
                         FROM (SELECT c.outbox_id,
                                      CASE WHEN octet_length(c.payload) > p_max_message_bytes THEN 0
                                           ELSE octet_length(c.payload)::bigint END AS counted
                                 FROM outbox.messages AS c
                                WHERE c.available_at <= now()
                                  AND c.lease_token IS NULL
                                  AND (p_topics IS NULL OR c.topic = ANY (p_topics))
                                  AND (p_exclude_topics IS NULL OR NOT c.topic LIKE ANY (p_exclude_topics))
                                  AND (c.message_key IS NULL OR NOT EXISTS (
                                          SELECT 1
                                            FROM outbox.messages AS e
                                           WHERE e.message_key = c.message_key
                                             AND e.seq < c.seq))
                                ORDER BY c.available_at, c.seq
                                LIMIT p_batch_size
                                  FOR UPDATE SKIP LOCKED) AS w) AS b
                WHERE p_max_bytes IS NULL OR b.before < p_max_bytes))
    RETURNING m.outbox_id, m.lease_token, m.topic, m.message_key,
              CASE WHEN octet_length(m.payload) > p_max_message_bytes THEN NULL ELSE m.payload END,
              m.content_type, m.headers, m.attempt_count + 1, m.created_at, m.lease_expires_at,
              octet_length(m.payload)::bigint;
END;
$$;

REVOKE ALL ON FUNCTION outbox.claim_outbox_batch(integer, text, integer, text[], text[], bigint, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.claim_outbox_batch(integer, text, integer, text[], text[], bigint, bigint)
    TO outbox_relay;

-- apply_outcomes (internal): as in V2, and one row can no longer fail the others.
-- * An attempt number already taken (an id reused before V6 refused it, whose history was
--   not renumbered) is recorded under the next free number instead of failing the insert.
-- * A message to be dead-lettered whose id already has a dead letter (the same kind of
--   reuse) is not deleted: it stays in outbox.messages, parked (available_at = infinity,
--   lease cleared) with last_error saying why, for an operator to resolve. Nothing is lost.
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
AS $$
DECLARE
    v_dead uuid[];
    v_done uuid[];
    v_retry uuid[];
    v_parked uuid[];
    v_recorded integer;
BEGIN
    INSERT INTO outbox.attempts AS a (outbox_id, attempt_no, state, worker_id, lease_token, error)
    SELECT * FROM unnest(p_outbox_ids, p_attempt_nos, p_states, p_worker_ids, p_lease_tokens, p_errors)
    ON CONFLICT ON CONSTRAINT attempts_pkey DO NOTHING;
    GET DIAGNOSTICS v_recorded = ROW_COUNT;

    IF v_recorded < cardinality(p_outbox_ids) THEN
        -- Rare (see above): find the rows whose attempt was not recorded by this call and
        -- append theirs after the last number their id has.
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

    SELECT coalesce(array_agg(u.id) FILTER (WHERE u.state = 'DISPATCHED'), '{}'),
           coalesce(array_agg(u.id) FILTER (WHERE u.state = 'FAILED'
                                            OR (u.state <> 'DISPATCHED' AND u.exhausted)), '{}'),
           coalesce(array_agg(u.id) FILTER (WHERE u.state IN ('RETRYABLE', 'ZOMBIE_REQUEUE')
                                            AND NOT u.exhausted), '{}')
      INTO v_done, v_dead, v_retry
      FROM unnest(p_outbox_ids, p_states, p_exhausted) AS u(id, state, exhausted);

    IF cardinality(v_done) > 0 THEN
        DELETE FROM outbox.messages WHERE outbox_id = ANY (v_done);
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
        )
        INSERT INTO outbox.dead_letters (outbox_id, topic, message_key, payload, content_type, headers,
                                         created_at, attempt_count, max_attempts, last_error)
        SELECT g.outbox_id, g.topic, g.message_key, g.payload, g.content_type, g.headers,
               g.created_at, u.attempt_no, g.max_attempts, u.error
          FROM gone AS g
          JOIN unnest(p_outbox_ids, p_attempt_nos, p_errors) AS u(id, attempt_no, error)
            ON u.id = g.outbox_id;
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

    RETURN cardinality(v_dead);
END;
$$;

-- repair_expired_leases: as in V2, taking its turn on the 'repair' row of outbox.turns. A
-- caller that does not get the turn at once returns (0, 0): another pass is running.
CREATE OR REPLACE FUNCTION outbox.repair_expired_leases(p_limit integer DEFAULT 1000)
RETURNS TABLE (requeued integer, dead_lettered integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    v_ids uuid[];
    v_nos integer[];
    v_workers text[];
    v_tokens uuid[];
    v_errors text[];
    v_exhausted boolean[];
    v_dead integer;
BEGIN
    IF p_limit IS NULL OR p_limit < 1 THEN
        PERFORM outbox.invalid_argument('p_limit', format('must be at least 1, got %s', p_limit));
    END IF;
    PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'repair' FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 0, 0;
        RETURN;
    END IF;

    SELECT array_agg(z.outbox_id), array_agg(z.attempt_no), array_agg(z.claimed_by),
           array_agg(z.lease_token), array_agg(z.error), array_agg(z.exhausted)
      INTO v_ids, v_nos, v_workers, v_tokens, v_errors, v_exhausted
      FROM (SELECT m.outbox_id,
                   m.attempt_count + 1 AS attempt_no,
                   m.claimed_by,
                   m.lease_token,
                   format('lease expired at %s without a completion from worker %s',
                          m.lease_expires_at, m.claimed_by) AS error,
                   m.attempt_count + 1 >= m.attempt_base + m.max_attempts AS exhausted
              FROM outbox.messages AS m
             WHERE m.lease_expires_at <= now()
             LIMIT p_limit
               FOR UPDATE SKIP LOCKED) AS z;

    IF v_ids IS NULL THEN
        RETURN QUERY SELECT 0, 0;
        RETURN;
    END IF;

    v_dead := outbox.apply_outcomes(
        v_ids, v_nos, array_fill('ZOMBIE_REQUEUE'::outbox.attempt_state, ARRAY[cardinality(v_ids)]),
        v_workers, v_tokens, v_errors, NULL, v_exhausted);
    PERFORM pg_notify('outbox_new', 'repaired');
    RETURN QUERY SELECT cardinality(v_ids) - v_dead, v_dead;
END;
$$;

-- replay_dead_letters: as in V2, except that a dead letter whose id is also pending in
-- outbox.messages (an id reused before V6 refused it) is left where it is, with a WARNING
-- naming it, instead of failing the whole replay on the primary key.
CREATE OR REPLACE FUNCTION outbox.replay_dead_letters(p_outbox_ids uuid[] DEFAULT NULL, p_topic text DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_count integer;
    v_kept uuid[];
BEGIN
    SELECT array_agg(d.outbox_id)
      INTO v_kept
      FROM outbox.dead_letters AS d
     WHERE (p_outbox_ids IS NULL OR d.outbox_id = ANY (p_outbox_ids))
       AND (p_topic IS NULL OR d.topic = p_topic)
       AND EXISTS (SELECT 1 FROM outbox.messages AS m WHERE m.outbox_id = d.outbox_id);
    IF v_kept IS NOT NULL THEN
        RAISE WARNING 'outbox: % dead letter(s) not replayed because a message with the same id is pending: %',
                      cardinality(v_kept), array_to_string(v_kept, ', ');
    END IF;

    WITH back AS (
        DELETE FROM outbox.dead_letters AS d
         WHERE (p_outbox_ids IS NULL OR d.outbox_id = ANY (p_outbox_ids))
           AND (p_topic IS NULL OR d.topic = p_topic)
           AND d.outbox_id <> ALL (coalesce(v_kept, '{}'))
        RETURNING d.*
    )
    INSERT INTO outbox.messages (outbox_id, topic, message_key, payload, content_type, headers,
                                 created_at, available_at, attempt_count, attempt_base,
                                 max_attempts, last_error)
    SELECT b.outbox_id, b.topic, b.message_key, b.payload, b.content_type, b.headers,
           b.created_at, now(), b.attempt_count, b.attempt_count, b.max_attempts, b.last_error
      FROM back AS b;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    IF v_count > 0 THEN
        PERFORM pg_notify('outbox_new', 'replayed');
    END IF;
    RETURN v_count;
END;
$$;

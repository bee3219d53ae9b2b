-- V16: two plans that stalled deliveries under sustained load are pinned to indexes.
--
-- Measured at 10,000 msg/s (2 relays, 10 % of messages keyed over 1,000 keys) with
-- attempts older than 60 s pruned every 3 s: twice, a short stall let the backlog reach
-- 30,000–40,000 messages, and from then on deliveries fell to 500–1,500 msg/s while the
-- backlog grew past a million. Two statements had switched plans:
--
-- 1. apply_outcomes marks the next message of each key that lost one as its head. The
--    statement joined the keys' heads to outbox.messages; with statistics taken when few
--    messages were behind a head, the planner put outbox.messages on the outside (an index
--    scan of the whole table filtered on `behind`) and looked the heads up again for each
--    of its rows: 11.7 s per completion at a 480,000 backlog. The heads are now collected
--    first and updated through the primary key, a plan that does not depend on statistics
--    (as the fences since V9).
-- 2. prune_attempts, with a large backlog, estimated that few old attempts would survive
--    its anti-joins and read outbox.messages whole (a hash anti-join over a sequential
--    scan, or a merge anti-join over messages_pkey, a heap fetch per message in uuid
--    order): passes ran for minutes, and their open transaction held back the MVCC
--    horizon, so dead messages stayed in the claim's index. Merge and hash joins are now
--    off for its statement (and JIT, which the nested loop's estimated cost would compile
--    on every call), which leaves a range scan of the time index with one primary-key
--    probe of outbox.messages and outbox.dead_letters per old attempt: its cost follows
--    the attempts pruned, not the backlog. And it takes an optional limit, so that a
--    caller can prune a large history in short transactions.
--
-- apply_outcomes keeps its signature (and grants); prune_attempts gains an argument with
-- a default, so calls with one argument work as before, and is granted again.

-- apply_outcomes (internal): as in V11, with the heads updated by primary key.
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
    v_recorded integer;
    v_keys text[];
    v_dead_keys text[];
BEGIN
    INSERT INTO outbox.attempts AS a (outbox_id, attempt_no, state, worker_id, lease_token, error)
    SELECT * FROM unnest(p_outbox_ids, p_attempt_nos, p_states, p_worker_ids, p_lease_tokens, p_errors)
    ON CONFLICT ON CONSTRAINT attempts_pkey DO NOTHING;
    GET DIAGNOSTICS v_recorded = ROW_COUNT;

    IF v_recorded < cardinality(p_outbox_ids) THEN
        -- Rare (see V6): find the rows whose attempt was not recorded by this call and
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

    -- The next message of each key that lost a message is its head now.
    IF cardinality(v_keys) > 0 THEN
        -- The heads are found first (one key-index probe per key), then updated by
        -- primary key: joined in one statement, the planner could put outbox.messages on
        -- the outside and walk all of it per completion (see the header).
        UPDATE outbox.messages AS m
           SET behind = false
         WHERE m.outbox_id = ANY (ARRAY(
                   SELECT f.outbox_id
                     FROM (SELECT DISTINCT k.key FROM unnest(v_keys) AS k(key)) AS k
                    CROSS JOIN LATERAL (
                           SELECT n.outbox_id
                             FROM outbox.messages AS n
                            WHERE n.message_key = k.key
                            ORDER BY n.seq
                            LIMIT 1) AS f))
           AND m.behind;
    END IF;

    RETURN cardinality(v_dead);
END;
$$;

-- prune_attempts: as in V2, with a limit, and merge joins, hash joins and JIT off for its
-- statement. With p_limit, at most that many attempts are deleted, oldest first; a caller
-- that gets p_limit back calls again (each call is its own short transaction, so a large
-- backlog of history never holds back the MVCC horizon while it is pruned). NULL: no limit.
DROP FUNCTION outbox.prune_attempts(interval);
CREATE FUNCTION outbox.prune_attempts(p_older_than interval, p_limit bigint DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_mergejoin = off
SET enable_hashjoin = off
SET jit = off
AS $$
DECLARE
    v_count bigint;
BEGIN
    IF p_older_than IS NULL OR p_older_than < interval '0' THEN
        PERFORM outbox.invalid_argument('p_older_than', 'must be a non-negative interval');
    END IF;
    IF p_limit IS NOT NULL AND p_limit < 1 THEN
        PERFORM outbox.invalid_argument('p_limit', 'must be NULL (no limit) or at least 1');
    END IF;
    -- Attempts of messages still pending or dead-lettered are kept: a history is pruned
    -- whole once its message is gone. Attempts are never updated, so the row addresses
    -- found first are still theirs when the rows are deleted.
    DELETE FROM outbox.attempts AS a
     WHERE a.ctid = ANY (ARRAY(
               SELECT o.ctid
                 FROM outbox.attempts AS o
                WHERE o.created_at < now() - p_older_than
                  AND NOT EXISTS (SELECT 1 FROM outbox.messages AS m WHERE m.outbox_id = o.outbox_id)
                  AND NOT EXISTS (SELECT 1 FROM outbox.dead_letters AS d WHERE d.outbox_id = o.outbox_id)
                ORDER BY o.created_at
                LIMIT p_limit));
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END;
$$;
REVOKE ALL ON FUNCTION outbox.prune_attempts(interval, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.prune_attempts(interval, bigint) TO outbox_relay;

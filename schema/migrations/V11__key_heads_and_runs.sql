-- V11: a hot key no longer starves everyone, and drains in runs.
--
-- The claim walked messages_ready_idx from the oldest ready message and, for every keyed
-- message, probed the key index for an earlier message of its key. With 50,000 messages
-- behind one key's head, every claim stepped over all of them (0.7–2.2 s per claim): the
-- other traffic drained at 2–5 % of its rate and the hot key at one message per claim.
--
-- Now:
-- * `behind` marks a keyed message that has an earlier message of its key pending. The
--   claim walks messages_heads_idx, which holds only the others (unkeyed messages and the
--   heads of keys), so its cost no longer depends on how many messages wait behind heads.
--   A trigger sets `behind` on insert (enqueue, replay, or a direct INSERT); the completion
--   that deletes a key's head clears it on the key's next message.
-- * A claim may return a run: after a key's head, the messages that follow it in its key,
--   consecutively, while they are ready, unleased, of the head's topic and not over the
--   payload limit, in the batch room the heads left. The batch comes back in enqueue order
--   (seq), so a run's messages are in order within it; the relayer delivers a run one
--   message after the other and gives back, unattempted, what follows a message that was
--   not delivered.
--
-- Per-key order does not rest on `behind` alone: the claim still takes a head only if no
-- earlier message of its key is pending (one probe), as before. A message marked as a head
-- while it is not one is therefore harmless (it is skipped until it is the head); what must
-- never happen is the first pending message of a key marked `behind` with nobody left to
-- clear it. Two races could cause that, and both are closed:
-- * a producer inserts behind message P while P's predecessor is being completed: the
--   completion cannot see the uncommitted row, so it clears `behind` on nobody. At commit
--   (a deferred constraint trigger) the producer locks its nearest earlier message FOR KEY
--   SHARE, so that message's deletion waits for the producer's commit, and the deleting
--   completion clears `behind` in a later statement, whose snapshot sees P. If the earlier
--   messages are gone already, the trigger clears P's own mark. The lock is held only
--   between the trigger and the commit.
-- * under REPEATABLE READ or SERIALIZABLE that lock could fail with a serialization error
--   and fail the producer's commit; there the trigger clears P's mark instead (P is then
--   a head candidate that waits for its turn through the probe, as every message used to).

ALTER TABLE outbox.messages ADD COLUMN behind boolean NOT NULL DEFAULT false;
COMMENT ON COLUMN outbox.messages.behind IS
    'an earlier message of the same message_key is pending; not a claim candidate';

-- Messages already pending: everything after the first pending message of its key.
UPDATE outbox.messages AS m
   SET behind = true
 WHERE m.message_key IS NOT NULL
   AND EXISTS (SELECT 1
                 FROM outbox.messages AS e
                WHERE e.message_key = m.message_key
                  AND e.seq < m.seq);

-- The claim's walk: unkeyed messages and heads, oldest ready first. It replaces
-- messages_ready_idx (nothing else reads that order), so an unkeyed message still costs
-- one index entry there, and a message behind its key costs none until it is the head.
CREATE INDEX messages_heads_idx ON outbox.messages (available_at, seq) WHERE NOT behind;
DROP INDEX outbox.messages_ready_idx;

-- mark_behind (trigger, before insert of a keyed message): behind when any message of the
-- key is pending. Every pending message visible here was enqueued (and numbered) earlier.
-- A VOLATILE trigger function sees the rows inserted earlier by the same statement, so a
-- multi-row INSERT of one key marks all but the first.
CREATE FUNCTION outbox.mark_behind() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    NEW.behind := EXISTS (SELECT 1 FROM outbox.messages AS e WHERE e.message_key = NEW.message_key);
    RETURN NEW;
END;
$$;
REVOKE ALL ON FUNCTION outbox.mark_behind() FROM PUBLIC;

CREATE TRIGGER messages_mark_behind
    BEFORE INSERT ON outbox.messages
    FOR EACH ROW
    WHEN (NEW.message_key IS NOT NULL)
    EXECUTE FUNCTION outbox.mark_behind();

-- settle_behind (deferred constraint trigger, at the commit of a message inserted behind):
-- see the header. SECURITY DEFINER: at commit it runs as the producer's role, which has no
-- rights on the table.
CREATE FUNCTION outbox.settle_behind() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF current_setting('transaction_isolation') = 'read committed' THEN
        -- A row deleted meanwhile is skipped by the lock, and the next earlier one is taken.
        PERFORM 1
           FROM outbox.messages AS e
          WHERE e.message_key = NEW.message_key
            AND e.seq < NEW.seq
          ORDER BY e.seq DESC
          LIMIT 1
            FOR KEY SHARE;
        IF FOUND THEN
            RETURN NULL;
        END IF;
    END IF;
    UPDATE outbox.messages AS m
       SET behind = false
     WHERE m.outbox_id = NEW.outbox_id
       AND m.behind;
    RETURN NULL;
END;
$$;
REVOKE ALL ON FUNCTION outbox.settle_behind() FROM PUBLIC;

CREATE CONSTRAINT TRIGGER messages_settle_behind
    AFTER INSERT ON outbox.messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.behind)
    EXECUTE FUNCTION outbox.settle_behind();

-- claim_outbox_batch: as in V6 (arguments, results, turns, budget and payload limit), with
-- heads from messages_heads_idx and runs after them (see the header). Rows come back in
-- enqueue order (seq).
--
-- A run is reached only through its head, which this claim holds locked (FOR UPDATE), and
-- no other claim takes a message whose key has an earlier pending message; so the run's
-- messages need no lock of their own before they are leased. The batch room decides the
-- run lengths: heads first (every key and unkeyed message gets its turn), then runs in the
-- heads' order. Crash cost: as in V2 (synchronous_commit off: a claim lost in a crash only
-- makes its messages claimable again).
CREATE OR REPLACE FUNCTION outbox.claim_outbox_batch(
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
DECLARE
    v_ids uuid[];
    v_bytes bigint;
    v_keys text[];
    v_seqs bigint[];
    v_topics text[];
    v_room integer;
    v_run uuid[];
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
    PERFORM set_config('synchronous_commit', 'off', true);

    -- Heads: as the V6 candidates, from messages_heads_idx. The budget is a running sum over
    -- the candidates in claim order; rows past it were locked by the inner scan and are
    -- left untouched.
    SELECT coalesce(array_agg(b.outbox_id), '{}'),
           coalesce(sum(b.counted), 0),
           array_agg(b.message_key) FILTER (WHERE b.message_key IS NOT NULL),
           array_agg(b.seq) FILTER (WHERE b.message_key IS NOT NULL),
           array_agg(b.topic) FILTER (WHERE b.message_key IS NOT NULL)
      INTO v_ids, v_bytes, v_keys, v_seqs, v_topics
      FROM (SELECT w.*,
                   sum(w.counted) OVER (ROWS UNBOUNDED PRECEDING) - w.counted AS before
              FROM (SELECT c.outbox_id, c.message_key, c.seq, c.topic,
                           CASE WHEN octet_length(c.payload) > p_max_message_bytes THEN 0
                                ELSE octet_length(c.payload)::bigint END AS counted
                      FROM outbox.messages AS c
                     WHERE NOT c.behind
                       AND c.available_at <= now()
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
     WHERE p_max_bytes IS NULL OR b.before < p_max_bytes;

    -- Runs: for each keyed head, in the heads' order, the messages that follow it in its
    -- key while each is claimable; at most the room left in the batch, within the budget.
    v_room := p_batch_size - cardinality(v_ids);
    IF v_keys IS NOT NULL AND v_room > 0 AND (p_max_bytes IS NULL OR v_bytes < p_max_bytes) THEN
        SELECT array_agg(r.outbox_id)
          INTO v_run
          FROM (SELECT q.outbox_id,
                       count(*) OVER o AS nth,
                       sum(q.len) OVER o - q.len AS before
                  FROM (SELECT h.ord, x.outbox_id, x.seq, x.len
                          FROM unnest(v_keys, v_seqs, v_topics) WITH ORDINALITY AS h(key, seq, topic, ord)
                         CROSS JOIN LATERAL (
                                SELECT y.outbox_id, y.seq, y.len
                                  FROM (SELECT n.outbox_id, n.seq,
                                               octet_length(n.payload)::bigint AS len,
                                               bool_and(n.available_at <= now()
                                                        AND n.lease_token IS NULL
                                                        AND n.topic = h.topic
                                                        AND (p_max_message_bytes IS NULL
                                                             OR octet_length(n.payload) <= p_max_message_bytes))
                                                   OVER (ORDER BY n.seq ROWS UNBOUNDED PRECEDING) AS unbroken
                                          FROM outbox.messages AS n
                                         WHERE n.message_key = h.key
                                           AND n.seq > h.seq
                                         ORDER BY n.seq
                                         LIMIT v_room) AS y
                                 WHERE y.unbroken) AS x) AS q
                WINDOW o AS (ORDER BY q.ord, q.seq ROWS UNBOUNDED PRECEDING)) AS r
         WHERE r.nth <= v_room
           AND (p_max_bytes IS NULL OR v_bytes + r.before < p_max_bytes);
        v_ids := v_ids || coalesce(v_run, '{}');
    END IF;

    RETURN QUERY
    WITH leased AS (
        UPDATE outbox.messages AS m
           SET claimed_by = p_worker_id,
               lease_token = gen_random_uuid(),
               lease_expires_at = now() + make_interval(secs => p_lease_seconds)
         WHERE m.outbox_id = ANY (v_ids)
           AND m.lease_token IS NULL
        RETURNING m.seq, m.outbox_id, m.lease_token, m.topic, m.message_key,
                  CASE WHEN octet_length(m.payload) > p_max_message_bytes THEN NULL ELSE m.payload END
                      AS payload,
                  m.content_type, m.headers, m.attempt_count + 1 AS attempt_no, m.created_at,
                  m.lease_expires_at, octet_length(m.payload)::bigint AS payload_bytes
    )
    SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
           l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes
      FROM leased AS l
     ORDER BY l.seq;
END;
$$;

-- apply_outcomes (internal): as in V6, and a deleted (delivered or dead-lettered) message's
-- key gets its next message marked as the head. That is a statement of its own after the
-- deletes: its snapshot sees every producer that committed while a delete waited on its
-- FOR KEY SHARE lock (settle_behind).
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
        UPDATE outbox.messages AS m
           SET behind = false
          FROM (SELECT DISTINCT k.key FROM unnest(v_keys) AS k(key)) AS k
         CROSS JOIN LATERAL (
                SELECT n.outbox_id
                  FROM outbox.messages AS n
                 WHERE n.message_key = k.key
                 ORDER BY n.seq
                 LIMIT 1) AS f
         WHERE m.outbox_id = f.outbox_id
           AND m.behind;
    END IF;

    RETURN cardinality(v_dead);
END;
$$;

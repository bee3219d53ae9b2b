-- Completion, extension and release: what a worker does with the leases claim_outbox_batch
-- gave it. It reports each message's outcome, keeps the leases of a slow delivery alive, or
-- gives back what it did not attempt.
--
-- Called by: outbox_relay, through complete_outbox_batch, complete_outbox_attempt,
-- extend_outbox_leases and release_outbox_leases. The other functions are internal and no
-- role may execute them: the completion calls them, and repair_expired_leases
-- (06_repair_retention.sql) calls apply_outcomes.
--
-- Functions:
--   outbox.complete_outbox_batch    records a batch's outcomes, reports lost leases per row
--   outbox.complete_outbox_batch_slot0 (and _slot1 … _slot3)
--                                   internal: complete_outbox_batch for one slot's messages
--   outbox.complete_outbox_attempt  records one message's outcome, P7002 on a lost lease
--   outbox.extend_outbox_leases     heartbeat: pushes back the expiry of leases still held
--   outbox.release_outbox_leases    gives back unattempted messages, no attempt recorded
--   outbox.apply_outcomes           internal: settles fenced rows (attempt, then delete,
--                                   dead-letter or requeue)
--   outbox.record_attempts          internal: appends attempts in the arrays' order
--   outbox.promote_heads            internal: a key's next message becomes its head
--   outbox.promote_slot0 (and _slot1 … _slot3)
--                                   internal: promote_heads' update in one slot
--   outbox.lock_keys                internal: serializes the completions of an order key
--   outbox.lock_keys_slot0 (and _slot1 … _slot3)
--                                   internal: lock_keys for one slot's messages
--
-- Conventions shared by all of them:
-- * The lease fence. A listed (outbox_id, lease_token) pair is acted on only when
--   p_worker_id holds that message under that very token and the lease has not expired
--   (lease_expires_at > now(), the start of the caller's transaction), checked on the
--   locked, newest version of the row: under READ COMMITTED a row that a concurrent
--   transaction changed (a repair, a new claim, another completion) is checked again once
--   its lock is granted. A pair that fails is a lost lease and changes nothing:
--   complete_outbox_batch reports it (lease_lost), extend and release leave it out,
--   complete_outbox_attempt raises P7002 (LEASE_LOST).
-- * Slots. A listed message is looked for only in the slot its lease token names
--   (outbox.token_slot, 04_claim.sql): a token that names no slot, or another slot than
--   the message's, is a lost lease. The completion's fence, the deletion of delivered
--   messages, the key locks and the promotion of next heads read and write one slot's own
--   table, by functions written for slot 0 and copied for slots 1 to 3
--   (outbox.copy_for_slots, which checks the rule it copies by; 04_claim.sql), reached
--   through dispatches written with the arm for slot 0 (outbox.dispatch_for_slots writes
--   the others); a completion whose tokens all name one slot, nearly every one, is that
--   slot's copy called once. The heartbeat, the release and the other outcomes
--   (apply_outcomes: retries, dead letters) go through the partitioned parent, the first
--   two matching each row in the slot its token names, apply_outcomes by id (enqueue keeps
--   an id to one pending row: 03_enqueue.sql).
-- * Lock order. Every fence locks the listed rows in (slot, outbox_id) order, so two calls over
--   the same rows (a completion and a heartbeat, two completions) cannot deadlock; a
--   repair skips the rows others hold. A fence that only locks takes FOR NO KEY UPDATE,
--   which a producer's FOR KEY SHARE (settle_behind, at its commit) does not block; the
--   deletion of a message waits for that lock, for the instant of the producer's commit.
--   Producers never wait for a completion (they skip locked rows), so no cycle forms.
-- * Plans. Rows are found by primary key whatever the statistics say: one probe per
--   listed id (a LATERAL subquery with a locking clause, which the planner never flattens
--   into a join), or one scan of messages_pkey for the listed ids (sequential and bitmap
--   scans off in the completions). extend_outbox_leases and release_outbox_leases leave
--   the planner its defaults: on a table the planner knows to be small it may read it
--   sequentially, which costs nothing there (tests/database/plans.rs checks their plans at real
--   sizes).
-- * Arrays are parallel, one element per message. Ids and tokens are checked by
--   outbox.check_leases: both present, the same length, no NULL, no id twice.
-- * Attempts. Every outcome applied appends one row to outbox.attempts, numbered
--   attempt_count + 1, so a message's attempt numbers have no gaps; an id with an earlier
--   history (reused) gets the next free number instead, with a WARNING.
-- * Errors: P7001 (invalid argument; the message and DETAIL name it) before anything is
--   read or locked, except the mixed-pairs check of complete_outbox_batch; P7002
--   (LEASE_LOST) only from complete_outbox_attempt.
-- * Isolation: READ COMMITTED, the relayer's. Under REPEATABLE READ or SERIALIZABLE a row
--   changed after the snapshot raises 40001 where READ COMMITTED checks it again.
-- * Commit: these functions leave synchronous_commit as the session has it (on by
--   default): a completion lost in a crash would deliver its messages again.


-- outbox.complete_outbox_batch_slot0 (internal): complete_outbox_batch (below) for messages
-- whose tokens name slot 0, called by it once its arguments are checked and, when the
-- batch spans slots, once every key's completion lock is held; copied for slots 1 to 3.
-- The fence, the attempts, the deletion of delivered messages and the promotion of the
-- next heads are those of complete_outbox_batch, on slot 0's table.
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
                          m.order_key, m.available_at, m.seq, m.behind
            ), done AS (
                SELECT u.ord, g.outbox_id, g.attempt_no, g.lease_token, g.order_key,
                       g.available_at, g.seq, g.behind, u.error,
                       g.lease_token <> u.token AS mixed
                  FROM gone AS g
                  JOIN unnest(p_outbox_ids, p_lease_tokens, p_errors)
                           WITH ORDINALITY AS u(id, token, error, ord)
                    ON u.id = g.outbox_id
            ), recorded AS (
                -- the log's current slot read once, not as each row's default
                INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token, error, slot)
                SELECT d.outbox_id, d.attempt_no, 'DISPATCHED', p_worker_id, d.lease_token, d.error, l.slot
                  FROM done AS d, (SELECT outbox.attempt_slot() AS slot) AS l
                 ORDER BY d.ord
            )
            SELECT array_agg(d.ord), array_agg(d.attempt_no),
                   array_agg(d.order_key) FILTER (WHERE d.order_key IS NOT NULL AND NOT d.behind),
                   array_agg(d.available_at) FILTER (WHERE d.order_key IS NOT NULL AND NOT d.behind),
                   array_agg(d.seq) FILTER (WHERE d.order_key IS NOT NULL AND NOT d.behind),
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


COMMENT ON FUNCTION outbox.complete_outbox_batch_slot0(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) IS
    'Internal: complete_outbox_batch for messages of slot 0, its arguments checked.';
REVOKE ALL ON FUNCTION outbox.complete_outbox_batch_slot0(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.complete_outbox_batch_slot0(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[])');


-- outbox.complete_outbox_batch: records the outcome of each listed message whose lease
-- p_worker_id still holds, in one round trip, and reports per message whether its lease
-- was lost.
--
-- Inputs:     p_worker_id     the id the messages were claimed with; non-empty.
--             p_outbox_ids    the messages; an empty array does nothing.
--             p_lease_tokens  the token claim_outbox_batch returned with each id.
--             p_states        one per message, not NULL: DISPATCHED (delivered: deleted),
--                             FAILED (permanent: dead-lettered) or RETRYABLE (tried again,
--                             or dead-lettered when it has no attempt left);
--                             ZOMBIE_REQUEUE is repair_expired_leases' own.
--             p_errors        NULL, or one per message (an element may be NULL): recorded
--                             with the attempt, and kept as last_error by a message that
--                             stays or is dead-lettered.
--             p_retry_ats     NULL, or one per message: when a RETRYABLE message is ready
--                             again; a NULL element or a past time means now; only
--                             RETRYABLE rows may have one.
-- Returns:    one row per listed id, in the call's order: outbox_id; attempt_no,
--             attempt_count + 1, the number the attempt is recorded under (NULL when the
--             lease was lost; an id with an earlier history has it recorded under a later
--             number, see record_attempts); lease_lost; dead_lettered (applied as FAILED,
--             or as RETRYABLE with no attempt left, which includes a message parked because
--             a dead letter with its id exists).
-- Locks:      First the completion lock of each listed message's order key (lock_keys),
--             so the completions of one order key run one after the other. When every
--             state is DISPATCHED, the fence is the deletion: one DELETE (this
--             worker, a listed token, an unexpired lease) by one scan of messages_pkey for
--             the listed ids, which locks the rows in id order, waits for a row another
--             transaction holds and checks it again; the same statement inserts the
--             attempts. Otherwise the fence locks each listed row FOR NO KEY UPDATE through
--             its own primary-key probe, in id order, then apply_outcomes settles the rows
--             it holds. Either way promote_heads then updates the next message of each key
--             that lost one, by primary key. Nothing is skipped: a row another fence holds
--             is waited for.
-- Guarantees: * The fence (see the header): a lost lease is reported, changes nothing, and
--               never fails the other rows.
--             * Each row applied gets one attempt (see the header), written in the call's
--               order, so a run is logged in the order it was delivered.
--             * DISPATCHED: the message is deleted. FAILED, or RETRYABLE on the last
--               attempt (attempt_count + 1 >= attempt_base + max_attempts): moved to
--               outbox.dead_letters with payload, headers and this error, or parked in
--               outbox.messages (lease cleared, available_at = infinity, last_error saying
--               why) when a dead letter with its id exists. RETRYABLE otherwise: lease
--               cleared, attempt_count advanced, available_at = the retry time (now when
--               NULL or past), last_error set; it stays its key's head, so the messages
--               behind it keep waiting.
--             * When a key's message is deleted or dead-lettered, the key's next pending
--               message becomes its head, in a statement after the deletion, which also
--               sees a producer's message whose commit the deletion waited for.
-- Raises:     P7001 when p_worker_id is NULL or blank; p_outbox_ids or p_lease_tokens is
--             NULL, holds a NULL or differs in length, or an id is listed twice; p_states
--             is NULL, of another length, or holds a NULL or ZOMBIE_REQUEUE; p_errors or
--             p_retry_ats has another length; a retry time comes with a state other than
--             RETRYABLE; or, when every state is DISPATCHED, a listed message is held by
--             this worker under a token listed with another id (pairs mixed up: the call's
--             deletions are undone; with other states such a pair is simply lost). Never
--             P7002: lost leases are reported.
-- Crash:      One transaction. A crash or disconnect before the commit applies nothing:
--             the messages stay leased until their leases expire, repair_expired_leases
--             then requeues them (a ZOMBIE_REQUEUE attempt each), and they are delivered
--             again under the same outbox_id. A call repeated after an unknown outcome
--             reports lease_lost for the rows the first call applied.
-- Shape:      Nearly every call reports a whole batch delivered, so that call is one
--             statement (data-modifying CTEs: the fenced DELETE, the join with the call's
--             pairs, the attempts' INSERT). Per completion of 500: 9.6 ms as a lock pass, a
--             deletion and an ON CONFLICT insert; 5.7 ms with the deletion as the fence;
--             3.4 ms as one statement. A unique_violation there (a reused id) is caught in
--             its subtransaction, and the call goes the general way. The general fence
--             probes per id because a join left to the planner put outbox.messages outside
--             under 0-row statistics (100–500 ms per call). Custom plans make the arrays
--             constants, so the tokens are checked against a hashed list; without bitmap
--             and sequential scans the DELETE walks the primary key in id order (those
--             would lock in page order). FOR NO KEY UPDATE, because FOR UPDATE conflicts
--             with a producer's FOR KEY SHARE and deadlocked with it (twice in 10 minutes
--             at 10,000 msg/s, 10 % keyed). Details: docs/performance.md.
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
    v_slot integer;
    v_slots integer[];
    v_ids uuid[];
    v_tokens uuid[];
    v_states outbox.attempt_state[];
    v_errors text[];
    v_retry_ats timestamptz[];
    v_out_ids uuid[] := '{}';
    v_out_nos integer[] := '{}';
    v_out_lost boolean[] := '{}';
    v_out_dead boolean[] := '{}';
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

    -- Each listed message is in the slot its lease token names; a token naming no slot
    -- (not issued by a claim) matches no lease.
    v_slot := outbox.token_slot(p_lease_tokens[1]);
    IF v_slot < 4 AND NOT EXISTS (SELECT 1
                                     FROM unnest(p_lease_tokens) AS u(token)
                                    WHERE outbox.token_slot(u.token) <> v_slot) THEN
        -- the arm for slot 0; outbox.dispatch_for_slots writes the others
        CASE v_slot
        WHEN 0 THEN
            RETURN QUERY SELECT * FROM outbox.complete_outbox_batch_slot0(p_worker_id, p_outbox_ids,
                             p_lease_tokens, p_states, p_errors, p_retry_ats);
        END CASE;
        RETURN;
    END IF;
    SELECT array_agg(DISTINCT outbox.token_slot(u.token) ORDER BY outbox.token_slot(u.token))
      INTO v_slots
      FROM unnest(p_lease_tokens) AS u(token);

    -- Several slots: the completion locks of all their keys first, in one order, then
    -- slot by slot in slot order; rows in the call's order.
    PERFORM outbox.lock_keys(ARRAY(SELECT u.id
                                     FROM unnest(p_outbox_ids, p_lease_tokens) AS u(id, token)
                                    WHERE outbox.token_keyed(u.token)));
    FOREACH v_slot IN ARRAY coalesce(v_slots, '{}') LOOP
        CONTINUE WHEN v_slot > 3;
        SELECT array_agg(u.id ORDER BY u.ord), array_agg(u.token ORDER BY u.ord),
               array_agg(u.state ORDER BY u.ord), array_agg(u.error ORDER BY u.ord),
               array_agg(u.retry_at ORDER BY u.ord)
          INTO v_ids, v_tokens, v_states, v_errors, v_retry_ats
          FROM unnest(p_outbox_ids, p_lease_tokens, p_states, p_errors, p_retry_ats)
                   WITH ORDINALITY AS u(id, token, state, error, retry_at, ord)
         WHERE outbox.token_slot(u.token) = v_slot;
        IF p_errors IS NULL THEN
            v_errors := NULL;
        END IF;
        IF p_retry_ats IS NULL THEN
            v_retry_ats := NULL;
        END IF;
        CASE v_slot
        WHEN 0 THEN
            SELECT v_out_ids || array_agg(r.outbox_id), v_out_nos || array_agg(r.attempt_no),
                   v_out_lost || array_agg(r.lease_lost), v_out_dead || array_agg(r.dead_lettered)
              INTO v_out_ids, v_out_nos, v_out_lost, v_out_dead
              FROM outbox.complete_outbox_batch_slot0(p_worker_id, v_ids, v_tokens, v_states,
                                                      v_errors, v_retry_ats) AS r;
        END CASE;
    END LOOP;
    RETURN QUERY
    SELECT u.id, r.attempt_no, coalesce(r.lease_lost, true), coalesce(r.dead_lettered, false)
      FROM unnest(p_outbox_ids) WITH ORDINALITY AS u(id, ord)
      LEFT JOIN unnest(v_out_ids, v_out_nos, v_out_lost, v_out_dead) AS r(id, attempt_no, lease_lost, dead_lettered)
             ON r.id = u.id
     ORDER BY u.ord;
END;
$$;

COMMENT ON FUNCTION outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) IS
    'Records each listed outcome (DISPATCHED, FAILED, RETRYABLE) whose lease p_worker_id still holds with that token; returns per id, in call order, attempt_no, lease_lost and dead_lettered; a lost lease changes nothing; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) TO outbox_relay;
SELECT outbox.dispatch_for_slots('outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[])');


-- outbox.complete_outbox_attempt: records the outcome of one message whose lease
-- p_worker_id holds, and returns its attempt number; a lost lease raises P7002.
--
-- Inputs:     p_outbox_id, p_lease_token  the message and the token it was claimed with;
--                                         not NULL.
--             p_worker_id                 the id it was claimed with; non-empty.
--             p_state                     DISPATCHED, FAILED or RETRYABLE; not NULL.
--             p_error                     default NULL; recorded with the attempt and kept
--                                         as last_error.
--             p_retry_at                  default NULL (now); only with RETRYABLE: when the
--                                         message is ready again (a past time means now).
-- Returns:    attempt_no as complete_outbox_batch returns it (attempt_count + 1).
-- Locks:      those of complete_outbox_batch, which it calls with one-element arrays.
-- Guarantees: those of complete_outbox_batch for one message.
-- Raises:     P7001 when p_outbox_id, p_lease_token or p_state is NULL, p_state is
--             ZOMBIE_REQUEUE, p_retry_at comes with a state other than RETRYABLE, or
--             p_worker_id is NULL or blank. P7002 (LEASE_LOST; the HINT names the usual
--             causes: expired, repaired, claimed or completed by another worker) when
--             p_worker_id does not hold the message under p_lease_token with an unexpired
--             lease; nothing has been changed.
-- Crash:      one transaction, as complete_outbox_batch: before the commit, nothing.
-- Shape:      a wrapper of complete_outbox_batch, so one message and a batch go through the
--             same fence and the same plans.
CREATE OR REPLACE FUNCTION outbox.complete_outbox_attempt(
    p_outbox_id uuid,
    p_lease_token uuid,
    p_worker_id text,
    p_state outbox.attempt_state,
    p_error text DEFAULT NULL,
    p_retry_at timestamptz DEFAULT NULL
) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_result record;
BEGIN
    IF p_outbox_id IS NULL THEN
        PERFORM outbox.invalid_argument('p_outbox_id', 'must not be NULL');
    END IF;
    IF p_lease_token IS NULL THEN
        PERFORM outbox.invalid_argument('p_lease_token', 'must not be NULL');
    END IF;
    IF p_state IS NULL THEN
        PERFORM outbox.invalid_argument('p_state', 'must not be NULL');
    END IF;
    IF p_state = 'ZOMBIE_REQUEUE' THEN
        PERFORM outbox.invalid_argument('p_state',
            'ZOMBIE_REQUEUE is recorded by repair_expired_leases, not by a completion');
    END IF;
    IF p_retry_at IS NOT NULL AND p_state <> 'RETRYABLE' THEN
        PERFORM outbox.invalid_argument('p_retry_at',
            format('a retry time is only allowed with state RETRYABLE, not with %s', p_state));
    END IF;

    SELECT * INTO v_result
      FROM outbox.complete_outbox_batch(p_worker_id, ARRAY[p_outbox_id], ARRAY[p_lease_token],
                                        ARRAY[p_state], ARRAY[p_error], ARRAY[p_retry_at]);
    IF v_result.lease_lost THEN
        RAISE EXCEPTION 'LEASE_LOST: worker % does not hold the lease % on message %',
                        p_worker_id, p_lease_token, p_outbox_id
            USING ERRCODE = 'P7002',
                  HINT = 'the lease expired, was repaired, or the message was claimed or completed by another worker';
    END IF;
    RETURN v_result.attempt_no;
END;
$$;

COMMENT ON FUNCTION outbox.complete_outbox_attempt(uuid, uuid, text, outbox.attempt_state, text, timestamptz) IS
    'Records one message''s outcome (DISPATCHED, FAILED, RETRYABLE) under the lease p_worker_id holds with p_lease_token and returns its attempt number; P7002 (LEASE_LOST) when that lease is not held, P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.complete_outbox_attempt(uuid, uuid, text, outbox.attempt_state, text, timestamptz) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.complete_outbox_attempt(uuid, uuid, text, outbox.attempt_state, text, timestamptz) TO outbox_relay;


-- outbox.extend_outbox_leases: heartbeat for slow destinations. Sets lease_expires_at =
-- now() + p_lease_seconds on each listed message p_worker_id still holds under its token.
--
-- Inputs:     p_worker_id, p_outbox_ids, p_lease_tokens  as for complete_outbox_batch.
--             p_lease_seconds  1 to 86400, counted from now() (the start of the caller's
--                              transaction); the new expiry replaces the old one, also
--                              when it is earlier.
-- Returns:    outbox_id and the new lease_expires_at of each lease still held, in no
--             particular order. A listed id that is missing has lost its lease: its worker
--             stops working on it (its completion would be refused anyway).
-- Locks:      each listed row FOR NO KEY UPDATE through its own primary-key probe, in id
--             order, then an UPDATE of those rows (HOT: the lease columns are in no index).
--             A row another fence holds is waited for and checked again; a producer is
--             never waited for.
-- Guarantees: the fence (see the header): only leases still held are extended; an expired
--             lease is never revived, even before a repair has taken it.
-- Raises:     P7001 when p_worker_id is NULL or blank; p_outbox_ids or p_lease_tokens is
--             NULL, holds a NULL or differs in length, or an id is listed twice;
--             p_lease_seconds is NULL or outside 1..86400. Never P7002.
-- Crash:      one transaction. An extension lost before its commit leaves the old expiry:
--             the lease may then expire and be repaired while the worker still delivers;
--             its completion reports lease_lost, and the message is delivered again.
-- Shape:      the fence probes the primary key per listed id whatever the statistics: a
--             join left to the planner rescanned the batch per leased row under 0-row
--             statistics (100–500 ms per call). Details: docs/performance.md.
CREATE OR REPLACE FUNCTION outbox.extend_outbox_leases(
    p_worker_id text,
    p_outbox_ids uuid[],
    p_lease_tokens uuid[],
    p_lease_seconds integer
) RETURNS TABLE (outbox_id uuid, lease_expires_at timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
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
                        ORDER BY outbox.token_slot(u.token), u.id) AS i
                CROSS JOIN LATERAL (
                       SELECT l.outbox_id
                         FROM outbox.messages AS l
                        WHERE l.outbox_id = i.id
                          AND l.slot = outbox.token_slot(i.token)
                          AND l.lease_token = i.token
                          AND l.claimed_by = p_worker_id
                          AND l.lease_expires_at > now()
                          FOR NO KEY UPDATE) AS h))
       AND m.lease_token = ANY (p_lease_tokens)
    RETURNING m.outbox_id, m.lease_expires_at;
END;
$$;

COMMENT ON FUNCTION outbox.extend_outbox_leases(text, uuid[], uuid[], integer) IS
    'Heartbeat: sets lease_expires_at = now() + p_lease_seconds on the listed leases p_worker_id still holds and returns them; a missing id is a lost lease; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.extend_outbox_leases(text, uuid[], uuid[], integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.extend_outbox_leases(text, uuid[], uuid[], integer) TO outbox_relay;


-- outbox.release_outbox_leases: gives back listed messages p_worker_id claimed and did not
-- attempt (at shutdown, or what follows a message of a run that was not delivered): the
-- lease is cleared, no attempt is recorded, and the message is ready again at once.
--
-- Inputs:     p_worker_id, p_outbox_ids, p_lease_tokens  as for complete_outbox_batch.
-- Returns:    the number of leases released; leases not held (any more) are ignored.
-- Locks:      as extend_outbox_leases: each listed row FOR NO KEY UPDATE through its own
--             primary-key probe, in id order, then an UPDATE of those rows (HOT).
-- Guarantees: the fence (see the header). attempt_count, available_at and `behind` are
--             unchanged: a released head is still its key's head, so key order holds.
--             When any lease was released, NOTIFY outbox_new ('released') at commit, so
--             waiting relayers look again.
-- Raises:     P7001 when p_worker_id is NULL or blank; p_outbox_ids or p_lease_tokens is
--             NULL, holds a NULL or differs in length, or an id is listed twice. Never
--             P7002.
-- Crash:      one transaction. A release lost before its commit leaves the leases to
--             expire: repair_expired_leases then requeues each message with a
--             ZOMBIE_REQUEUE attempt, one attempt spent where the release spends none.
-- Shape:      as extend_outbox_leases.
CREATE OR REPLACE FUNCTION outbox.release_outbox_leases(
    p_worker_id text,
    p_outbox_ids uuid[],
    p_lease_tokens uuid[]
) RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
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
                        ORDER BY outbox.token_slot(u.token), u.id) AS i
                CROSS JOIN LATERAL (
                       SELECT l.outbox_id
                         FROM outbox.messages AS l
                        WHERE l.outbox_id = i.id
                          AND l.slot = outbox.token_slot(i.token)
                          AND l.lease_token = i.token
                          AND l.claimed_by = p_worker_id
                          AND l.lease_expires_at > now()
                          FOR NO KEY UPDATE) AS h))
       AND m.lease_token = ANY (p_lease_tokens);
    GET DIAGNOSTICS v_released = ROW_COUNT;
    IF v_released > 0 THEN
        PERFORM pg_notify('outbox_new', 'released');
    END IF;
    RETURN v_released;
END;
$$;

COMMENT ON FUNCTION outbox.release_outbox_leases(text, uuid[], uuid[]) IS
    'Gives back the listed leases p_worker_id still holds, unattempted: lease cleared, no attempt recorded, ready at once; returns how many; notifies outbox_new; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.release_outbox_leases(text, uuid[], uuid[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.release_outbox_leases(text, uuid[], uuid[]) TO outbox_relay;


-- outbox.apply_outcomes (internal): settles rows its caller has already locked and fenced.
-- Called by complete_outbox_batch (a call not all DISPATCHED, or listing a reused id) and
-- by repair_expired_leases (ZOMBIE_REQUEUE); no role may execute it.
--
-- Inputs:     parallel arrays, one element per message, in the order the attempts are
--             written: ids, attempt numbers (attempt_count + 1), states, worker ids, lease
--             tokens, errors, retry times (a NULL array or element: now), exhausted (no
--             attempt left after this one).
-- Does:       record_attempts, then: DISPATCHED deleted; FAILED, or another state when
--             exhausted, moved to outbox.dead_letters, or parked (lease cleared,
--             available_at = infinity, last_error saying why) when a dead letter with its id
--             exists; RETRYABLE or ZOMBIE_REQUEUE otherwise: lease cleared, attempt_count =
--             the attempt number, available_at = the retry time but not before now(),
--             last_error. Last, promote_heads for the keys that lost a message, in a
--             statement after the deletions.
-- Returns:    the number moved to dead letters (parked messages not counted).
-- Locks:      the caller's rows, and the keys' next heads that promote_heads updates; a
--             deletion waits for a producer's FOR KEY SHARE for the instant of its commit.
-- Raises:     nothing of its own.
-- Shape:      every statement finds its rows by primary key (outbox_id = ANY); sequential
--             scans are off because under 0-row statistics one read every pending row
--             instead (3 ms at 20,000 rows, 150 ms at 1,000,000, per batch).
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
    v_keys text[] := '{}';
    v_after timestamptz[] := '{}';
    v_seqs bigint[] := '{}';
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
            RETURNING order_key, available_at, seq, behind
        )
        SELECT coalesce(array_agg(g.order_key) FILTER (WHERE g.order_key IS NOT NULL AND NOT g.behind), '{}'),
               coalesce(array_agg(g.available_at) FILTER (WHERE g.order_key IS NOT NULL AND NOT g.behind), '{}'),
               coalesce(array_agg(g.seq) FILTER (WHERE g.order_key IS NOT NULL AND NOT g.behind), '{}')
          INTO v_keys, v_after, v_seqs
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
        )
        SELECT v_keys || coalesce(array_agg(g.order_key) FILTER (WHERE g.order_key IS NOT NULL AND NOT g.behind), '{}'),
               v_after || coalesce(array_agg(g.available_at) FILTER (WHERE g.order_key IS NOT NULL AND NOT g.behind), '{}'),
               v_seqs || coalesce(array_agg(g.seq) FILTER (WHERE g.order_key IS NOT NULL AND NOT g.behind), '{}')
          INTO v_keys, v_after, v_seqs
          FROM gone AS g;
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
        PERFORM outbox.promote_heads(v_keys, v_after, v_seqs);
    END IF;

    RETURN cardinality(v_dead);
END;
$$;

COMMENT ON FUNCTION outbox.apply_outcomes(uuid[], integer[], outbox.attempt_state[], text[], uuid[], text[], timestamptz[], boolean[]) IS
    'Internal (complete_outbox_batch, repair_expired_leases): records the attempts of rows the caller has locked and fenced, then deletes, dead-letters (or parks) or requeues each and promotes keys'' next heads; returns the number dead-lettered.';

REVOKE ALL ON FUNCTION outbox.apply_outcomes(uuid[], integer[], outbox.attempt_state[], text[], uuid[], text[], timestamptz[], boolean[]) FROM PUBLIC;


-- outbox.record_attempts (internal): appends one attempt per element, in the arrays'
-- order. Called by apply_outcomes; no role may execute it.
--
-- Guarantees: every element is recorded, in the current slot of outbox.attempts. An
--             attempt number its id already has in that slot (an outbox_id with an earlier
--             history) is not an error: that element is written under the next free number
--             of its id, with a WARNING giving how many; the others keep their numbers. The
--             numbers of one life never meet: each is its message's attempt_count + 1 under
--             the fence. An earlier life's history in an older slot is not looked for
--             (enqueue refuses an id that has one, 03_enqueue.sql): only a row inserted into
--             outbox.messages directly, with the id of such a history, can repeat a number.
-- Raises:     nothing of its own (the unique_violation of a reused id is caught).
-- Shape:      a plain INSERT in a subtransaction, and INSERT … ON CONFLICT only after it
--             failed: ON CONFLICT's speculative insertion per row cost 4.3–5.1 ms per 500
--             attempts against 2.7–3.0 ms plainly, and 20 % more WAL.
CREATE OR REPLACE FUNCTION outbox.record_attempts(
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
    -- the log's current slot read once, not as each row's default
    v_slot smallint := outbox.attempt_slot();
BEGIN
    BEGIN
        INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token, error, slot)
        SELECT u.*, v_slot
          FROM unnest(p_outbox_ids, p_attempt_nos, p_states, p_worker_ids, p_lease_tokens, p_errors) AS u;
        RETURN;
    EXCEPTION WHEN unique_violation THEN
        -- An id with an earlier history is among them: written again below.
    END;

    INSERT INTO outbox.attempts AS a (outbox_id, attempt_no, state, worker_id, lease_token, error)
    SELECT * FROM unnest(p_outbox_ids, p_attempt_nos, p_states, p_worker_ids, p_lease_tokens, p_errors)
    ON CONFLICT DO NOTHING;
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

COMMENT ON FUNCTION outbox.record_attempts(uuid[], integer[], outbox.attempt_state[], text[], uuid[], text[]) IS
    'Internal (apply_outcomes): appends one attempt per element in the arrays'' order; an attempt number its id already has is written under the next free number, with a WARNING.';

REVOKE ALL ON FUNCTION outbox.record_attempts(uuid[], integer[], outbox.attempt_state[], text[], uuid[], text[]) FROM PUBLIC;


-- outbox.lock_keys_slot0 (internal): lock_keys (below) for messages of slot 0: the lock of
-- each listed message's order key, by one probe of the slot's primary key per listed id;
-- copied for slots 1 to 3.
CREATE OR REPLACE FUNCTION outbox.lock_keys_slot0(p_outbox_ids uuid[]) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_hash integer;
BEGIN
    FOR v_hash IN
        SELECT DISTINCT k.hash
          FROM unnest(p_outbox_ids) AS u(id)
         CROSS JOIN LATERAL (
                SELECT x.message_key, x.order_key
                  FROM outbox.messages_0 AS x
                 WHERE x.outbox_id = u.id
                 LIMIT 1) AS m
         CROSS JOIN LATERAL (VALUES (hashtext(m.order_key)), (hashtext(m.message_key))) AS k(hash)
         WHERE m.order_key IS NOT NULL
         ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock(hashtext('outbox.key'), v_hash);
    END LOOP;
END;
$$;


COMMENT ON FUNCTION outbox.lock_keys_slot0(uuid[]) IS
    'Internal: lock_keys for messages of slot 0.';
REVOKE ALL ON FUNCTION outbox.lock_keys_slot0(uuid[]) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.lock_keys_slot0(uuid[])');


-- outbox.lock_keys (internal): takes, for the transaction, the completion locks of each
-- listed message that has a key (transaction-scoped advisory locks, classid
-- hashtext('outbox.key'), objid the hashtext of a key), in objid order: one for its order
-- key, the chain whose next head promote_heads promotes (messages.order_key,
-- 01_tables.sql), and one for its message_key. Two message_keys that share an order key (a
-- key holding the unit separator, E'a\x1fb', ordered across the whole outbox, and key 'a'
-- ordered per topic on topic 'b') share the order key's lock; a message_key whose topics
-- are ordered per topic shares its message_key's lock across them, which serializes more
-- than its chains need and never less. Called by complete_outbox_batch before it changes
-- anything; no role may execute it.
--
-- Locks:      the advisory locks, held until the caller's transaction ends, waiting for
--             a completion of the same order key or message_key (or of a key with the same
--             hash) to end. Taken in one order, before any row lock of the completion, so two
--             completions cannot deadlock on them; nothing else takes them.
-- Guarantees: the completions of one order key run one after the other, so promote_heads
--             never decides on a snapshot that misses a concurrent completion of its order
--             key. Two messages of an order key can be held by two workers at once (a
--             key's heads are taken in commit order when producers overlap,
--             docs/guarantees.md), and a relayer completes a run's messages as each is
--             delivered: concurrent, each completion's promotion could see the other's
--             message as the chain's head and leave the chain with no head at all.
-- Raises:     nothing of its own.
-- Shape:      one probe of messages_pkey per listed id, a LATERAL subquery that the
--             planner cannot pull up (LIMIT 1): written as a join of the ids, with no
--             statistics on a fresh table it walked a whole index of keys instead
--             (2,000 keyed rows read to find 3 at a 20,000 backlog). Unkeyed messages take
--             no lock (order_key is NULL exactly when message_key is).
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
        SELECT DISTINCT k.hash
          FROM unnest(p_outbox_ids) AS u(id)
         CROSS JOIN LATERAL (
                SELECT x.message_key, x.order_key
                  FROM ((SELECT x0.message_key, x0.order_key FROM outbox.messages_0 x0 WHERE x0.outbox_id = u.id)
                        UNION ALL
                        (SELECT x1.message_key, x1.order_key FROM outbox.messages_1 x1 WHERE x1.outbox_id = u.id)
                        UNION ALL
                        (SELECT x2.message_key, x2.order_key FROM outbox.messages_2 x2 WHERE x2.outbox_id = u.id)
                        UNION ALL
                        (SELECT x3.message_key, x3.order_key FROM outbox.messages_3 x3 WHERE x3.outbox_id = u.id)) AS x
                 LIMIT 1) AS m
         CROSS JOIN LATERAL (VALUES (hashtext(m.order_key)), (hashtext(m.message_key))) AS k(hash)
         WHERE m.order_key IS NOT NULL
         ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock(hashtext('outbox.key'), v_hash);
    END LOOP;
END;
$$;

COMMENT ON FUNCTION outbox.lock_keys(uuid[]) IS
    'Internal (complete_outbox_batch): takes the transaction-scoped completion locks of the order key and of the message_key of each listed keyed message, in one order.';

REVOKE ALL ON FUNCTION outbox.lock_keys(uuid[]) FROM PUBLIC;


-- outbox.promote_slot0 (internal): makes the listed messages of slot 0 that are still
-- behind heads, not before the given times; returns their order keys.
CREATE OR REPLACE FUNCTION outbox.promote_slot0(p_ids uuid[], p_after timestamptz[])
RETURNS SETOF text
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RETURN QUERY
    UPDATE outbox.messages_0 AS m
       SET behind = false,
           available_at = greatest(m.available_at, p_after[array_position(p_ids, m.outbox_id)])
     WHERE m.outbox_id = ANY (p_ids)
       AND m.behind
    RETURNING m.order_key;
END;
$$;

COMMENT ON FUNCTION outbox.promote_slot0(uuid[], timestamptz[]) IS
    'Internal: promote_heads'' update in slot 0.';
REVOKE ALL ON FUNCTION outbox.promote_slot0(uuid[], timestamptz[]) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.promote_slot0(uuid[], timestamptz[])');


-- outbox.promote_heads (internal): the first pending message of each listed order key
-- (a key as enqueue scoped it: messages.order_key, 01_tables.sql) becomes
-- its head (behind = false) where it is not already. Called by complete_outbox_batch and
-- apply_outcomes after they delete keyed messages, as a statement of its own, so that its
-- snapshot sees a producer's message whose commit the deletion waited for; no role may
-- execute it.
--
-- Inputs:     parallel arrays, one element per head the caller deleted (a keyed message
--             not behind: it had an entry in messages_shard_heads_idx): its key, its
--             available_at and its seq. A key whose deletions held no head is not listed:
--             its head is still pending and nothing behind it is due.
-- Raises:     nothing of its own.
-- Locks:      each key's first pending message while it is marked behind (FOR NO KEY
--             UPDATE, through the UPDATE), waiting for a transaction that holds it.
-- Guarantees: when the caller commits, each listed key's first pending message, as any
--             later statement sees it, is not marked behind, or is being deleted by a
--             completion that has not committed and promotes the key itself. The message
--             it finds may be one that another completion is deleting (two completions of
--             consecutive messages of one key at once): the UPDATE waits for that
--             completion and, the row gone, updates nothing; the key is then looked up
--             again, in a new statement whose snapshot sees that deletion, until its first
--             pending message is found already a head, is updated, or the key has none.
--             The other completion, which saw this one's message still there and a head,
--             changed nothing. Each round ends with a message of the key gone or promoted,
--             so the loop ends. The key's first pending message is looked for after the
--             lowest seq deleted under it (the head: nothing earlier is pending but a
--             message whose late commit cleared its own mark, settle_behind), so the walk
--             skips the key's delivered entries. A promoted message's available_at moves
--             up to the latest available_at of the heads deleted under its key, if it was
--             earlier: its entry enters messages_shard_heads_idx at or after that of a head
--             that held its shard's claim floor (04_claim.sql) until this transaction
--             commits, so the new entry is never below the floor. It keeps its place among
--             the messages enqueued after it.
-- Shape:      the heads are found first (one probe of messages_order_key_seq_idx per distinct
--             key) and then updated by primary key: joined in one statement, the planner
--             could walk all of outbox.messages per call (11.7 s at a 480,000 backlog).
--             PL/pgSQL with plan_cache_mode = auto keeps the plans between calls (they do
--             not depend on the arrays). A call without a concurrent deletion makes one
--             round: the lookup and the UPDATE.
CREATE OR REPLACE FUNCTION outbox.promote_heads(p_keys text[], p_after timestamptz[], p_seqs bigint[])
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = auto
SET enable_seqscan = off
AS $$
DECLARE
    v_keys     text[];       -- the keys to promote a message of
    v_after    timestamptz[]; -- for each, the latest available_at the caller deleted
    v_from     bigint[];     -- for each, the lowest seq the caller deleted
    v_ids      uuid[];       -- the first pending message of a key, still marked behind
    v_id_keys  text[];       -- its key
    v_id_after timestamptz[]; -- its key's v_after
    v_id_from  bigint[];     -- its key's v_from
    v_id_slots smallint[];   -- its slot
    v_promoted text[];       -- the keys whose message this round's UPDATE changed
BEGIN
    SELECT array_agg(k.key), array_agg(k.after), array_agg(k.from_seq)
      INTO v_keys, v_after, v_from
      FROM (SELECT u.key, max(u.after) AS after, min(u.seq) AS from_seq
              FROM unnest(p_keys, p_after, p_seqs) AS u(key, after, seq)
             WHERE u.key IS NOT NULL
             GROUP BY u.key) AS k;
    WHILE cardinality(v_keys) > 0 LOOP
        SELECT array_agg(f.outbox_id), array_agg(k.key), array_agg(k.after), array_agg(k.from_seq),
               array_agg(f.slot)
          INTO v_ids, v_id_keys, v_id_after, v_id_from, v_id_slots
          FROM unnest(v_keys, v_after, v_from) AS k(key, after, from_seq)
         CROSS JOIN LATERAL (
                SELECT a.outbox_id, a.behind, a.slot
                  FROM ((SELECT n0.outbox_id, n0.seq, n0.behind, n0.slot FROM outbox.messages_0 n0
                          WHERE n0.order_key = k.key AND n0.seq > k.from_seq ORDER BY n0.seq LIMIT 1)
                        UNION ALL
                        (SELECT n1.outbox_id, n1.seq, n1.behind, n1.slot FROM outbox.messages_1 n1
                          WHERE n1.order_key = k.key AND n1.seq > k.from_seq ORDER BY n1.seq LIMIT 1)
                        UNION ALL
                        (SELECT n2.outbox_id, n2.seq, n2.behind, n2.slot FROM outbox.messages_2 n2
                          WHERE n2.order_key = k.key AND n2.seq > k.from_seq ORDER BY n2.seq LIMIT 1)
                        UNION ALL
                        (SELECT n3.outbox_id, n3.seq, n3.behind, n3.slot FROM outbox.messages_3 n3
                          WHERE n3.order_key = k.key AND n3.seq > k.from_seq ORDER BY n3.seq LIMIT 1)) AS a
                 ORDER BY a.seq
                 LIMIT 1) AS f
         WHERE f.behind;
        EXIT WHEN v_ids IS NULL;

        SELECT coalesce(array_agg(p.key), '{}') INTO v_promoted
          FROM (SELECT outbox.promote_slot0(v_ids, v_id_after) AS key WHERE 0 = ANY (v_id_slots)
                UNION ALL
                SELECT outbox.promote_slot1(v_ids, v_id_after) WHERE 1 = ANY (v_id_slots)
                UNION ALL
                SELECT outbox.promote_slot2(v_ids, v_id_after) WHERE 2 = ANY (v_id_slots)
                UNION ALL
                SELECT outbox.promote_slot3(v_ids, v_id_after) WHERE 3 = ANY (v_id_slots)) AS p;

        -- A message not updated was deleted (or made a head) by another transaction while
        -- this one waited for it: its key is looked up again.
        SELECT array_agg(k.key), array_agg(k.after), array_agg(k.from_seq)
          INTO v_keys, v_after, v_from
          FROM unnest(v_id_keys, v_id_after, v_id_from) AS k(key, after, from_seq)
         WHERE k.key <> ALL (v_promoted);
    END LOOP;
END;
$$;

COMMENT ON FUNCTION outbox.promote_heads(text[], timestamptz[], bigint[]) IS
    'Internal (complete_outbox_batch, apply_outcomes): marks the first pending message of each listed key as its head (behind = false), not before the latest available_at deleted under the key.';

REVOKE ALL ON FUNCTION outbox.promote_heads(text[], timestamptz[], bigint[]) FROM PUBLIC;

-- outbox.attempts in a ring of four slots and a fifth partition for kept histories: the
-- log becomes partitioned by slot (LIST), completions and repair append to the current
-- slot, and prune_attempts, besides deleting old attempts row by row, moves the log on to
-- the next empty slot every half retention and truncates a slot whose attempts are all
-- older than the retention, after copying the histories it must keep (of messages pending
-- or dead-lettered) into slot 4. While a snapshot holds the MVCC horizon back, truncation
-- gives back what the deleted attempts left behind, which vacuum may not.
--
-- In place: the log as it is becomes slot 0 (ATTACH PARTITION), with its rows, pages,
-- storage settings, primary key and time indexes as they are; nothing is copied and no
-- index is built. Adding the slot column writes no row (a constant default); the CHECK
-- that proves slot 0's bound reads the log once under the ACCESS EXCLUSIVE lock the
-- migration holds until it commits (completions and repair wait for it; about 0.09 s per
-- million attempts on a 2-core machine). The views that read outbox.attempts are defined
-- again over the new table. The SQL API keeps its names and semantics; 01_tables.sql and
-- 06_repair_retention.sql hold the contracts in full.

LOCK TABLE outbox.attempts IN ACCESS EXCLUSIVE MODE;

-- The log as it is becomes slot 0. Its primary key (outbox_id, attempt_no) stays its own:
-- a partitioned table's unique index must hold the slot, so each slot has its own key.
ALTER TABLE outbox.attempts RENAME TO attempts_0;
ALTER TABLE outbox.attempts_0 RENAME CONSTRAINT attempts_pkey TO attempts_0_pkey;
ALTER INDEX outbox.attempts_created_at_idx RENAME TO attempts_0_created_at_idx;
ALTER INDEX outbox.attempts_failures_idx RENAME TO attempts_0_failures_idx;
ALTER TABLE outbox.attempts_0 ADD COLUMN slot smallint NOT NULL DEFAULT 0;
ALTER TABLE outbox.attempts_0 ADD CONSTRAINT attempts_0_slot CHECK (slot = 0);


-- outbox.attempt_slot: the current slot of outbox.attempts (0 to 3), a register rather
-- than a counter: only outbox.rotate_attempts sets it (setval), and outbox.attempt_slot()
-- reads it. A sequence, so that reading it on every insert and setting it leave no row
-- version behind; setval is not transactional, and takes effect at once for every writer.
CREATE SEQUENCE outbox.attempt_slot AS smallint MINVALUE 0 MAXVALUE 3 START 0;

COMMENT ON SEQUENCE outbox.attempt_slot IS
    'The slot of outbox.attempts completions and repair append to (0 to 3); set only by rotate_attempts.';

REVOKE ALL ON SEQUENCE outbox.attempt_slot FROM PUBLIC;


-- outbox.attempt_slot(): internal; the default of outbox.attempts.slot: the current slot,
-- as outbox.attempt_slot holds it when the row is inserted. Granted to no one (it runs as
-- the owner, who alone inserts into the log). Raises nothing.
CREATE OR REPLACE FUNCTION outbox.attempt_slot() RETURNS smallint
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    -- a function call, not a scan of the sequence (see outbox.message_slot())
    SELECT coalesce(pg_sequence_last_value('outbox.attempt_slot'::regclass), 0)::smallint
$$;

COMMENT ON FUNCTION outbox.attempt_slot() IS
    'Internal: the slot of outbox.attempts attempts are appended to now; the default of attempts.slot. Not granted.';

REVOKE ALL ON FUNCTION outbox.attempt_slot() FROM PUBLIC;


-- outbox.attempt_slots: one row per slot of the ring: since when it is (or last was) the
-- current slot. Written only by rotate_attempts, once per rotation; read by
-- rotate_attempts (is the current slot's half retention over?). Owner only.
CREATE TABLE outbox.attempt_slots (
    slot      smallint    NOT NULL,
    opened_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT attempt_slots_pkey PRIMARY KEY (slot),
    CONSTRAINT attempt_slots_slot CHECK (slot BETWEEN 0 AND 3)
);

INSERT INTO outbox.attempt_slots (slot) SELECT s FROM generate_series(0, 3) AS s;

COMMENT ON TABLE outbox.attempt_slots IS
    'Since when each slot of outbox.attempts is (or last was) the one attempts are appended to; written by rotate_attempts; owner only.';

REVOKE ALL ON TABLE outbox.attempt_slots FROM PUBLIC;


CREATE TABLE outbox.attempts (
    outbox_id   uuid                 NOT NULL,
    attempt_no  integer              NOT NULL,
    state       outbox.attempt_state NOT NULL,
    worker_id   text                 NOT NULL,
    -- the lease the outcome was reported under (for ZOMBIE_REQUEUE: the expired lease)
    lease_token uuid                 NOT NULL,
    error       text,
    created_at  timestamptz          NOT NULL DEFAULT clock_timestamp(),
    -- the partition: 0 to 3, the slot of the ring the attempt was appended to; 4, a
    -- history kept when its slot was truncated
    slot        smallint             NOT NULL DEFAULT outbox.attempt_slot(),
    CONSTRAINT attempts_attempt_no_positive CHECK (attempt_no >= 1)
) PARTITION BY LIST (slot);

CREATE INDEX attempts_created_at_idx ON outbox.attempts (created_at);

CREATE INDEX attempts_failures_idx ON outbox.attempts (created_at DESC)
    WHERE state <> 'DISPATCHED';

ALTER TABLE outbox.attempts ATTACH PARTITION outbox.attempts_0 FOR VALUES IN (0);
ALTER TABLE outbox.attempts_0 DROP CONSTRAINT attempts_0_slot;
ALTER TABLE outbox.attempts_0 ALTER COLUMN slot SET DEFAULT outbox.attempt_slot();


-- Slots 1 to 3 and the kept histories (4), with the storage settings slot 0 keeps from the
-- table it was, each with its own primary key and the parent's two time indexes.
CREATE TABLE outbox.attempts_1 PARTITION OF outbox.attempts FOR VALUES IN (1) WITH (
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 100000
);
ALTER TABLE outbox.attempts_1 ADD CONSTRAINT attempts_1_pkey PRIMARY KEY (outbox_id, attempt_no);

CREATE TABLE outbox.attempts_2 PARTITION OF outbox.attempts FOR VALUES IN (2) WITH (
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 100000
);
ALTER TABLE outbox.attempts_2 ADD CONSTRAINT attempts_2_pkey PRIMARY KEY (outbox_id, attempt_no);

CREATE TABLE outbox.attempts_3 PARTITION OF outbox.attempts FOR VALUES IN (3) WITH (
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 100000
);
ALTER TABLE outbox.attempts_3 ADD CONSTRAINT attempts_3_pkey PRIMARY KEY (outbox_id, attempt_no);

CREATE TABLE outbox.attempts_kept PARTITION OF outbox.attempts FOR VALUES IN (4) WITH (
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 100000
);
ALTER TABLE outbox.attempts_kept ADD CONSTRAINT attempts_kept_pkey PRIMARY KEY (outbox_id, attempt_no);

-- The failures index of each partition, named as slot 0's.
ALTER INDEX outbox.attempts_1_created_at_idx1 RENAME TO attempts_1_failures_idx;
ALTER INDEX outbox.attempts_2_created_at_idx1 RENAME TO attempts_2_failures_idx;
ALTER INDEX outbox.attempts_3_created_at_idx1 RENAME TO attempts_3_failures_idx;
ALTER INDEX outbox.attempts_kept_created_at_idx1 RENAME TO attempts_kept_failures_idx;

COMMENT ON TABLE outbox.attempts IS
    'Append-only outcome log: one row per attempt, numbered 1, 2, 3 … per message with no gap; written by completions and repair, pruned by prune_attempts; owner only.';
COMMENT ON COLUMN outbox.attempts.slot IS
    'the partition: 0 to 3, the slot of the ring the attempt was appended to; 4, a history kept when its slot was truncated';

REVOKE ALL ON TABLE outbox.attempts FROM PUBLIC;

COMMENT ON TABLE outbox.attempts_0 IS
    'Slot 0 of outbox.attempts (a partition); truncated by rotate_attempts once its attempts are older than the retention; owner only.';
REVOKE ALL ON TABLE outbox.attempts_0 FROM PUBLIC;

COMMENT ON TABLE outbox.attempts_1 IS
    'Slot 1 of outbox.attempts (a partition); truncated by rotate_attempts once its attempts are older than the retention; owner only.';
REVOKE ALL ON TABLE outbox.attempts_1 FROM PUBLIC;

COMMENT ON TABLE outbox.attempts_2 IS
    'Slot 2 of outbox.attempts (a partition); truncated by rotate_attempts once its attempts are older than the retention; owner only.';
REVOKE ALL ON TABLE outbox.attempts_2 FROM PUBLIC;

COMMENT ON TABLE outbox.attempts_3 IS
    'Slot 3 of outbox.attempts (a partition); truncated by rotate_attempts once its attempts are older than the retention; owner only.';
REVOKE ALL ON TABLE outbox.attempts_3 FROM PUBLIC;

COMMENT ON TABLE outbox.attempts_kept IS
    'Slot 4 of outbox.attempts (a partition): histories of messages pending or dead-lettered when their slot was truncated; pruned row by row; owner only.';
REVOKE ALL ON TABLE outbox.attempts_kept FROM PUBLIC;


-- The turn of rotate_attempts.
INSERT INTO outbox.turns (name) VALUES ('prune');

COMMENT ON TABLE outbox.turns IS
    'Rows locked by the claims (claim_outbox_batch_seq, claim_outbox_batch), repair_expired_leases, rotate_messages, rotate_attempts and observe to take turns; owner only.';


-- The completion of a delivered batch, slot by slot: its attempts name the log's current
-- slot, read once per call rather than as each row's default.
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
                -- the log's current slot read once, not as each row's default
                INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token, error, slot)
                SELECT d.outbox_id, d.attempt_no, 'DISPATCHED', p_worker_id, d.lease_token, d.error, l.slot
                  FROM done AS d, (SELECT outbox.attempt_slot() AS slot) AS l
                 ORDER BY d.ord
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


COMMENT ON FUNCTION outbox.complete_outbox_batch_slot0(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) IS
    'Internal: complete_outbox_batch for messages of slot 0, its arguments checked.';
REVOKE ALL ON FUNCTION outbox.complete_outbox_batch_slot0(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.complete_outbox_batch_slot0(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[])');


-- record_attempts: an earlier history is looked for in the slot an attempt is appended to
-- (the log's own key names no constraint across slots), which is read once per call.
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


-- prune_attempts deletes slot by slot and keeps the ring; rotate_attempts is new.
-- outbox.prune_attempts: retention for the attempt log; deletes the oldest attempts older
-- than p_older_than of messages that are finished (delivered, or dead-lettered and gone),
-- and keeps the log within its ring of slots (rotate_attempts).
--
-- Inputs:     p_older_than  age of the attempts to delete: created_at < now() - p_older_than
--                           (now() is the start of the caller's transaction). Required,
--                           at least interval '0'. It is also the ring's retention: the
--                           current slot is kept half of it before the log moves on.
--             p_limit       the most attempts removed by this call (default NULL: no limit),
--                           row by row oldest first, then with a slot whose remaining
--                           attempts fit in what is left of it. When set, at least 1.
-- Returns:    the number of attempts removed, row by row and by truncation (bigint), at
--             most p_limit. A caller with a limit calls again while it gets p_limit back.
-- Locks:      the attempt rows it deletes. It reads outbox.messages and outbox.dead_letters
--             without locking them, and takes no turn for the rows: concurrent calls select
--             the same oldest attempts, the later one waits for the earlier one's row locks
--             and then skips what that one deleted (each counts only its own deletions).
--             Then, through rotate_attempts, the 'prune' turn (never waited for) and at
--             most one slot it truncates, ACCESS EXCLUSIVE, waited for at most 50 ms and
--             held until the caller commits.
-- Guarantees: the history of a message that is pending (outbox.messages) or dead-lettered
--             (outbox.dead_letters) in the statement's snapshot is never removed, so a
--             replayed message keeps its whole history; a finished message's history may go
--             over several calls, oldest attempt first. Once a delivered message's attempts
--             are gone, enqueue no longer knows its id and accepts it again.
-- Raises:     P7001 (p_older_than) when it is NULL or negative; P7001 (p_limit) when it is
--             below 1.
-- Crash:      nothing: one transaction; what it deleted or truncated comes back, and the
--             next call removes it.
-- Shape:      one plan whatever the statistics say (merge and hash joins, sequential and
--             bitmap scans, sorts and Materialize are off, and JIT): old attempts in time
--             order from each slot's attempts_N_created_at_idx (a B-tree: it reads only the
--             rows in range, wherever reused pages put them), merged across the slots, each
--             probed in outbox.messages and outbox.dead_letters by primary key, stopped at
--             the limit, then deleted slot by slot by row address (attempts are never
--             updated, so the addresses found are still theirs; an address names a row in
--             each slot, so each is deleted from its own). Its cost follows the attempts
--             pruned, not the backlog: 24–26 ms per call of 10,000 beside 200,000 pending
--             messages, with empty or fresh statistics. Call it every few seconds with a
--             limit (e.g. 10,000): one call that deletes millions is one long transaction
--             that holds back vacuum (docs/performance.md). The truncation comes last, so
--             that its locks are held for the truncation only.
CREATE OR REPLACE FUNCTION outbox.prune_attempts(p_older_than interval, p_limit bigint DEFAULT NULL)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_mergejoin = off
SET enable_hashjoin = off
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET enable_material = off
SET jit = off
AS $$
DECLARE
    v_count bigint := 0;
    v_deleted bigint;
    v_slots smallint[];
    v_ctids tid[];
    v_slot smallint;
BEGIN
    IF p_older_than IS NULL OR p_older_than < interval '0' THEN
        PERFORM outbox.invalid_argument('p_older_than', 'must be a non-negative interval');
    END IF;
    IF p_limit IS NOT NULL AND p_limit < 1 THEN
        PERFORM outbox.invalid_argument('p_limit', 'must be NULL (no limit) or at least 1');
    END IF;
    -- Attempts of messages still pending or dead-lettered are kept: a history is pruned
    -- whole once its message is gone.
    SELECT coalesce(array_agg(o.slot), '{}'), coalesce(array_agg(o.ctid), '{}')
      INTO v_slots, v_ctids
      FROM (SELECT o.slot, o.ctid
              FROM outbox.attempts AS o
             WHERE o.created_at < now() - p_older_than
               AND NOT EXISTS (SELECT 1 FROM outbox.messages AS m WHERE m.outbox_id = o.outbox_id)
               AND NOT EXISTS (SELECT 1 FROM outbox.dead_letters AS d WHERE d.outbox_id = o.outbox_id)
             ORDER BY o.created_at
             LIMIT p_limit) AS o;
    FOR v_slot IN SELECT DISTINCT u.s FROM unnest(v_slots) AS u(s) LOOP
        DELETE FROM outbox.attempts AS a
         WHERE a.slot = v_slot
           AND a.ctid = ANY (ARRAY(SELECT u.t
                                     FROM unnest(v_slots, v_ctids) AS u(s, t)
                                    WHERE u.s = v_slot));
        GET DIAGNOSTICS v_deleted = ROW_COUNT;
        v_count := v_count + v_deleted;
    END LOOP;
    RETURN v_count + outbox.rotate_attempts(p_older_than, p_limit - v_count);
END;
$$;

COMMENT ON FUNCTION outbox.prune_attempts(interval, bigint) IS
    'Removes up to p_limit (NULL: all) of the oldest attempts older than p_older_than of messages neither pending nor dead-lettered, row by row, then keeps the log''s ring of slots, truncating its oldest slot once older than that (rotate_attempts); returns how many; call again while it returns p_limit; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.prune_attempts(interval, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.prune_attempts(interval, bigint) TO outbox_relay;


-- outbox.rotate_attempts (internal): keeps outbox.attempts within its ring of slots
-- (01_tables.sql, "The slots of outbox.attempts"). Called by prune_attempts with its
-- retention; no role may execute it.
--
-- Inputs:     p_older_than  the retention: a slot is truncated once its attempts are all
--                           older than now() - p_older_than, and the current slot is kept
--                           p_older_than / 2 before the log moves on.
--             p_budget      the most attempts the truncation may remove (what is left of
--                           prune_attempts' limit), or NULL: no limit. A slot with more
--                           (not kept) is left to the row-by-row deletion until it fits.
-- Returns:    the number of attempts it removed (those of the truncated slot, less the kept
--             histories it copied out). 0 at once when another call holds the turn, or
--             when the caller's transaction is not READ COMMITTED (its snapshot would not
--             see what committed after it started).
-- Locks:      1. the 'prune' row of outbox.turns, FOR UPDATE SKIP LOCKED: one call at a time
--                across the fleet; a caller that does not get it returns 0 at once.
--             2. at most one slot, after the rotation: the oldest slot after the current
--                one that has pages, once its attempts are all older than the retention.
--                SHARE (no attempt can be appended to it or deleted from it meanwhile)
--                while it copies the kept histories and counts, then ACCESS EXCLUSIVE for
--                the truncation; each waited for at most 50 ms (lock_timeout), and held
--                until the caller commits. The truncation is the call's last step: the
--                ACCESS EXCLUSIVE lock keeps out readers of the whole log (the views, an
--                enqueue of a given id), no writer, since nothing is appended to a slot that
--                is not current. A slot that cannot be locked in time is left for the next
--                call: a session that read the log (a view, an enqueue of a given id) and
--                has not ended holds it open until it ends.
-- Guarantees: * The current slot is never truncated, and a slot only once every attempt in
--               it, read under its SHARE lock, is older than the retention.
--             * Nothing of a message pending or dead-lettered is removed: before the
--               truncation, every attempt in the slot of an id pending in outbox.messages
--               or present in outbox.dead_letters is copied to slot 4 (outbox.attempts_kept)
--               with its number, state, worker, lease token, error and time. Slot 4 is
--               never truncated; prune_attempts deletes from it row by row. A kept attempt
--               whose number its id already has in slot 4 (possible only for an id with an
--               earlier life's history, see record_attempts) stops the copy: the slot is
--               kept, with a WARNING naming it, and row-by-row retention goes on.
--             * The log moves on only to the next slot of the ring, and only once that slot
--               has no page in a committed state: the rotation comes before the
--               truncation, so never to a slot this call truncates. The slots after the
--               current one are in the order they were written, oldest first.
--             * A WARNING says so when the log cannot move on although its current slot
--               has been current for the whole retention (the next slot is held open, or
--               kept as above).
--             * A transaction whose snapshot is older than a truncation sees the slot empty
--               and the copied histories not at all (TRUNCATE is not MVCC-safe): only a
--               caller that reads the log across a prune in one REPEATABLE READ or
--               SERIALIZABLE transaction can see it.
-- Raises:     nothing (a lock not granted in time, and the duplicate number above, are
--             caught).
-- Crash:      nothing: the caller's transaction. The current slot is set (setval) outside
--             the transaction: if the caller rolls back afterwards, the log has still moved
--             on, to a slot with no page.
-- Shape:      while a snapshot holds the MVCC horizon back, vacuum may remove nothing that
--             the row-by-row deletions leave; truncation gives a slot's table and index space
--             back at once, whatever snapshot is held, so that the log stays within about
--             twice the retention's attempts, dead or alive. The slot's checks and copy read
--             its live rows sequentially (sequential and bitmap scans are on again, which
--             prune_attempts turns off): by then prune_attempts has deleted the finished
--             messages' attempts older than the retention, so few rows are live.
CREATE OR REPLACE FUNCTION outbox.rotate_attempts(p_older_than interval, p_budget bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '50ms'
SET enable_seqscan = on
SET enable_bitmapscan = on
SET jit = off
AS $$
DECLARE
    v_cutoff timestamptz := now() - p_older_than;
    v_current integer;
    v_next integer;
    v_oldest integer;
    v_newest timestamptz;
    v_rows bigint;
    v_kept bigint;
    v_opened timestamptz;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN 0;
    END IF;
    PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'prune' FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    v_current := outbox.attempt_slot();

    -- Rotation: once the current slot has been current for half the retention, the log
    -- moves on to the next slot, if it has no page.
    BEGIN
        SELECT s.opened_at INTO v_opened FROM outbox.attempt_slots AS s WHERE s.slot = v_current;
        v_next := (v_current + 1) % 4;
        IF v_opened IS NULL OR v_opened <= clock_timestamp() - p_older_than / 2 THEN
            IF pg_relation_size(format('outbox.attempts_%s', v_next)::regclass) = 0 THEN
                UPDATE outbox.attempt_slots AS s SET opened_at = clock_timestamp() WHERE s.slot = v_next;
                PERFORM setval('outbox.attempt_slot', v_next);
                v_current := v_next;
            ELSIF v_opened <= clock_timestamp() - p_older_than THEN
                RAISE WARNING 'outbox: the attempt log stays in slot % (current since %): slot % is not truncated yet; a session that keeps outbox.attempts open holds it',
                              v_current, v_opened, v_next;
            END IF;
        END IF;
    EXCEPTION WHEN lock_not_available THEN
        -- The next slot is locked by another session: the next call tries again.
    END;

    -- Truncation, last: the oldest slot after the current one that has pages, once its
    -- attempts are all older than the retention. Each statement reads a snapshot taken
    -- when it starts, so what is read under a lock sees every row committed before the
    -- lock was granted.
    BEGIN
        FOR v_i IN 1 .. 3 LOOP
            IF pg_relation_size(format('outbox.attempts_%s', (v_current + v_i) % 4)::regclass) > 0 THEN
                v_oldest := (v_current + v_i) % 4;
                EXIT;
            END IF;
        END LOOP;
        IF v_oldest IS NULL THEN
            RETURN 0;
        END IF;
        EXECUTE format('SELECT max(a.created_at) FROM outbox.attempts_%s AS a', v_oldest) INTO v_newest;
        IF v_newest >= v_cutoff THEN
            RETURN 0;
        END IF;
        EXECUTE format('LOCK TABLE outbox.attempts_%s IN SHARE MODE', v_oldest);
        EXECUTE format(
            'SELECT max(a.created_at), count(*),
                    count(*) FILTER (WHERE EXISTS (SELECT 1 FROM outbox.messages AS m WHERE m.outbox_id = a.outbox_id)
                                        OR EXISTS (SELECT 1 FROM outbox.dead_letters AS d WHERE d.outbox_id = a.outbox_id))
               FROM outbox.attempts_%s AS a',
            v_oldest)
           INTO v_newest, v_rows, v_kept;
        IF v_newest >= v_cutoff OR v_rows - v_kept > p_budget THEN
            RETURN 0;
        END IF;
        EXECUTE format(
            'INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token, error, created_at, slot)
             SELECT a.outbox_id, a.attempt_no, a.state, a.worker_id, a.lease_token, a.error, a.created_at, 4
               FROM outbox.attempts_%s AS a
              WHERE EXISTS (SELECT 1 FROM outbox.messages AS m WHERE m.outbox_id = a.outbox_id)
                 OR EXISTS (SELECT 1 FROM outbox.dead_letters AS d WHERE d.outbox_id = a.outbox_id)',
            v_oldest);
        GET DIAGNOSTICS v_kept = ROW_COUNT;
        EXECUTE format('LOCK TABLE outbox.attempts_%s IN ACCESS EXCLUSIVE MODE', v_oldest);
        EXECUTE format('TRUNCATE outbox.attempts_%s', v_oldest);
        RETURN v_rows - v_kept;
    EXCEPTION
        WHEN lock_not_available THEN
            -- Held open by another session: the next call tries again.
            RETURN 0;
        WHEN unique_violation THEN
            RAISE WARNING 'outbox: slot % of outbox.attempts is kept: a history it holds repeats an attempt number already in slot 4 (%)',
                          v_oldest, SQLERRM;
            RETURN 0;
    END;
END;
$$;

COMMENT ON FUNCTION outbox.rotate_attempts(interval, bigint) IS
    'Internal (prune_attempts): moves the log to the next empty slot of outbox.attempts every p_older_than / 2, then truncates the oldest slot whose attempts are all older than p_older_than (at most p_budget of them), after copying the histories of messages pending or dead-lettered to slot 4; one call at a time (''prune'' turn); returns the attempts removed. Not granted.';

REVOKE ALL ON FUNCTION outbox.rotate_attempts(interval, bigint) FROM PUBLIC;


-- The views over the attempt log, defined again over the partitioned table (a view is
-- bound to the table it was created over, which is now slot 0).
-- outbox.worker_activity: one row per worker id that holds a lease or recorded an attempt
-- in the last 5 minutes: leases_held and next_lease_expiry now; dispatched_5m, retried_5m,
-- failed_5m, zombie_requeues_5m (attempts of each state in the last 5 minutes; a
-- ZOMBIE_REQUEUE carries the id of the worker whose lease expired: a crashing or freezing
-- worker), last_attempt_at. Reads the last 5 minutes of attempts_created_at_idx and
-- outbox.messages whole.
CREATE OR REPLACE VIEW outbox.worker_activity AS
WITH recent AS (
    SELECT a.worker_id,
           count(*) FILTER (WHERE a.state = 'DISPATCHED')     AS dispatched_5m,
           count(*) FILTER (WHERE a.state = 'RETRYABLE')      AS retried_5m,
           count(*) FILTER (WHERE a.state = 'FAILED')         AS failed_5m,
           count(*) FILTER (WHERE a.state = 'ZOMBIE_REQUEUE') AS zombie_requeues_5m,
           max(a.created_at)                                  AS last_attempt_at
      FROM outbox.attempts AS a
     WHERE a.created_at > now() - interval '5 minutes'
     GROUP BY a.worker_id
), held AS (
    SELECT m.claimed_by AS worker_id,
           count(*) AS leases_held,
           min(m.lease_expires_at) AS next_lease_expiry
      FROM outbox.messages AS m
     WHERE m.claimed_by IS NOT NULL
     GROUP BY m.claimed_by
)
SELECT coalesce(h.worker_id, r.worker_id)   AS worker_id,
       coalesce(h.leases_held, 0)           AS leases_held,
       h.next_lease_expiry,
       coalesce(r.dispatched_5m, 0)         AS dispatched_5m,
       coalesce(r.retried_5m, 0)            AS retried_5m,
       coalesce(r.failed_5m, 0)             AS failed_5m,
       coalesce(r.zombie_requeues_5m, 0)    AS zombie_requeues_5m,
       r.last_attempt_at
  FROM held AS h
  FULL JOIN recent AS r ON r.worker_id = h.worker_id;

COMMENT ON VIEW outbox.worker_activity IS
    'Per worker id: leases held and the next to expire, and attempts by state in the last 5 minutes with the latest one''s time.';

REVOKE ALL ON outbox.worker_activity FROM PUBLIC;
GRANT SELECT ON outbox.worker_activity TO outbox_reader, outbox_relay;

-- outbox.recent_failures: the 100 latest attempts that did not deliver (FAILED, RETRYABLE,
-- ZOMBIE_REQUEUE), newest first: outbox_id, topic (NULL once the message is neither
-- pending nor dead-lettered), attempt_no, state, worker_id, error, created_at, and now_in
-- (where the message is now: pending, dead_letter, or delivered when it is in neither
-- table). Reads the newest 100 entries of
-- attempts_failures_idx and probes each message by primary key: cheap at any size.
CREATE OR REPLACE VIEW outbox.recent_failures AS
SELECT a.outbox_id,
       coalesce(m.topic, d.topic) AS topic,
       a.attempt_no,
       a.state,
       a.worker_id,
       a.error,
       a.created_at,
       CASE WHEN m.outbox_id IS NOT NULL THEN 'pending'
            WHEN d.outbox_id IS NOT NULL THEN 'dead_letter'
            ELSE 'delivered' END AS now_in
  FROM (SELECT * FROM outbox.attempts
         WHERE state <> 'DISPATCHED'
         ORDER BY created_at DESC
         LIMIT 100) AS a
  LEFT JOIN outbox.messages AS m ON m.outbox_id = a.outbox_id
  LEFT JOIN outbox.dead_letters AS d ON d.outbox_id = a.outbox_id
 ORDER BY a.created_at DESC;

COMMENT ON VIEW outbox.recent_failures IS
    'The 100 latest attempts that did not deliver, newest first, with topic, worker, error, and where the message is now (pending, dead_letter, delivered).';

REVOKE ALL ON outbox.recent_failures FROM PUBLIC;
GRANT SELECT ON outbox.recent_failures TO outbox_reader, outbox_relay;

-- outbox.attempt_rates: attempts per minute and state over the last hour (minute, state,
-- attempts), newest minute first; a minute without attempts of a state has no row. Reads
-- the last hour of attempts_created_at_idx: its cost follows the attempts of an hour.
CREATE OR REPLACE VIEW outbox.attempt_rates AS
SELECT date_trunc('minute', a.created_at) AS minute,
       a.state,
       count(*) AS attempts
  FROM outbox.attempts AS a
 WHERE a.created_at > now() - interval '1 hour'
 GROUP BY 1, 2
 ORDER BY 1 DESC, 2;

COMMENT ON VIEW outbox.attempt_rates IS
    'Attempts per minute and state over the last hour, newest minute first.';

REVOKE ALL ON outbox.attempt_rates FROM PUBLIC;
GRANT SELECT ON outbox.attempt_rates TO outbox_reader, outbox_relay;

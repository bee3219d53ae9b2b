-- Repair and retention: the maintenance that keeps the outbox moving and its history bounded.
--
-- Three functions, all executable by outbox_relay only:
--
--   repair_expired_leases(p_limit)
--       gives back the messages whose lease ran out without a completion (a worker died,
--       froze or lost its connection), each with a ZOMBIE_REQUEUE attempt, and dead-letters
--       those out of attempts. Called by every relayer's janitor once per repair interval
--       (15 s by default, jittered) and by `outbox-relay repair`.
--   rotate_messages(p_period)
--       moves producers to the next slot of outbox.messages once the current one is
--       p_period old, and truncates a slot in which nothing is pending. Called by every
--       relayer's janitor every 5 s (one call at a time across the fleet).
--   prune_attempts(p_older_than, p_limit)
--       deletes old attempt history of finished messages, and keeps the attempt log in its
--       ring of slots (through the internal rotate_attempts). Called by the operator's
--       scheduler (cron, pg_cron) and by `outbox-relay bench --sustained-rate` beside its
--       load; the relayer itself never prunes.
--
-- Conventions shared by all three:
-- * SECURITY DEFINER with search_path pg_catalog, pg_temp, every object schema-qualified:
--   the caller needs EXECUTE only, no right on any table.
-- * An invalid argument raises P7001 through outbox.invalid_argument, naming the argument,
--   before anything is read or locked.
-- * Each call is one transaction's worth of work and is meant to be its own short
--   transaction (autocommit): what it locks is held until the caller commits, and while it
--   runs it holds back the MVCC horizon, so that vacuum cannot remove the dead rows the
--   claims step over. Both take a limit for that reason.
-- * Maintenance that must run once at a time takes turns by locking a row of outbox.turns
--   (`FOR UPDATE SKIP LOCKED`): only the schema owner can read or lock that table, so no
--   other login can hold a turn. A caller that finds the turn taken returns at once; the
--   turn is released when its transaction ends. repair_expired_leases takes the 'repair'
--   turn, rotate_messages the 'rotate' turn, rotate_attempts the 'prune' turn;
--   prune_attempts' row-by-row deletion takes none (concurrent prunes are safe, see its
--   contract).
-- * Every plan is index-driven and independent of statistics where the backlog can be
--   large, except the scan for expired leases, which reads outbox.messages sequentially by
--   design (the lease columns are in no index).

-- outbox.repair_expired_leases: requeues, with a ZOMBIE_REQUEUE attempt each, up to p_limit
-- messages whose lease expired, and dead-letters those that have no attempt left.
--
-- Inputs:     p_limit    the most expired leases handled by this pass (default 1000; the
--                        relayer passes --repair-limit). NULL or < 1 is invalid. The rest
--                        wait for the next pass.
-- Returns:    one row (requeued, dead_lettered): requeued counts messages kept in
--             outbox.messages with their lease cleared, ready at once (or, rarely, parked
--             with available_at 'infinity' because a dead letter with the same id exists);
--             dead_lettered counts messages moved to outbox.dead_letters. (0, 0) when another
--             pass holds the turn or no lease has expired.
-- Locks:      1. the 'repair' row of outbox.turns, FOR UPDATE SKIP LOCKED: never waits; a
--                caller that does not get it returns (0, 0) at once (another pass runs).
--                Held until the caller's transaction ends, so one pass runs at a time
--                across the fleet.
--             2. the first p_limit rows of outbox.messages with lease_expires_at <= now()
--                in scan order, each FOR UPDATE SKIP LOCKED by its tuple address: a row
--                that a completion, heartbeat or release holds is skipped, never waited
--                for, and the expiry is re-checked on the newest committed version of a
--                row, so a lease completed or extended concurrently is never touched (it is
--                left for the next pass). A tuple address names a row in each slot of
--                outbox.messages; a row of another slot at a listed address is taken only
--                when it meets the same conditions itself (its lease expired too), so at
--                most a few more than p_limit rows may be handled in one pass.
--             3. through apply_outcomes: writes those rows (update, or delete and dead
--                letter), inserts their attempts, and clears `behind` on the next message
--                of each key whose head it dead-lettered (promote_heads), which may wait for
--                a claim or completion holding that message.
-- Guarantees: every handled message gets exactly one attempt, state ZOMBIE_REQUEUE, number
--             attempt_count + 1 (the next free number, with a WARNING, when its id had an
--             earlier history), with the worker id and lease token of the expired lease and
--             the error 'lease expired at … without a completion from worker …'. The attempt
--             counts towards max_attempts, so a message that kills its worker every time is
--             eventually dead-lettered (with payload, headers and that error). A requeued
--             message keeps its place in its key's order; its old token is cleared, so a
--             late report under the expired lease changes nothing: complete_outbox_batch
--             reports it lease_lost, complete_outbox_attempt raises P7002 (LEASE_LOST), and
--             extend_outbox_leases and release_outbox_leases leave it out.
--             There is no cursor over ids or times: every pass scans the table from its
--             start, so a lease whose claim committed late is never skipped.
--             The claim floors' safety net: first, every unleased message that is not
--             behind and is below its shard's claim floor (04_claim.sql) gets available_at
--             = the clock, with a WARNING giving how many: a message dated in the past
--             whose commit raced a claim raising the floor, or a server clock stepped
--             back, can leave one there. Claims find it again at once; it is not counted
--             in the result. Rows another transaction holds are skipped (the next pass
--             sees them). When it
--             handled any message, the relayers are woken (NOTIFY outbox_new, payload
--             'repaired') at commit.
-- Raises:     P7001 (p_limit) when p_limit is NULL or below 1. Nothing else (a reused id
--             is recorded under its next free number with a WARNING, or parked).
-- Crash:      nothing: one transaction. If it never commits, the leases stay expired, the
--             turn is released, and the next pass (of any process) handles them.
-- Shape:      the lease columns are kept out of every index, so that a claim, a heartbeat
--             and a release stay HOT updates; the price is one sequential scan of
--             outbox.messages per pass, paid by one process per repair interval, which
--             finds the expired leases and the safety net's messages together and locks
--             nothing: what it found is locked afterwards by tuple address. JIT is off, so
--             the scan's estimated cost at a large backlog never makes a pass compile its
--             plan.
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
    v_lifted integer;
    v_floors timestamptz[];
    v_low tid[];
    v_expired tid[];
BEGIN
    IF p_limit IS NULL OR p_limit < 1 THEN
        PERFORM outbox.invalid_argument('p_limit', format('must be at least 1, got %s', p_limit));
    END IF;
    PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'repair' FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 0, 0;
        RETURN;
    END IF;

    -- One sequential scan finds both kinds of work, without locking: the messages ready to
    -- claim below their shard's claim floor (the floors' safety net, 04_claim.sql) and the
    -- first p_limit expired leases in scan order. Each kind is then locked by tuple address
    -- and its conditions checked again on the newest version of the row: a row updated
    -- since the scan (its version moved) or held by another transaction is left for the
    -- next pass.
    v_floors := outbox.claim_floors();
    SELECT coalesce(array_agg(f.ctid) FILTER (WHERE NOT f.expired), '{}'),
           coalesce(array_agg(f.ctid) FILTER (WHERE f.expired AND f.nth <= p_limit), '{}')
      INTO v_low, v_expired
      FROM (SELECT b.ctid, b.expired,
                   count(*) FILTER (WHERE b.expired) OVER (ROWS UNBOUNDED PRECEDING) AS nth
              FROM (SELECT c.ctid, coalesce(c.lease_expires_at <= now(), false) AS expired
                      FROM outbox.messages AS c
                     WHERE c.lease_expires_at <= now()
                        OR (c.lease_token IS NULL
                            AND NOT c.behind
                            AND c.available_at < v_floors[(hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) + 1])) AS b) AS f;

    -- The safety net: a message below its floor moves up to the clock, where the claims'
    -- walks find it.
    IF cardinality(v_low) > 0 THEN
        UPDATE outbox.messages AS m
           SET available_at = clock_timestamp()
         WHERE m.ctid = ANY (ARRAY(
                   SELECT b.ctid
                     FROM outbox.messages AS b
                    WHERE b.ctid = ANY (v_low)
                      AND b.lease_token IS NULL
                      AND NOT b.behind
                      AND b.available_at < v_floors[(hashtext(coalesce(b.message_key, b.outbox_id::text)) & 15) + 1]
                      FOR UPDATE SKIP LOCKED))
           AND m.lease_token IS NULL
           AND NOT m.behind;
        GET DIAGNOSTICS v_lifted = ROW_COUNT;
        IF v_lifted > 0 THEN
            RAISE WARNING 'outbox: % message(s) were below their shard''s claim floor and were moved up to now', v_lifted
                USING HINT = 'a message dated in the past committed while a claim raised its floor, or the server clock went back';
            PERFORM pg_notify('outbox_new', 'repaired');
        END IF;
    END IF;

    IF cardinality(v_expired) = 0 THEN
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
             WHERE m.ctid = ANY (v_expired)
               AND m.lease_expires_at <= now()
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

COMMENT ON FUNCTION outbox.repair_expired_leases(integer) IS
    'Requeues up to p_limit messages whose lease expired (a ZOMBIE_REQUEUE attempt each) and dead-letters those out of attempts; one pass at a time (''repair'' turn, else (0, 0) at once); returns (requeued, dead_lettered); P7001 on a bad limit.';

REVOKE ALL ON FUNCTION outbox.repair_expired_leases(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.repair_expired_leases(integer) TO outbox_relay;

-- outbox.rotate_messages: keeps outbox.messages within its ring of slots (01_tables.sql,
-- "The slots of outbox.messages"): truncates a slot that is not current once nothing in it
-- is pending, and moves producers on to the next empty slot once the current one has been
-- current for p_period.
--
-- Inputs:     p_period   how long a slot stays current before producers move on (default
--                        30 s, which the relayer's janitor uses). NULL or under 1 s is
--                        invalid.
-- Returns:    one row (current_slot, truncated_slot, busy_slot, pinned_slots): the slot
--             producers write to when the call returns; the slot it truncated, or NULL; the
--             slot it found with nothing pending but could not lock within 50 ms (left for
--             the next call), or NULL; how many slots other than the current one hold a
--             pending message (0 to 3: at 3 producers stay in the current slot, and the
--             ring no longer bounds the table under a held horizon until one is done).
--             (current slot, NULL, NULL, NULL) at once when another call holds the turn.
-- Locks:      1. the 'rotate' row of outbox.turns, FOR UPDATE SKIP LOCKED: one call at a
--                time across the fleet; held until the caller's transaction ends.
--             2. at most one slot, after the rotation: the first slot after the current
--                one, in ring order, that has pages and in which a plain read finds no row
--                (slots with something pending are passed over). It is locked ACCESS
--                EXCLUSIVE with lock_timeout 50 ms, read again under the lock, and
--                truncated when still empty; the lock is held until the caller commits,
--                and the call does nothing after the truncation. While the call waits for
--                that lock, statements that open the slot wait behind it: the claim's
--                probe opens all four, so claims wait up to 50 ms per call (one call per
--                5 s across the fleet). A session that keeps the slot open (a transaction
--                that read outbox.messages, or enqueued into the slot, and has not ended:
--                an enqueue of a keyed message or of a given id reads every slot) holds it
--                until it ends: the call gives up after 50 ms and reports it (busy_slot),
--                and the next call tries again.
-- Guarantees: * Nothing pending is removed. A slot is truncated only when, under its ACCESS
--               EXCLUSIVE lock, a fresh snapshot finds no row in it: no other transaction
--               has the slot open (an insert in progress holds its lock), and every
--               committed row is visible. Under REPEATABLE READ or SERIALIZABLE (an older
--               snapshot) it truncates nothing.
--             * The current slot is never truncated. Producers move only to a slot with no
--               page (truncated, or never written since the last truncation), so a slot that
--               a late producer wrote to after it stopped being current waits until that
--               message is done.
--             * A transaction whose snapshot is older than a truncation sees the slot empty
--               when it reads it afterwards (TRUNCATE is not MVCC-safe): every row it would
--               have seen there was delivered or dead-lettered before the truncation.
--             * A slot with a message pending (delayed, retrying, behind a slow key, or in a
--               backlog) is not truncated until that message is done; producers pass over
--               it to the next empty slot. While every slot other than the current one has
--               something pending, producers stay in the current slot.
-- Raises:     P7001 (p_period) when it is NULL or under 1 second.
-- Crash:      nothing: one transaction. The current slot is set (setval) before the
--             transaction commits and is not rolled back with it, which only moves
--             producers to a slot that is empty.
-- Shape:      truncation instead of vacuum, because vacuum may not remove what a held
--             MVCC horizon keeps: a truncated slot gives its table and index space back at
--             once, whatever snapshot is held. One slot per call, so that the lock is held
--             for one slot's check and truncation only (the janitor calls every 5 s). The
--             checks read the slot sequentially: its rows are dead or gone, and a slot's
--             size is bounded by the traffic of its period.
CREATE OR REPLACE FUNCTION outbox.rotate_messages(p_period interval DEFAULT interval '30 seconds')
RETURNS TABLE (current_slot integer, truncated_slot integer, busy_slot integer, pinned_slots integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET lock_timeout = '50ms'
SET jit = off
AS $$
DECLARE
    v_current integer := outbox.message_slot();
    v_slot integer;
    v_empty integer;
    v_pending boolean;
    v_opened timestamptz;
BEGIN
    IF p_period IS NULL OR p_period < interval '1 second' THEN
        PERFORM outbox.invalid_argument('p_period', format('must be at least 1 second, got %s', coalesce(p_period::text, 'NULL')));
    END IF;
    PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'rotate' FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT v_current, NULL::integer, NULL::integer, NULL::integer;
        RETURN;
    END IF;
    v_current := outbox.message_slot();

    -- Rotation: once the current slot's period is over, producers move to the next slot
    -- that has no page.
    SELECT s.opened_at INTO v_opened FROM outbox.message_slots AS s WHERE s.slot = v_current;
    IF v_opened IS NULL OR v_opened <= clock_timestamp() - p_period THEN
        FOR v_i IN 1 .. 3 LOOP
            v_slot := (v_current + v_i) % 4;
            IF pg_relation_size(format('outbox.messages_%s', v_slot)::regclass) = 0 THEN
                PERFORM setval('outbox.message_slot', v_slot);
                UPDATE outbox.message_slots AS s SET opened_at = clock_timestamp() WHERE s.slot = v_slot;
                v_current := v_slot;
                EXIT;
            END IF;
        END LOOP;
    END IF;

    -- The slots producers cannot move to (not current, something pending), and the oldest
    -- slot after the current one that has pages and no row: the one to truncate. The
    -- truncation comes last, so that its lock is held for its own check and the truncation
    -- only, until the caller commits. Each statement below reads a snapshot taken when it
    -- starts, so the check made under the lock sees every row committed before the lock
    -- was granted.
    pinned_slots := 0;
    FOR v_i IN 1 .. 3 LOOP
        v_slot := (v_current + v_i) % 4;
        CONTINUE WHEN pg_relation_size(format('outbox.messages_%s', v_slot)::regclass) = 0;
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM outbox.messages_%s)', v_slot) INTO v_pending;
        IF v_pending THEN
            pinned_slots := pinned_slots + 1;
        ELSIF v_empty IS NULL THEN
            v_empty := v_slot;
        END IF;
    END LOOP;
    IF v_empty IS NOT NULL AND current_setting('transaction_isolation') = 'read committed' THEN
        BEGIN
            EXECUTE format('LOCK TABLE outbox.messages_%s IN ACCESS EXCLUSIVE MODE', v_empty);
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM outbox.messages_%s)', v_empty) INTO v_pending;
            IF NOT v_pending THEN
                EXECUTE format('TRUNCATE outbox.messages_%s', v_empty);
                truncated_slot := v_empty;
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            busy_slot := v_empty;
        END;
    END IF;
    current_slot := v_current;
    RETURN NEXT;
END;
$$;

COMMENT ON FUNCTION outbox.rotate_messages(interval) IS
    'Truncates the oldest slot of outbox.messages (not the current one) in which nothing is pending, and moves producers to the next empty slot once the current one is p_period old; one call at a time (''rotate'' turn); returns (current_slot, truncated_slot, busy_slot, pinned_slots); P7001 on a bad period.';

REVOKE ALL ON FUNCTION outbox.rotate_messages(interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.rotate_messages(interval) TO outbox_relay;

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

-- Claim floors: each shard's walk of messages_shard_heads_idx starts at the shard's floor,
-- a time at or before every entry of the shard that is live or being written, kept in
-- sequences (not rows, which a held MVCC horizon would pile up). While something holds
-- the horizon, the dead entries of delivered messages stay at the front of each shard, and
-- a walk from the start stepped over all of them. The floor rises to the first entry a
-- claim's probe finds, capped by a bound that trails the oldest transaction holding an id.
-- Inserts put their entry at or after the clock (the column's default, enqueue without a
-- time, replays); a key's promoted head goes no earlier than the head its completion
-- deleted (promote_heads takes those times); a message dated in the past lowers its
-- shard's floor at its commit (deferred triggers), and repair_expired_leases moves up a
-- message found below its floor. The full contract is in the area files (04_claim.sql for the floors).
-- Under a held horizon the keyed probes step over the key's dead entries: mark_behind reads
-- the key newest first, and promote_heads starts after the seq its completion deleted.

ALTER TABLE outbox.messages ALTER COLUMN available_at SET DEFAULT clock_timestamp();

CREATE SEQUENCE outbox.claim_floor_0 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_1 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_2 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_3 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_4 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_5 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_6 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_7 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_8 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_9 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_10 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_11 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_12 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_13 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_14 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_15 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_bound AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_mark_at AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_mark_xid AS bigint MINVALUE 0 START 0;

DO $$
BEGIN
    FOR v_shard IN 0 .. 15 LOOP
        EXECUTE format('COMMENT ON SEQUENCE outbox.%I IS %L', 'claim_floor_' || v_shard,
                       format('The claim floor of shard %s (microseconds since the Unix epoch): no live entry of the shard is below it. Set by the claims only.', v_shard));
        EXECUTE format('REVOKE ALL ON SEQUENCE outbox.%I FROM PUBLIC', 'claim_floor_' || v_shard);
    END LOOP;
END;
$$;

COMMENT ON SEQUENCE outbox.claim_floor_bound IS
    'No entry still to be written is below this time (microseconds since the Unix epoch); caps every claim floor. Set by claim_floor_bound only.';
COMMENT ON SEQUENCE outbox.claim_floor_mark_at IS
    'The next value of claim_floor_bound (microseconds since the Unix epoch, before its margin), taken once every transaction id below claim_floor_mark_xid has ended.';
COMMENT ON SEQUENCE outbox.claim_floor_mark_xid IS
    'The transaction id claim_floor_mark_at waits for: every id below it has ended before the mark is taken.';

REVOKE ALL ON SEQUENCE outbox.claim_floor_bound FROM PUBLIC;
REVOKE ALL ON SEQUENCE outbox.claim_floor_mark_at FROM PUBLIC;
REVOKE ALL ON SEQUENCE outbox.claim_floor_mark_xid FROM PUBLIC;


-- outbox.claim_floors (internal): the 16 floors, shard 0 first (index 1), 0 as -infinity.
-- Called by the claims, repair_expired_leases and lower_claim_floor; no role may execute
-- it. Reads the sequences without locking them; raises nothing.
CREATE OR REPLACE FUNCTION outbox.claim_floors() RETURNS timestamptz[]
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT array_agg(CASE WHEN f.micros = 0 THEN timestamptz '-infinity'
                          ELSE timestamptz 'epoch' + f.micros * interval '1 microsecond' END
                     ORDER BY f.shard)
      FROM (SELECT 0, last_value FROM outbox.claim_floor_0
            UNION ALL SELECT 1, last_value FROM outbox.claim_floor_1
            UNION ALL SELECT 2, last_value FROM outbox.claim_floor_2
            UNION ALL SELECT 3, last_value FROM outbox.claim_floor_3
            UNION ALL SELECT 4, last_value FROM outbox.claim_floor_4
            UNION ALL SELECT 5, last_value FROM outbox.claim_floor_5
            UNION ALL SELECT 6, last_value FROM outbox.claim_floor_6
            UNION ALL SELECT 7, last_value FROM outbox.claim_floor_7
            UNION ALL SELECT 8, last_value FROM outbox.claim_floor_8
            UNION ALL SELECT 9, last_value FROM outbox.claim_floor_9
            UNION ALL SELECT 10, last_value FROM outbox.claim_floor_10
            UNION ALL SELECT 11, last_value FROM outbox.claim_floor_11
            UNION ALL SELECT 12, last_value FROM outbox.claim_floor_12
            UNION ALL SELECT 13, last_value FROM outbox.claim_floor_13
            UNION ALL SELECT 14, last_value FROM outbox.claim_floor_14
            UNION ALL SELECT 15, last_value FROM outbox.claim_floor_15) AS f(shard, micros)
$$;

COMMENT ON FUNCTION outbox.claim_floors() IS
    'Internal (claims, repair_expired_leases): the claim floors of shards 0 to 15, as timestamps. Not granted.';

REVOKE ALL ON FUNCTION outbox.claim_floors() FROM PUBLIC;


-- outbox.raise_claim_floor (internal): sets the floor of shard p_shard from p_from (as the
-- claim read it at its start) to p_to, which the caller computed as the invariant above
-- requires, and returns the floor the shard has then. Called by the claims under READ
-- COMMITTED; no role may execute it.
--
-- Locks:      the shard's floor lock (a transaction-scoped advisory lock, 'outbox.floor'
--             and the shard number plus 1), tried without waiting and held until the
--             claim's transaction ends. lower_claim_floor takes it, waiting, and keeps it
--             until its own commit.
-- Guarantees: the floor is left as it is when the lock is held elsewhere (a message
--             dated in the past is committing or prepared), when the floor is no longer
--             p_from (lowered or raised since the claim read it), or when p_to is not
--             after the epoch (such a floor would be stored as none). So a floor is never
--             raised over a lowering whose message the claim's snapshot could not see.
-- Raises:     nothing for a shard of 0 to 15.
-- Crash:      not transactional (setval): a claim rolled back keeps the floor it raised,
--             which stays valid.
CREATE OR REPLACE FUNCTION outbox.raise_claim_floor(p_shard integer, p_from timestamptz, p_to timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_floor regclass := ('outbox.claim_floor_' || p_shard)::regclass;
    v_now bigint;
BEGIN
    IF p_to <= timestamptz 'epoch'
       OR NOT pg_try_advisory_xact_lock(hashtext('outbox.floor'), p_shard + 1) THEN
        RETURN p_from;
    END IF;
    v_now := coalesce(pg_sequence_last_value(v_floor), 0);
    IF v_now <> (CASE WHEN p_from = '-infinity' THEN 0
                      ELSE (extract(epoch FROM p_from) * 1000000)::bigint END) THEN
        RETURN (CASE WHEN v_now = 0 THEN timestamptz '-infinity'
                     ELSE timestamptz 'epoch' + v_now * interval '1 microsecond' END);
    END IF;
    PERFORM setval(v_floor, (extract(epoch FROM p_to) * 1000000)::bigint);
    RETURN p_to;
END;
$$;

COMMENT ON FUNCTION outbox.raise_claim_floor(integer, timestamptz, timestamptz) IS
    'Internal (claims): raises the claim floor of one shard from the value the claim read, under the shard''s floor lock tried without waiting; not transactional. Not granted.';

REVOKE ALL ON FUNCTION outbox.raise_claim_floor(integer, timestamptz, timestamptz) FROM PUBLIC;


-- outbox.claim_floor_bound (internal): returns the bound every floor is capped by, after
-- moving it up when it is due. Called by the claims at their start; no role may execute it.
--
-- Does:       at most once per 50 ms across the fleet (a transaction-scoped advisory lock
--             tried without waiting, 'outbox.floor'), and only under READ COMMITTED (a
--             snapshot of the transaction's start would see old transaction ids as the
--             newest) in a transaction that holds no id yet: when every transaction id
--             below the mark's has ended (the current snapshot's xmin), the bound becomes
--             the mark's time less 200 ms, and a new mark is taken: the clock, then this
--             transaction's own id, got after it, so every id got later is got after the
--             clock was read.
-- Locks:      the advisory lock, held until the caller's transaction ends.
-- Guarantees: every transaction holding a transaction id got before the bound's time plus
--             200 ms has ended. A transaction without one (a read-only snapshot, however old)
--             does not hold the bound back.
-- Raises:     nothing.
-- Crash:      the mark's id is written before its time, so a mark half written pairs an
--             older time with a newer id, which only delays the bound.
-- Shape:      assigns the claim's transaction id at most 20 times a second (raising a
--             floor, a setval, gives its claim one too and writes a WAL record, only when
--             the floor moves); sequences as
--             the floors, for the same reason. The margin covers a write that reads the
--             clock moments before its transaction gets its id, within one statement (a
--             multi-row INSERT reads its first row's default, then runs its BEFORE
--             triggers); one that takes longer than the margin is found by the safety net.
--             Every claim steps over the entries delivered in the bound's lag (the margin,
--             the 50 ms and the longest transaction in progress at the mark): with a lag
--             of 2.3 s at 2,000 msg/s held, about 450 entries per scan of a shard.
CREATE OR REPLACE FUNCTION outbox.claim_floor_bound() RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_bound bigint;
    v_at bigint;
    v_xid bigint;
    v_now bigint := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
BEGIN
    SELECT b.last_value, a.last_value
      INTO v_bound, v_at
      FROM outbox.claim_floor_bound AS b, outbox.claim_floor_mark_at AS a;
    IF v_now - v_at >= 50000
       AND current_setting('transaction_isolation') = 'read committed'
       AND pg_current_xact_id_if_assigned() IS NULL
       AND pg_try_advisory_xact_lock(hashtext('outbox.floor'), 0) THEN
        SELECT b.last_value, a.last_value, x.last_value
          INTO v_bound, v_at, v_xid
          FROM outbox.claim_floor_bound AS b, outbox.claim_floor_mark_at AS a,
               outbox.claim_floor_mark_xid AS x;
        -- The mark is taken up only once every id below its own has ended, and replaced
        -- only then: a transaction that holds an id for long keeps the bound where it was.
        IF v_now - v_at >= 50000
           AND (v_at = 0 OR pg_snapshot_xmin(pg_current_snapshot())::text::bigint >= v_xid) THEN
            -- The new mark's time first: the first setval gives this transaction its id.
            v_now := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
            IF v_at > 0 THEN
                v_bound := greatest(v_bound, v_at - 200000);
                PERFORM setval('outbox.claim_floor_bound', v_bound);
            END IF;
            PERFORM setval('outbox.claim_floor_mark_xid', pg_current_xact_id()::text::bigint);
            PERFORM setval('outbox.claim_floor_mark_at', v_now);
        END IF;
    END IF;
    RETURN timestamptz 'epoch' + v_bound * interval '1 microsecond';
END;
$$;

COMMENT ON FUNCTION outbox.claim_floor_bound() IS
    'Internal (claims): the time no entry still to be written is below, moved up at most every 50 ms once the transactions that held ids at its mark have ended. Not granted.';

REVOKE ALL ON FUNCTION outbox.claim_floor_bound() FROM PUBLIC;


-- outbox.lower_claim_floor (internal): the function of the deferred constraint triggers
-- messages_lower_claim_floor_on_insert (a message dated more than the bound's margin before
-- its insert: enqueue with a past p_available_at, now() of a transaction that began long
-- before, or the schema owner's own INSERT) and
-- messages_lower_claim_floor_on_update (an UPDATE that moves available_at earlier: the
-- owner's own, the SQL API never does). Not granted.
--
-- Such a message may be below its shard's floor. At the commit of its transaction (or at
-- PREPARE TRANSACTION, or at SET CONSTRAINTS … IMMEDIATE) this takes the floor locks of all
-- 16 shards in shard order (raise_claim_floor), waiting for claims that hold them, and
-- keeps them until the transaction ends; then it lowers the floor to the message's available_at (one before
-- the epoch removes the floor) when it is below it. No claim raises that floor again until
-- the message is committed and visible to its next statement: a claim that read the floor
-- before the lowering finds it changed, one that tries while the lock is held passes.
-- Not transactional: a transaction rolled back after it leaves the floor lower, which only
-- costs a longer walk. Raises nothing.
CREATE OR REPLACE FUNCTION outbox.lower_claim_floor() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_shard integer := hashtext(coalesce(NEW.message_key, NEW.outbox_id::text)) & 15;
BEGIN
    -- Every shard's floor lock, in shard order, so that two transactions lowering floors of
    -- several shards never wait for each other in a cycle.
    FOR v_lock IN 1 .. 16 LOOP
        PERFORM pg_advisory_xact_lock(hashtext('outbox.floor'), v_lock);
    END LOOP;
    IF NEW.available_at < (outbox.claim_floors())[v_shard + 1] THEN
        PERFORM setval(('outbox.claim_floor_' || v_shard)::regclass,
                       (extract(epoch FROM greatest(NEW.available_at, timestamptz 'epoch')) * 1000000)::bigint);
    END IF;
    RETURN NULL;
END;
$$;

COMMENT ON FUNCTION outbox.lower_claim_floor() IS
    'Internal (deferred triggers messages_lower_claim_floor_on_insert and _on_update, for a message dated in the past): lowers the shard''s claim floor to the message at commit. Not granted.';

REVOKE ALL ON FUNCTION outbox.lower_claim_floor() FROM PUBLIC;

CREATE CONSTRAINT TRIGGER messages_lower_claim_floor_on_insert
    AFTER INSERT ON outbox.messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.available_at < clock_timestamp() - interval '200 milliseconds')
    EXECUTE FUNCTION outbox.lower_claim_floor();

CREATE CONSTRAINT TRIGGER messages_lower_claim_floor_on_update
    AFTER UPDATE OF available_at ON outbox.messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.available_at < OLD.available_at)
    EXECUTE FUNCTION outbox.lower_claim_floor();


DROP FUNCTION outbox.claim_shard_candidates(integer, integer, bigint, text[], text[], bigint, bigint);

CREATE OR REPLACE FUNCTION outbox.claim_shard_candidates(
    p_shard integer,
    p_floor timestamptz,
    p_now timestamptz,
    p_room integer,
    p_used bigint,
    p_topics text[],
    p_exclude_topics text[],
    p_max_bytes bigint,
    p_max_message_bytes bigint,
    OUT ids uuid[],
    OUT ctids tid[],
    OUT bytes bigint
)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_custom_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET jit = off
AS $$
DECLARE
    v_keys text[];
    v_seqs bigint[];
    v_topics text[];
    v_room integer;
    v_run uuid[];
    v_run_ctids tid[];
    v_run_bytes bigint;
BEGIN
    -- Heads. The budget is a running sum over the candidates in claim order; rows past it
    -- were locked by the inner scan and are left untouched.
    SELECT coalesce(array_agg(b.outbox_id), '{}'),
           coalesce(array_agg(b.ctid), '{}'),
           coalesce(sum(b.counted), 0),
           array_agg(b.message_key) FILTER (WHERE b.message_key IS NOT NULL),
           array_agg(b.seq) FILTER (WHERE b.message_key IS NOT NULL),
           array_agg(b.topic) FILTER (WHERE b.message_key IS NOT NULL)
      INTO ids, ctids, bytes, v_keys, v_seqs, v_topics
      FROM (SELECT w.*,
                   sum(w.counted) OVER (ROWS UNBOUNDED PRECEDING) - w.counted AS before
              FROM (SELECT c.outbox_id, c.ctid, c.message_key, c.seq, c.topic,
                           CASE WHEN octet_length(c.payload) > p_max_message_bytes THEN 0
                                ELSE octet_length(c.payload)::bigint END AS counted
                      FROM outbox.messages AS c
                     WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
                       AND NOT c.behind
                       AND c.available_at >= p_floor
                       AND c.available_at <= p_now
                       AND c.lease_token IS NULL
                       AND (p_topics IS NULL OR c.topic = ANY (p_topics))
                       AND (p_exclude_topics IS NULL OR NOT c.topic LIKE ANY (p_exclude_topics))
                       AND (c.message_key IS NULL OR NOT EXISTS (
                               SELECT 1
                                 FROM outbox.messages AS e
                                WHERE e.message_key = c.message_key
                                  AND e.seq < c.seq))
                     ORDER BY c.available_at, c.seq
                     LIMIT p_room
                       FOR UPDATE SKIP LOCKED) AS w) AS b
     WHERE p_max_bytes IS NULL OR p_used + b.before < p_max_bytes;

    -- Runs: for each keyed head, in the heads' order, the messages that follow it in its
    -- key while each is claimable; at most the room left, within the budget.
    v_room := p_room - cardinality(ids);
    IF v_keys IS NOT NULL AND v_room > 0 AND (p_max_bytes IS NULL OR p_used + bytes < p_max_bytes) THEN
        SELECT array_agg(r.outbox_id), array_agg(r.ctid), sum(r.len)
          INTO v_run, v_run_ctids, v_run_bytes
          FROM (SELECT q.outbox_id, q.ctid, q.len,
                       count(*) OVER o AS nth,
                       sum(q.len) OVER o - q.len AS before
                  FROM (SELECT h.ord, x.outbox_id, x.ctid, x.seq, x.len
                          FROM unnest(v_keys, v_seqs, v_topics) WITH ORDINALITY AS h(key, seq, topic, ord)
                         CROSS JOIN LATERAL (
                                SELECT y.outbox_id, y.ctid, y.seq, y.len
                                  FROM (SELECT n.outbox_id, n.ctid, n.seq,
                                               octet_length(n.payload)::bigint AS len,
                                               bool_and(n.available_at <= p_now
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
           AND (p_max_bytes IS NULL OR p_used + bytes + r.before < p_max_bytes);
        ids := ids || coalesce(v_run, '{}');
        ctids := ctids || coalesce(v_run_ctids, '{}');
        bytes := bytes + coalesce(v_run_bytes, 0);
    END IF;
END;
$$;

COMMENT ON FUNCTION outbox.claim_shard_candidates(integer, timestamptz, timestamptz, integer, bigint, text[], text[], bigint, bigint) IS
    'Internal (claim_outbox_batch_seq and claim_outbox_batch, under the shard''s turn): locks up to p_room heads of one shard and returns their ids, tuple addresses and counted bytes, then the runs behind the keyed heads, within the room and budget left.';

REVOKE ALL ON FUNCTION outbox.claim_shard_candidates(integer, timestamptz, timestamptz, integer, bigint, text[], text[], bigint, bigint) FROM PUBLIC;


CREATE OR REPLACE FUNCTION outbox.claim_outbox_batch_seq(
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
    payload_bytes bigint,
    seq bigint
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
    v_start integer;
    v_shard integer;
    v_busy integer;
    v_turns integer := 0;
    v_ids uuid[] := '{}';
    v_ctids tid[] := '{}';
    v_bytes bigint := 0;
    v_now timestamptz := clock_timestamp();
    v_floors timestamptz[];
    v_bound timestamptz;
    v_first timestamptz;
    v_raised timestamptz;
    -- each statement reads a snapshot newer than the bound: floors may be raised
    v_fresh boolean := current_setting('transaction_isolation') = 'read committed';
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
    PERFORM set_config('synchronous_commit', 'off', true);
    v_floors := outbox.claim_floors();
    v_bound := outbox.claim_floor_bound();

    -- The shards in turn from a random one. Each is probed for a ready entry before its
    -- turn is taken, so that an idle queue costs no turn; the probe is a hint only (it
    -- stops at the first entry, leased or not): the shard is read again under its turn.
    -- Shards that other claims hold are skipped. Only when pass 1 took no turn while some
    -- shard has work (all such shards are held) does pass 2 wait, for the turn of the first
    -- shard it found with work, and then go on round the others, skipping those held.
    v_start := floor(random() * 16)::integer;
    FOR v_pass IN 1 .. 2 LOOP
        EXIT WHEN v_turns > 0 OR (v_pass = 2 AND v_busy IS NULL);
        FOR v_i IN 0 .. 15 LOOP
            v_shard := (v_start + v_i) % 16;
            IF v_pass = 2 AND v_shard = v_busy THEN
                PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'claim:' || v_shard FOR UPDATE;
            ELSE
                -- The shard's first entry from its floor, leased or not: it raises the floor
                -- (claim_floor_bound), and no entry due by now means no work.
                v_first := (SELECT c.available_at
                              FROM outbox.messages AS c
                             WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = v_shard
                               AND NOT c.behind
                               AND c.available_at >= v_floors[v_shard + 1]
                             ORDER BY c.available_at, c.seq
                             LIMIT 1);
                v_raised := least(coalesce(v_first, 'infinity'), v_bound);
                IF v_raised > v_floors[v_shard + 1] AND v_fresh THEN
                    v_floors[v_shard + 1] := outbox.raise_claim_floor(v_shard, v_floors[v_shard + 1], v_raised);
                END IF;
                CONTINUE WHEN v_first IS NULL OR v_first > v_now;
                CONTINUE WHEN (p_topics IS NOT NULL OR p_exclude_topics IS NOT NULL) AND NOT EXISTS (
                    SELECT 1
                      FROM outbox.messages AS c
                     WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = v_shard
                       AND NOT c.behind
                       AND c.available_at >= v_floors[v_shard + 1]
                       AND c.available_at <= v_now
                       AND (p_topics IS NULL OR c.topic = ANY (p_topics))
                       AND (p_exclude_topics IS NULL OR NOT c.topic LIKE ANY (p_exclude_topics)));
                v_busy := coalesce(v_busy, v_shard);
                PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'claim:' || v_shard FOR UPDATE SKIP LOCKED;
                CONTINUE WHEN NOT FOUND;
            END IF;
            v_turns := v_turns + 1;
            SELECT v_ids || s.ids, v_ctids || s.ctids, v_bytes + s.bytes
              INTO v_ids, v_ctids, v_bytes
              FROM outbox.claim_shard_candidates(v_shard, v_floors[v_shard + 1], v_now,
                                                 p_batch_size - cardinality(v_ids), v_bytes,
                                                 p_topics, p_exclude_topics, p_max_bytes,
                                                 p_max_message_bytes) AS s;
            EXIT WHEN cardinality(v_ids) >= p_batch_size
                   OR (p_max_bytes IS NOT NULL AND v_bytes >= p_max_bytes);
        END LOOP;
    END LOOP;

    RETURN QUERY
    WITH leased AS (
        UPDATE outbox.messages AS m
           SET claimed_by = p_worker_id,
               lease_token = gen_random_uuid(),
               lease_expires_at = now() + make_interval(secs => p_lease_seconds)
         WHERE m.ctid = ANY (v_ctids)
           -- a check, not a way in: written so that it cannot drive an index scan
           AND (m.outbox_id = ANY (v_ids)) IS TRUE
           AND m.lease_token IS NULL
        RETURNING m.seq, m.outbox_id, m.lease_token, m.topic, m.message_key,
                  CASE WHEN octet_length(m.payload) > p_max_message_bytes THEN NULL ELSE m.payload END
                      AS payload,
                  m.content_type, m.headers, m.attempt_count + 1 AS attempt_no, m.created_at,
                  m.lease_expires_at, octet_length(m.payload)::bigint AS payload_bytes
    )
    SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
           l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes, l.seq
      FROM leased AS l
     ORDER BY l.seq;
END;
$$;

COMMENT ON FUNCTION outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint) IS
    'Leases up to p_batch_size ready messages (unkeyed ones, heads of keys, and the runs behind keyed heads) to p_worker_id for p_lease_seconds, within the topic filters and byte budget; rows in enqueue order, each with its seq; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint) TO outbox_relay;


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
    v_start integer;
    v_shard integer;
    v_busy integer;
    v_turns integer := 0;
    v_ids uuid[] := '{}';
    v_ctids tid[] := '{}';
    v_bytes bigint := 0;
    v_now timestamptz := clock_timestamp();
    v_floors timestamptz[];
    v_bound timestamptz;
    v_first timestamptz;
    v_raised timestamptz;
    -- each statement reads a snapshot newer than the bound: floors may be raised
    v_fresh boolean := current_setting('transaction_isolation') = 'read committed';
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
    PERFORM set_config('synchronous_commit', 'off', true);
    v_floors := outbox.claim_floors();
    v_bound := outbox.claim_floor_bound();

    -- The shards in turn from a random one. Each is probed for a ready entry before its
    -- turn is taken, so that an idle queue costs no turn; the probe is a hint only (it
    -- stops at the first entry, leased or not): the shard is read again under its turn.
    -- Shards that other claims hold are skipped. Only when pass 1 took no turn while some
    -- shard has work (all such shards are held) does pass 2 wait, for the turn of the first
    -- shard it found with work, and then go on round the others, skipping those held.
    v_start := floor(random() * 16)::integer;
    FOR v_pass IN 1 .. 2 LOOP
        EXIT WHEN v_turns > 0 OR (v_pass = 2 AND v_busy IS NULL);
        FOR v_i IN 0 .. 15 LOOP
            v_shard := (v_start + v_i) % 16;
            IF v_pass = 2 AND v_shard = v_busy THEN
                PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'claim:' || v_shard FOR UPDATE;
            ELSE
                -- The shard's first entry from its floor, leased or not: it raises the floor
                -- (claim_floor_bound), and no entry due by now means no work.
                v_first := (SELECT c.available_at
                              FROM outbox.messages AS c
                             WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = v_shard
                               AND NOT c.behind
                               AND c.available_at >= v_floors[v_shard + 1]
                             ORDER BY c.available_at, c.seq
                             LIMIT 1);
                v_raised := least(coalesce(v_first, 'infinity'), v_bound);
                IF v_raised > v_floors[v_shard + 1] AND v_fresh THEN
                    v_floors[v_shard + 1] := outbox.raise_claim_floor(v_shard, v_floors[v_shard + 1], v_raised);
                END IF;
                CONTINUE WHEN v_first IS NULL OR v_first > v_now;
                CONTINUE WHEN (p_topics IS NOT NULL OR p_exclude_topics IS NOT NULL) AND NOT EXISTS (
                    SELECT 1
                      FROM outbox.messages AS c
                     WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = v_shard
                       AND NOT c.behind
                       AND c.available_at >= v_floors[v_shard + 1]
                       AND c.available_at <= v_now
                       AND (p_topics IS NULL OR c.topic = ANY (p_topics))
                       AND (p_exclude_topics IS NULL OR NOT c.topic LIKE ANY (p_exclude_topics)));
                v_busy := coalesce(v_busy, v_shard);
                PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'claim:' || v_shard FOR UPDATE SKIP LOCKED;
                CONTINUE WHEN NOT FOUND;
            END IF;
            v_turns := v_turns + 1;
            SELECT v_ids || s.ids, v_ctids || s.ctids, v_bytes + s.bytes
              INTO v_ids, v_ctids, v_bytes
              FROM outbox.claim_shard_candidates(v_shard, v_floors[v_shard + 1], v_now,
                                                 p_batch_size - cardinality(v_ids), v_bytes,
                                                 p_topics, p_exclude_topics, p_max_bytes,
                                                 p_max_message_bytes) AS s;
            EXIT WHEN cardinality(v_ids) >= p_batch_size
                   OR (p_max_bytes IS NOT NULL AND v_bytes >= p_max_bytes);
        END LOOP;
    END LOOP;

    RETURN QUERY
    WITH leased AS (
        UPDATE outbox.messages AS m
           SET claimed_by = p_worker_id,
               lease_token = gen_random_uuid(),
               lease_expires_at = now() + make_interval(secs => p_lease_seconds)
         WHERE m.ctid = ANY (v_ctids)
           -- a check, not a way in: written so that it cannot drive an index scan
           AND (m.outbox_id = ANY (v_ids)) IS TRUE
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

COMMENT ON FUNCTION outbox.claim_outbox_batch(integer, text, integer, text[], text[], bigint, bigint) IS
    'Kept for relayers of the previous release: claim_outbox_batch_seq without the seq column (same leases, rows in enqueue order; P7001 on a bad argument). Dropped by a later release.';

REVOKE ALL ON FUNCTION outbox.claim_outbox_batch(integer, text, integer, text[], text[], bigint, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.claim_outbox_batch(integer, text, integer, text[], text[], bigint, bigint) TO outbox_relay;


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
            coalesce(p_headers, '{}'), coalesce(p_available_at, clock_timestamp()),
            coalesce(p_max_attempts, 10));

    -- Wake the relayers at commit (NOTIFY outbox_new), unless this transaction already
    -- asked or another transaction of the current 2 ms window does: the window's
    -- transaction-scoped advisory lock, taken without waiting, picks one.
    IF (p_available_at IS NULL OR p_available_at <= clock_timestamp())
       AND current_setting('outbox.woken', true) IS DISTINCT FROM 'yes' THEN
        IF pg_try_advisory_xact_lock(
               hashtext('outbox.wake_relayers'),
               ((extract(epoch FROM clock_timestamp()) * 500)::bigint % 2147483647)::integer) THEN
            PERFORM pg_notify('outbox_new', '');
            PERFORM set_config('outbox.woken', 'yes', true);
        END IF;
    END IF;
    RETURN v_id;
END;
$$;

COMMENT ON FUNCTION outbox.enqueue(text, bytea, text, jsonb, timestamptz, uuid, integer, text) IS
    'Inserts one message (bytea payload) in the caller''s transaction and returns its outbox_id; wakes the relayers at commit; P7001 on a bad argument, 23505 on a reused outbox_id.';

REVOKE ALL ON FUNCTION outbox.enqueue(text, bytea, text, jsonb, timestamptz, uuid, integer, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.enqueue(text, bytea, text, jsonb, timestamptz, uuid, integer, text) TO outbox_producer;
GRANT EXECUTE ON FUNCTION outbox.enqueue(text, bytea, text, jsonb, timestamptz, uuid, integer, text) TO outbox_relay;


CREATE OR REPLACE FUNCTION outbox.mark_behind() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    NEW.behind := coalesce((SELECT true
                              FROM outbox.messages AS e
                             WHERE e.message_key = NEW.message_key
                             ORDER BY e.seq DESC
                             LIMIT 1), false);
    RETURN NEW;
END;
$$;

COMMENT ON FUNCTION outbox.mark_behind() IS
    'Internal (trigger messages_mark_behind, before insert of a keyed message): marks the message behind when an earlier message of its key is pending. Not granted.';

REVOKE ALL ON FUNCTION outbox.mark_behind() FROM PUBLIC;


DROP FUNCTION outbox.promote_heads(text[]);

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
    v_promoted text[];       -- the keys whose message this round's UPDATE changed
BEGIN
    SELECT array_agg(k.key), array_agg(k.after), array_agg(k.from_seq)
      INTO v_keys, v_after, v_from
      FROM (SELECT u.key, max(u.after) AS after, min(u.seq) AS from_seq
              FROM unnest(p_keys, p_after, p_seqs) AS u(key, after, seq)
             WHERE u.key IS NOT NULL
             GROUP BY u.key) AS k;
    WHILE cardinality(v_keys) > 0 LOOP
        SELECT array_agg(f.outbox_id), array_agg(k.key), array_agg(k.after), array_agg(k.from_seq)
          INTO v_ids, v_id_keys, v_id_after, v_id_from
          FROM unnest(v_keys, v_after, v_from) AS k(key, after, from_seq)
         CROSS JOIN LATERAL (
                SELECT n.outbox_id, n.behind
                  FROM outbox.messages AS n
                 WHERE n.message_key = k.key
                   AND n.seq > k.from_seq
                 ORDER BY n.seq
                 LIMIT 1) AS f
         WHERE f.behind;
        EXIT WHEN v_ids IS NULL;

        WITH promoted AS (
            UPDATE outbox.messages AS m
               SET behind = false,
                   available_at = greatest(m.available_at, v_id_after[array_position(v_ids, m.outbox_id)])
             WHERE m.outbox_id = ANY (v_ids)
               AND m.behind
            RETURNING m.message_key
        )
        SELECT coalesce(array_agg(p.message_key), '{}')
          INTO v_promoted
          FROM promoted AS p;

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

    -- One completion at a time per key, so that promote_heads sees what the key's other
    -- completions did.
    PERFORM outbox.lock_keys(p_outbox_ids);

    IF 'DISPATCHED' = ALL (p_states) THEN
        BEGIN
            -- The fence is the deletion: this worker, the token listed with the id, an
            -- unexpired lease; a row changed by a concurrent commit (a repair, another
            -- claim) is checked again after the wait. The attempts are inserted in the
            -- call's order (ord).
            WITH gone AS (
                DELETE FROM outbox.messages AS m
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
                INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token, error)
                SELECT d.outbox_id, d.attempt_no, 'DISPATCHED', p_worker_id, d.lease_token, d.error
                  FROM done AS d
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
                  JOIN outbox.messages AS m ON m.outbox_id = u.id
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

COMMENT ON FUNCTION outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) IS
    'Records each listed outcome (DISPATCHED, FAILED, RETRYABLE) whose lease p_worker_id still holds with that token; returns per id, in call order, attempt_no, lease_lost and dead_lettered; a lost lease changes nothing; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) TO outbox_relay;


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
            RETURNING message_key, available_at, seq, behind
        )
        SELECT coalesce(array_agg(g.message_key) FILTER (WHERE g.message_key IS NOT NULL AND NOT g.behind), '{}'),
               coalesce(array_agg(g.available_at) FILTER (WHERE g.message_key IS NOT NULL AND NOT g.behind), '{}'),
               coalesce(array_agg(g.seq) FILTER (WHERE g.message_key IS NOT NULL AND NOT g.behind), '{}')
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
        SELECT v_keys || coalesce(array_agg(g.message_key) FILTER (WHERE g.message_key IS NOT NULL AND NOT g.behind), '{}'),
               v_after || coalesce(array_agg(g.available_at) FILTER (WHERE g.message_key IS NOT NULL AND NOT g.behind), '{}'),
               v_seqs || coalesce(array_agg(g.seq) FILTER (WHERE g.message_key IS NOT NULL AND NOT g.behind), '{}')
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
BEGIN
    IF p_limit IS NULL OR p_limit < 1 THEN
        PERFORM outbox.invalid_argument('p_limit', format('must be at least 1, got %s', p_limit));
    END IF;
    PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'repair' FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 0, 0;
        RETURN;
    END IF;

    -- The claim floors' safety net (04_claim.sql): a message ready to claim below its
    -- shard's floor moves up to the clock, where the claims' walks find it.
    v_floors := outbox.claim_floors();
    UPDATE outbox.messages AS m
       SET available_at = clock_timestamp()
     WHERE m.ctid = ANY (ARRAY(
               SELECT b.ctid
                 FROM outbox.messages AS b
                WHERE b.lease_token IS NULL
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

COMMENT ON FUNCTION outbox.repair_expired_leases(integer) IS
    'Requeues up to p_limit messages whose lease expired (a ZOMBIE_REQUEUE attempt each) and dead-letters those out of attempts; one pass at a time (''repair'' turn, else (0, 0) at once); returns (requeued, dead_lettered); P7001 on a bad limit.';

REVOKE ALL ON FUNCTION outbox.repair_expired_leases(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.repair_expired_leases(integer) TO outbox_relay;


CREATE OR REPLACE FUNCTION outbox.replay_step(p_replay_id bigint, p_limit integer DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_replay outbox.replays;
    v_ids uuid[];
    v_kept uuid[];
    v_count integer;
BEGIN
    IF p_limit IS NOT NULL AND p_limit < 1 THEN
        PERFORM outbox.invalid_argument('p_limit', format('must be at least 1, got %s', p_limit));
    END IF;
    SELECT * INTO v_replay FROM outbox.replays AS r WHERE r.replay_id = p_replay_id FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM outbox.invalid_argument('p_replay_id', format('no replay %s (start_replay)', p_replay_id));
    END IF;
    IF v_replay.replayed_by <> session_user THEN
        PERFORM outbox.invalid_argument('p_replay_id',
            format('replay %s belongs to %s', p_replay_id, v_replay.replayed_by));
    END IF;
    IF v_replay.finished_at IS NOT NULL THEN
        RETURN 0;
    END IF;
    IF jsonb_typeof(v_replay.filter -> 'outbox_ids') = 'array' THEN
        v_ids := ARRAY(SELECT jsonb_array_elements_text(v_replay.filter -> 'outbox_ids')::uuid);
    END IF;

    SELECT array_agg(d.outbox_id) FILTER (WHERE EXISTS (
               SELECT 1 FROM outbox.messages AS m WHERE m.outbox_id = d.outbox_id))
      INTO v_kept
      FROM outbox.dead_letters_matching(v_ids, v_replay.filter ->> 'topic',
                                        (v_replay.filter ->> 'since')::timestamptz,
                                        v_replay.filter ->> 'error_contains') AS d
     WHERE d.dead_lettered_at <= v_replay.up_to;
    IF v_kept IS NOT NULL THEN
        RAISE WARNING 'outbox: % dead letter(s) not replayed because a message with the same id is pending: %',
                      cardinality(v_kept), array_to_string(v_kept, ', ');
    END IF;

    WITH picked AS (
        SELECT d.outbox_id
          FROM outbox.dead_letters_matching(v_ids, v_replay.filter ->> 'topic',
                                            (v_replay.filter ->> 'since')::timestamptz,
                                            v_replay.filter ->> 'error_contains') AS d
         WHERE d.dead_lettered_at <= v_replay.up_to
           AND d.outbox_id <> ALL (coalesce(v_kept, '{}'))
         ORDER BY d.created_at, d.outbox_id
         LIMIT p_limit
    ), back AS (
        DELETE FROM outbox.dead_letters AS d
         USING picked AS p
         WHERE d.outbox_id = p.outbox_id
        RETURNING d.*
    )
    -- in creation order, so a key's replayed messages keep their order among themselves
    INSERT INTO outbox.messages (outbox_id, topic, message_key, payload, content_type, headers,
                                 created_at, available_at, attempt_count, attempt_base,
                                 max_attempts, last_error)
    SELECT b.outbox_id, b.topic, b.message_key, b.payload, b.content_type, b.headers,
           b.created_at, clock_timestamp(), b.attempt_count, b.attempt_count, b.max_attempts, b.last_error
      FROM back AS b
     ORDER BY b.created_at, b.outbox_id;
    GET DIAGNOSTICS v_count = ROW_COUNT;

    UPDATE outbox.replays AS r
       SET replayed = r.replayed + v_count,
           finished_at = CASE WHEN v_count = 0 OR v_count < coalesce(p_limit, v_count + 1)
                              THEN clock_timestamp() END
     WHERE r.replay_id = p_replay_id;
    IF v_count > 0 THEN
        PERFORM pg_notify('outbox_new', 'replayed');
    END IF;
    RETURN v_count;
END;
$$;

COMMENT ON FUNCTION outbox.replay_step(bigint, integer) IS
    'Moves up to p_limit (NULL: all) more of this login''s replay p_replay_id''s dead letters back to outbox.messages, oldest first, with a fresh attempt budget; returns how many (0: done); P7001 on a bad limit or replay id.';

REVOKE ALL ON FUNCTION outbox.replay_step(bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.replay_step(bigint, integer) TO outbox_relay;

-- outbox.messages in a ring of four slots: the table becomes partitioned by slot (LIST),
-- producers write to the current slot, and outbox.rotate_messages moves them on to the next
-- empty slot every period and truncates a slot in which nothing is pending. While a
-- snapshot holds the MVCC horizon back, truncation gives back what delivered messages left
-- behind, which vacuum may not.
--
-- In place: the table as it is becomes slot 0 (ATTACH PARTITION), with its rows, pages,
-- storage settings and the two claim indexes as they are; nothing is copied. What is built
-- is the primary key, which a partitioned table needs over (outbox_id, slot): one index
-- build over the pending messages, under the ACCESS EXCLUSIVE lock the migration holds
-- until it commits (producers and relayers wait for it; about 0.63 s per million pending
-- messages on a 2-core machine). seq goes on from where it was. The views that read
-- outbox.messages are defined again over the new table; the observation sums the slots'
-- statistics. The SQL API keeps its names and semantics; 01_tables.sql and
-- 06_repair_retention.sql hold the contracts in full.

LOCK TABLE outbox.messages IN ACCESS EXCLUSIVE MODE;

-- Where seq stands, kept while the identity moves from the table to the new parent.
CREATE TEMPORARY TABLE v32_seq ON COMMIT DROP AS
SELECT s.last_value, s.is_called FROM outbox.messages_seq_seq AS s;

-- The table as it is becomes slot 0. Its triggers are the parent's from now on, its
-- identity too, and its primary key (outbox_id) gives way to the parent's (outbox_id, slot);
-- the CHECK on slot proves the partition's bound, so that attaching it reads no row.
DROP TRIGGER messages_mark_behind ON outbox.messages;
DROP TRIGGER messages_settle_behind ON outbox.messages;
DROP TRIGGER messages_lower_claim_floor_on_insert ON outbox.messages;
DROP TRIGGER messages_lower_claim_floor_on_update ON outbox.messages;
ALTER TABLE outbox.messages RENAME TO messages_0;
ALTER TABLE outbox.messages_0 DROP CONSTRAINT messages_pkey;
ALTER INDEX outbox.messages_shard_heads_idx RENAME TO messages_0_expr_available_at_seq_idx;
ALTER INDEX outbox.messages_key_seq_idx RENAME TO messages_0_message_key_seq_idx;
ALTER TABLE outbox.messages_0 ALTER COLUMN seq DROP IDENTITY;
ALTER TABLE outbox.messages_0 ADD COLUMN slot smallint NOT NULL DEFAULT 0;
ALTER TABLE outbox.messages_0 ADD CONSTRAINT messages_0_slot CHECK (slot = 0);
COMMENT ON COLUMN outbox.messages_0.behind IS NULL;

-- outbox.message_slot: the current slot (0 to 3), a register rather than a counter: only
-- outbox.rotate_messages sets it (setval), and outbox.message_slot() reads it. A sequence,
-- so that reading it on every insert and setting it leave no row version behind; setval is
-- not transactional, and takes effect at once for every producer.
CREATE SEQUENCE outbox.message_slot AS smallint MINVALUE 0 MAXVALUE 3 START 0;

COMMENT ON SEQUENCE outbox.message_slot IS
    'The slot of outbox.messages producers write to (0 to 3); set only by rotate_messages.';

REVOKE ALL ON SEQUENCE outbox.message_slot FROM PUBLIC;


-- outbox.message_slot: internal; the default of outbox.messages.slot: the current slot, as
-- outbox.message_slot holds it when the row is inserted. Granted to no one (it runs as the
-- owner, who alone inserts into the table). Raises nothing.
CREATE OR REPLACE FUNCTION outbox.message_slot() RETURNS smallint
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    -- a function call, not a scan of the sequence: callers that run with enable_seqscan
    -- off would cost that scan past every JIT threshold, and compile it on every insert
    SELECT coalesce(pg_sequence_last_value('outbox.message_slot'::regclass), 0)::smallint
$$;

COMMENT ON FUNCTION outbox.message_slot() IS
    'Internal: the slot of outbox.messages producers write to now; the default of messages.slot. Not granted.';

REVOKE ALL ON FUNCTION outbox.message_slot() FROM PUBLIC;


-- outbox.message_slots: one row per slot: since when it is (or last was) the current slot.
-- Written only by rotate_messages, once per rotation; read by rotate_messages (is the
-- current slot's period over?) and by the observation. Owner only.
CREATE TABLE outbox.message_slots (
    slot      smallint    NOT NULL,
    opened_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT message_slots_pkey PRIMARY KEY (slot),
    CONSTRAINT message_slots_slot CHECK (slot BETWEEN 0 AND 3)
);

INSERT INTO outbox.message_slots (slot) SELECT s FROM generate_series(0, 3) AS s;

COMMENT ON TABLE outbox.message_slots IS
    'Since when each slot of outbox.messages is (or last was) the one producers write to; written by rotate_messages; owner only.';

REVOKE ALL ON TABLE outbox.message_slots FROM PUBLIC;


CREATE TABLE outbox.messages (
    outbox_id        uuid        NOT NULL DEFAULT outbox.uuid_v7(),
    -- enqueue order; decides which message is the head of its key; sent to consumers of
    -- keyed messages as their per-key sequence (claim_outbox_batch_seq, 04_claim.sql)
    seq              bigint      NOT NULL GENERATED ALWAYS AS IDENTITY,
    topic            text        NOT NULL,
    -- NULL: no order; otherwise delivered one at a time, in seq order, with its key
    message_key      text,
    payload          bytea       NOT NULL,
    content_type     text        NOT NULL DEFAULT 'application/json',
    headers          jsonb       NOT NULL DEFAULT '{}',
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- not before: delays and retry backoff (a time before the write lowers the claim
    -- floor of its shard at commit, 04_claim.sql)
    available_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- attempts recorded so far; the next attempt is number attempt_count + 1
    attempt_count    integer     NOT NULL DEFAULT 0,
    -- attempts recorded in earlier lives (before the latest replay from dead letters):
    -- this life's budget ends at attempt number attempt_base + max_attempts
    attempt_base     integer     NOT NULL DEFAULT 0,
    -- attempts allowed per life (a replay starts a new life)
    max_attempts     integer     NOT NULL DEFAULT 10,
    -- the lease: all three set (leased) or all three NULL (not leased)
    claimed_by       text,
    lease_token      uuid,
    lease_expires_at timestamptz,
    -- the error of the latest failed attempt
    last_error       text,
    behind           boolean     NOT NULL DEFAULT false,
    -- the partition: the slot producers wrote to when the message was inserted
    slot             smallint    NOT NULL DEFAULT outbox.message_slot(),
    CONSTRAINT messages_pkey PRIMARY KEY (outbox_id, slot),
    CONSTRAINT messages_topic_not_empty CHECK (topic <> ''),
    CONSTRAINT messages_max_attempts_positive CHECK (max_attempts >= 1),
    CONSTRAINT messages_headers_object CHECK (jsonb_typeof(headers) = 'object'),
    CONSTRAINT messages_lease_complete CHECK (
        (claimed_by IS NULL) = (lease_token IS NULL)
        AND (lease_token IS NULL) = (lease_expires_at IS NULL))
) PARTITION BY LIST (slot);

ALTER TABLE outbox.messages ATTACH PARTITION outbox.messages_0 FOR VALUES IN (0);
ALTER TABLE outbox.messages_0 DROP CONSTRAINT messages_0_slot;
ALTER TABLE outbox.messages_0 ALTER COLUMN slot SET DEFAULT outbox.message_slot();

SELECT setval(pg_get_serial_sequence('outbox.messages', 'seq'), v.last_value, v.is_called)
  FROM v32_seq AS v;


-- Slots 1 to 3, with the storage settings slot 0 keeps from the table it was.
CREATE TABLE outbox.messages_1 PARTITION OF outbox.messages FOR VALUES IN (1) WITH (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 20000,
    autovacuum_vacuum_cost_delay = 0
);

CREATE TABLE outbox.messages_2 PARTITION OF outbox.messages FOR VALUES IN (2) WITH (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 20000,
    autovacuum_vacuum_cost_delay = 0
);

CREATE TABLE outbox.messages_3 PARTITION OF outbox.messages FOR VALUES IN (3) WITH (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 20000,
    autovacuum_vacuum_cost_delay = 0
);

CREATE INDEX messages_shard_heads_idx
    ON outbox.messages ((hashtext(coalesce(message_key, outbox_id::text)) & 15), available_at, seq)
    WHERE NOT behind;

CREATE INDEX messages_key_seq_idx ON outbox.messages (message_key, seq)
    WHERE message_key IS NOT NULL;

COMMENT ON TABLE outbox.messages IS
    'Pending work, one row per undelivered message, with its lease while in flight; written only by the SQL API, owner only (read it through the views).';
COMMENT ON COLUMN outbox.messages.behind IS
    'an earlier message of the same message_key is pending; not a claim candidate';
COMMENT ON COLUMN outbox.messages.slot IS
    'the partition (0 to 3): the slot producers wrote to when the message was inserted';

REVOKE ALL ON TABLE outbox.messages FROM PUBLIC;

COMMENT ON TABLE outbox.messages_0 IS
    'Slot 0 of outbox.messages (a partition); truncated by rotate_messages once nothing in it is pending; owner only.';
REVOKE ALL ON TABLE outbox.messages_0 FROM PUBLIC;

COMMENT ON TABLE outbox.messages_1 IS
    'Slot 1 of outbox.messages (a partition); truncated by rotate_messages once nothing in it is pending; owner only.';
REVOKE ALL ON TABLE outbox.messages_1 FROM PUBLIC;

COMMENT ON TABLE outbox.messages_2 IS
    'Slot 2 of outbox.messages (a partition); truncated by rotate_messages once nothing in it is pending; owner only.';
REVOKE ALL ON TABLE outbox.messages_2 FROM PUBLIC;

COMMENT ON TABLE outbox.messages_3 IS
    'Slot 3 of outbox.messages (a partition); truncated by rotate_messages once nothing in it is pending; owner only.';
REVOKE ALL ON TABLE outbox.messages_3 FROM PUBLIC;


CREATE TRIGGER messages_mark_behind
    BEFORE INSERT ON outbox.messages
    FOR EACH ROW
    WHEN (NEW.message_key IS NOT NULL)
    EXECUTE FUNCTION outbox.mark_behind();

CREATE CONSTRAINT TRIGGER messages_settle_behind
    AFTER INSERT ON outbox.messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.behind)
    EXECUTE FUNCTION outbox.settle_behind();

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

-- The views, over the new table (a view is bound to the table it was created on).
CREATE OR REPLACE VIEW outbox.status AS
SELECT count(*) FILTER (WHERE m.lease_token IS NULL AND m.available_at <= now())   AS ready,
       count(*) FILTER (WHERE m.lease_token IS NULL AND m.available_at > now())    AS delayed,
       count(*) FILTER (WHERE m.lease_expires_at > now())                          AS in_flight,
       count(*) FILTER (WHERE m.lease_expires_at <= now())                         AS expired_leases,
       (SELECT count(*) FROM outbox.dead_letters)                                  AS dead_letters,
       now() - min(m.available_at) FILTER (WHERE m.lease_token IS NULL
                                            AND m.available_at <= now())           AS oldest_ready_age
  FROM outbox.messages AS m;

CREATE OR REPLACE VIEW outbox.in_flight AS
SELECT m.outbox_id,
       m.topic,
       m.message_key,
       m.claimed_by,
       m.lease_token,
       m.lease_expires_at,
       m.lease_expires_at <= now() AS expired,
       m.attempt_count + 1         AS attempt_no,
       m.created_at
  FROM outbox.messages AS m
 WHERE m.lease_token IS NOT NULL;

CREATE OR REPLACE VIEW outbox.topic_lag AS
WITH pending AS (
    SELECT m.topic,
           count(*) FILTER (WHERE m.lease_token IS NULL AND m.available_at <= now()) AS ready,
           count(*) FILTER (WHERE m.lease_token IS NULL AND m.available_at > now())  AS delayed,
           count(*) FILTER (WHERE m.lease_token IS NOT NULL)                         AS in_flight,
           min(m.created_at)                                                         AS oldest_created_at
      FROM outbox.messages AS m
     GROUP BY m.topic
), dead AS (
    SELECT d.topic, count(*) AS dead_letters
      FROM outbox.dead_letters AS d
     GROUP BY d.topic
)
SELECT coalesce(p.topic, d.topic)        AS topic,
       coalesce(p.ready, 0)              AS ready,
       coalesce(p.delayed, 0)            AS delayed,
       coalesce(p.in_flight, 0)          AS in_flight,
       coalesce(d.dead_letters, 0)       AS dead_letters,
       now() - p.oldest_created_at       AS lag
  FROM pending AS p
  FULL JOIN dead AS d ON d.topic = p.topic;

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

INSERT INTO outbox.turns (name) VALUES ('rotate');

COMMENT ON TABLE outbox.turns IS
    'Rows locked by the claims (claim_outbox_batch_seq, claim_outbox_batch), repair_expired_leases, rotate_messages and observe to take turns; owner only.';

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

CREATE OR REPLACE FUNCTION outbox.observation(p_top_topics integer)
RETURNS jsonb
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
WITH clock AS (
    SELECT clock_timestamp() AS now
), pending AS (
    SELECT m.topic,
           count(*) FILTER (WHERE m.lease_token IS NULL AND m.available_at <= c.now) AS ready,
           count(*) FILTER (WHERE m.lease_token IS NULL AND m.available_at > c.now)  AS delayed,
           count(*) FILTER (WHERE m.lease_expires_at > c.now)                        AS in_flight,
           count(*) FILTER (WHERE m.lease_expires_at <= c.now)                       AS expired_leases,
           min(m.available_at) FILTER (WHERE m.lease_token IS NULL
                                         AND m.available_at <= c.now)                AS oldest_ready_at,
           -- parked messages (available_at 'infinity') are delayed but never due
           min(m.available_at) FILTER (WHERE m.lease_token IS NULL
                                         AND m.available_at > c.now
                                         AND m.available_at < 'infinity')            AS next_due_at
      FROM outbox.messages AS m, clock AS c
     GROUP BY m.topic
), dead AS (
    SELECT d.topic, count(*) AS dead_letters
      FROM outbox.dead_letters AS d
     GROUP BY d.topic
), topics AS (
    SELECT coalesce(p.topic, d.topic)  AS topic,
           coalesce(p.ready, 0)        AS ready,
           coalesce(p.delayed, 0)      AS delayed,
           coalesce(p.in_flight, 0)    AS in_flight,
           coalesce(p.expired_leases, 0) AS expired_leases,
           coalesce(d.dead_letters, 0) AS dead_letters,
           p.oldest_ready_at,
           p.next_due_at
      FROM pending AS p
      FULL JOIN dead AS d ON d.topic = p.topic
), ranked AS (
    SELECT t.*,
           row_number() OVER (ORDER BY t.ready + t.delayed + t.in_flight + t.expired_leases DESC,
                                       t.dead_letters DESC, t.topic) AS rank
      FROM topics AS t
), labelled AS (
    -- a topic really named 'other' shares its label with the remainder
    SELECT CASE WHEN r.rank <= p_top_topics THEN r.topic ELSE 'other' END AS label,
           sum(r.ready)::bigint          AS ready,
           sum(r.delayed)::bigint        AS delayed,
           sum(r.in_flight)::bigint      AS in_flight,
           sum(r.expired_leases)::bigint AS expired_leases,
           sum(r.dead_letters)::bigint   AS dead_letters,
           min(r.oldest_ready_at)        AS oldest_ready_at,
           min(r.next_due_at)            AS next_due_at
      FROM ranked AS r
     GROUP BY 1
), attempts AS (
    -- attempts_created_at_idx (a B-tree) reads only the last minute of the attempt log
    SELECT a.state::text AS state, count(*) AS attempts
      FROM outbox.attempts AS a, clock AS c
     WHERE a.created_at > c.now - interval '1 minute'
     GROUP BY a.state
), holders AS (
    -- Sessions of this database whose snapshot (backend_xmin) or transaction id holds back
    -- what vacuum may remove from outbox.messages. The query text is the statement's text
    -- (placeholders, never bound parameters), cut to 100 characters.
    SELECT 'session'::text AS kind,
           a.pid,
           a.application_name AS name,
           a.state,
           extract(epoch FROM c.now - coalesce(a.xact_start, a.query_start, a.backend_start))::float8
                                                         AS age_seconds,
           greatest(age(a.backend_xmin), age(a.backend_xid)) AS xid_age,
           left(a.query, 100)                              AS query
      FROM pg_stat_activity AS a, clock AS c
     WHERE a.datname = current_database()
       AND a.pid <> pg_backend_pid()
       AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
    UNION ALL
    -- Physical slots (hot_standby_feedback) hold back every database; a logical slot holds
    -- back only the catalogs (catalog_xmin), not outbox.messages. No age in time is known.
    SELECT 'replication slot', s.active_pid, s.slot_name::text,
           CASE WHEN s.active THEN 'active' ELSE 'inactive' END,
           NULL, age(s.xmin), NULL
      FROM pg_replication_slots AS s
     WHERE s.xmin IS NOT NULL
       AND (s.database IS NULL OR s.database = current_database())
    UNION ALL
    SELECT 'prepared transaction', NULL, p.gid, 'prepared',
           extract(epoch FROM c.now - p.prepared)::float8, age(p.transaction), NULL
      FROM pg_prepared_xacts AS p, clock AS c
     WHERE p.database = current_database()
), vacuum AS (
    -- summed over the slots (the partitions of outbox.messages)
    SELECT sum(s.n_live_tup)::bigint AS n_live_tup, sum(s.n_dead_tup)::bigint AS n_dead_tup,
           max(greatest(s.last_autovacuum, s.last_vacuum)) AS last_vacuum,
           max(s.last_autovacuum) AS last_autovacuum
      FROM pg_stat_user_tables AS s
     WHERE s.relid IN (SELECT p.relid FROM pg_partition_tree('outbox.messages') AS p WHERE p.isleaf)
)
SELECT jsonb_build_object(
    'topics', coalesce((
        SELECT jsonb_agg(jsonb_build_object(
                   'topic', l.label,
                   'ready', l.ready,
                   'delayed', l.delayed,
                   'in_flight', l.in_flight,
                   'expired_leases', l.expired_leases,
                   'dead_letters', l.dead_letters,
                   'oldest_ready_age_seconds',
                       extract(epoch FROM c.now - l.oldest_ready_at)::float8,
                   'next_due_at', l.next_due_at)
                   ORDER BY l.ready + l.delayed + l.in_flight + l.expired_leases DESC, l.label)
          FROM labelled AS l, clock AS c), '[]'),
    'attempts_last_minute', coalesce((
        SELECT jsonb_object_agg(a.state, a.attempts) FROM attempts AS a), '{}'),
    'horizon_holders', coalesce((
        SELECT jsonb_agg(to_jsonb(h) ORDER BY h.xid_age DESC) FROM holders AS h), '[]'),
    'messages_table', (
        SELECT jsonb_build_object(
                   'live_tuples', v.n_live_tup,
                   'dead_tuples', v.n_dead_tup,
                   'last_autovacuum', v.last_autovacuum,
                   'last_vacuum', v.last_vacuum)
          FROM vacuum AS v)
)
$$;

COMMENT ON FUNCTION outbox.observation(integer) IS
    'Internal (observe, under the ''observe'' turn): computes the observation snapshot (topics, attempts in the last minute, MVCC horizon holders, outbox.messages tuples and vacuum); reads the whole backlog. Not granted.';

REVOKE ALL ON FUNCTION outbox.observation(integer) FROM PUBLIC;

-- The functions that find messages by id or key without a claim's plan settings read no
-- slot sequentially: a slot emptied by truncation has no page, and a plan made then would
-- read it whole once it fills.
CREATE OR REPLACE FUNCTION outbox.mark_behind() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
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

CREATE OR REPLACE FUNCTION outbox.settle_behind() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
BEGIN
    IF current_setting('transaction_isolation') = 'read committed' THEN
        -- The nearest earlier message of the key that no completion is deleting. Locked,
        -- its deletion waits for this commit; none, and this message is the head to come.
        PERFORM 1
           FROM outbox.messages AS e
          WHERE e.message_key = NEW.message_key
            AND e.seq < NEW.seq
          ORDER BY e.seq DESC
          LIMIT 1
            FOR KEY SHARE SKIP LOCKED;
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
SET enable_seqscan = off
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
        -- One enqueue of a given id at a time: the key of outbox.messages holds the slot,
        -- so two producers inserting one id into two slots (on either side of a rotation)
        -- would not wait for each other on it. The second waits here for the first's
        -- commit and then finds its row below.
        PERFORM pg_advisory_xact_lock(hashtext('outbox.id'), hashtext(v_id::text));
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

CREATE OR REPLACE FUNCTION outbox.replay_step(p_replay_id bigint, p_limit integer DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
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


-- Leases in flight are given back here, as release_outbox_leases would: no attempt is
-- recorded and the messages are ready again at once. A lease token now carries its
-- message's slot and whether the message is keyed (its last hex digit, 04_claim.sql), and
-- the completion, the heartbeat and the release look for a message in the slot its token
-- names and take its key's completion lock by that bit; a token issued before this
-- migration carries neither. Its holder's completion is a lost lease (lease_lost from
-- complete_outbox_batch, P7002 from complete_outbox_attempt): the message is delivered
-- again (at-least-once, as after a lease expiry), with the attempt number the lost one
-- had, so nothing is lost, no attempt is spent and the histories stay gapless.
UPDATE outbox.messages_0
   SET claimed_by = NULL, lease_token = NULL, lease_expires_at = NULL
 WHERE lease_token IS NOT NULL;

-- The hot path addresses each slot's own table: a statement on the partitioned table
-- costs the drain 11-13 % (docs/performance.md), one on a slot's table does not. The
-- functions that claim, lease, delete delivered messages, lock keys and promote heads are
-- written once for slot 0 (the *_slot0 functions) and copied for slots 1 to 3 by
-- outbox.copy_for_slots; the functions the callers know dispatch to them by slot: the
-- claim walks the slots oldest first, and the slot of a leased message travels in its
-- lease token (its last hex digit).

-- outbox.copy_for_slots (internal): creates the copies for slots 1 to 3 of a function
-- written for slot 0: its definition with every `outbox.messages_0 AS` and every name
-- ending in _slot0 renumbered, its comment, and no grant.
CREATE FUNCTION outbox.copy_for_slots(p_template regprocedure) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_def text := pg_get_functiondef(p_template);
    v_copy text;
    v_oid oid;
BEGIN
    IF v_def !~ '_slot0\(' THEN
        RAISE EXCEPTION 'copy_for_slots: % is not a slot 0 template', p_template;
    END IF;
    FOR v_slot IN 1 .. 3 LOOP
        -- the template's own table is written `outbox.messages_0 AS alias`; a reference to
        -- one given slot is written without AS and kept
        v_copy := regexp_replace(v_def, '\mmessages_0 AS ', 'messages_' || v_slot || ' AS ', 'g');
        v_copy := regexp_replace(v_copy, '_slot0\M', '_slot' || v_slot, 'g');
        EXECUTE v_copy;
        v_oid := to_regprocedure(regexp_replace(p_template::text, '_slot0\(', '_slot' || v_slot || '('));
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', v_oid::regprocedure);
        EXECUTE format('COMMENT ON FUNCTION %s IS %L', v_oid::regprocedure,
                       replace(obj_description(p_template, 'pg_proc'), 'slot 0', 'slot ' || v_slot));
    END LOOP;
END;
$$;

COMMENT ON FUNCTION outbox.copy_for_slots(regprocedure) IS
    'Internal: creates the copies for slots 1 to 3 of a function written for slot 0.';
REVOKE ALL ON FUNCTION outbox.copy_for_slots(regprocedure) FROM PUBLIC;

-- Lease tokens. A claim's token is random but for its last hex digit, which says where
-- the message is: bits 0 and 1 its slot, bit 2 whether it has a key (so that a completion
-- looks up the keys of keyed messages only), bit 3 clear. A token with bit 3 set was not
-- issued by a claim and matches no lease.

-- outbox.token_slot (internal): the slot a lease token names, or 8 to 11 (no slot).
CREATE FUNCTION outbox.token_slot(p_token uuid) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT get_byte(uuid_send(p_token), 15) & 11
$$;

COMMENT ON FUNCTION outbox.token_slot(uuid) IS
    'Internal: the slot a lease token names (bits 0 and 1 of its last hex digit), or 8 to 11 when bit 3 is set (no slot: not a claim''s token).';
REVOKE ALL ON FUNCTION outbox.token_slot(uuid) FROM PUBLIC;

-- outbox.token_keyed (internal): whether a lease token was issued for a keyed message.
CREATE FUNCTION outbox.token_keyed(p_token uuid) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT get_byte(uuid_send(p_token), 15) & 4 = 4
$$;

COMMENT ON FUNCTION outbox.token_keyed(uuid) IS
    'Internal: whether a lease token was issued for a keyed message (bit 2 of its last hex digit).';
REVOKE ALL ON FUNCTION outbox.token_keyed(uuid) FROM PUBLIC;

-- outbox.ring (internal): the four slots, oldest first: the one after the current slot
-- first, the current slot last.
CREATE FUNCTION outbox.ring() RETURNS integer[]
LANGUAGE sql VOLATILE
AS $$
    SELECT ARRAY[(c + 1) % 4, (c + 2) % 4, (c + 3) % 4, c]
      FROM (SELECT coalesce(pg_sequence_last_value('outbox.message_slot'::regclass), 0)::integer AS c) AS r
$$;

COMMENT ON FUNCTION outbox.ring() IS
    'Internal: the four slots, oldest first (the current slot last).';
REVOKE ALL ON FUNCTION outbox.ring() FROM PUBLIC;

-- outbox.key_pending_before (internal): whether a message of p_key with a seq below p_seq
-- is pending in any slot: one probe of each slot's messages_key_seq_idx, by a plan kept
-- for the session. The claim asks it only of a shard with entries in more than one slot.
CREATE FUNCTION outbox.key_pending_before(p_key text, p_seq bigint) RETURNS boolean
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM outbox.messages_0 e0 WHERE e0.message_key = p_key AND e0.seq < p_seq)
        OR EXISTS (SELECT 1 FROM outbox.messages_1 e1 WHERE e1.message_key = p_key AND e1.seq < p_seq)
        OR EXISTS (SELECT 1 FROM outbox.messages_2 e2 WHERE e2.message_key = p_key AND e2.seq < p_seq)
        OR EXISTS (SELECT 1 FROM outbox.messages_3 e3 WHERE e3.message_key = p_key AND e3.seq < p_seq);
END;
$$;

COMMENT ON FUNCTION outbox.key_pending_before(text, bigint) IS
    'Internal: whether a message of the key with a lower seq is pending in any slot.';
REVOKE ALL ON FUNCTION outbox.key_pending_before(text, bigint) FROM PUBLIC;


-- outbox.claim_probe_slots (internal): claim_probe in each slot: the available_at of the
-- first entry of shard p_shard at or after p_floor in slots 0 to 3 (NULL where none).
CREATE FUNCTION outbox.claim_probe_slots(p_shard integer, p_floor timestamptz)
RETURNS timestamptz[]
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN ARRAY[
        (SELECT c.available_at FROM outbox.messages_0 c
          WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
            AND NOT c.behind AND c.available_at >= p_floor
          ORDER BY c.available_at, c.seq LIMIT 1),
        (SELECT c.available_at FROM outbox.messages_1 c
          WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
            AND NOT c.behind AND c.available_at >= p_floor
          ORDER BY c.available_at, c.seq LIMIT 1),
        (SELECT c.available_at FROM outbox.messages_2 c
          WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
            AND NOT c.behind AND c.available_at >= p_floor
          ORDER BY c.available_at, c.seq LIMIT 1),
        (SELECT c.available_at FROM outbox.messages_3 c
          WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
            AND NOT c.behind AND c.available_at >= p_floor
          ORDER BY c.available_at, c.seq LIMIT 1)];
END;
$$;

COMMENT ON FUNCTION outbox.claim_probe_slots(integer, timestamptz) IS
    'Internal: the available_at of a shard''s first entry from its floor, in each of the four slots.';
REVOKE ALL ON FUNCTION outbox.claim_probe_slots(integer, timestamptz) FROM PUBLIC;

DROP FUNCTION outbox.claim_probe(integer, timestamptz);


CREATE OR REPLACE FUNCTION outbox.claim_shard_candidates_slot0(
    p_shard integer,
    p_floor timestamptz,
    p_now timestamptz,
    p_room integer,
    p_used bigint,
    p_topics text[],
    p_exclude_topics text[],
    p_max_bytes bigint,
    p_max_message_bytes bigint,
    p_other_slots boolean,
    OUT ids uuid[],
    OUT ctids tid[],
    OUT bytes bigint
)
LANGUAGE plpgsql VOLATILE
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
                      FROM outbox.messages_0 AS c
                     WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
                       AND NOT c.behind
                       AND c.available_at >= p_floor
                       AND c.available_at <= p_now
                       AND c.lease_token IS NULL
                       AND (p_topics IS NULL OR c.topic = ANY (p_topics))
                       AND (p_exclude_topics IS NULL OR NOT c.topic LIKE ANY (p_exclude_topics))
                       AND (c.message_key IS NULL OR NOT (
                               EXISTS (SELECT 1
                                         FROM outbox.messages_0 AS e
                                        WHERE e.message_key = c.message_key
                                          AND e.seq < c.seq)
                               OR (p_other_slots AND outbox.key_pending_before(c.message_key, c.seq))))
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
                                          FROM outbox.messages_0 AS n
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


COMMENT ON FUNCTION outbox.claim_shard_candidates_slot0(integer, timestamptz, timestamptz, integer, bigint, text[], text[], bigint, bigint, boolean) IS
    'Internal: claim_shard_candidates in slot 0 (a run ends at the end of the slot).';
REVOKE ALL ON FUNCTION outbox.claim_shard_candidates_slot0(integer, timestamptz, timestamptz, integer, bigint, text[], text[], bigint, bigint, boolean) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.claim_shard_candidates_slot0(integer, timestamptz, timestamptz, integer, bigint, text[], text[], bigint, bigint, boolean)');

DROP FUNCTION outbox.claim_shard_candidates(integer, timestamptz, timestamptz, integer, bigint, text[], text[], bigint, bigint);


-- outbox.lease_slot0 (internal): leases the listed rows of slot 0 (tuple addresses, with
-- their ids as a check) that are still unleased, with a token naming the slot.
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
BEGIN
    RETURN QUERY
    UPDATE outbox.messages_0 AS m
       SET claimed_by = p_worker_id,
           -- random but for its last hex digit: the slot, and 4 when keyed
           lease_token = (left(gen_random_uuid()::text, 35)
                          || (m.slot + CASE WHEN m.message_key IS NULL THEN 0 ELSE 4 END)::text)::uuid,
           lease_expires_at = now() + make_interval(secs => p_lease_seconds)
     WHERE m.ctid = ANY (p_ctids)
       -- a check, not a way in: written so that it cannot drive an index scan
       AND (m.outbox_id = ANY (p_ids)) IS TRUE
       AND m.lease_token IS NULL
    RETURNING m.outbox_id, m.lease_token, m.topic, m.message_key,
              CASE WHEN octet_length(m.payload) > p_max_message_bytes THEN NULL ELSE m.payload END,
              m.content_type, m.headers, m.attempt_count + 1, m.created_at,
              m.lease_expires_at, octet_length(m.payload)::bigint, m.seq;
END;
$$;

COMMENT ON FUNCTION outbox.lease_slot0(uuid[], tid[], text, integer, bigint) IS
    'Internal: leases the listed rows of slot 0 with a token naming the slot.';
REVOKE ALL ON FUNCTION outbox.lease_slot0(uuid[], tid[], text, integer, bigint) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.lease_slot0(uuid[], tid[], text, integer, bigint)');

-- outbox.lease_candidates (internal): leases what the claim chose when it spans slots,
-- slot by slot.
CREATE FUNCTION outbox.lease_candidates(
    p_ids uuid[],
    p_ctids tid[],
    p_slots smallint[],
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
    v_slot integer;
    v_ids uuid[];
    v_ctids tid[];
BEGIN
    -- in slot order, the completions' lock order
    FOREACH v_slot IN ARRAY ARRAY(SELECT DISTINCT u.slot FROM unnest(p_slots) AS u(slot) ORDER BY 1) LOOP
        SELECT array_agg(u.id), array_agg(u.ctid) INTO v_ids, v_ctids
          FROM unnest(p_ids, p_ctids, p_slots) AS u(id, ctid, slot)
         WHERE u.slot = v_slot;
        IF v_slot = 0 THEN
            RETURN QUERY SELECT * FROM outbox.lease_slot0(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes);
        ELSIF v_slot = 1 THEN
            RETURN QUERY SELECT * FROM outbox.lease_slot1(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes);
        ELSIF v_slot = 2 THEN
            RETURN QUERY SELECT * FROM outbox.lease_slot2(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes);
        ELSE
            RETURN QUERY SELECT * FROM outbox.lease_slot3(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes);
        END IF;
    END LOOP;
END;
$$;

COMMENT ON FUNCTION outbox.lease_candidates(uuid[], tid[], smallint[], text, integer, bigint) IS
    'Internal: leases a claim''s chosen rows slot by slot, in slot order.';
REVOKE ALL ON FUNCTION outbox.lease_candidates(uuid[], tid[], smallint[], text, integer, bigint) FROM PUBLIC;


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
    v_slots smallint[] := '{}';
    v_slot integer;
    v_ring integer[] := outbox.ring();
    v_probes timestamptz[];
    v_other boolean;
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
                v_probes := outbox.claim_probe_slots(v_shard, v_floors[v_shard + 1]);
                v_first := least(v_probes[1], v_probes[2], v_probes[3], v_probes[4]);
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
            IF v_pass = 2 THEN
                v_probes := outbox.claim_probe_slots(v_shard, v_floors[v_shard + 1]);
            END IF;
            -- The shard's candidates slot by slot, oldest first, in the slots it has work in.
            FOREACH v_slot IN ARRAY v_ring LOOP
                EXIT WHEN cardinality(v_ids) >= p_batch_size
                       OR (p_max_bytes IS NOT NULL AND v_bytes >= p_max_bytes);
                CONTINUE WHEN v_probes[v_slot + 1] IS NULL OR v_probes[v_slot + 1] > v_now;
                -- Keys are checked in the other slots only where the shard has entries.
                v_other := num_nonnulls(v_probes[1], v_probes[2], v_probes[3], v_probes[4]) > 1;
                IF v_slot = 0 THEN
                    SELECT v_ids || s.ids, v_ctids || s.ctids,
                           v_slots || array_fill(v_slot::smallint, ARRAY[cardinality(s.ids)]),
                           v_bytes + s.bytes
                      INTO v_ids, v_ctids, v_slots, v_bytes
                      FROM outbox.claim_shard_candidates_slot0(v_shard, v_floors[v_shard + 1], v_now,
                               p_batch_size - cardinality(v_ids), v_bytes, p_topics, p_exclude_topics,
                               p_max_bytes, p_max_message_bytes, v_other) AS s;
                ELSIF v_slot = 1 THEN
                    SELECT v_ids || s.ids, v_ctids || s.ctids,
                           v_slots || array_fill(v_slot::smallint, ARRAY[cardinality(s.ids)]),
                           v_bytes + s.bytes
                      INTO v_ids, v_ctids, v_slots, v_bytes
                      FROM outbox.claim_shard_candidates_slot1(v_shard, v_floors[v_shard + 1], v_now,
                               p_batch_size - cardinality(v_ids), v_bytes, p_topics, p_exclude_topics,
                               p_max_bytes, p_max_message_bytes, v_other) AS s;
                ELSIF v_slot = 2 THEN
                    SELECT v_ids || s.ids, v_ctids || s.ctids,
                           v_slots || array_fill(v_slot::smallint, ARRAY[cardinality(s.ids)]),
                           v_bytes + s.bytes
                      INTO v_ids, v_ctids, v_slots, v_bytes
                      FROM outbox.claim_shard_candidates_slot2(v_shard, v_floors[v_shard + 1], v_now,
                               p_batch_size - cardinality(v_ids), v_bytes, p_topics, p_exclude_topics,
                               p_max_bytes, p_max_message_bytes, v_other) AS s;
                ELSIF v_slot = 3 THEN
                    SELECT v_ids || s.ids, v_ctids || s.ctids,
                           v_slots || array_fill(v_slot::smallint, ARRAY[cardinality(s.ids)]),
                           v_bytes + s.bytes
                      INTO v_ids, v_ctids, v_slots, v_bytes
                      FROM outbox.claim_shard_candidates_slot3(v_shard, v_floors[v_shard + 1], v_now,
                               p_batch_size - cardinality(v_ids), v_bytes, p_topics, p_exclude_topics,
                               p_max_bytes, p_max_message_bytes, v_other) AS s;
                END IF;
            END LOOP;
            EXIT WHEN cardinality(v_ids) >= p_batch_size
                   OR (p_max_bytes IS NOT NULL AND v_bytes >= p_max_bytes);
        END LOOP;
    END LOOP;

    -- Nothing chosen: nothing to lease (and no UPDATE to plan).
    IF cardinality(v_ids) = 0 THEN
        RETURN;
    END IF;
    -- The lease, in each slot by tuple address.
    v_slot := v_slots[1];
    IF v_slot = ALL (v_slots) THEN
    IF v_slot = 0 THEN
        RETURN QUERY
        SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
               l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes, l.seq
          FROM outbox.lease_slot0(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes) AS l
         ORDER BY l.seq;
    ELSIF v_slot = 1 THEN
        RETURN QUERY
        SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
               l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes, l.seq
          FROM outbox.lease_slot1(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes) AS l
         ORDER BY l.seq;
    ELSIF v_slot = 2 THEN
        RETURN QUERY
        SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
               l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes, l.seq
          FROM outbox.lease_slot2(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes) AS l
         ORDER BY l.seq;
    ELSIF v_slot = 3 THEN
        RETURN QUERY
        SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
               l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes, l.seq
          FROM outbox.lease_slot3(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes) AS l
         ORDER BY l.seq;
    END IF;
    ELSE
        RETURN QUERY
        SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
               l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes, l.seq
          FROM outbox.lease_candidates(v_ids, v_ctids, v_slots, p_worker_id, p_lease_seconds,
                                       p_max_message_bytes) AS l
         ORDER BY l.seq;
    END IF;
END;
$$;


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
    v_slots smallint[] := '{}';
    v_slot integer;
    v_ring integer[] := outbox.ring();
    v_probes timestamptz[];
    v_other boolean;
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
                v_probes := outbox.claim_probe_slots(v_shard, v_floors[v_shard + 1]);
                v_first := least(v_probes[1], v_probes[2], v_probes[3], v_probes[4]);
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
            IF v_pass = 2 THEN
                v_probes := outbox.claim_probe_slots(v_shard, v_floors[v_shard + 1]);
            END IF;
            -- The shard's candidates slot by slot, oldest first, in the slots it has work in.
            FOREACH v_slot IN ARRAY v_ring LOOP
                EXIT WHEN cardinality(v_ids) >= p_batch_size
                       OR (p_max_bytes IS NOT NULL AND v_bytes >= p_max_bytes);
                CONTINUE WHEN v_probes[v_slot + 1] IS NULL OR v_probes[v_slot + 1] > v_now;
                -- Keys are checked in the other slots only where the shard has entries.
                v_other := num_nonnulls(v_probes[1], v_probes[2], v_probes[3], v_probes[4]) > 1;
                IF v_slot = 0 THEN
                    SELECT v_ids || s.ids, v_ctids || s.ctids,
                           v_slots || array_fill(v_slot::smallint, ARRAY[cardinality(s.ids)]),
                           v_bytes + s.bytes
                      INTO v_ids, v_ctids, v_slots, v_bytes
                      FROM outbox.claim_shard_candidates_slot0(v_shard, v_floors[v_shard + 1], v_now,
                               p_batch_size - cardinality(v_ids), v_bytes, p_topics, p_exclude_topics,
                               p_max_bytes, p_max_message_bytes, v_other) AS s;
                ELSIF v_slot = 1 THEN
                    SELECT v_ids || s.ids, v_ctids || s.ctids,
                           v_slots || array_fill(v_slot::smallint, ARRAY[cardinality(s.ids)]),
                           v_bytes + s.bytes
                      INTO v_ids, v_ctids, v_slots, v_bytes
                      FROM outbox.claim_shard_candidates_slot1(v_shard, v_floors[v_shard + 1], v_now,
                               p_batch_size - cardinality(v_ids), v_bytes, p_topics, p_exclude_topics,
                               p_max_bytes, p_max_message_bytes, v_other) AS s;
                ELSIF v_slot = 2 THEN
                    SELECT v_ids || s.ids, v_ctids || s.ctids,
                           v_slots || array_fill(v_slot::smallint, ARRAY[cardinality(s.ids)]),
                           v_bytes + s.bytes
                      INTO v_ids, v_ctids, v_slots, v_bytes
                      FROM outbox.claim_shard_candidates_slot2(v_shard, v_floors[v_shard + 1], v_now,
                               p_batch_size - cardinality(v_ids), v_bytes, p_topics, p_exclude_topics,
                               p_max_bytes, p_max_message_bytes, v_other) AS s;
                ELSIF v_slot = 3 THEN
                    SELECT v_ids || s.ids, v_ctids || s.ctids,
                           v_slots || array_fill(v_slot::smallint, ARRAY[cardinality(s.ids)]),
                           v_bytes + s.bytes
                      INTO v_ids, v_ctids, v_slots, v_bytes
                      FROM outbox.claim_shard_candidates_slot3(v_shard, v_floors[v_shard + 1], v_now,
                               p_batch_size - cardinality(v_ids), v_bytes, p_topics, p_exclude_topics,
                               p_max_bytes, p_max_message_bytes, v_other) AS s;
                END IF;
            END LOOP;
            EXIT WHEN cardinality(v_ids) >= p_batch_size
                   OR (p_max_bytes IS NOT NULL AND v_bytes >= p_max_bytes);
        END LOOP;
    END LOOP;

    -- Nothing chosen: nothing to lease (and no UPDATE to plan).
    IF cardinality(v_ids) = 0 THEN
        RETURN;
    END IF;
    -- The lease, in each slot by tuple address.
    v_slot := v_slots[1];
    IF v_slot = ALL (v_slots) THEN
    IF v_slot = 0 THEN
        RETURN QUERY
        SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
               l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes
          FROM outbox.lease_slot0(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes) AS l
         ORDER BY l.seq;
    ELSIF v_slot = 1 THEN
        RETURN QUERY
        SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
               l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes
          FROM outbox.lease_slot1(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes) AS l
         ORDER BY l.seq;
    ELSIF v_slot = 2 THEN
        RETURN QUERY
        SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
               l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes
          FROM outbox.lease_slot2(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes) AS l
         ORDER BY l.seq;
    ELSIF v_slot = 3 THEN
        RETURN QUERY
        SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
               l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes
          FROM outbox.lease_slot3(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes) AS l
         ORDER BY l.seq;
    END IF;
    ELSE
        RETURN QUERY
        SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
               l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes
          FROM outbox.lease_candidates(v_ids, v_ctids, v_slots, p_worker_id, p_lease_seconds,
                                       p_max_message_bytes) AS l
         ORDER BY l.seq;
    END IF;
END;
$$;


CREATE OR REPLACE FUNCTION outbox.lock_keys_slot0(p_outbox_ids uuid[]) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_hash integer;
BEGIN
    FOR v_hash IN
        SELECT DISTINCT hashtext(m.message_key)
          FROM unnest(p_outbox_ids) AS u(id)
         CROSS JOIN LATERAL (
                SELECT x.message_key
                  FROM outbox.messages_0 AS x
                 WHERE x.outbox_id = u.id
                 LIMIT 1) AS m
         WHERE m.message_key IS NOT NULL
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
        SELECT DISTINCT hashtext(m.message_key)
          FROM unnest(p_outbox_ids) AS u(id)
         CROSS JOIN LATERAL (
                SELECT x.message_key
                  FROM ((SELECT x0.message_key FROM outbox.messages_0 x0 WHERE x0.outbox_id = u.id)
                        UNION ALL
                        (SELECT x1.message_key FROM outbox.messages_1 x1 WHERE x1.outbox_id = u.id)
                        UNION ALL
                        (SELECT x2.message_key FROM outbox.messages_2 x2 WHERE x2.outbox_id = u.id)
                        UNION ALL
                        (SELECT x3.message_key FROM outbox.messages_3 x3 WHERE x3.outbox_id = u.id)) AS x
                 LIMIT 1) AS m
         WHERE m.message_key IS NOT NULL
         ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock(hashtext('outbox.key'), v_hash);
    END LOOP;
END;
$$;


-- outbox.promote_slot0 (internal): makes the listed messages of slot 0 that are still
-- behind heads, not before the given times; returns their keys.
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
    RETURNING m.message_key;
END;
$$;

COMMENT ON FUNCTION outbox.promote_slot0(uuid[], timestamptz[]) IS
    'Internal: promote_heads'' update in slot 0.';
REVOKE ALL ON FUNCTION outbox.promote_slot0(uuid[], timestamptz[]) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.promote_slot0(uuid[], timestamptz[])');


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
                          WHERE n0.message_key = k.key AND n0.seq > k.from_seq ORDER BY n0.seq LIMIT 1)
                        UNION ALL
                        (SELECT n1.outbox_id, n1.seq, n1.behind, n1.slot FROM outbox.messages_1 n1
                          WHERE n1.message_key = k.key AND n1.seq > k.from_seq ORDER BY n1.seq LIMIT 1)
                        UNION ALL
                        (SELECT n2.outbox_id, n2.seq, n2.behind, n2.slot FROM outbox.messages_2 n2
                          WHERE n2.message_key = k.key AND n2.seq > k.from_seq ORDER BY n2.seq LIMIT 1)
                        UNION ALL
                        (SELECT n3.outbox_id, n3.seq, n3.behind, n3.slot FROM outbox.messages_3 n3
                          WHERE n3.message_key = k.key AND n3.seq > k.from_seq ORDER BY n3.seq LIMIT 1)) AS a
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


-- The public completion: checks its arguments, then completes slot by slot.
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
        IF v_slot = 0 THEN
            RETURN QUERY SELECT * FROM outbox.complete_outbox_batch_slot0(p_worker_id, p_outbox_ids,
                             p_lease_tokens, p_states, p_errors, p_retry_ats);
        ELSIF v_slot = 1 THEN
            RETURN QUERY SELECT * FROM outbox.complete_outbox_batch_slot1(p_worker_id, p_outbox_ids,
                             p_lease_tokens, p_states, p_errors, p_retry_ats);
        ELSIF v_slot = 2 THEN
            RETURN QUERY SELECT * FROM outbox.complete_outbox_batch_slot2(p_worker_id, p_outbox_ids,
                             p_lease_tokens, p_states, p_errors, p_retry_ats);
        ELSIF v_slot = 3 THEN
            RETURN QUERY SELECT * FROM outbox.complete_outbox_batch_slot3(p_worker_id, p_outbox_ids,
                             p_lease_tokens, p_states, p_errors, p_retry_ats);
        END IF;
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
        IF v_slot = 0 THEN
            SELECT v_out_ids || array_agg(r.outbox_id), v_out_nos || array_agg(r.attempt_no),
                   v_out_lost || array_agg(r.lease_lost), v_out_dead || array_agg(r.dead_lettered)
              INTO v_out_ids, v_out_nos, v_out_lost, v_out_dead
              FROM outbox.complete_outbox_batch_slot0(p_worker_id, v_ids, v_tokens, v_states,
                                                      v_errors, v_retry_ats) AS r;
        ELSIF v_slot = 1 THEN
            SELECT v_out_ids || array_agg(r.outbox_id), v_out_nos || array_agg(r.attempt_no),
                   v_out_lost || array_agg(r.lease_lost), v_out_dead || array_agg(r.dead_lettered)
              INTO v_out_ids, v_out_nos, v_out_lost, v_out_dead
              FROM outbox.complete_outbox_batch_slot1(p_worker_id, v_ids, v_tokens, v_states,
                                                      v_errors, v_retry_ats) AS r;
        ELSIF v_slot = 2 THEN
            SELECT v_out_ids || array_agg(r.outbox_id), v_out_nos || array_agg(r.attempt_no),
                   v_out_lost || array_agg(r.lease_lost), v_out_dead || array_agg(r.dead_lettered)
              INTO v_out_ids, v_out_nos, v_out_lost, v_out_dead
              FROM outbox.complete_outbox_batch_slot2(p_worker_id, v_ids, v_tokens, v_states,
                                                      v_errors, v_retry_ats) AS r;
        ELSIF v_slot = 3 THEN
            SELECT v_out_ids || array_agg(r.outbox_id), v_out_nos || array_agg(r.attempt_no),
                   v_out_lost || array_agg(r.lease_lost), v_out_dead || array_agg(r.dead_lettered)
              INTO v_out_ids, v_out_nos, v_out_lost, v_out_dead
              FROM outbox.complete_outbox_batch_slot3(p_worker_id, v_ids, v_tokens, v_states,
                                                      v_errors, v_retry_ats) AS r;
        END IF;
    END LOOP;
    RETURN QUERY
    SELECT u.id, r.attempt_no, coalesce(r.lease_lost, true), coalesce(r.dead_lettered, false)
      FROM unnest(p_outbox_ids) WITH ORDINALITY AS u(id, ord)
      LEFT JOIN unnest(v_out_ids, v_out_nos, v_out_lost, v_out_dead) AS r(id, attempt_no, lease_lost, dead_lettered)
             ON r.id = u.id
     ORDER BY u.ord;
END;
$$;


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

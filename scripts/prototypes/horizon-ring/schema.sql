-- A prototype of insert-only outbox storage in a ring of partitions, to measure what a
-- held MVCC horizon does to it (docs/performance-history.md, "A ring of insert-only partitions:
-- a prototype"). Not the product's schema: schema/ is. It keeps what the measurement
-- needs of the product's hot path (per-message fenced leases, a completion record per
-- attempt, per-key first-delivery order, shards with turns, claim floors outside MVCC)
-- and leaves out what it does not (retries, dead letters, replay, observation, roles).
--
-- Storage: every table is partitioned by `part`, a ring of 4 partitions. Producers insert
-- into the current partition (ring.gen's value mod 4). Nothing is ever updated or deleted:
--   ring.ready   the messages, written once by the producer;
--   ring.leases  one row per claim of a message (its fence: token, worker, expiry);
--   ring.done    one row per completed message (the attempt log's terminal row), in the
--                partition of its message.
-- ring.rotate() moves producers to the next partition once the current one is old enough
-- and that partition is empty, and truncates a partition once every message in it is
-- done, under a short lock_timeout (a session that has the partition open keeps it).
-- While the horizon is held, nothing here leaves a dead row version: the claim's walk,
-- the fence and the key-head check read only live index entries.
DROP SCHEMA IF EXISTS ring CASCADE;
CREATE SCHEMA ring;

-- Enqueue order; a producer takes its transaction id before its first number (below).
CREATE SEQUENCE ring.seq AS bigint;
-- The current generation; its partition is gen % 4.
CREATE SEQUENCE ring.gen AS bigint MINVALUE 0 START 0;
-- When the current generation began (microseconds since the epoch).
CREATE SEQUENCE ring.gen_at AS bigint MINVALUE 0 START 0;

CREATE TABLE ring.ready (
    part         smallint    NOT NULL,
    seq          bigint      NOT NULL,
    shard        smallint    NOT NULL,
    topic        text        NOT NULL,
    message_key  text,
    payload      bytea       NOT NULL,
    available_at timestamptz NOT NULL DEFAULT clock_timestamp()
) PARTITION BY LIST (part);

CREATE TABLE ring.leases (
    part       smallint    NOT NULL,
    seq        bigint      NOT NULL,
    token      uuid        NOT NULL,
    worker     text        NOT NULL,
    expires_at timestamptz NOT NULL
) PARTITION BY LIST (part);

CREATE TABLE ring.done (
    part    smallint    NOT NULL,
    seq     bigint      NOT NULL,
    token   uuid        NOT NULL,
    done_at timestamptz NOT NULL DEFAULT clock_timestamp()
) PARTITION BY LIST (part);

DO $$
BEGIN
    FOR p IN 0 .. 3 LOOP
        EXECUTE format('CREATE TABLE ring.ready_%s PARTITION OF ring.ready FOR VALUES IN (%s)', p, p);
        EXECUTE format('CREATE TABLE ring.leases_%s PARTITION OF ring.leases FOR VALUES IN (%s)', p, p);
        EXECUTE format('CREATE TABLE ring.done_%s PARTITION OF ring.done FOR VALUES IN (%s)', p, p);
    END LOOP;
    FOR s IN 0 .. 15 LOOP
        EXECUTE format('CREATE SEQUENCE ring.floor_%s AS bigint MINVALUE 0 START 0', s);
    END LOOP;
END;
$$;

-- The claim's walk: a shard's entries in enqueue order.
CREATE INDEX ready_shard_seq_idx ON ring.ready (shard, seq);
-- The key-head check: the key's previous message.
CREATE INDEX ready_key_seq_idx ON ring.ready (message_key, seq) WHERE message_key IS NOT NULL;
-- The fence: a message's leases, newest last.
CREATE INDEX leases_seq_idx ON ring.leases (seq, expires_at);
-- Done at most once per message.
CREATE UNIQUE INDEX done_seq_idx ON ring.done (seq, part);

-- The floors' bound, as in schema/04_claim.sql but in seq numbers, and held back only by
-- producers: every producer that took a number at or below the bound has ended.
CREATE SEQUENCE ring.bound AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE ring.mark_seq AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE ring.mark_xid AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE ring.mark_at AS bigint MINVALUE 0 START 0;

-- enqueue: p_count messages of 256 bytes, p_keyed_pct percent of them keyed over 100 keys.
CREATE FUNCTION ring.enqueue(p_count integer, p_keyed_pct integer) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_part smallint;
BEGIN
    -- The transaction id first, so that every number taken later is above any bound whose
    -- mark was taken before this id (ring.bound_now).
    PERFORM pg_current_xact_id();
    v_part := (SELECT last_value FROM ring.gen) % 4;
    INSERT INTO ring.ready (part, seq, shard, topic, message_key, payload)
    SELECT v_part, q.seq, hashtext(coalesce(q.k, q.seq::text)) & 15, 'orders', q.k,
           convert_to(rpad('{"n":' || q.seq, 255, ' ') || '}', 'UTF8')
      FROM (SELECT nextval('ring.seq') AS seq,
                   CASE WHEN random() * 100 < p_keyed_pct
                        THEN 'key-' || (random() * 99)::int END AS k
              FROM generate_series(1, p_count)) AS q;
END;
$$;

-- The bound: moved up at most every 50 ms, to the seq of a mark once every transaction
-- id below the mark's has ended.
CREATE FUNCTION ring.bound_now() RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    v_now bigint := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
    v_bound bigint;
    v_at bigint;
    v_mseq bigint;
    v_xid bigint;
BEGIN
    SELECT b.last_value, a.last_value INTO v_bound, v_at FROM ring.bound b, ring.mark_at a;
    IF v_now - v_at >= 50000 AND pg_current_xact_id_if_assigned() IS NULL
       AND pg_try_advisory_xact_lock(hashtext('ring.bound')) THEN
        SELECT m.last_value, x.last_value INTO v_mseq, v_xid FROM ring.mark_seq m, ring.mark_xid x;
        -- Every producer that took a number below the mark holds the table's
        -- RowExclusiveLock (taken before its INSERT numbers a row) under an id below the
        -- mark's, until it ends. Other transactions, however old, do not hold the bound.
        IF v_at = 0 OR NOT EXISTS (
               SELECT 1
                 FROM pg_locks AS w
                 JOIN pg_locks AS x ON x.pid = w.pid AND x.locktype = 'transactionid'
                                   AND x.mode = 'ExclusiveLock'
                WHERE w.locktype = 'relation' AND w.relation = 'ring.ready'::regclass
                  AND w.mode = 'RowExclusiveLock'
                  AND x.transactionid::text::bigint < v_xid % 4294967296) THEN
            IF v_at > 0 AND v_mseq > v_bound THEN
                v_bound := v_mseq;
                PERFORM setval('ring.bound', v_bound);
            END IF;
            -- the mark: the numbers taken so far, then an id got after reading them
            PERFORM setval('ring.mark_seq', coalesce(pg_sequence_last_value('ring.seq'), 0));
            PERFORM setval('ring.mark_xid', pg_current_xact_id()::text::bigint);
            PERFORM setval('ring.mark_at', v_now);
        END IF;
    END IF;
    RETURN v_bound;
END;
$$;

-- claim: up to p_batch messages for p_worker, shard by shard from a random one, each
-- shard under its turn (an advisory lock tried without waiting). A message is a candidate
-- when it is due, not done, holds no unexpired lease, and (keyed) the key's previous
-- message is done. Returns the (seq, token) pairs leased, as text for pgbench's \gset.
CREATE FUNCTION ring.claim(p_batch integer, p_worker text, p_lease_seconds integer)
RETURNS text
LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET enable_mergejoin = off
SET enable_hashjoin = off
SET jit = off
AS $$
DECLARE
    v_start integer := floor(random() * 16)::integer;
    v_bound bigint := ring.bound_now();
    v_room integer := p_batch;
    v_out text[] := '{}';
    v_shard integer;
    v_floor bigint;
    v_first bigint;
    v_got text[];
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    FOR i IN 0 .. 15 LOOP
        EXIT WHEN v_room <= 0;
        v_shard := (v_start + i) % 16;
        CONTINUE WHEN NOT pg_try_advisory_xact_lock(hashtext('ring.turn'), v_shard);
        v_floor := pg_sequence_last_value(('ring.floor_' || v_shard)::regclass);
        v_floor := coalesce(v_floor, 0);
        -- raise the floor to the first entry not done, capped by the bound
        SELECT r.seq INTO v_first
          FROM ring.ready r
         WHERE r.shard = v_shard AND r.seq >= v_floor
           AND NOT EXISTS (SELECT 1 FROM ring.done d WHERE d.seq = r.seq AND d.part = r.part)
         ORDER BY r.seq LIMIT 1;
        IF least(coalesce(v_first, v_bound + 1), v_bound + 1) > v_floor THEN
            v_floor := least(coalesce(v_first, v_bound + 1), v_bound + 1);
            PERFORM setval(('ring.floor_' || v_shard)::regclass, v_floor);
        END IF;
        CONTINUE WHEN v_first IS NULL;
        WITH c AS (
            SELECT r.part, r.seq
              FROM ring.ready r
             WHERE r.shard = v_shard AND r.seq >= v_floor AND r.available_at <= now()
               AND NOT EXISTS (SELECT 1 FROM ring.done d WHERE d.seq = r.seq AND d.part = r.part)
               AND NOT EXISTS (SELECT 1 FROM ring.leases l
                                WHERE l.seq = r.seq AND l.part = r.part AND l.expires_at > now())
               AND (r.message_key IS NULL
                    OR NOT EXISTS (
                        SELECT 1
                          FROM (SELECT e.seq, e.part FROM ring.ready e
                                 WHERE e.message_key = r.message_key AND e.seq < r.seq
                                 ORDER BY e.seq DESC LIMIT 1) p
                         WHERE NOT EXISTS (SELECT 1 FROM ring.done d2
                                            WHERE d2.seq = p.seq AND d2.part = p.part)))
             ORDER BY r.seq
             LIMIT v_room),
        l AS (
            INSERT INTO ring.leases (part, seq, token, worker, expires_at)
            SELECT c.part, c.seq, gen_random_uuid(), p_worker,
                   now() + p_lease_seconds * interval '1 second'
              FROM c
            RETURNING leases.part, leases.seq, leases.token)
        SELECT array_agg(l.part || ':' || l.seq || ':' || l.token) INTO v_got FROM l;
        IF v_got IS NOT NULL THEN
            v_out := v_out || v_got;
            v_room := v_room - cardinality(v_got);
        END IF;
    END LOOP;
    RETURN array_to_string(v_out, ',');
END;
$$;

-- complete: records each (part:seq:token) whose token is the message's newest lease and
-- not expired; returns how many were recorded (the others lost their lease).
CREATE FUNCTION ring.complete(p_leases text) RETURNS integer
LANGUAGE plpgsql
SET plan_cache_mode = force_custom_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_mergejoin = off
SET enable_hashjoin = off
SET jit = off
AS $$
DECLARE
    v_n integer;
BEGIN
    IF p_leases IS NULL OR p_leases = '' THEN
        RETURN 0;
    END IF;
    PERFORM set_config('synchronous_commit', 'off', true);
    WITH x AS (
        SELECT split_part(t, ':', 1)::smallint AS part, split_part(t, ':', 2)::bigint AS seq,
               split_part(t, ':', 3)::uuid AS token
          FROM unnest(string_to_array(p_leases, ',')) AS t),
    ins AS (
        INSERT INTO ring.done (part, seq, token)
        SELECT x.part, x.seq, x.token
          FROM x
         WHERE EXISTS (SELECT 1 FROM ring.leases l
                        WHERE l.seq = x.seq AND l.part = x.part AND l.token = x.token
                          AND l.expires_at > now())
           AND NOT EXISTS (SELECT 1 FROM ring.leases n
                            WHERE n.seq = x.seq AND n.part = x.part AND n.token <> x.token
                              AND n.expires_at > (SELECT l2.expires_at FROM ring.leases l2
                                                   WHERE l2.seq = x.seq AND l2.part = x.part
                                                     AND l2.token = x.token))
        ON CONFLICT DO NOTHING
        RETURNING 1)
    SELECT count(*) INTO v_n FROM ins;
    RETURN v_n;
END;
$$;

-- rotate: moves producers to the next partition when the current one is at least
-- p_gen_seconds old and the next is empty; truncates each other partition whose messages
-- are all done, under a lock_timeout of 100 ms. Returns what it did, for the log.
CREATE FUNCTION ring.rotate(p_gen_seconds integer) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_gen bigint := (SELECT last_value FROM ring.gen);
    v_at bigint := (SELECT last_value FROM ring.gen_at);
    v_now bigint := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
    v_did text := '';
    v_part integer;
    v_open bigint;
BEGIN
    PERFORM set_config('lock_timeout', '100ms', true);
    FOR k IN 1 .. 3 LOOP
        v_part := (v_gen + k) % 4;
        -- not done: a message of the partition with no done row (the partition's own)
        EXECUTE format('SELECT count(*) FROM ring.ready_%s r WHERE NOT EXISTS '
                       '(SELECT 1 FROM ring.done_%s d WHERE d.seq = r.seq)', v_part, v_part)
           INTO v_open;
        IF v_open = 0 AND EXISTS (SELECT 1 FROM ring.ready WHERE part = v_part) THEN
            BEGIN
                EXECUTE format('LOCK TABLE ring.ready_%s, ring.leases_%s, ring.done_%s IN ACCESS EXCLUSIVE MODE',
                               v_part, v_part, v_part);
                -- under the lock no producer is writing it: count again
                EXECUTE format('SELECT count(*) FROM ring.ready_%s r WHERE NOT EXISTS '
                               '(SELECT 1 FROM ring.done_%s d WHERE d.seq = r.seq)', v_part, v_part)
                   INTO v_open;
                IF v_open = 0 THEN
                    EXECUTE format('TRUNCATE ring.ready_%s, ring.leases_%s, ring.done_%s', v_part, v_part, v_part);
                    v_did := v_did || ' truncated ' || v_part;
                END IF;
            EXCEPTION WHEN lock_not_available THEN
                v_did := v_did || ' busy ' || v_part;
            END;
        END IF;
    END LOOP;
    IF v_now - v_at >= p_gen_seconds * 1000000 THEN
        v_part := (v_gen + 1) % 4;
        IF NOT EXISTS (SELECT 1 FROM ring.ready WHERE part = v_part) THEN
            PERFORM nextval('ring.gen');
            PERFORM setval('ring.gen_at', v_now);
            v_did := v_did || ' moved to ' || v_part;
        ELSE
            v_did := v_did || ' ring full';
        END IF;
    END IF;
    RETURN v_did;
END;
$$;

-- Observation: what an operator, a dashboard and the relayers read to know the outbox's
-- state, and the schema version check.
--
-- Objects:
--
--   status, in_flight, topic_lag, worker_activity, recent_failures, attempt_rates (views)
--       copy-paste queries for psql (README, "Watching it: the views"); SELECT for
--       outbox_reader and outbox_relay. Each is computed when read, by the reader.
--   observe(p_top_topics, p_max_age)
--       the fleet gauges and the MVCC watchdog as one jsonb snapshot, computed by one
--       caller at a time and shared by all; EXECUTE for outbox_relay (every relayer, every
--       --observe-interval-secs, and `outbox-relay status`) and outbox_reader.
--   observation(p_top_topics)
--       internal: computes that snapshot; called by observe only, granted to no role.
--   count_attempt_minutes(p_now)
--       internal: counts the whole minutes of the last hour not counted yet into
--       outbox.attempt_minutes; called by observe only, granted to no role.
--   latest_observation()
--       the stored snapshot as it is, never computed; EXECUTE for outbox_reader and
--       outbox_relay (the console's pages).
--   observed_attempt_rates()
--       delivered and not delivered attempts per whole minute of the last hour, as the
--       refreshes counted them; EXECUTE for outbox_reader and outbox_relay (the console).
--   schema_version()
--       the version of the newest applied migration; EXECUTE for all three roles (every
--       verb and /readyz of the relayer compare it with the version the build needs).
--   circuits (view)
--       each destination's circuit state as each relayer last reported it, stale reports
--       marked; SELECT for outbox_reader and outbox_relay (`outbox-relay status`).
--   report_circuits(p_worker_id, p_destinations, p_states, p_since, p_ttl)
--       a relayer's circuit states, written when one changes and renewed before they
--       expire; EXECUTE for outbox_relay.
--   report_coverage(p_worker_id, p_include_topics, p_topics, p_ttl, p_route_patterns,
--                   p_route_destinations)
--       the topics a relayer claims and its routes' destinations, written at its start
--       and renewed before it expires; EXECUTE for outbox_relay.
--   uncovered_topics(p_older_than)
--       the topics with messages ready for longer than p_older_than that no running
--       relayer claims, and the keys held behind them; EXECUTE for outbox_reader and
--       outbox_relay.
--   stalled_topics(p_older_than)
--       those topics and the topics every relayer claiming them leaves unclaimed behind an
--       open circuit, naming the cause and the keys held behind them; EXECUTE for
--       outbox_reader and outbox_relay (each relayer's observer, `outbox-relay status`).
--
-- Conventions shared by all of them:
-- * Views read the tables with the view owner's rights, and the functions are SECURITY
--   DEFINER with search_path pg_catalog, pg_temp: readers hold no right on any table.
-- * Everything here only reads the outbox's tables and takes no row lock on them; observe
--   alone writes, to its own table outbox.observations, under the 'observe' turn, and
--   report_circuits to its own table outbox.circuit_reports, and report_coverage to
--   outbox.coverage_reports.
-- * Figures are as of one moment: now() (the reader's transaction start) in the views,
--   clock_timestamp() at the start of the computation in the snapshot.
-- * Message states, the same in every view and in the snapshot: ready (unleased,
--   available_at <= now), delayed (unleased, available_at later: delays, retry backoff,
--   and messages parked with available_at 'infinity'), in flight (leased, lease running),
--   expired lease (leased, lease ran out; the next repair pass requeues it).
-- * A view or snapshot part that counts pending messages reads outbox.messages whole (a
--   sequential scan: the lease columns are in no index), so its cost grows with the
--   backlog; parts over the attempt log read a time range of attempts_created_at_idx or
--   attempts_failures_idx, so their cost follows the attempts in range.
-- * schema_version() is bound, when this file is loaded, to refinery's history table
--   public.refinery_schema_history, which must exist then (refinery creates it before its
--   first migration).

-- outbox.status: one row, the state of the whole outbox now: ready, delayed, in_flight,
-- expired_leases (counts of pending messages in each state, see the header), dead_letters
-- (rows of outbox.dead_letters), oldest_ready_age (now() minus the oldest available_at of
-- a ready message: how long it has been claimable; NULL when none is ready). Reads
-- outbox.messages and outbox.dead_letters whole: about as costly as observe's computation,
-- paid by each reader.
CREATE VIEW outbox.status AS
SELECT count(*) FILTER (WHERE m.lease_token IS NULL AND m.available_at <= now())   AS ready,
       count(*) FILTER (WHERE m.lease_token IS NULL AND m.available_at > now())    AS delayed,
       count(*) FILTER (WHERE m.lease_expires_at > now())                          AS in_flight,
       count(*) FILTER (WHERE m.lease_expires_at <= now())                         AS expired_leases,
       (SELECT count(*) FROM outbox.dead_letters)                                  AS dead_letters,
       now() - min(m.available_at) FILTER (WHERE m.lease_token IS NULL
                                            AND m.available_at <= now())           AS oldest_ready_age
  FROM outbox.messages AS m;

COMMENT ON VIEW outbox.status IS
    'One row: pending messages ready, delayed, in flight and with an expired lease, dead letters, and the age of the oldest ready message; reads outbox.messages whole.';

REVOKE ALL ON outbox.status FROM PUBLIC;
GRANT SELECT ON outbox.status TO outbox_reader, outbox_relay;

-- outbox.in_flight: every leased message: outbox_id, topic, message_key, claimed_by (the
-- worker id), lease_token, lease_expires_at, expired (the lease ran out), attempt_no (the
-- attempt in progress, attempt_count + 1), created_at. Reads outbox.messages whole (the
-- lease columns are in no index).
CREATE VIEW outbox.in_flight AS
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

COMMENT ON VIEW outbox.in_flight IS
    'Every leased message: who holds it (claimed_by), with which token, until when, whether the lease expired, and the attempt in progress.';

REVOKE ALL ON outbox.in_flight FROM PUBLIC;
GRANT SELECT ON outbox.in_flight TO outbox_reader, outbox_relay;

-- outbox.topic_lag: one row per topic with pending messages or dead letters: ready,
-- delayed, in_flight (every leased message, expired or not), dead_letters, and lag (now()
-- minus the created_at of the topic's oldest pending message, whatever its state; NULL when
-- only dead letters remain). Reads outbox.messages and outbox.dead_letters whole.
CREATE VIEW outbox.topic_lag AS
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

COMMENT ON VIEW outbox.topic_lag IS
    'Per topic: ready, delayed, leased and dead-lettered counts, and lag (age of the oldest pending message); reads outbox.messages and outbox.dead_letters whole.';

REVOKE ALL ON outbox.topic_lag FROM PUBLIC;
GRANT SELECT ON outbox.topic_lag TO outbox_reader, outbox_relay;

-- outbox.worker_activity: one row per worker id that holds a lease or recorded an attempt
-- in the last 5 minutes: leases_held and next_lease_expiry now; dispatched_5m, retried_5m,
-- failed_5m, zombie_requeues_5m (attempts of each state in the last 5 minutes; a
-- ZOMBIE_REQUEUE carries the id of the worker whose lease expired: a crashing or freezing
-- worker), last_attempt_at. Reads the last 5 minutes of attempts_created_at_idx and
-- outbox.messages whole.
CREATE VIEW outbox.worker_activity AS
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
CREATE VIEW outbox.recent_failures AS
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
CREATE VIEW outbox.attempt_rates AS
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

-- outbox.observation: computes the snapshot that observe stores and returns (its shape is
-- in observe's contract). Internal: called by observe only, under the 'observe' turn;
-- granted to no role. It reads outbox.messages once (one sequential pass grouped by
-- topic and by lease holder), outbox.dead_letters grouped by topic, the last minute of attempts_created_at_idx,
-- pg_stat_activity, pg_replication_slots, pg_prepared_xacts and pg_stat_user_tables; it
-- locks nothing and raises nothing. Topics beyond the p_top_topics largest backlogs (ties:
-- more dead letters, then name) are summed under the label 'other', so that metric labels
-- stay bounded; a topic really named 'other' shares that label. Sessions are seen with the
-- owner's rights: without superuser or pg_read_all_stats the owner does not see other
-- roles' sessions' snapshots and statements, and those holders are missing.
-- Shape: its cost grows with the backlog, about 0.37 s at 1,000,000 pending messages on
-- the 2-core test machine (1.7 s when nothing is cached), which is why observe computes it
-- once per interval for the whole fleet.
CREATE OR REPLACE FUNCTION outbox.observation(p_top_topics integer)
RETURNS jsonb
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
WITH clock AS (
    SELECT clock_timestamp() AS now
), scan AS (
    -- one pass over outbox.messages, grouped twice: by topic, and by lease holder
    SELECT GROUPING(m.topic) = 1 AS by_holder,
           m.topic,
           m.claimed_by,
           count(*) FILTER (WHERE m.lease_token IS NULL AND m.available_at <= c.now) AS ready,
           count(*) FILTER (WHERE m.lease_token IS NULL AND m.available_at > c.now)  AS delayed,
           count(*) FILTER (WHERE m.lease_expires_at > c.now)                        AS in_flight,
           count(*) FILTER (WHERE m.lease_expires_at <= c.now)                       AS expired_leases,
           min(m.available_at) FILTER (WHERE m.lease_token IS NULL
                                         AND m.available_at <= c.now)                AS oldest_ready_at,
           -- parked messages (available_at 'infinity') are delayed but never due
           min(m.available_at) FILTER (WHERE m.lease_token IS NULL
                                         AND m.available_at > c.now
                                         AND m.available_at < 'infinity')            AS next_due_at,
           min(m.lease_expires_at)                                                   AS next_lease_expiry
      FROM outbox.messages AS m, clock AS c
     GROUP BY GROUPING SETS ((m.topic), (m.claimed_by))
), pending AS (
    SELECT s.topic, s.ready, s.delayed, s.in_flight, s.expired_leases, s.oldest_ready_at,
           s.next_due_at
      FROM scan AS s
     WHERE NOT s.by_holder
), held AS (
    SELECT s.claimed_by AS worker_id,
           s.in_flight + s.expired_leases AS leases_held,
           s.next_lease_expiry
      FROM scan AS s
     WHERE s.by_holder AND s.claimed_by IS NOT NULL
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
), worker_attempts AS (
    -- attempts_created_at_idx (a B-tree) reads only the last minute of the attempt log
    SELECT a.worker_id, a.state::text AS state, count(*) AS attempts,
           max(a.created_at) AS last_attempt_at
      FROM outbox.attempts AS a, clock AS c
     WHERE a.created_at > c.now - interval '1 minute'
     GROUP BY a.worker_id, a.state
), attempts AS (
    SELECT w.state, sum(w.attempts)::bigint AS attempts
      FROM worker_attempts AS w
     GROUP BY w.state
), workers AS (
    -- the lease holders and the workers with attempts in the last minute, the 200 holding
    -- most leases (then the latest to record an attempt)
    SELECT coalesce(h.worker_id, r.worker_id) AS worker_id,
           coalesce(h.leases_held, 0)         AS leases_held,
           h.next_lease_expiry,
           coalesce(r.attempts, '{}')         AS attempts_last_minute,
           r.last_attempt_at
      FROM held AS h
      FULL JOIN (SELECT w.worker_id,
                        jsonb_object_agg(w.state, w.attempts) AS attempts,
                        max(w.last_attempt_at) AS last_attempt_at
                   FROM worker_attempts AS w
                  GROUP BY w.worker_id) AS r ON r.worker_id = h.worker_id
     ORDER BY 2 DESC, r.last_attempt_at DESC NULLS LAST, 1
     LIMIT 200
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
    'workers', coalesce((
        SELECT jsonb_agg(jsonb_build_object(
                   'worker_id', w.worker_id,
                   'leases_held', w.leases_held,
                   'next_lease_expiry', w.next_lease_expiry,
                   'attempts_last_minute', w.attempts_last_minute,
                   'last_attempt_at', w.last_attempt_at)
                   ORDER BY w.leases_held DESC, w.last_attempt_at DESC NULLS LAST, w.worker_id)
          FROM workers AS w), '[]'),
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
    'Internal (observe, under the ''observe'' turn): computes the observation snapshot (topics, lease holders, attempts in the last minute, MVCC horizon holders, outbox.messages tuples and vacuum); reads the whole backlog. Not granted.';

REVOKE ALL ON FUNCTION outbox.observation(integer) FROM PUBLIC;

-- outbox.count_attempt_minutes: internal; called by observe's refresh, under the 'observe'
-- turn, granted to no role. Counts the attempts of each whole minute of the hour before
-- p_now that ended at least 15 seconds before p_now (an attempt's created_at is the moment
-- of its insert, and a completion's transaction commits within that margin) and has no row
-- in outbox.attempt_minutes yet, one range of attempts_created_at_idx per minute, and
-- deletes the rows older than two hours. Locks the rows it writes; raises nothing.
CREATE OR REPLACE FUNCTION outbox.count_attempt_minutes(p_now timestamptz)
RETURNS void
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
INSERT INTO outbox.attempt_minutes AS t (minute, delivered, not_delivered)
SELECT m.minute, c.delivered, c.not_delivered
  FROM generate_series(date_trunc('minute', p_now) - interval '60 minutes',
                       date_trunc('minute', p_now - interval '15 seconds') - interval '1 minute',
                       interval '1 minute') AS m(minute)
 CROSS JOIN LATERAL (
       SELECT count(*) FILTER (WHERE a.state = 'DISPATCHED')  AS delivered,
              count(*) FILTER (WHERE a.state <> 'DISPATCHED') AS not_delivered
         FROM outbox.attempts AS a
        WHERE a.created_at >= m.minute
          AND a.created_at < m.minute + interval '1 minute') AS c
 WHERE NOT EXISTS (SELECT 1 FROM outbox.attempt_minutes AS x WHERE x.minute = m.minute)
ON CONFLICT (minute) DO NOTHING;

DELETE FROM outbox.attempt_minutes AS t WHERE t.minute < p_now - interval '2 hours';
$$;

COMMENT ON FUNCTION outbox.count_attempt_minutes(timestamptz) IS
    'Internal (observe''s refresh): counts the attempts of each whole minute of the last hour not counted yet into attempt_minutes. Not granted.';

REVOKE ALL ON FUNCTION outbox.count_attempt_minutes(timestamptz) FROM PUBLIC;

-- outbox.latest_observation: the stored observation snapshot as it is, however old.
--
-- Inputs:     none.
-- Returns:    one row (observed_at, took_ms, snapshot) when a snapshot is stored: when its
--             computation started, how long it took, and the snapshot (its shape is in
--             observe's contract); no row when none is stored yet.
-- Locks:      nothing (a read; STABLE).
-- Guarantees: never computes: its cost is one row's read whatever the backlog, for a
--             reader that must answer at once (the console's pages) and asks observe for a
--             refresh apart, under a longer timeout, when the snapshot is too old.
-- Raises:     nothing.
-- Crash:      nothing: a read.
-- Shape:      one read of outbox.observations' single row.
CREATE OR REPLACE FUNCTION outbox.latest_observation()
RETURNS TABLE (observed_at timestamptz, took_ms double precision, snapshot jsonb)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
SELECT o.observed_at, o.took_ms, o.snapshot FROM outbox.observations AS o
$$;

COMMENT ON FUNCTION outbox.latest_observation() IS
    'The stored observation snapshot (observed_at, took_ms, snapshot) as it is, never computed; no row before the first refresh.';

REVOKE ALL ON FUNCTION outbox.latest_observation() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.latest_observation() TO outbox_reader, outbox_relay;

-- outbox.observed_attempt_rates: attempts per whole minute of the last hour, as the
-- refreshes of the observation counted them.
--
-- Inputs:     none.
-- Returns:    minute, delivered (DISPATCHED), not_delivered (RETRYABLE, FAILED,
--             ZOMBIE_REQUEUE), oldest minute first, for the minutes that began in the last
--             hour and have been counted; a minute no refresh counted (none ran for the
--             last hour) has no row.
-- Locks:      nothing (a read; STABLE).
-- Guarantees: the counts of attempt_rates for those minutes as of their counting (up to
--             attempts later pruned), at the cost of at most 60 rows, not of an hour of
--             attempts.
-- Raises:     nothing.
-- Crash:      nothing: a read.
-- Shape:      one range of attempt_minutes_pkey.
CREATE OR REPLACE FUNCTION outbox.observed_attempt_rates()
RETURNS TABLE (minute timestamptz, delivered bigint, not_delivered bigint)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
SELECT t.minute, t.delivered, t.not_delivered
  FROM outbox.attempt_minutes AS t
 WHERE t.minute >= now() - interval '1 hour'
 ORDER BY t.minute
$$;

COMMENT ON FUNCTION outbox.observed_attempt_rates() IS
    'Delivered and not delivered attempts per whole minute of the last hour, as observe''s refreshes counted them, oldest first.';

REVOKE ALL ON FUNCTION outbox.observed_attempt_rates() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.observed_attempt_rates() TO outbox_reader, outbox_relay;

-- outbox.observe: the latest observation snapshot, computed first when it is older than
-- p_max_age, by one caller of the fleet at a time.
--
-- Inputs:     p_top_topics  how many topics are named in the snapshot, largest backlog
--                           first; the rest are summed as 'other' (default 10; 1 to 1000)
--             p_max_age     a stored snapshot at most this old is returned as it is
--                           (default 15 seconds; at least interval '0'; 0 refreshes
--                           whenever the turn is free)
-- Returns:    one row (observed_at, refreshed, snapshot): when the snapshot's computation
--             started, whether this call computed it, and the snapshot. A caller that finds
--             the turn taken gets the stored snapshot, however old, at once; when none is
--             stored yet, a row with observed_at and snapshot NULL.
--             The snapshot (jsonb):
--               topics                [{topic, ready, delayed, in_flight, expired_leases,
--                                      dead_letters, oldest_ready_age_seconds, next_due_at
--                                      (when the first delayed message becomes ready; NULL
--                                      when none is delayed or all are parked at
--                                      'infinity')}], largest backlog first; at most
--                                     p_top_topics plus 'other'
--               attempts_last_minute  {state: attempts recorded in the last minute}
--               workers               [{worker_id, leases_held (leases it holds, expired
--                                      or not), next_lease_expiry, attempts_last_minute
--                                      ({state: its attempts in the last minute}),
--                                      last_attempt_at (its latest attempt within the last
--                                      minute)}]: every lease holder and every worker with
--                                     an attempt in the last minute, most leases first, at
--                                     most 200
--               horizon_holders       [{kind (session, replication slot, prepared
--                                      transaction), pid, name (application name, slot name
--                                      or gid), state, age_seconds, xid_age, query (the
--                                      statement's text, never its parameters, cut to 100
--                                      characters)}], oldest first: what holds back the
--                                     dead rows vacuum may remove from outbox.messages
--               messages_table        {live_tuples, dead_tuples, last_autovacuum,
--                                      last_vacuum}
-- Locks:      only when the stored snapshot is stale: the 'observe' row of outbox.turns,
--             FOR UPDATE SKIP LOCKED (never waits), held until the caller's transaction
--             ends, then the single row of outbox.observations and the rows of
--             outbox.attempt_minutes, written by the turn holder alone. No lock on the
--             outbox's other tables.
-- Guarantees: a refresh also counts, in outbox.attempt_minutes, each whole minute of the
--             last hour that ended 15 seconds or more before it and has no row yet (so each
--             minute is counted once by the fleet: the whole hour after a pause), and
--             deletes the minutes older than two hours (observed_attempt_rates reads them).
--             At most one computation runs at a time across the fleet, and callers within
--             p_max_age all get the same stored snapshot, so every relayer exports the same
--             figures (aggregate them with max, never sum). Under the turn the stored
--             snapshot is read again, so one just refreshed by the previous holder is not
--             computed twice. A stored snapshot is returned as computed, with the
--             p_top_topics of the caller that refreshed it.
-- Raises:     P7001 (p_top_topics) when it is NULL or outside 1..1000; P7001 (p_max_age)
--             when it is NULL or negative. 25006 when it must refresh inside a read-only
--             transaction (a standby).
-- Crash:      nothing: one transaction; until a refresh commits, callers get the previous
--             snapshot, and the turn is free again.
-- Shape:      the computation reads the whole backlog (see observation: about 0.37 s at
--             1,000,000 pending messages), so it is shared: paid once per interval by the
--             fleet instead of once per relayer and per `status` call. The minutes read one
--             minute's range of attempts_created_at_idx each, once per minute.
CREATE OR REPLACE FUNCTION outbox.observe(
    p_top_topics integer DEFAULT 10,
    p_max_age interval DEFAULT interval '15 seconds'
) RETURNS TABLE (observed_at timestamptz, refreshed boolean, snapshot jsonb)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_started timestamptz := clock_timestamp();
    v_latest outbox.observations;
    v_snapshot jsonb;
BEGIN
    IF p_top_topics IS NULL OR p_top_topics < 1 OR p_top_topics > 1000 THEN
        PERFORM outbox.invalid_argument('p_top_topics',
            format('must be between 1 and 1000, got %s', coalesce(p_top_topics::text, 'NULL')));
    END IF;
    IF p_max_age IS NULL OR p_max_age < interval '0' THEN
        PERFORM outbox.invalid_argument('p_max_age', 'must be a non-negative interval');
    END IF;

    SELECT * INTO v_latest FROM outbox.observations;
    IF v_latest.observed_at > v_started - p_max_age THEN
        RETURN QUERY SELECT v_latest.observed_at, false, v_latest.snapshot;
        RETURN;
    END IF;
    PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'observe' FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT v_latest.observed_at, false, v_latest.snapshot;
        RETURN;
    END IF;
    -- Under the turn: the previous holder may have refreshed since the first look.
    SELECT * INTO v_latest FROM outbox.observations;
    IF v_latest.observed_at > v_started - p_max_age THEN
        RETURN QUERY SELECT v_latest.observed_at, false, v_latest.snapshot;
        RETURN;
    END IF;

    v_snapshot := outbox.observation(p_top_topics);
    PERFORM outbox.count_attempt_minutes(v_started);
    INSERT INTO outbox.observations AS o (singleton, observed_at, took_ms, snapshot)
    VALUES (true, v_started,
            extract(epoch FROM clock_timestamp() - v_started) * 1000, v_snapshot)
    ON CONFLICT (singleton) DO UPDATE
        SET observed_at = excluded.observed_at,
            took_ms = excluded.took_ms,
            snapshot = excluded.snapshot;
    RETURN QUERY SELECT v_started, true, v_snapshot;
END;
$$;

COMMENT ON FUNCTION outbox.observe(integer, interval) IS
    'The fleet''s observation snapshot (backlog per topic, attempts last minute, MVCC horizon holders, vacuum of outbox.messages), recomputed by one caller at a time when older than p_max_age; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.observe(integer, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.observe(integer, interval) TO outbox_relay, outbox_reader;

-- outbox.schema_version: the version of the newest migration applied to this database.
--
-- Inputs:     none.
-- Returns:    max(version) of public.refinery_schema_history (integer; NULL when it holds
--             no row).
-- Locks:      nothing (a read; STABLE).
-- Guarantees: it reads refinery's history table with the owner's rights, so a login
--             holding only outbox_relay, outbox_producer or outbox_reader can ask. The body
--             is parsed when the function is created (BEGIN ATOMIC), which binds it to that
--             table whatever search_path a caller has. The relayer's verbs and /readyz
--             compare it with the version their build reaches, so that a database that was
--             never migrated, or is older than the binary, is reported by name ("schema
--             outbox is at version 4, this build needs 5") instead of failing later on a
--             missing function.
-- Raises:     nothing.
-- Crash:      nothing: a read.
-- Shape:      a SQL-standard body (Postgres 14 or later) instead of a string, so the table
--             is resolved once, at creation, and recorded as a dependency.
CREATE OR REPLACE FUNCTION outbox.schema_version() RETURNS integer
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT max(version) FROM public.refinery_schema_history;
END;

COMMENT ON FUNCTION outbox.schema_version() IS
    'Version of the newest applied migration; compared by the relayer with the version it needs.';

REVOKE ALL ON FUNCTION outbox.schema_version() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.schema_version() TO outbox_relay, outbox_producer, outbox_reader;


-- outbox.circuits: one row per (destination, worker) report of outbox.circuit_reports:
-- destination, state (closed, open or half-open), worker_id (the relayer that reported
-- it), since (when that relayer's circuit entered the state, by its clock), reported_at
-- (its latest report), expires_at, and stale (expires_at has passed: the relayer stopped
-- renewing its report; it stopped, or cannot reach the database). A relayer that stops
-- cleanly deletes its rows; stale rows are deleted an hour after they expire. Reads
-- outbox.circuit_reports whole: a few rows per relayer.
CREATE VIEW outbox.circuits AS
SELECT r.destination,
       r.state,
       r.worker_id,
       r.since,
       r.reported_at,
       r.expires_at,
       r.expires_at <= now() AS stale
  FROM outbox.circuit_reports AS r;

COMMENT ON VIEW outbox.circuits IS
    'Each destination''s circuit state (closed, open, half-open) as each relayer last reported it, since when, and whether the report is stale (not renewed before expires_at).';

REVOKE ALL ON outbox.circuits FROM PUBLIC;
GRANT SELECT ON outbox.circuits TO outbox_reader, outbox_relay;

-- outbox.report_circuits: one relayer's circuit state for each of its destinations.
--
-- Inputs:     p_worker_id     the relayer's worker id
--             p_destinations  every destination of the relayer, by name, each once (an
--                             empty array: the relayer has none, or is stopping)
--             p_states        the circuit of each: 'closed', 'open' or 'half-open'
--             p_since         when each circuit entered that state, by the relayer's clock
--             p_ttl           how long the reports hold without being renewed (more than 0)
--             (element i of p_destinations, p_states and p_since go together)
-- Returns:    nothing.
-- Locks:      the rows of outbox.circuit_reports of p_worker_id, and rows expired for more
--             than an hour that no other call holds (FOR UPDATE SKIP LOCKED, never waits).
--             No lock on the outbox's other tables.
-- Guarantees: afterwards the worker's rows are exactly p_destinations, with these states
--             and since, reported_at now() and expires_at now() + p_ttl; its rows for other
--             destinations are deleted. Rows of any worker expired for more than an hour are
--             deleted, so workers that stopped without a clean shutdown leave nothing
--             behind for long.
-- Raises:     P7001 (p_worker_id) when it is NULL or blank; P7001 (p_destinations) when it
--             is NULL, holds a NULL or empty name or a name twice; P7001 (p_states) when it
--             is NULL, of another length than p_destinations, or holds another value;
--             P7001 (p_since) when it is NULL, of another length, or holds a NULL; P7001
--             (p_ttl) when it is NULL or not positive.
-- Crash:      nothing: one transaction; the previous reports stand until it commits.
-- Shape:      the relayer calls it when a circuit changes state and to renew its reports
--             (a third of the way to their expiry), never per claim or batch: its writes
--             follow the destinations' health, not the traffic. The whole set in one call
--             keeps one relayer's rows consistent with each other.
CREATE OR REPLACE FUNCTION outbox.report_circuits(
    p_worker_id text,
    p_destinations text[],
    p_states text[],
    p_since timestamptz[],
    p_ttl interval
) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox.check_worker_id(p_worker_id);
    IF p_destinations IS NULL
       OR EXISTS (SELECT FROM unnest(p_destinations) AS d WHERE d IS NULL OR btrim(d) = '')
       OR cardinality(p_destinations)
          <> (SELECT count(DISTINCT d) FROM unnest(p_destinations) AS d) THEN
        PERFORM outbox.invalid_argument('p_destinations',
            'must be an array of distinct non-empty names');
    END IF;
    IF p_states IS NULL OR cardinality(p_states) <> cardinality(p_destinations)
       OR EXISTS (SELECT FROM unnest(p_states) AS s
                   WHERE s IS NULL OR s NOT IN ('closed', 'open', 'half-open')) THEN
        PERFORM outbox.invalid_argument('p_states',
            format('must hold closed, open or half-open for each of the %s destinations',
                   cardinality(p_destinations)));
    END IF;
    IF p_since IS NULL OR cardinality(p_since) <> cardinality(p_destinations)
       OR array_position(p_since, NULL) IS NOT NULL THEN
        PERFORM outbox.invalid_argument('p_since',
            format('must hold a time for each of the %s destinations',
                   cardinality(p_destinations)));
    END IF;
    IF p_ttl IS NULL OR p_ttl <= interval '0' THEN
        PERFORM outbox.invalid_argument('p_ttl', 'must be a positive interval');
    END IF;

    INSERT INTO outbox.circuit_reports AS r
           (worker_id, destination, state, since, reported_at, expires_at)
    SELECT p_worker_id, d.destination, d.state, d.since, now(), now() + p_ttl
      FROM unnest(p_destinations, p_states, p_since) AS d(destination, state, since)
    ON CONFLICT (worker_id, destination) DO UPDATE
        SET state = excluded.state,
            since = excluded.since,
            reported_at = excluded.reported_at,
            expires_at = excluded.expires_at;
    DELETE FROM outbox.circuit_reports AS r
     WHERE r.worker_id = p_worker_id
       AND r.destination <> ALL (p_destinations);
    -- SKIP LOCKED: two relayers cleaning up at once never wait for each other
    DELETE FROM outbox.circuit_reports AS r
     WHERE (r.worker_id, r.destination) IN (
               SELECT o.worker_id, o.destination
                 FROM outbox.circuit_reports AS o
                WHERE o.expires_at < now() - interval '1 hour'
                  FOR UPDATE SKIP LOCKED);
END;
$$;

COMMENT ON FUNCTION outbox.report_circuits(text, text[], text[], timestamptz[], interval) IS
    'A relayer''s circuit state per destination (closed, open, half-open) and since when, holding for p_ttl; replaces its earlier reports and deletes reports expired for an hour; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.report_circuits(text, text[], text[], timestamptz[], interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.report_circuits(text, text[], text[], timestamptz[], interval) TO outbox_relay;


-- outbox.report_coverage: the topics one relayer claims, and where its routes send them,
-- so that a topic no running relayer claims (uncovered_topics), or whose destination's
-- circuit is open in every relayer that claims it (stalled_topics), can be named.
--
-- Inputs:     p_worker_id           the relayer's worker id
--             p_include_topics      the claim's p_include_topics: LIKE patterns of the
--                                   topics its routes cover (NULL: every topic)
--             p_topics              the claim's p_topics: the exact topics it is limited
--                                   to (NULL: no limit)
--             p_ttl                 how long the report holds without being renewed; 0
--                                   withdraws it (a relayer that stops)
--             p_route_patterns      its routes' topics as LIKE patterns, in the
--                                   configuration's order (NULL: not reported)
--             p_route_destinations  the destination of each of those routes, by the name
--                                   its circuit is reported under (report_circuits); NULL
--                                   exactly when p_route_patterns is
-- Returns:    nothing.
-- Locks:      the row of outbox.coverage_reports of p_worker_id, and rows expired for more
--             than an hour that no other call holds (FOR UPDATE SKIP LOCKED, never waits).
-- Guarantees: afterwards the worker's row holds these topics and routes, reported_at now()
--             and expires_at now() + p_ttl (no row when p_ttl is 0). Rows of any worker
--             expired for more than an hour are deleted.
-- Raises:     P7001 (p_worker_id) when it is NULL or blank; P7001 (p_include_topics,
--             p_topics, p_route_patterns, p_route_destinations) when it holds a NULL;
--             P7001 (p_route_destinations) when exactly one of the two route arrays is
--             NULL or their lengths differ; P7001 (p_ttl) when it is NULL or negative.
-- Crash:      nothing: one transaction; the previous report stands until it commits.
-- Shape:      the relayer calls it at start and to renew its report (a third of the way to
--             its expiry), never per claim or batch.
CREATE OR REPLACE FUNCTION outbox.report_coverage(
    p_worker_id text,
    p_include_topics text[],
    p_topics text[],
    p_ttl interval,
    p_route_patterns text[] DEFAULT NULL,
    p_route_destinations text[] DEFAULT NULL
) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox.check_worker_id(p_worker_id);
    IF array_position(p_include_topics, NULL) IS NOT NULL THEN
        PERFORM outbox.invalid_argument('p_include_topics', 'must not hold a NULL pattern');
    END IF;
    IF array_position(p_topics, NULL) IS NOT NULL THEN
        PERFORM outbox.invalid_argument('p_topics', 'must not hold a NULL topic');
    END IF;
    IF array_position(p_route_patterns, NULL) IS NOT NULL THEN
        PERFORM outbox.invalid_argument('p_route_patterns', 'must not hold a NULL pattern');
    END IF;
    IF array_position(p_route_destinations, NULL) IS NOT NULL THEN
        PERFORM outbox.invalid_argument('p_route_destinations', 'must not hold a NULL destination');
    END IF;
    IF (p_route_patterns IS NULL) <> (p_route_destinations IS NULL)
       OR cardinality(p_route_patterns) IS DISTINCT FROM cardinality(p_route_destinations) THEN
        PERFORM outbox.invalid_argument('p_route_destinations',
            'must hold one destination for each of p_route_patterns (both NULL, or both of one length)');
    END IF;
    IF p_ttl IS NULL OR p_ttl < interval '0' THEN
        PERFORM outbox.invalid_argument('p_ttl', 'must be an interval of 0 or more');
    END IF;

    IF p_ttl = interval '0' THEN
        DELETE FROM outbox.coverage_reports AS r WHERE r.worker_id = p_worker_id;
    ELSE
        INSERT INTO outbox.coverage_reports AS r
               (worker_id, include_topics, topics, reported_at, expires_at,
                route_patterns, route_destinations)
        VALUES (p_worker_id, p_include_topics, p_topics, now(), now() + p_ttl,
                p_route_patterns, p_route_destinations)
        ON CONFLICT (worker_id) DO UPDATE
            SET include_topics = excluded.include_topics,
                topics = excluded.topics,
                reported_at = excluded.reported_at,
                expires_at = excluded.expires_at,
                route_patterns = excluded.route_patterns,
                route_destinations = excluded.route_destinations;
    END IF;
    -- SKIP LOCKED: two relayers cleaning up at once never wait for each other
    DELETE FROM outbox.coverage_reports AS r
     WHERE r.worker_id IN (
               SELECT o.worker_id
                 FROM outbox.coverage_reports AS o
                WHERE o.expires_at < now() - interval '1 hour'
                  FOR UPDATE SKIP LOCKED);
END;
$$;

COMMENT ON FUNCTION outbox.report_coverage(text, text[], text[], interval, text[], text[]) IS
    'The topics a relayer claims (LIKE patterns of its routes, exact topics it is limited to) and its routes'' destinations, holding for p_ttl (0 withdraws it); deletes reports expired for an hour; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.report_coverage(text, text[], text[], interval, text[], text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.report_coverage(text, text[], text[], interval, text[], text[]) TO outbox_relay;


-- outbox.uncovered_topics: the topics whose ready messages no running relayer claims.
--
-- Inputs:     p_older_than  how long a message must have been ready (available_at at least
--                           this long ago) to count; 0 or more.
-- Returns:    one row per topic that has messages ready (unleased, available_at at or
--             before now() - p_older_than) and that no unexpired report of
--             outbox.coverage_reports covers (a report covers a topic when its topics is
--             NULL or holds it, and its include_topics is NULL or has a pattern it is LIKE):
--             topic; ready (those messages); oldest_ready_age (now() minus the oldest
--             available_at of them); held_keys (keys that have a message of this topic
--             pending before a message of another topic: by per-key order, those messages
--             wait for this topic's to be delivered or dead-lettered); held_topics (the
--             other topics those messages are on, sorted). Oldest first.
-- Locks:      nothing (reads only).
-- Guarantees: a topic claimed by a relayer that reports (this release's relayers, through
--             report_coverage) is not returned while its report holds. A relayer that does
--             not report (a release before it) is not seen: during a rolling upgrade its
--             topics may be returned.
-- Raises:     P7001 (p_older_than) when it is NULL or negative.
-- Shape:      the rows of stalled_topics(p_older_than) whose cause is 'uncovered', oldest
--             first: one sequential scan of outbox.messages, and one more for each returned
--             topic's keyed messages (stalled_topics has the whole shape). Kept for psql
--             and dashboards; the relayers and `outbox-relay status` call stalled_topics.
CREATE OR REPLACE FUNCTION outbox.uncovered_topics(p_older_than interval)
RETURNS TABLE (
    topic text,
    ready bigint,
    oldest_ready_age interval,
    held_keys bigint,
    held_topics text[]
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- stalled_topics checks p_older_than (P7001 naming it)
    RETURN QUERY
    SELECT s.topic, s.ready, s.oldest_ready_age, s.held_keys, s.held_topics
      FROM outbox.stalled_topics(p_older_than) AS s
     WHERE s.cause = 'uncovered'
     ORDER BY s.oldest_ready_age DESC, s.topic;
END;
$$;

COMMENT ON FUNCTION outbox.uncovered_topics(interval) IS
    'Topics with messages ready for at least p_older_than that no running relayer''s coverage report covers: how many, the oldest''s age, and the keys whose messages on other topics wait behind them; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.uncovered_topics(interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.uncovered_topics(interval) TO outbox_reader, outbox_relay;


-- outbox.stalled_topics: the topics whose ready messages wait because no running relayer
-- claims them (uncovered) or because every running relayer that claims them leaves them
-- unclaimed while their destination's circuit is open (circuit_open), with the keys held
-- behind them on other topics: where a key's order spans the whole outbox (the default,
-- key_order_scope in 03_enqueue.sql), a key's later messages on any topic wait for these;
-- a message whose topic's key order is scoped per topic holds nothing on other topics.
--
-- Inputs:     p_older_than  how long a message must have been ready (available_at at least
--                           this long ago) to count; 0 or more.
-- Returns:    one row per such topic that has messages ready (unleased, available_at at or
--             before now() - p_older_than): topic; cause, 'uncovered' (no unexpired report
--             of outbox.coverage_reports covers it, as in uncovered_topics) or
--             'circuit_open' (at least one unexpired report covers it, and in each of them
--             the topic is LIKE a route pattern whose destination that relayer reports
--             open or half-open in outbox.circuit_reports, unexpired: the claim filter of
--             such a relayer leaves every such topic out); destinations (for
--             circuit_open, those destinations, sorted; empty for uncovered); ready (those
--             messages); oldest_ready_age (now() minus the oldest available_at of them);
--             held_keys (order keys that have a message of this topic pending before a
--             message of another topic: keys ordered across the whole outbox); held_topics (the other topics those messages are on,
--             sorted). Oldest first.
-- Locks:      nothing (reads only).
-- Guarantees: a topic is returned as circuit_open only while every relayer that reports
--             covering it reports an open or half-open circuit for its route of it; a
--             relayer that reports no routes (a release before them) never holds a topic
--             here, so during a rolling upgrade a topic may be missed, never named wrongly
--             as held by a circuit.
-- Raises:     P7001 (p_older_than) when it is NULL or negative.
-- Shape:      reads outbox.messages whole once (a sequential scan, as the observation
--             does), grouped by topic before the reports are checked, so the patterns are
--             matched once per topic, not per message; each returned topic's keyed
--             messages are read in one more scan, and the messages behind them probed
--             through messages_order_key_seq_idx. Called by each relayer's observer in place of
--             uncovered_topics, once per observe interval while the fleet's observation has
--             a message ready for longer than the bound, and by `outbox-relay status`.
CREATE OR REPLACE FUNCTION outbox.stalled_topics(p_older_than interval)
RETURNS TABLE (
    topic text,
    cause text,
    destinations text[],
    ready bigint,
    oldest_ready_age interval,
    held_keys bigint,
    held_topics text[]
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_older_than IS NULL OR p_older_than < interval '0' THEN
        PERFORM outbox.invalid_argument('p_older_than', 'must be an interval of 0 or more');
    END IF;
    RETURN QUERY
    WITH waiting AS (
        SELECT m.topic, count(*) AS ready, min(m.available_at) AS oldest
          FROM outbox.messages AS m
         WHERE m.lease_token IS NULL
           AND m.available_at <= now() - p_older_than
         GROUP BY m.topic
    ), covering AS (
        -- each unexpired report covering a waiting topic, with the destinations of its
        -- routes of that topic whose circuit it reports open or half-open
        SELECT w.topic, r.worker_id,
               (SELECT array_agg(DISTINCT d.destination)
                  FROM unnest(r.route_patterns, r.route_destinations) AS d (pattern, destination)
                  JOIN outbox.circuit_reports AS c
                    ON c.worker_id = r.worker_id
                   AND c.destination = d.destination
                   AND c.state IN ('open', 'half-open')
                   AND c.expires_at > now()
                 WHERE w.topic LIKE d.pattern) AS open_destinations
          FROM waiting AS w
          JOIN outbox.coverage_reports AS r
            ON r.expires_at > now()
           AND (r.topics IS NULL OR w.topic = ANY (r.topics))
           AND (r.include_topics IS NULL OR w.topic LIKE ANY (r.include_topics))
    ), stalled AS (
        SELECT w.topic, 'uncovered'::text AS cause, '{}'::text[] AS destinations,
               w.ready, w.oldest
          FROM waiting AS w
         WHERE NOT EXISTS (SELECT 1 FROM covering AS c WHERE c.topic = w.topic)
        UNION ALL
        SELECT w.topic, 'circuit_open', d.destinations, w.ready, w.oldest
          FROM waiting AS w
          JOIN LATERAL (
                   SELECT array_agg(DISTINCT o.destination ORDER BY o.destination) AS destinations,
                          bool_and(c.open_destinations IS NOT NULL) AS every_one
                     FROM covering AS c
                     LEFT JOIN LATERAL unnest(c.open_destinations) AS o (destination) ON true
                    WHERE c.topic = w.topic) AS d ON true
         WHERE d.every_one
    )
    SELECT s.topic, s.cause, s.destinations, s.ready, now() - s.oldest,
           coalesce(h.keys, 0),
           coalesce(h.topics, '{}')
      FROM stalled AS s
      LEFT JOIN LATERAL (
               SELECT count(DISTINCT m.order_key) AS keys,
                      array_agg(DISTINCT b.topic ORDER BY b.topic) AS topics
                 FROM outbox.messages AS m
                 JOIN outbox.messages AS b
                   ON b.order_key = m.order_key
                  AND b.seq > m.seq
                  AND b.topic <> m.topic
                WHERE m.topic = s.topic
                  AND m.order_key IS NOT NULL) AS h ON true
     ORDER BY s.oldest, s.topic;
END;
$$;

COMMENT ON FUNCTION outbox.stalled_topics(interval) IS
    'Topics with messages ready for at least p_older_than that wait because no running relayer claims them (uncovered) or every relayer claiming them has its destination''s circuit open (circuit_open, naming the destinations): how many, the oldest''s age, and the keys whose messages on other topics wait behind them; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.stalled_topics(interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.stalled_topics(interval) TO outbox_reader, outbox_relay;

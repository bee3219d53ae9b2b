-- The console reads the observation instead of the tables. Its overview read leases per
-- worker from outbox.worker_activity (a whole read of outbox.messages on every render) and
-- its chart from outbox.attempt_rates (an hour of attempts on every render): at 1,000,000
-- pending messages the overview took 1.4 s and the destinations page 0.6 s, and both grow
-- with the backlog and the attempt rate. The observation the fleet already computes once
-- per interval now also groups its one pass over outbox.messages by lease holder, and its
-- last minute of attempts by worker (snapshot key 'workers'); its refresh counts each
-- whole minute of attempts once into outbox.attempt_minutes (observed_attempt_rates); and
-- latest_observation returns the stored snapshot without ever computing it, so a page
-- costs the same at any backlog. And console_messages searches a filter that no id or key
-- bounds (a rare topic or state) among the 100,000 messages below its cursor only, instead
-- of walking the primary key until it has a page (up to the statement timeout at ten
-- million); console_window_end gives the next window's cursor. Contracts in full:
-- 01_tables.sql, 08_observation.sql, 11_console.sql.

-- outbox.attempt_minutes: the attempts of each whole minute of the last hour, delivered and
-- not, counted once by the refresh of the observation that first finds the minute over
-- (observe, under the 'observe' turn) and read by observed_attempt_rates. Rows older than
-- two hours are deleted by the same refresh. Owner only.
CREATE TABLE outbox.attempt_minutes (
    minute        timestamptz NOT NULL,
    -- attempts DISPATCHED in the minute
    delivered     bigint      NOT NULL,
    -- attempts RETRYABLE, FAILED or ZOMBIE_REQUEUE in the minute
    not_delivered bigint      NOT NULL,
    CONSTRAINT attempt_minutes_pkey PRIMARY KEY (minute)
);

COMMENT ON TABLE outbox.attempt_minutes IS
    'Attempts per whole minute of the last hour (delivered, not delivered), counted once by observe''s refresh; owner only.';

REVOKE ALL ON TABLE outbox.attempt_minutes FROM PUBLIC;

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

-- outbox.console_messages: a keyset page of pending messages, newest first, with the
-- console's filters.
--
-- Inputs:     p_id          this outbox_id only (NULL: any)
--             p_topic       this topic exactly (NULL: any)
--             p_key         this message_key exactly (NULL: any)
--             p_state       'ready', 'leased', 'waiting' (behind an earlier message of its
--                           key) or 'scheduled' (available_at later); NULL: any. The four are
--                           disjoint and cover every message: leased first, then waiting,
--                           then scheduled, else ready.
--             p_older_than  created at least this long ago (NULL: any age)
--             p_before      the keyset cursor: only outbox_ids smaller than this (NULL: from
--                           the newest)
--             p_limit       at most this many rows, 1 to 1001 (a page of up to 1000 and one
--                           more, to know that another page follows)
-- Returns:    outbox_id, topic, message_key, state (as p_state names it), created_at,
--             available_at, attempt_count, claimed_by, lease_expires_at, last_error;
--             outbox_id descending. No payload, headers or lease token.
-- Locks:      nothing (a read; STABLE).
-- Guarantees: the next page is the call with p_before = the last outbox_id returned; pages
--             neither repeat nor skip a message that stays pending between them. Without
--             p_id and p_key, a filter (topic, state, age) is looked for among the
--             console_search_window() (100,000) messages below p_before only: fewer than
--             p_limit rows means no more match in that window, and the search goes on with
--             p_before = console_window_end(p_before).
-- Raises:     P7001 (p_limit) when NULL or outside 1 to 1001; P7001 (p_state) when not one
--             of the four states; P7001 (p_older_than) when negative.
-- Crash:      nothing: a read.
-- Shape:      the statement is written with the filters given and planned for their values
--             at each call (EXECUTE ... USING), so that no optional filter leaves a generic
--             plan that reads outbox.messages whole: by primary key for p_id, through
--             messages_key_seq_idx for p_key (the key's own messages), otherwise walking
--             messages_pkey backwards from p_before and stopping at p_limit rows, or at the
--             end of the search window for a filter that few messages match (a rare topic or
--             state): at most 100,000 index entries and rows at any backlog.
CREATE OR REPLACE FUNCTION outbox.console_messages(
    p_id uuid,
    p_topic text,
    p_key text,
    p_state text,
    p_older_than interval,
    p_before uuid,
    p_limit integer
) RETURNS TABLE (
    outbox_id uuid,
    topic text,
    message_key text,
    state text,
    created_at timestamptz,
    available_at timestamptz,
    attempt_count integer,
    claimed_by text,
    lease_expires_at timestamptz,
    last_error text
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_where text := '';
    v_from text := 'outbox.messages AS m';
BEGIN
    IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 1001 THEN
        PERFORM outbox.invalid_argument('p_limit',
            format('must be between 1 and 1001, got %s', coalesce(p_limit::text, 'NULL')));
    END IF;
    IF p_state IS NOT NULL AND p_state NOT IN ('ready', 'leased', 'waiting', 'scheduled') THEN
        PERFORM outbox.invalid_argument('p_state',
            format('must be ready, leased, waiting or scheduled, got %L', p_state));
    END IF;
    IF p_older_than < interval '0' THEN
        PERFORM outbox.invalid_argument('p_older_than', 'must be an interval of 0 or more');
    END IF;
    IF p_id IS NOT NULL THEN
        v_where := v_where || ' AND m.outbox_id = $1';
    END IF;
    -- the messages searched: the search window below the cursor, unless an id or a key
    -- bounds them already
    IF p_id IS NULL AND p_key IS NULL
       AND (p_topic IS NOT NULL OR p_state IS NOT NULL OR p_older_than IS NOT NULL) THEN
        v_from := '(SELECT * FROM outbox.messages AS w'
                  || CASE WHEN p_before IS NOT NULL THEN ' WHERE w.outbox_id < $5' ELSE '' END
                  || ' ORDER BY w.outbox_id DESC LIMIT outbox.console_search_window()) AS m';
    END IF;
    IF p_topic IS NOT NULL THEN
        v_where := v_where || ' AND m.topic = $2';
    END IF;
    IF p_key IS NOT NULL THEN
        v_where := v_where || ' AND m.message_key = $3';
    END IF;
    IF p_older_than IS NOT NULL THEN
        v_where := v_where || ' AND m.created_at <= now() - $4';
    END IF;
    IF p_before IS NOT NULL THEN
        v_where := v_where || ' AND m.outbox_id < $5';
    END IF;
    v_where := v_where || CASE p_state
        WHEN 'leased' THEN ' AND m.lease_token IS NOT NULL'
        WHEN 'waiting' THEN ' AND m.lease_token IS NULL AND m.behind'
        WHEN 'scheduled' THEN
            ' AND m.lease_token IS NULL AND NOT m.behind AND m.available_at > now()'
        WHEN 'ready' THEN
            ' AND m.lease_token IS NULL AND NOT m.behind AND m.available_at <= now()'
        ELSE ''
    END;
    RETURN QUERY EXECUTE
        'SELECT m.outbox_id, m.topic, m.message_key,
                CASE WHEN m.lease_token IS NOT NULL THEN ''leased''
                     WHEN m.behind THEN ''waiting''
                     WHEN m.available_at > now() THEN ''scheduled''
                     ELSE ''ready'' END,
                m.created_at, m.available_at, m.attempt_count, m.claimed_by,
                m.lease_expires_at, m.last_error
           FROM ' || v_from || '
          WHERE true' || v_where || '
          ORDER BY m.outbox_id DESC
          LIMIT $6'
        USING p_id, p_topic, p_key, p_older_than, p_before, p_limit;
END;
$$;

COMMENT ON FUNCTION outbox.console_messages(uuid, text, text, text, interval, uuid, integer) IS
    'A keyset page (outbox_id descending, before p_before) of pending messages filtered by id, topic, key, state and age (each NULL: any), at most p_limit (1 to 1001) rows, without payloads; planned per call on an index; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.console_messages(uuid, text, text, text, interval, uuid, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.console_messages(uuid, text, text, text, interval, uuid, integer) TO outbox_reader, outbox_relay;

-- outbox.console_search_window: how many pending messages console_messages searches for a
-- filter that no id or key bounds, from its cursor: 100,000.
--
-- Inputs:     none.
-- Returns:    100000.
-- Locks:      nothing. Raises: nothing. Crash: nothing.
-- Shape:      a constant, written once for console_messages and console_window_end.
CREATE OR REPLACE FUNCTION outbox.console_search_window() RETURNS integer
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT 100000 $$;

COMMENT ON FUNCTION outbox.console_search_window() IS
    'How many pending messages console_messages searches below its cursor for a filter no id or key bounds (100,000).';

REVOKE ALL ON FUNCTION outbox.console_search_window() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.console_search_window() TO outbox_reader, outbox_relay;

-- outbox.console_window_end: where the search window of console_messages below p_before
-- ends: the cursor of the next window.
--
-- Inputs:     p_before  the cursor of the window (NULL: from the newest message)
-- Returns:    the outbox_id of the last of the console_search_window() pending messages
--             below p_before, newest first; NULL when fewer remain (the window reached the
--             oldest pending message).
-- Locks:      nothing (a read; STABLE).
-- Guarantees: console_messages with p_before = the result searches the messages just
--             older than the window it searched with p_before.
-- Raises:     nothing.
-- Crash:      nothing: a read.
-- Shape:      messages_pkey walked backwards from p_before, 100,000 entries (an index-only
--             scan where the visibility map allows), at any backlog.
CREATE OR REPLACE FUNCTION outbox.console_window_end(p_before uuid) RETURNS uuid
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_end uuid;
BEGIN
    EXECUTE
        'SELECT w.outbox_id FROM outbox.messages AS w'
        || CASE WHEN p_before IS NOT NULL THEN ' WHERE w.outbox_id < $1' ELSE '' END
        || ' ORDER BY w.outbox_id DESC OFFSET outbox.console_search_window() - 1 LIMIT 1'
        INTO v_end
        USING p_before;
    RETURN v_end;
END;
$$;

COMMENT ON FUNCTION outbox.console_window_end(uuid) IS
    'The last outbox_id of console_messages''s search window below p_before (the next window''s cursor); NULL when the window reaches the oldest pending message.';

REVOKE ALL ON FUNCTION outbox.console_window_end(uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.console_window_end(uuid) TO outbox_reader, outbox_relay;

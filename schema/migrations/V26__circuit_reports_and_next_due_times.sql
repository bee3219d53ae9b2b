-- Each relayer reports its destinations' circuit states (closed, open, half-open) to
-- outbox.circuit_reports through report_circuits, when a circuit changes state and to renew
-- the reports before they expire; the view outbox.circuits shows them, stale ones marked.
-- The observation snapshot gives each topic the time its first delayed message becomes
-- ready (next_due_at). Expand only: a new table, view and function, and observation's body
-- re-created with the same signature (its jsonb gains a key that earlier readers ignore).
-- The full contract of each object is in its area file (01_tables.sql, 08_observation.sql).

CREATE TABLE outbox.circuit_reports (
    worker_id   text        NOT NULL,
    destination text        NOT NULL,
    state       text        NOT NULL,
    -- when the circuit entered this state, by the relayer's clock
    since       timestamptz NOT NULL,
    -- when the relayer last reported it (the database's clock)
    reported_at timestamptz NOT NULL,
    -- after this the report is stale: the relayer did not renew it (stopped, or cut off)
    expires_at  timestamptz NOT NULL,
    CONSTRAINT circuit_reports_pkey PRIMARY KEY (worker_id, destination),
    CONSTRAINT circuit_reports_state CHECK (state IN ('closed', 'open', 'half-open'))
);

COMMENT ON TABLE outbox.circuit_reports IS
    'Each relayer''s circuit state per destination (closed, open, half-open), since when, and until when the report holds; written by report_circuits, read through outbox.circuits; owner only.';

REVOKE ALL ON TABLE outbox.circuit_reports FROM PUBLIC;


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
    SELECT s.n_live_tup, s.n_dead_tup, greatest(s.last_autovacuum, s.last_vacuum) AS last_vacuum,
           s.last_autovacuum
      FROM pg_stat_user_tables AS s
     WHERE s.relid = 'outbox.messages'::regclass
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

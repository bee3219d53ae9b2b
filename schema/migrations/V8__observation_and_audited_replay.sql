-- V8: what an operator watches and how they steer.
--
-- * outbox.observe: the fleet's gauges (backlog per topic, oldest ready age, dead letters,
--   attempts per state in the last minute) and an MVCC watchdog (who holds back the
--   horizon of outbox.messages, its dead tuples and last autovacuum), computed by one
--   caller at a time on the 'observe' turn and kept in outbox.observations, so that every
--   relayer of the fleet exports the same figures at the cost of one computation per
--   interval.
-- * Replays by filter, audited: outbox.dead_letters_matching is the one definition of the
--   dead-letter filter (topic, dead-lettered since, error text, ids) used to list, count and
--   replay; every replay writes a row to outbox.replays (who, when, why, the filter, how
--   many), readable through outbox.replay_log. A large replay runs in steps so that a
--   client can show progress, all steps adding to one audit row.

INSERT INTO outbox.turns (name) VALUES ('observe') ON CONFLICT (name) DO NOTHING;

COMMENT ON TABLE outbox.turns IS
    'Rows locked by claim_outbox_batch, repair_expired_leases and observe to take turns; owner only.';

-- The latest observation: a single row, replaced by each refresh.
CREATE TABLE outbox.observations (
    singleton   boolean          NOT NULL DEFAULT true,
    observed_at timestamptz      NOT NULL,
    -- how long computing the snapshot took (it is paid once per interval for the fleet)
    took_ms     double precision NOT NULL,
    snapshot    jsonb            NOT NULL,
    CONSTRAINT observations_pkey PRIMARY KEY (singleton),
    CONSTRAINT observations_single_row CHECK (singleton)
);
REVOKE ALL ON outbox.observations FROM PUBLIC;

-- observation: computes a snapshot (see observe for its shape). Internal: not granted.
--
-- Per topic it reads outbox.messages once (one sequential pass, grouped by topic), so its
-- cost grows with the backlog; at 1,000,000 pending messages it is a few hundred
-- milliseconds, paid by one process per interval. Topics beyond the p_top_topics largest
-- backlogs are summed under the label 'other' so that metric labels stay bounded.
CREATE FUNCTION outbox.observation(p_top_topics integer)
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
                                         AND m.available_at <= c.now)                AS oldest_ready_at
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
           p.oldest_ready_at
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
           min(r.oldest_ready_at)        AS oldest_ready_at
      FROM ranked AS r
     GROUP BY 1
), attempts AS (
    -- the attempt log is insert-ordered: its BRIN index finds the last minute cheaply
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
                       extract(epoch FROM c.now - l.oldest_ready_at)::float8)
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

-- observe: the latest observation, refreshed first when it is older than p_max_age.
-- One caller refreshes at a time (the 'observe' turn); a caller that finds the turn taken
-- does not wait: it gets the previous snapshot (no row's fields are set when there is none
-- yet). refreshed says whether this call computed the snapshot.
--
-- The snapshot (jsonb):
--   topics                 [{topic, ready, delayed, in_flight, expired_leases,
--                            dead_letters, oldest_ready_age_seconds}], largest backlog
--                          first; at most p_top_topics topics plus 'other'
--   attempts_last_minute   {state: attempts recorded in the last minute}
--   horizon_holders        [{kind (session, replication slot, prepared transaction), pid,
--                            name (application name, slot name or gid), state,
--                            age_seconds, xid_age, query}], oldest first
--   messages_table         {live_tuples, dead_tuples, last_autovacuum, last_vacuum}
CREATE FUNCTION outbox.observe(
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

-- dead_letters_matching: the dead letters a filter selects; each NULL argument matches
-- everything. p_error_contains matches the last error as text, ignoring case. The one
-- definition of the filter for listing, counting and replaying.
CREATE FUNCTION outbox.dead_letters_matching(
    p_outbox_ids uuid[] DEFAULT NULL,
    p_topic text DEFAULT NULL,
    p_since timestamptz DEFAULT NULL,
    p_error_contains text DEFAULT NULL
) RETURNS SETOF outbox.dead_letters
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
SELECT d.*
  FROM outbox.dead_letters AS d
 WHERE (p_outbox_ids IS NULL OR d.outbox_id = ANY (p_outbox_ids))
   AND (p_topic IS NULL OR d.topic = p_topic)
   AND (p_since IS NULL OR d.dead_lettered_at >= p_since)
   AND (p_error_contains IS NULL OR strpos(lower(d.last_error), lower(p_error_contains)) > 0)
$$;

-- The audit of replays: one row per replay, however many steps it ran in.
CREATE TABLE outbox.replays (
    replay_id   bigint      NOT NULL GENERATED ALWAYS AS IDENTITY,
    started_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- the login role that asked (session_user: the functions run as their owner)
    replayed_by text        NOT NULL DEFAULT session_user,
    reason      text,
    -- {outbox_ids, topic, since, error_contains}: what was asked for (NULL: anything)
    filter      jsonb       NOT NULL,
    -- only dead letters dead-lettered up to the start are replayed: a message that fails
    -- again while a long replay runs is not replayed a second time by it
    up_to       timestamptz NOT NULL DEFAULT clock_timestamp(),
    replayed    bigint      NOT NULL DEFAULT 0,
    finished_at timestamptz,
    CONSTRAINT replays_pkey PRIMARY KEY (replay_id)
);
REVOKE ALL ON outbox.replays FROM PUBLIC;

CREATE VIEW outbox.replay_log AS
SELECT r.replay_id, r.started_at, r.finished_at, r.replayed_by, r.reason, r.replayed, r.filter
  FROM outbox.replays AS r
 ORDER BY r.replay_id DESC;

-- start_replay: records a replay's audit row and returns its id; replay_step moves the
-- dead letters it selects. Nothing is moved yet.
CREATE FUNCTION outbox.start_replay(
    p_outbox_ids uuid[] DEFAULT NULL,
    p_topic text DEFAULT NULL,
    p_since timestamptz DEFAULT NULL,
    p_error_contains text DEFAULT NULL,
    p_reason text DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_id bigint;
BEGIN
    INSERT INTO outbox.replays (reason, filter)
    VALUES (nullif(btrim(p_reason), ''),
            jsonb_build_object('outbox_ids', to_jsonb(p_outbox_ids), 'topic', p_topic,
                               'since', p_since, 'error_contains', p_error_contains))
    RETURNING replay_id INTO v_id;
    RETURN v_id;
END;
$$;

-- replay_step: moves up to p_limit (NULL: all) of the dead letters selected by replay
-- p_replay_id's filter back into outbox.messages with a fresh attempt budget, oldest
-- message first, adds them to the audit row and returns how many moved; 0 means the replay
-- is done (finished_at is then set). As replay_dead_letters in V6: attempt numbers
-- continue, and a dead letter whose id is also pending is kept (with a warning). Steps of
-- concurrent replays skip each other's rows instead of waiting.
CREATE FUNCTION outbox.replay_step(p_replay_id bigint, p_limit integer DEFAULT NULL)
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
           b.created_at, now(), b.attempt_count, b.attempt_count, b.max_attempts, b.last_error
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

-- replay_dead_letters: as in V6 (ids and/or topic; neither: all), with the filters of
-- dead_letters_matching and a reason, in one step and audited. Calls with the V2 arguments
-- keep working.
DROP FUNCTION IF EXISTS outbox.replay_dead_letters(uuid[], text);
CREATE FUNCTION outbox.replay_dead_letters(
    p_outbox_ids uuid[] DEFAULT NULL,
    p_topic text DEFAULT NULL,
    p_since timestamptz DEFAULT NULL,
    p_error_contains text DEFAULT NULL,
    p_reason text DEFAULT NULL
) RETURNS integer
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
SELECT outbox.replay_step(
           outbox.start_replay(p_outbox_ids, p_topic, p_since, p_error_contains, p_reason),
           NULL)
$$;

REVOKE ALL ON FUNCTION
    outbox.observation(integer),
    outbox.observe(integer, interval),
    outbox.dead_letters_matching(uuid[], text, timestamptz, text),
    outbox.start_replay(uuid[], text, timestamptz, text, text),
    outbox.replay_step(bigint, integer),
    outbox.replay_dead_letters(uuid[], text, timestamptz, text, text)
    FROM PUBLIC;

GRANT EXECUTE ON FUNCTION outbox.observe(integer, interval) TO outbox_relay, outbox_reader;
GRANT EXECUTE ON FUNCTION
    outbox.dead_letters_matching(uuid[], text, timestamptz, text),
    outbox.start_replay(uuid[], text, timestamptz, text, text),
    outbox.replay_step(bigint, integer),
    outbox.replay_dead_letters(uuid[], text, timestamptz, text, text)
    TO outbox_relay;
GRANT SELECT ON outbox.replay_log TO outbox_reader, outbox_relay;

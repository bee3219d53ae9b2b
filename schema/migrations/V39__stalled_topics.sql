-- A topic held behind an open circuit is named as a topic no relayer claims is. Each
-- relayer's coverage report gains its routes (outbox.coverage_reports.route_patterns and
-- route_destinations, and report_coverage's trailing p_route_patterns and
-- p_route_destinations, default NULL), and the new outbox.stalled_topics names the topics
-- whose ready messages wait either because no running relayer claims them or because every
-- relayer claiming them leaves them out while their destination's circuit is open, with the
-- keys held behind them on other topics; uncovered_topics returns its rows of cause
-- 'uncovered' instead of computing them again. A signature that gains arguments is a new
-- function, and the old one beside it would make every call that leaves them out ambiguous:
-- report_coverage is dropped and created again, with its comment and grant; the previous
-- release's calls of four arguments resolve to it unchanged. Contracts in full:
-- 01_tables.sql and 08_observation.sql.

ALTER TABLE outbox.coverage_reports
    ADD COLUMN route_patterns text[],
    ADD COLUMN route_destinations text[],
    ADD CONSTRAINT coverage_reports_routes CHECK (
        (route_patterns IS NULL) = (route_destinations IS NULL)
        AND cardinality(route_patterns) IS NOT DISTINCT FROM cardinality(route_destinations));

COMMENT ON TABLE outbox.coverage_reports IS
    'The topics each running relayer claims (LIKE patterns of its routes, exact topics it is limited to), its routes'' destinations, and until when the report holds; written by report_coverage, read by uncovered_topics and stalled_topics; owner only.';

DROP FUNCTION outbox.report_coverage(text, text[], text[], interval);


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


-- outbox.stalled_topics: the topics whose ready messages wait because no running relayer
-- claims them (uncovered) or because every running relayer that claims them leaves them
-- unclaimed while their destination's circuit is open (circuit_open), with the keys held
-- behind them on other topics: per-key order is kept across the whole outbox, so a key's
-- later messages on any topic wait for these.
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
--             held_keys (keys that have a message of this topic pending before a message
--             of another topic); held_topics (the other topics those messages are on,
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
--             through messages_key_seq_idx. Called by each relayer's observer in place of
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
               SELECT count(DISTINCT m.message_key) AS keys,
                      array_agg(DISTINCT b.topic ORDER BY b.topic) AS topics
                 FROM outbox.messages AS m
                 JOIN outbox.messages AS b
                   ON b.message_key = m.message_key
                  AND b.seq > m.seq
                  AND b.topic <> m.topic
                WHERE m.topic = s.topic
                  AND m.message_key IS NOT NULL) AS h ON true
     ORDER BY s.oldest, s.topic;
END;
$$;

COMMENT ON FUNCTION outbox.stalled_topics(interval) IS
    'Topics with messages ready for at least p_older_than that wait because no running relayer claims them (uncovered) or every relayer claiming them has its destination''s circuit open (circuit_open, naming the destinations): how many, the oldest''s age, and the keys whose messages on other topics wait behind them; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.stalled_topics(interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.stalled_topics(interval) TO outbox_reader, outbox_relay;


-- outbox.uncovered_topics: the rows of stalled_topics whose cause is 'uncovered' (its
-- contract unchanged; the whole comment in 08_observation.sql).
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

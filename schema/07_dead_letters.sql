-- Dead letters and replay: finding the messages that were given up on, and moving them
-- back into the outbox, audited.
--
-- Objects, all for outbox_relay (the `outbox-relay dead-letters` and `replay` verbs, or an
-- operator's psql session with a login in that role); outbox_reader reads replay_log here,
-- and dead letters through the console's functions (11_console.sql):
--
--   dead_letters_matching(ids, topic, since, error_contains)   the dead letters a filter
--                                            selects: the one definition of the filter,
--                                            used to list, count, show and replay
--   start_replay(ids, topic, since, error_contains, reason)    records a replay's audit row
--                                            and returns its id; moves nothing
--   replay_step(replay_id, limit)            moves the next dead letters of that replay back
--                                            into outbox.messages; 0 when it is done
--   replay_dead_letters(ids, topic, since, error_contains, reason)   the two above in one
--                                            call and one transaction
--   replay_log (view)                        the audit rows, newest first
--
-- Conventions shared by all of them:
-- * SECURITY DEFINER with search_path pg_catalog, pg_temp: the caller holds no right on
--   outbox.dead_letters, outbox.replays or outbox.messages. An invalid argument raises
--   P7001 naming it.
-- * A filter argument that is NULL matches everything; the arguments combine with AND. All
--   NULL selects every dead letter.
-- * A replay is one row of outbox.replays (who, when, why, the filter, how many moved,
--   when it finished), however many steps it runs in. It belongs to the login that started
--   it (session_user: the functions run as their owner), and only that login can step it.
--   It moves only dead letters whose dead_lettered_at is at most its start (up_to), so a
--   message that fails again while a long replay runs is not replayed twice by it.
-- * A replayed message gets its dead letter's id, topic, key, payload, content type,
--   headers, created_at and last error, is ready at once (available_at = the clock), and gets
--   a fresh budget of max_attempts attempts (attempt_base = attempt_count): its attempt
--   numbers continue where they stopped, so the attempt log keeps one gapless history per
--   message. It joins the back of its key's queue (a new seq; behind a pending message of
--   its key). The relayers are woken (NOTIFY outbox_new, payload 'replayed') at commit.
-- * A dead letter whose id is also pending in outbox.messages (a message parked because
--   its id was reused) is never replayed: it is named in a WARNING and stays.

-- outbox.dead_letters_matching: the dead letters a filter selects, all columns (payload
-- included), in no particular order.
--
-- Inputs:     p_outbox_ids      these ids (NULL: any id; an empty array: none)
--             p_topic           this topic exactly (NULL: any)
--             p_since           dead_lettered_at >= p_since (NULL: any time)
--             p_error_contains  last_error contains this text, ignoring case (NULL: any;
--                               a dead letter without last_error never matches a text)
-- Returns:    SETOF outbox.dead_letters, unordered; the caller orders and limits.
-- Locks:      nothing (a read; STABLE).
-- Guarantees: listing, counting, showing and replaying select with this one definition, so
--             a dry run counts exactly what a replay with the same filter moves (up to the
--             dead letters added or removed in between).
-- Raises:     nothing.
-- Crash:      nothing: a read.
-- Shape:      SECURITY DEFINER with its own search_path, so it is never inlined into the
--             caller's query: a caller's WHERE, ORDER BY and LIMIT apply after the whole
--             selection is read. Its statement gets one generic plan, a sequential scan of
--             outbox.dead_letters whatever the arguments (the optional filters leave no index
--             condition): its cost follows the number of dead letters, which operators keep
--             small by replaying or deleting them.
CREATE OR REPLACE FUNCTION outbox.dead_letters_matching(
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

COMMENT ON FUNCTION outbox.dead_letters_matching(uuid[], text, timestamptz, text) IS
    'The dead letters selected by ids, topic, dead-lettered since, and error text (case-insensitive); each NULL matches all; the one filter used to list, count and replay.';

REVOKE ALL ON FUNCTION outbox.dead_letters_matching(uuid[], text, timestamptz, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.dead_letters_matching(uuid[], text, timestamptz, text) TO outbox_relay;

-- outbox.start_replay: records the audit row of a replay of what the filter selects and
-- returns its replay_id. Nothing moves until replay_step.
--
-- Inputs:     p_outbox_ids, p_topic, p_since, p_error_contains   the filter, as
--                               dead_letters_matching (each NULL: any), stored as jsonb
--                               {outbox_ids, topic, since, error_contains}
--             p_reason          why (free text for the audit; NULL or blank: none)
-- Returns:    the new replay_id (bigint).
-- Locks:      nothing beyond the audit row it inserts.
-- Guarantees: the row records session_user as replayed_by, and started_at and up_to as
--             the current clock time; only dead letters dead-lettered up to up_to are
--             moved by this replay. The row is visible to replay_step once the caller
--             commits (a step in another transaction needs that commit).
-- Raises:     nothing.
-- Crash:      nothing moved; if the caller commits and never steps, replay_log shows an
--             unfinished replay that moved 0.
-- Shape:      a replay is split into a start and steps so that a client can move a large
--             selection in short transactions and show progress, all steps adding to one
--             audit row.
CREATE OR REPLACE FUNCTION outbox.start_replay(
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

COMMENT ON FUNCTION outbox.start_replay(uuid[], text, timestamptz, text, text) IS
    'Records the audit row of a replay of the dead letters the filter selects (each NULL: any), dead-lettered up to now, with a reason; returns its replay_id; moves nothing (replay_step does).';

REVOKE ALL ON FUNCTION outbox.start_replay(uuid[], text, timestamptz, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.start_replay(uuid[], text, timestamptz, text, text) TO outbox_relay;

-- outbox.replay_step: moves up to p_limit more of replay p_replay_id's dead letters back
-- into outbox.messages, oldest message first, and returns how many moved.
--
-- Inputs:     p_replay_id   a replay started by this login (start_replay)
--             p_limit       the most dead letters moved by this step (default NULL: all
--                           that are left). When set, at least 1.
-- Returns:    the number moved (integer). The replay is finished (finished_at set) when a
--             step moves fewer than p_limit, or 0, or runs without a limit; a step of a
--             finished replay returns 0 and changes nothing.
-- Locks:      1. the replay's row of outbox.replays, FOR UPDATE: a second step of the same
--                replay waits for the first to end.
--             2. the dead letters it deletes: a dead letter that another replay is moving
--                is waited for, then skipped once that replay has moved it.
--             3. the messages it inserts; a keyed message's triggers lock the nearest
--                earlier message of its key FOR KEY SHARE SKIP LOCKED at commit.
-- Guarantees: it moves only dead letters that match the replay's filter, were
--             dead-lettered up to the replay's start, and whose id is not pending; they are
--             inserted in created_at, outbox_id order, so a key's replayed messages keep
--             their order among themselves. Each moved message is deleted from
--             outbox.dead_letters and inserted into outbox.messages in the same statement
--             (see the file header for what it gets), and the count is added to the audit
--             row in the same transaction.
-- Raises:     P7001 (p_limit) when it is below 1; P7001 (p_replay_id) when no such replay
--             exists, or when it belongs to another login. WARNING (not an error) naming
--             the matching dead letters kept because their id is pending. 23505 if a
--             message with a moved dead letter's id is inserted concurrently, between the
--             check and the move (enqueue refuses such ids, so only an insert by the owner);
--             the step then moves nothing.
-- Crash:      nothing: one transaction per step. Steps committed before stay moved and
--             counted; the replay can be resumed by the same login with more steps.
-- Shape:      each step reads the replay's whole selection twice through
--             dead_letters_matching (the pending-id check, then the pick, sorted by
--             created_at), so a step costs in proportion to the dead letters the filter
--             selects, not to p_limit; p_limit bounds the rows written and the transaction
--             (the CLI moves 1,000 per step). The pending-id check probes each slot's
--             primary key: enable_seqscan is off, so that a plan the session keeps, made
--             while a slot was empty, never reads that slot whole per dead letter once it
--             fills (01_tables.sql).
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

COMMENT ON FUNCTION outbox.replay_step(bigint, integer) IS
    'Moves up to p_limit (NULL: all) more of this login''s replay p_replay_id''s dead letters back to outbox.messages, oldest first, with a fresh attempt budget; returns how many (0: done); P7001 on a bad limit or replay id.';

REVOKE ALL ON FUNCTION outbox.replay_step(bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.replay_step(bigint, integer) TO outbox_relay;

-- outbox.replay_dead_letters: a whole replay in one call: start_replay, then one
-- replay_step without a limit.
--
-- Inputs:     p_outbox_ids, p_topic, p_since, p_error_contains, p_reason   as start_replay
--             (all NULL: every dead letter); a call that passes only ids and/or topic
--             selects by those alone.
-- Returns:    the number moved (integer).
-- Locks:      as start_replay and replay_step, all in the caller's transaction.
-- Guarantees: as replay_step; the audit row is written and finished in the same
--             transaction as the moves.
-- Raises:     WARNING naming the dead letters kept because their id is pending; 23505 as
--             replay_step (a concurrent insert of a moved id); nothing else.
-- Crash:      nothing: one transaction; if it does not commit, nothing moved and no audit
--             row remains.
-- Shape:      one transaction for the whole selection: for a large one, use start_replay
--             and replay_step with a limit (`outbox-relay replay --step`).
CREATE OR REPLACE FUNCTION outbox.replay_dead_letters(
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

COMMENT ON FUNCTION outbox.replay_dead_letters(uuid[], text, timestamptz, text, text) IS
    'Moves the dead letters the filter selects (all NULL: all) back to outbox.messages with a fresh attempt budget, in one transaction, audited in outbox.replays with p_reason; returns how many.';

REVOKE ALL ON FUNCTION outbox.replay_dead_letters(uuid[], text, timestamptz, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.replay_dead_letters(uuid[], text, timestamptz, text, text) TO outbox_relay;

-- outbox.replay_log: every replay, newest first: replay_id, started_at, finished_at (NULL
-- while steps remain, or if the client stopped), replayed_by (the login role), reason,
-- replayed (how many moved), filter ({outbox_ids, topic, since, error_contains}; null:
-- any). Reads outbox.replays with the view owner's rights; readable by outbox_reader and
-- outbox_relay. Cheap: one row per replay.
CREATE VIEW outbox.replay_log AS
SELECT r.replay_id, r.started_at, r.finished_at, r.replayed_by, r.reason, r.replayed, r.filter
  FROM outbox.replays AS r
 ORDER BY r.replay_id DESC;

COMMENT ON VIEW outbox.replay_log IS
    'Audit of dead-letter replays, newest first: who (login role), when, why, the filter, how many moved, when finished.';

REVOKE ALL ON outbox.replay_log FROM PUBLIC;
GRANT SELECT ON outbox.replay_log TO outbox_reader, outbox_relay;

-- Console reads: what the browser console (`outbox-relay console`, docs/console.md) reads of
-- the pending messages, their attempts and the dead letters, so that a login holding only
-- outbox_reader sees every screen.
--
-- Objects:
--   console_messages(p_id, p_topic, p_key, p_state, p_older_than, p_before, p_limit)
--       a keyset page of pending messages with the Messages screen's filters, a filter no
--       id or key bounds searched in a window of 100,000 messages
--   console_search_window()
--       that window's size
--   console_window_end(p_before)
--       where the window below p_before ends: the next window's cursor
--   console_message(p_id, p_with_payload)
--       one pending message in full, with its key's position
--   console_attempts(p_id, p_limit)
--       one message's attempt log
--   console_dead_letters(p_outbox_ids, p_topic, p_since, p_error_contains, p_before, p_limit)
--       a keyset page of dead letters, selected as dead_letters_matching selects them
--   console_dead_letter_count(p_outbox_ids, p_topic, p_since, p_error_contains)
--       how many dead letters that filter selects, counted up to 10001
--   console_dead_letter(p_id, p_with_payload)
--       one dead letter in full
--   console_dead_letter_condition(p_outbox_ids, p_topic, p_since, p_error_contains)
--       internal: the WHERE condition of the dead-letter filter; granted to no one
--
-- Conventions shared by all of them:
-- * SECURITY DEFINER with search_path pg_catalog, pg_temp; EXECUTE for outbox_reader and
--   outbox_relay. Their callers hold no right on outbox.messages, outbox.attempts or
--   outbox.dead_letters. Each only reads and takes no lock beyond a read's.
-- * Bounded: every list takes a limit the function checks (P7001 outside its range) and
--   is keyset-paginated on a primary key (p_before: the last outbox_id of the previous
--   page); the count stops at 10001 rows; a message's key position counts up to 10001. A
--   list whose filters have optional values is written with the filters given and planned
--   for their values at each call (EXECUTE ... USING), never as one generic plan of `p IS
--   NULL OR …` arms, which would read the table whole. The caller still sets a
--   statement_timeout (the console does), which bounds a filter that few rows match.
-- * Payloads are read only when asked (p_with_payload): the lists never return them, and
--   a console that hides payloads (--sensitive-payloads) passes false, so they never leave
--   the database; payload_bytes (their stored size, read without the value) is returned
--   either way.

-- outbox.console_dead_letter_condition (internal): the WHERE condition, over
-- outbox.dead_letters AS d, of the filter of dead_letters_matching with the filters given
-- only, naming them as the parameters $1 (p_outbox_ids), $2 (p_topic), $3 (p_since) and
-- $4 (p_error_contains) of the caller's EXECUTE. Called by console_dead_letters and
-- console_dead_letter_count; granted to no one.
--
-- Inputs:     which of the four filters are given (their values are not written into the
--             text: the caller passes them with USING)
-- Returns:    'true' followed by one ' AND …' per filter given.
-- Raises:     nothing.
-- Shape:      the condition of dead_letters_matching, without its `IS NULL OR` arms, so that
--             the planner sees only the filters given and can use dead_letters_pkey for the
--             ids and dead_letters_topic_idx for the topic.
CREATE OR REPLACE FUNCTION outbox.console_dead_letter_condition(
    p_outbox_ids uuid[],
    p_topic text,
    p_since timestamptz,
    p_error_contains text
) RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT 'true'
       || CASE WHEN p_outbox_ids IS NOT NULL THEN ' AND d.outbox_id = ANY ($1)' ELSE '' END
       || CASE WHEN p_topic IS NOT NULL THEN ' AND d.topic = $2' ELSE '' END
       || CASE WHEN p_since IS NOT NULL THEN ' AND d.dead_lettered_at >= $3' ELSE '' END
       || CASE WHEN p_error_contains IS NOT NULL
               THEN ' AND strpos(lower(d.last_error), lower($4)) > 0' ELSE '' END
$$;

COMMENT ON FUNCTION outbox.console_dead_letter_condition(uuid[], text, timestamptz, text) IS
    'Internal: the WHERE condition over outbox.dead_letters AS d of the dead-letter filters given, as parameters $1 to $4 of the caller''s EXECUTE. Not granted.';

REVOKE ALL ON FUNCTION outbox.console_dead_letter_condition(uuid[], text, timestamptz, text) FROM PUBLIC;

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
--             messages_order_key_seq_idx for p_key (the key's own messages), otherwise walking
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
        -- the key's order keys (itself, and itself, unit separator, topic for each topic
        -- scoped per topic) are one range of messages_order_key_seq_idx (C collation)
        v_where := v_where || ' AND m.order_key >= $3 AND m.order_key < ($3 || chr(32))'
                           || ' AND m.message_key = $3';
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

-- outbox.console_message: one pending message in full, with its key's position.
--
-- Inputs:     p_id            the outbox_id
--             p_with_payload  true: return the payload; false or NULL: payload is NULL and
--                             the payload is not read (payload_bytes is its stored size)
-- Returns:    no row when p_id is not pending; otherwise its columns as console_messages
--             returns them, then content_type, headers, payload, payload_bytes,
--             max_attempts, ahead (the messages it waits for: those of its order key with a
--             smaller seq, counted up to 10001; NULL without a key) and key_head (the
--             outbox_id of its order key's smallest seq, the one delivered next; NULL
--             without a key). Its order key is its key across the whole outbox, or on its
--             topic alone when enqueue scoped it so (01_tables.sql).
-- Locks:      nothing (a read; STABLE).
-- Guarantees: a caller that must not see payloads (the console's --sensitive-payloads)
--             passes false, and no payload leaves the database.
-- Raises:     nothing.
-- Crash:      nothing: a read.
-- Shape:      one primary-key probe of outbox.messages, and for a keyed message two ranges
--             of messages_order_key_seq_idx, the first stopped at 10001 rows.
CREATE OR REPLACE FUNCTION outbox.console_message(p_id uuid, p_with_payload boolean)
RETURNS TABLE (
    outbox_id uuid,
    topic text,
    message_key text,
    state text,
    created_at timestamptz,
    available_at timestamptz,
    attempt_count integer,
    claimed_by text,
    lease_expires_at timestamptz,
    last_error text,
    content_type text,
    headers jsonb,
    payload bytea,
    payload_bytes bigint,
    max_attempts integer,
    ahead bigint,
    key_head uuid
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
SELECT m.outbox_id, m.topic, m.message_key,
       CASE WHEN m.lease_token IS NOT NULL THEN 'leased'
            WHEN m.behind THEN 'waiting'
            WHEN m.available_at > now() THEN 'scheduled'
            ELSE 'ready' END,
       m.created_at, m.available_at, m.attempt_count, m.claimed_by, m.lease_expires_at,
       m.last_error, m.content_type, m.headers,
       CASE WHEN p_with_payload THEN m.payload END,
       octet_length(m.payload)::bigint,
       m.max_attempts,
       CASE WHEN m.order_key IS NOT NULL THEN
           (SELECT count(*)
              FROM (SELECT 1
                      FROM outbox.messages AS k
                     WHERE k.order_key = m.order_key
                       AND k.seq < m.seq
                     LIMIT 10001) AS ahead)
       END,
       (SELECT k.outbox_id
          FROM outbox.messages AS k
         WHERE k.order_key = m.order_key
         ORDER BY k.seq
         LIMIT 1)
  FROM outbox.messages AS m
 WHERE m.outbox_id = p_id
$$;

COMMENT ON FUNCTION outbox.console_message(uuid, boolean) IS
    'One pending message with its state, headers, payload only when p_with_payload (its size always), the messages of its key ahead of it (up to 10,001) and its key''s head; no row when not pending.';

REVOKE ALL ON FUNCTION outbox.console_message(uuid, boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.console_message(uuid, boolean) TO outbox_reader, outbox_relay;

-- outbox.console_attempts: the attempt log of one message, oldest first.
--
-- Inputs:     p_id     the outbox_id (pending, dead-lettered or delivered)
--             p_limit  at most this many attempts, 1 to 1000
-- Returns:    attempt_no, state (as text), worker_id, error, created_at; attempt_no
--             ascending. The attempts retention has not pruned yet.
-- Locks:      nothing (a read; STABLE).
-- Guarantees: nothing beyond the read.
-- Raises:     P7001 (p_limit) when NULL or outside 1 to 1000.
-- Crash:      nothing: a read.
-- Shape:      one range of each partition's primary key (outbox_id, attempt_no).
CREATE OR REPLACE FUNCTION outbox.console_attempts(p_id uuid, p_limit integer)
RETURNS TABLE (
    attempt_no integer,
    state text,
    worker_id text,
    error text,
    created_at timestamptz
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 1000 THEN
        PERFORM outbox.invalid_argument('p_limit',
            format('must be between 1 and 1000, got %s', coalesce(p_limit::text, 'NULL')));
    END IF;
    RETURN QUERY
    SELECT a.attempt_no, a.state::text, a.worker_id, a.error, a.created_at
      FROM outbox.attempts AS a
     WHERE a.outbox_id = p_id
     ORDER BY a.attempt_no
     LIMIT p_limit;
END;
$$;

COMMENT ON FUNCTION outbox.console_attempts(uuid, integer) IS
    'The attempts of one message (those retention kept), oldest first, at most p_limit (1 to 1000); P7001 on a bad limit.';

REVOKE ALL ON FUNCTION outbox.console_attempts(uuid, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.console_attempts(uuid, integer) TO outbox_reader, outbox_relay;

-- outbox.console_dead_letters: a keyset page of dead letters, newest outbox_id first,
-- selected as dead_letters_matching selects them.
--
-- Inputs:     p_outbox_ids, p_topic, p_since, p_error_contains   the filter of
--                           dead_letters_matching (07_dead_letters.sql; each NULL: any)
--             p_before      the keyset cursor: only outbox_ids smaller than this (NULL: from
--                           the newest)
--             p_limit       at most this many rows, 1 to 1001
-- Returns:    outbox_id, topic, message_key, dead_lettered_at, attempt_count, last_error;
--             outbox_id descending. No payload.
-- Locks:      nothing (a read; STABLE).
-- Guarantees: the filter selects what dead_letters_matching, and so a replay with the same
--             filter, selects; the next page is the call with p_before = the last id.
-- Raises:     P7001 (p_limit) when NULL or outside 1 to 1001.
-- Crash:      nothing: a read.
-- Shape:      planned per call with the filters given (EXECUTE ... USING): by primary key
--             for p_outbox_ids, otherwise walking dead_letters_pkey backwards from p_before
--             (or dead_letters_topic_idx for a rare topic), stopped at p_limit rows that
--             match. A filter that few dead letters match (an error text, a recent p_since)
--             walks further, up to the caller's statement_timeout.
CREATE OR REPLACE FUNCTION outbox.console_dead_letters(
    p_outbox_ids uuid[],
    p_topic text,
    p_since timestamptz,
    p_error_contains text,
    p_before uuid,
    p_limit integer
) RETURNS TABLE (
    outbox_id uuid,
    topic text,
    message_key text,
    dead_lettered_at timestamptz,
    attempt_count integer,
    last_error text
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 1001 THEN
        PERFORM outbox.invalid_argument('p_limit',
            format('must be between 1 and 1001, got %s', coalesce(p_limit::text, 'NULL')));
    END IF;
    RETURN QUERY EXECUTE
        'SELECT d.outbox_id, d.topic, d.message_key, d.dead_lettered_at, d.attempt_count,
                d.last_error
           FROM outbox.dead_letters AS d
          WHERE ' || outbox.console_dead_letter_condition(p_outbox_ids, p_topic, p_since,
                                                           p_error_contains)
               || CASE WHEN p_before IS NOT NULL THEN ' AND d.outbox_id < $5' ELSE '' END || '
          ORDER BY d.outbox_id DESC
          LIMIT $6'
        USING p_outbox_ids, p_topic, p_since, p_error_contains, p_before, p_limit;
END;
$$;

COMMENT ON FUNCTION outbox.console_dead_letters(uuid[], text, timestamptz, text, uuid, integer) IS
    'A keyset page (outbox_id descending, before p_before) of the dead letters dead_letters_matching selects, at most p_limit (1 to 1001) rows, without payloads; planned per call on an index; P7001 on a bad limit.';

REVOKE ALL ON FUNCTION outbox.console_dead_letters(uuid[], text, timestamptz, text, uuid, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.console_dead_letters(uuid[], text, timestamptz, text, uuid, integer) TO outbox_reader, outbox_relay;

-- outbox.console_dead_letter_count: how many dead letters a filter selects, counted up to
-- 10001.
--
-- Inputs:     p_outbox_ids, p_topic, p_since, p_error_contains   the filter of
--                           dead_letters_matching (each NULL: any)
-- Returns:    the count, at most 10001 (10001: more than 10000).
-- Locks:      nothing (a read; STABLE).
-- Guarantees: counts what console_dead_letters lists and a replay with the same filter
--             moves (up to the dead letters added or removed in between).
-- Raises:     nothing.
-- Crash:      nothing: a read.
-- Shape:      planned per call as console_dead_letters, stopped at the 10001st dead letter
--             that matches: a filter that few dead letters match reads the ones its index
--             does not exclude, up to the caller's statement_timeout.
CREATE OR REPLACE FUNCTION outbox.console_dead_letter_count(
    p_outbox_ids uuid[],
    p_topic text,
    p_since timestamptz,
    p_error_contains text
) RETURNS bigint
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_count bigint;
BEGIN
    EXECUTE
        'SELECT count(*)
           FROM (SELECT 1
                   FROM outbox.dead_letters AS d
                  WHERE ' || outbox.console_dead_letter_condition(p_outbox_ids, p_topic,
                                                                   p_since, p_error_contains)
                  || '
                  LIMIT 10001) AS capped'
        INTO v_count
        USING p_outbox_ids, p_topic, p_since, p_error_contains;
    RETURN v_count;
END;
$$;

COMMENT ON FUNCTION outbox.console_dead_letter_count(uuid[], text, timestamptz, text) IS
    'How many dead letters dead_letters_matching selects with this filter, counted up to 10,001 (10,001: more than 10,000).';

REVOKE ALL ON FUNCTION outbox.console_dead_letter_count(uuid[], text, timestamptz, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.console_dead_letter_count(uuid[], text, timestamptz, text) TO outbox_reader, outbox_relay;

-- outbox.console_dead_letter: one dead letter in full.
--
-- Inputs:     p_id            the outbox_id
--             p_with_payload  true: return the payload; false or NULL: payload is NULL and
--                             the payload is not read (payload_bytes is its stored size)
-- Returns:    no row when p_id is not a dead letter; otherwise outbox_id, topic,
--             message_key, content_type, headers, payload, payload_bytes, created_at,
--             dead_lettered_at, attempt_count, max_attempts, last_error.
-- Locks:      nothing (a read; STABLE).
-- Guarantees: as console_message: false leaves the payload in the database.
-- Raises:     nothing.
-- Crash:      nothing: a read.
-- Shape:      one probe of dead_letters_pkey.
CREATE OR REPLACE FUNCTION outbox.console_dead_letter(p_id uuid, p_with_payload boolean)
RETURNS TABLE (
    outbox_id uuid,
    topic text,
    message_key text,
    content_type text,
    headers jsonb,
    payload bytea,
    payload_bytes bigint,
    created_at timestamptz,
    dead_lettered_at timestamptz,
    attempt_count integer,
    max_attempts integer,
    last_error text
)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
SELECT d.outbox_id, d.topic, d.message_key, d.content_type, d.headers,
       CASE WHEN p_with_payload THEN d.payload END,
       octet_length(d.payload)::bigint,
       d.created_at, d.dead_lettered_at, d.attempt_count, d.max_attempts, d.last_error
  FROM outbox.dead_letters AS d
 WHERE d.outbox_id = p_id
$$;

COMMENT ON FUNCTION outbox.console_dead_letter(uuid, boolean) IS
    'One dead letter with its headers, payload only when p_with_payload (its size always); no row when p_id is not a dead letter.';

REVOKE ALL ON FUNCTION outbox.console_dead_letter(uuid, boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.console_dead_letter(uuid, boolean) TO outbox_reader, outbox_relay;

-- Enqueue: the producers' API.
--
-- An application writes a message into the outbox in the same transaction as its business
-- change, by calling one of:
--   outbox.enqueue(text, bytea, text, jsonb, timestamptz, uuid, integer, text, text, text)
--                                                                           any bytes
--   outbox.enqueue(text, jsonb, text, jsonb, timestamptz, uuid, integer, text, text)
--                                                                           JSON
-- and, internal to both, outbox.with_trace_context (the creation context checked and put
-- into the headers).
-- The scope of a key's order, which enqueue applies to each keyed message it inserts:
--   outbox.key_order_scope(text)                the scope a topic's keyed messages get now
--   outbox.set_key_order_scope(text, text)      sets the scope of the topics of a pattern
--   outbox.unset_key_order_scope(text)          removes a pattern's rule
--   outbox.key_order_scopes                     view: the rules
-- Callers: outbox_relay (the relayer's `key-order` verb) sets and removes rules;
-- outbox_reader and outbox_relay read them.
-- Callers: logins in outbox_producer (applications) and outbox_relay (the relayer's
-- `enqueue` verb). Neither role has any right on the tables: the bytea form is SECURITY
-- DEFINER; the jsonb form is a plain SQL function that calls it.
--
-- Conventions of both:
-- * They run inside the caller's transaction and commit or roll back with it: the message
--   exists for the relayers exactly when the business change does. They never commit,
--   open a transaction, or keep anything in the session, so they work through a
--   transaction-mode connection pooler.
-- * Defaults: a NULL argument means its default (a new id, now, 10 attempts, no headers),
--   except p_topic and p_payload, which are required.
-- * The relayers are woken by NOTIFY outbox_new (empty payload) at the caller's commit; a
--   delayed message is found by the relayers' poll instead.
-- * Errors: P7001 for a refused argument, 23505 for a reused outbox_id (see 02_errors.sql).
-- * Trace context (docs/tracing.md): the message's creation context, the W3C `traceparent`
--   and `tracestate` of the producer's span, is kept in its headers under those names, so
--   that every destination that carries headers carries it. It comes from, first that is
--   given: the arguments p_traceparent/p_tracestate; the settings outbox.traceparent/
--   outbox.tracestate of the caller's transaction (`SET LOCAL outbox.traceparent = '…'`,
--   or set_config('outbox.traceparent', …, true): one line in an instrumented producer,
--   whose enqueue calls stay as they are); the headers traceparent/tracestate in
--   p_headers, kept as given. The arguments and the settings are checked (W3C Trace
--   Context level 1, version 00) and replace both headers of p_headers: a tracestate
--   belongs to the trace of its traceparent, so the two come from one place. Headers are
--   the message's data (a producer may copy them from a message it received), the setting
--   is the transaction's own current context, the argument the caller's choice for this
--   one message: the more deliberate source wins. In an outbox in another schema the
--   settings are named after that schema (`<schema>.traceparent`).


-- outbox.with_trace_context: internal; called by enqueue(bytea) when a trace context comes
-- from its arguments or from the settings. Not granted (enqueue runs it as the owner).
--
-- Inputs:     p_headers      the message's headers (a JSON object).
--             p_traceparent  a W3C traceparent, version 00: `00-` 32 hex digits (the trace
--                            id, not all zeros) `-` 16 hex digits (the parent id, not all
--                            zeros) `-` 2 hex digits (the flags), lower case, nothing
--                            around it. Other versions are refused (level 1 defines 00
--                            only).
--             p_tracestate   NULL, or a W3C tracestate: at most 512 characters and 32
--                            list members (empty members, and spaces or tabs around the
--                            commas, allowed), each key=value with key lcalpha followed by
--                            up to 255 of lcalpha, digits, _ - * / (or tenant@system), and
--                            value 1 to 256 printable ASCII characters other than , and =,
--                            not ending in a space.
--             p_from         how the two are named in an error: 'p_' (the arguments
--                            p_traceparent, p_tracestate) or 'outbox.' (the settings).
-- Returns:    p_headers with its traceparent and tracestate replaced by these (no
--             tracestate when p_tracestate is NULL).
-- Raises:     P7001 naming the argument or setting and quoting the value when
--             p_traceparent is NULL (a tracestate without its traceparent) or malformed,
--             or when p_tracestate is malformed.
-- Shape:      regular expressions and lengths over the text, no table; IMMUTABLE like the
--             checks of 02_errors.sql. Duplicate tracestate keys are not looked for. About
--             3–4 µs for a traceparent, 7–8 µs with a tracestate of two members (with
--             bounded repetitions, {0,255}, in the expressions instead of length():
--             100–230 µs; docs/tracing.md).
CREATE OR REPLACE FUNCTION outbox.with_trace_context(
    p_headers jsonb,
    p_traceparent text,
    p_tracestate text,
    p_from text
) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_member text;
    v_key text;
    v_members integer := 0;
BEGIN
    IF p_traceparent IS NULL THEN
        PERFORM outbox.invalid_argument(p_from || 'tracestate',
            format('%L comes without a traceparent (give %straceparent too)', p_tracestate, p_from));
    END IF;
    -- 55 characters, dashes at 3, 36 and 53, lower-case hex between them: version 00, a
    -- trace id of 32 digits, a parent id of 16, flags of 2.
    IF length(p_traceparent) <> 55
       OR p_traceparent !~ '^00-[0-9a-f]*-[0-9a-f]*-[0-9a-f]*$'
       OR substr(p_traceparent, 36, 1) <> '-' OR substr(p_traceparent, 53, 1) <> '-'
       OR substr(p_traceparent, 4, 32) = repeat('0', 32)
       OR substr(p_traceparent, 37, 16) = repeat('0', 16) THEN
        PERFORM outbox.invalid_argument(p_from || 'traceparent',
            format('%L is not a W3C traceparent (00-<trace id: 32 lower-case hex digits, not all 0>-<parent id: 16 lower-case hex digits, not all 0>-<flags: 2 hex digits>)',
                   p_traceparent));
    END IF;
    IF p_tracestate IS NULL THEN
        RETURN (p_headers - 'tracestate') || jsonb_build_object('traceparent', p_traceparent);
    END IF;
    IF length(p_tracestate) > 512 THEN
        PERFORM outbox.invalid_argument(p_from || 'tracestate',
            format('%L is not a W3C tracestate: %s characters, at most 512', p_tracestate, length(p_tracestate)));
    END IF;
    -- Each member's syntax by a regular expression, its lengths by length(): a bounded
    -- repetition ({0,255}) makes the expression a hundred times slower to run.
    FOREACH v_member IN ARRAY string_to_array(p_tracestate, ',') LOOP
        v_member := btrim(v_member, E' \t');
        CONTINUE WHEN v_member = '';
        v_members := v_members + 1;
        v_key := split_part(v_member, '=', 1);
        IF v_member !~ '^(?:[a-z][a-z0-9_*/-]*|[a-z0-9][a-z0-9_*/-]*@[a-z][a-z0-9_*/-]*)=[\x20-\x2b\x2d-\x3c\x3e-\x7e]*[\x21-\x2b\x2d-\x3c\x3e-\x7e]$'
           OR length(v_key) > 256
           OR length(v_member) - length(v_key) - 1 > 256
           OR (position('@' IN v_key) > 0
               AND (position('@' IN v_key) - 1 > 241 OR length(v_key) - position('@' IN v_key) > 14)) THEN
            PERFORM outbox.invalid_argument(p_from || 'tracestate',
                format('%L is not a W3C tracestate: member %L is not key=value (key: a lower-case letter, then lower-case letters, digits, _ - * /, or tenant@system; value: printable ASCII other than , and =)',
                       p_tracestate, v_member));
        END IF;
    END LOOP;
    IF v_members > 32 THEN
        PERFORM outbox.invalid_argument(p_from || 'tracestate',
            format('%L is not a W3C tracestate: %s members, at most 32', p_tracestate, v_members));
    END IF;
    RETURN p_headers || jsonb_build_object('traceparent', p_traceparent, 'tracestate', p_tracestate);
END;
$$;

COMMENT ON FUNCTION outbox.with_trace_context(jsonb, text, text, text) IS
    'Internal to enqueue: the headers with this W3C traceparent and tracestate in place of theirs; P7001 naming the argument or setting (p_from) when either is malformed.';

REVOKE ALL ON FUNCTION outbox.with_trace_context(jsonb, text, text, text) FROM PUBLIC;


-- outbox.enqueue (bytea payload): inserts one message and returns its outbox_id.
--
-- Inputs:     p_topic         required, non-empty; routes the message to a destination.
--             p_payload       required (not NULL); any bytes, stored as given.
--             p_message_key   default NULL (no order: delivered in parallel with any other
--                             message). Messages sharing a non-NULL key are delivered one at
--                             a time, in the order they were enqueued, across the whole
--                             outbox or within their topic, as key_order_scope names for
--                             p_topic at this insert; transactions that enqueue under one
--                             key at the same time get no order between them.
--             p_headers       a JSON object of the message's headers; default and NULL: {}.
--             p_available_at  not before; default and NULL: the clock at the insert
--                             (clock_timestamp()). A time in the future delays the
--                             message; a time in the past makes it ready at once, and
--                             at the commit lowers its shard's claim floor to it
--                             (04_claim.sql).
--             p_outbox_id     the producer's own id; default and NULL: a new UUIDv7. Every
--                             delivery of the message carries it.
--             p_max_attempts  attempts before the message is dead-lettered, at least 1;
--                             default and NULL: 10.
--             p_content_type  default and NULL: application/octet-stream.
--             p_traceparent   the creation context, a W3C traceparent (version 00:
--                             00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>,
--                             lower case, neither id all zeros); stored as the header
--                             traceparent. Default and NULL: the setting outbox.traceparent
--                             of the caller's transaction when set and not empty, else the
--                             traceparent of p_headers as given, else none.
--             p_tracestate    its W3C tracestate (at most 32 key=value members, at most 512
--                             characters); stored as the header tracestate. Default and
--                             NULL: none when p_traceparent is given, else the setting
--                             outbox.tracestate with the setting outbox.traceparent.
-- Returns:    the message's outbox_id.
-- Locks:      with p_outbox_id given: the pending message with that id, if any, FOR KEY
--             SHARE, which waits for a transaction that is deleting it (a completion, a
--             dead-lettering) or holds it FOR UPDATE (a claim), so that the checks that
--             follow see its outcome; before that, a transaction-scoped advisory lock of
--             the id, which a second enqueue of the same id waits for until this
--             transaction ends, and then finds its row (under READ COMMITTED: a
--             REPEATABLE READ or SERIALIZABLE caller keeps its snapshot, and two such
--             enqueues of one id into two slots, on either side of a rotation, are not
--             kept apart; in one slot, messages_pkey keeps them apart). The new row. For a
--             keyed message, at commit,
--             the nearest earlier message of its key FOR KEY SHARE SKIP LOCKED (trigger
--             settle_behind): never a wait. For a message ready now, a transaction-scoped
--             advisory lock of the current 2 ms window, tried without waiting.
-- Guarantees: the message is visible to the relayers when the caller's transaction commits,
--             and never before; then it is delivered at least once, every time with the
--             same outbox_id, or dead-lettered with its payload. A keyed message is not
--             claimed while an earlier message of its key is pending. The caller's commit
--             notifies outbox_new at most once per transaction, and under load about once
--             per 2 ms window for all producers; a transaction that lost its window is
--             picked up by the winner's wake-up, the relayer's re-check shortly after it,
--             or at worst the relayer's poll interval.
-- Raises:     P7001 when p_topic is NULL or empty, p_payload is NULL, p_headers is not a
--             JSON object, p_max_attempts is below 1, or the trace context of the
--             arguments or of the settings is malformed (or a tracestate comes without its
--             traceparent), naming p_traceparent, p_tracestate, outbox.traceparent or
--             outbox.tracestate and the value (outbox.with_trace_context). 23505 when p_outbox_id is pending,
--             dead-lettered, or has attempts (its message was delivered or tried; after
--             prune_attempts removed a delivered message's history, its id is accepted
--             again); the message names the id and which, DETAIL is the id.
-- Crash:      nothing of its own: everything it does is part of the caller's transaction. A
--             crash or rollback before the commit removes the message with the business
--             change, and no notification is sent.
-- Shape:      one PL/pgSQL call, SECURITY DEFINER with a fixed search_path (outbox_producer
--             has no rights on the table). The id checks run only for an id the producer
--             gives; they probe every slot's primary key. enable_seqscan is off, so that a
--             plan made while a slot is empty never reads it sequentially once it fills
--             (01_tables.sql). The wake-up is written in the body, not in a function of its own, which
--             would be a second call and a second search_path set per message. Postgres
--             makes transactions that notify commit one at a time (a database-wide lock
--             held through the WAL flush), so only the first transaction of each 2 ms
--             window notifies: with every enqueue notifying, 16 connections reached 4,150
--             msg/s, with the window 11,000. CPU per enqueue transaction: 112–117 µs against
--             79–87 µs for the plain INSERT (SECURITY DEFINER with its search_path about
--             5 µs, the wake-up about 5 µs); throughput 0.82–0.88×, 0.79–0.82× and
--             0.76–0.86× the plain INSERT's at 1, 16 and 64 connections. Without a trace
--             context it reads the two settings (current_setting, no catalogue access);
--             with one it also checks it (3–8 µs) and rewrites the headers
--             (docs/tracing.md has the figures).
CREATE OR REPLACE FUNCTION outbox.enqueue(
    p_topic text,
    p_payload bytea,
    p_message_key text DEFAULT NULL,
    p_headers jsonb DEFAULT '{}',
    p_available_at timestamptz DEFAULT NULL,
    p_outbox_id uuid DEFAULT NULL,
    p_max_attempts integer DEFAULT 10,
    p_content_type text DEFAULT 'application/octet-stream',
    p_traceparent text DEFAULT NULL,
    p_tracestate text DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_id uuid := coalesce(p_outbox_id, outbox.uuid_v7());
    v_used text;
    v_headers jsonb := coalesce(p_headers, '{}');
    v_traceparent text := p_traceparent;
    v_tracestate text := p_tracestate;
    v_trace_from text := 'p_';
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
    -- The creation context: the arguments, else the transaction's settings (empty once a
    -- SET LOCAL has ended), else the headers as given.
    IF v_traceparent IS NULL AND v_tracestate IS NULL THEN
        v_traceparent := nullif(current_setting('outbox.traceparent', true), '');
        v_tracestate := nullif(current_setting('outbox.tracestate', true), '');
        v_trace_from := 'outbox.';
    END IF;
    IF v_traceparent IS NOT NULL OR v_tracestate IS NOT NULL THEN
        v_headers := outbox.with_trace_context(v_headers, v_traceparent, v_tracestate, v_trace_from);
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
            v_headers, coalesce(p_available_at, clock_timestamp()),
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

COMMENT ON FUNCTION outbox.enqueue(text, bytea, text, jsonb, timestamptz, uuid, integer, text, text, text) IS
    'Inserts one message (bytea payload) in the caller''s transaction and returns its outbox_id, with its creation trace context (arguments, else the settings outbox.traceparent/outbox.tracestate, else p_headers) in its headers; wakes the relayers at commit; P7001 on a bad argument or trace context, 23505 on a reused outbox_id.';

REVOKE ALL ON FUNCTION outbox.enqueue(text, bytea, text, jsonb, timestamptz, uuid, integer, text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.enqueue(text, bytea, text, jsonb, timestamptz, uuid, integer, text, text, text) TO outbox_producer;
GRANT EXECUTE ON FUNCTION outbox.enqueue(text, bytea, text, jsonb, timestamptz, uuid, integer, text, text, text) TO outbox_relay;


-- outbox.enqueue (jsonb payload): enqueue(bytea) with the JSON as UTF-8 text and content
-- type application/json.
--
-- Inputs:     as enqueue(bytea), without p_content_type (p_traceparent and p_tracestate
--             follow p_max_attempts). p_payload is required (SQL NULL is
--             refused; the JSON value null is a payload like any other). It is stored as
--             jsonb prints it (keys in jsonb's order, a repeated key once, whitespace
--             normalised), not as the caller's original text.
-- Returns:    the message's outbox_id.
-- Locks:      those of enqueue(bytea).
-- Guarantees: those of enqueue(bytea).
-- Raises:     what enqueue(bytea) raises: P7001, 23505.
-- Crash:      nothing of its own (the caller's transaction).
-- Shape:      a SQL function with no SECURITY DEFINER and no SET clause, which Postgres
--             inlines into the caller's statement (tests/sql_api/enqueue.rs checks it with EXPLAIN
--             VERBOSE): the statement then makes the one definer call of enqueue(bytea).
--             It runs with the caller's rights and search_path, which decide nothing but the
--             conversion of the caller's own payload (every name in it is qualified).
--             Measured against a plain INSERT: 0.81–0.84×, 0.80–0.83× and 0.62–0.73× at 1,
--             16 and 64 connections (it also parses the JSON and prints it back).
CREATE OR REPLACE FUNCTION outbox.enqueue(
    p_topic text,
    p_payload jsonb,
    p_message_key text DEFAULT NULL,
    p_headers jsonb DEFAULT '{}',
    p_available_at timestamptz DEFAULT NULL,
    p_outbox_id uuid DEFAULT NULL,
    p_max_attempts integer DEFAULT 10,
    p_traceparent text DEFAULT NULL,
    p_tracestate text DEFAULT NULL
) RETURNS uuid
LANGUAGE sql VOLATILE SECURITY INVOKER
AS $$
    SELECT outbox.enqueue(p_topic, pg_catalog.convert_to(p_payload::pg_catalog.text, 'UTF8'),
                          p_message_key, p_headers, p_available_at, p_outbox_id, p_max_attempts,
                          'application/json', p_traceparent, p_tracestate);
$$;

COMMENT ON FUNCTION outbox.enqueue(text, jsonb, text, jsonb, timestamptz, uuid, integer, text, text) IS
    'Inserts one message (JSON payload, stored as UTF-8 with content type application/json) through enqueue(bytea), inlined into the caller''s statement, trace context as enqueue(bytea); returns its outbox_id; P7001, 23505 as enqueue(bytea).';

REVOKE ALL ON FUNCTION outbox.enqueue(text, jsonb, text, jsonb, timestamptz, uuid, integer, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.enqueue(text, jsonb, text, jsonb, timestamptz, uuid, integer, text, text) TO outbox_producer;
GRANT EXECUTE ON FUNCTION outbox.enqueue(text, jsonb, text, jsonb, timestamptz, uuid, integer, text, text) TO outbox_relay;


-- outbox.key_order_scope: the scope of the key order a keyed message of p_topic gets when it
-- is enqueued now: 'global' (it waits for every earlier message of its key on any topic
-- ordered across the whole outbox) or 'topic' (only for earlier messages of its key on
-- p_topic; no message of another topic waits for it).
--
-- Inputs:     p_topic   a topic (NULL: NULL).
-- Returns:    the scope of the most specific rule of outbox.key_order_rules whose pattern
--             p_topic matches (LIKE): a pattern without `%` before one with it, then the
--             longer, then the first in byte order; 'global', the default, when none
--             matches. The default is the whole outbox because a key usually names one
--             entity (an order, an account) whose events on different topics must keep
--             their order, and because it is the order every earlier release gave.
-- Locks:      nothing (a read).
-- Raises:     nothing.
-- Shape:      reads the rules, a few rows, whole (no index answers LIKE with the pattern in
--             the table), once per call. Called by mark_behind on every keyed insert
--             (01_tables.sql), which runs with enable_seqscan off: set on here, since off
--             it costs the scan past every JIT threshold and compiled it on every insert
--             (200 ms per keyed message).
CREATE OR REPLACE FUNCTION outbox.key_order_scope(p_topic text) RETURNS text
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = on
AS $$
    SELECT CASE WHEN p_topic IS NOT NULL THEN
               coalesce((SELECT r.scope
                           FROM outbox.key_order_rules AS r
                          WHERE p_topic LIKE r.topic_pattern
                          ORDER BY strpos(r.topic_pattern, '%') = 0 DESC,
                                   length(r.topic_pattern) DESC,
                                   r.topic_pattern COLLATE "C"
                          LIMIT 1), 'global')
           END
$$;

COMMENT ON FUNCTION outbox.key_order_scope(text) IS
    'The scope of the key order a keyed message of the topic gets if enqueued now: global (the whole outbox, the default) or topic (its topic alone), by the most specific rule of set_key_order_scope.';

REVOKE ALL ON FUNCTION outbox.key_order_scope(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.key_order_scope(text) TO outbox_reader, outbox_relay;


-- outbox.set_key_order_scope: sets the scope of the key order of the topics p_topic_pattern
-- matches, replacing that pattern's rule if it has one.
--
-- Inputs:     p_topic_pattern  a LIKE pattern of topics (`orders.%`, `payments`; `\` escapes
--                              `%`, `_` and `\`), not empty.
--             p_scope          'topic': a key's messages of such a topic wait only for
--                              earlier messages of the key on the same topic; 'global': for
--                              every earlier message of the key (the default of a topic no
--                              rule matches; a rule saying it overrides a wider rule).
-- Returns:    the pattern's scope before the call (NULL: it had no rule).
-- Guarantees: applies to messages enqueued after the caller commits (each takes the scope
--             of the rules its insert sees, key_order_scope); messages already pending
--             keep the order they were given. A key's messages on one topic never pass
--             each other: while the key has a message pending on the topic under the
--             previous scope, its new messages there take that message's order key
--             (mark_behind, 01_tables.sql), and the new scope begins for the key on that
--             topic once nothing of it is pending there. Changing a topic to 'topic' then
--             lets its new messages pass the key's pending messages of other topics;
--             changing it back to 'global' makes them wait for every pending message of
--             their key.
-- Locks:      the pattern's rule (a row of outbox.key_order_rules).
-- Raises:     P7001 (p_topic_pattern) when NULL or empty; P7001 (p_scope) when not 'global'
--             or 'topic'.
-- Crash:      nothing: the rule is written in the caller's transaction.
CREATE OR REPLACE FUNCTION outbox.set_key_order_scope(p_topic_pattern text, p_scope text)
RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_before text;
BEGIN
    IF p_topic_pattern IS NULL OR p_topic_pattern = '' THEN
        PERFORM outbox.invalid_argument('p_topic_pattern', 'must be a non-empty LIKE pattern of topics');
    END IF;
    IF p_scope IS NULL OR p_scope NOT IN ('global', 'topic') THEN
        PERFORM outbox.invalid_argument('p_scope',
            format('must be ''global'' (the whole outbox) or ''topic'' (per topic), not %s',
                   coalesce(quote_literal(p_scope), 'NULL')));
    END IF;
    SELECT r.scope INTO v_before
      FROM outbox.key_order_rules AS r
     WHERE r.topic_pattern = p_topic_pattern
       FOR UPDATE;
    INSERT INTO outbox.key_order_rules (topic_pattern, scope)
    VALUES (p_topic_pattern, p_scope)
    ON CONFLICT (topic_pattern) DO UPDATE
       SET scope = EXCLUDED.scope, set_at = EXCLUDED.set_at, set_by = EXCLUDED.set_by;
    RETURN v_before;
END;
$$;

COMMENT ON FUNCTION outbox.set_key_order_scope(text, text) IS
    'Sets the key order scope (global: the whole outbox; topic: per topic) of the topics matching a LIKE pattern, for messages enqueued after it; returns the pattern''s previous scope; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.set_key_order_scope(text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.set_key_order_scope(text, text) TO outbox_relay;


-- outbox.unset_key_order_scope: removes the rule of p_topic_pattern, so that its topics take
-- the scope of the next most specific rule, or the whole outbox.
--
-- Inputs:     p_topic_pattern  the pattern as set_key_order_scope was given it.
-- Returns:    whether the pattern had a rule.
-- Guarantees: as set_key_order_scope: applies to messages enqueued after the commit.
-- Locks:      the pattern's rule.
-- Raises:     P7001 (p_topic_pattern) when NULL or empty.
-- Crash:      nothing.
CREATE OR REPLACE FUNCTION outbox.unset_key_order_scope(p_topic_pattern text) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_topic_pattern IS NULL OR p_topic_pattern = '' THEN
        PERFORM outbox.invalid_argument('p_topic_pattern', 'must be a non-empty LIKE pattern of topics');
    END IF;
    DELETE FROM outbox.key_order_rules AS r WHERE r.topic_pattern = p_topic_pattern;
    RETURN FOUND;
END;
$$;

COMMENT ON FUNCTION outbox.unset_key_order_scope(text) IS
    'Removes the key order scope rule of a topic pattern (its topics fall back to the next rule, or the whole outbox) for messages enqueued after it; whether it had one; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.unset_key_order_scope(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.unset_key_order_scope(text) TO outbox_relay;


-- outbox.key_order_scopes: the rules of the key order scope: topic_pattern (LIKE), scope
-- ('global' or 'topic'), set_at, set_by (the login that set it); most specific first, in
-- the order key_order_scope applies them. A topic no rule matches keeps its keys' order
-- across the whole outbox.
CREATE OR REPLACE VIEW outbox.key_order_scopes AS
SELECT r.topic_pattern, r.scope, r.set_at, r.set_by
  FROM outbox.key_order_rules AS r
 ORDER BY strpos(r.topic_pattern, '%') = 0 DESC, length(r.topic_pattern) DESC,
          r.topic_pattern COLLATE "C";

COMMENT ON VIEW outbox.key_order_scopes IS
    'The key order scope rules (topic pattern, outbox or topic, when and by whom set), most specific first; topics no rule matches keep their keys'' order across the whole outbox.';

REVOKE ALL ON outbox.key_order_scopes FROM PUBLIC;
GRANT SELECT ON outbox.key_order_scopes TO outbox_reader, outbox_relay;

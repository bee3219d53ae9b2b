-- Adopting a table: relaying an outbox table an application already writes, such as the
-- one Debezium's outbox event router reads, without changing the application.
--
-- Objects:
--   adopt_table(p_table, p_preset, p_mapping)    installs the adoption's triggers on a table
--   unadopt_table(p_table)                       removes them, leaving the table as it was
--   adopted_row()                                the row trigger: one inserted row, one message
--   adopted_row_updated()                        the statement trigger that warns of an UPDATE
--   adopted_tables (view)                        the tables adopted, with their mappings
--
-- An adopted table keeps its producers' INSERT statements and its own rows. The trigger
-- outbox_adopt (AFTER INSERT, FOR EACH ROW) turns each inserted row into a message of
-- outbox.messages through outbox.enqueue, in the inserting transaction: the message commits
-- and rolls back with the row, an id the outbox already knows fails the insert with
-- enqueue's 23505, and everything enqueue guarantees (per-key order, the wake-up, the
-- attempt budget) holds for it. A row deleted later in the same transaction (Debezium's
-- "remove after insert", which keeps the table empty) was enqueued when it was inserted,
-- so it is relayed. An UPDATE of rows is not relayed: the statement trigger
-- outbox_adopt_updates raises a WARNING once per statement and relays nothing; a DELETE is
-- not relayed and not reported (removing relayed rows is the table's normal upkeep). Rows
-- in the table before the adoption are not relayed.
--
-- The mapping, a jsonb object held as the trigger's argument (so the trigger is the whole
-- state of an adoption, and the view reads it back from the catalogue), names columns of
-- the table:
--   topic         the column whose value is the message's topic, or
--   topic_value   a topic for every row (one of the two is required)
--   key           the column of the message key (per-key order); none: unkeyed
--   id            the column of the outbox_id (uuid, or text holding one); none: a new UUIDv7
--   payload       the column of the payload (required): json (its stored text, as it is),
--                 jsonb (as jsonb prints it), both of content type application/json; text
--                 or varchar (UTF-8, text/plain; charset=utf-8; '' an empty payload); or
--                 bytea (its bytes, application/octet-stream); NULL: an empty payload of
--                 type application/octet-stream
--   headers       an object of header name → column: each non-NULL value as a header
--                 (text as it is, other types as to_jsonb writes them)
--   available_at  the column of the not-before time (timestamptz or timestamp); none: now
--   trace         a column holding a trace context in the Java properties form the Quarkus
--                 outbox extension writes (`traceparent=00-…` on a line): its traceparent
--                 is set as the header traceparent
--   max_attempts  attempts before dead-lettering, for every row; none: enqueue's default
-- The mapping names columns; the trigger reads their types when a row is inserted. A
-- column renamed or dropped after the adoption fails each insert with 42703 naming it:
-- after DDL on an adopted table, adopt it again.
-- The preset debezium is the mapping of Debezium's outbox table: topic aggregatetype, key
-- aggregateid, id id, payload payload, headers type (and timestamp and tracingspancontext
-- when the table has them) under their column names, trace tracingspancontext when it
-- exists; p_mapping's keys replace the preset's.
--
-- Rights: the triggers run as the role that inserts (SECURITY INVOKER, fixed search_path),
-- so that role needs what any producer needs, EXECUTE on outbox.enqueue through
-- outbox_producer, and nothing else; Postgres does not check EXECUTE on a trigger function
-- when the trigger fires. Adopting needs the TRIGGER right on the table (its owner has it)
-- and EXECUTE on the functions below, which outbox_relay holds.


-- outbox.adopted_row: the row trigger of an adopted table (trigger outbox_adopt). Not
-- callable other than as a trigger.
--
-- Inputs:     TG_ARGV[0], the resolved mapping (see the header) as adopt_table wrote it;
--             NEW, the inserted row.
-- Returns:    NULL (an AFTER trigger: the row is inserted as given).
-- Locks:      those of outbox.enqueue.
-- Guarantees: exactly one outbox.enqueue call per inserted row, in the inserting
--             transaction and with its rights. The payload is the column's value as
--             stored, whatever the session's settings: a bytea's bytes, a json's or a
--             text's stored text, a jsonb's text; its type is the column's type now, not
--             the type it had when the table was adopted.
-- Raises:     42703 naming the table and each mapped column the row no longer has (a
--             column renamed or dropped since the adoption: run outbox-relay adopt again);
--             42804 when the payload column's type is no longer one a payload can take;
--             P7001 (the topic column) when the row's topic is NULL or empty; what
--             outbox.enqueue raises for the row (23505 for a known id); 22P02 for an id
--             that is not a uuid, 22007/22008 for a bad time. Each fails the producer's
--             INSERT: nothing is inserted that is not relayed.
-- Shape:      the row is read through to_jsonb(NEW) once, so one function serves every
--             table and mapping; the mapping is parsed from the trigger argument per row.
--             A json or bytea payload is read from NEW itself (EXECUTE … USING NEW), as
--             to_jsonb would rewrite a json and print a bytea by bytea_output.
--             With an id column, enqueue takes a transaction-scoped advisory lock per row:
--             a transaction that inserts more rows than the lock table holds (about
--             max_locks_per_transaction × max_connections, less what others hold; 6,400 by
--             default) fails with 53200; insert in transactions of a thousand rows or so.
--             Measured (docs/from-debezium.md): the insert of the Quarkus extension's row
--             costs 3–4× the plain insert, 1.1–1.2× the same insert with the application's
--             own call of enqueue (the id checks are enqueue's); the check of the mapped
--             columns and the payload's type add 15–30 % to the trigger's time inside the
--             transaction, within the noise of a committed single-row insert.
CREATE OR REPLACE FUNCTION outbox.adopted_row() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_map jsonb := TG_ARGV[0]::jsonb;
    v_row jsonb := to_jsonb(NEW);
    v_table text := format('%I.%I', TG_TABLE_SCHEMA, TG_TABLE_NAME);
    v_column text := v_map ->> 'payload';
    v_missing text;
    v_type text;
    v_text text;
    v_payload bytea;
    v_content_type text;
    v_topic text;
    v_headers jsonb := '{}';
    v_header record;
    v_trace text;
BEGIN
    -- Each column the mapping names must still be a column of the row (by key: a column
    -- that is there but NULL is a NULL value, not a missing column); and the payload
    -- column's type now. One query for both: each is a query per row.
    SELECT string_agg(quote_ident(m.name), ', ') FILTER (WHERE NOT v_row ? m.name),
           (SELECT format_type(a.atttypid, NULL)
              FROM pg_attribute AS a
             WHERE a.attrelid = TG_RELID AND a.attname = v_column AND NOT a.attisdropped)
      INTO v_missing, v_type
      FROM jsonb_array_elements_text(
               jsonb_build_array(v_map -> 'topic', v_map -> 'key', v_map -> 'id', v_map -> 'payload',
                                 v_map -> 'available_at', v_map -> 'trace')
               || jsonb_path_query_array(coalesce(v_map -> 'headers', '{}'), '$.*')) AS m(name)
     WHERE m.name IS NOT NULL;
    IF v_missing IS NOT NULL THEN
        RAISE EXCEPTION 'outbox: the adopted table % has no column % any more, which its adoption maps: after changing the columns of an adopted table, run outbox-relay adopt on it again', v_table, v_missing
            USING ERRCODE = '42703';
    END IF;

    -- The payload, by the column's type now.
    IF v_row ->> v_column IS NULL THEN
        -- No payload: an empty one, of no type (a tombstone for the debezium envelope).
        v_payload := '\x'::bytea;
        v_content_type := 'application/octet-stream';
    ELSIF v_type = 'bytea' THEN
        EXECUTE format('SELECT ($1).%I', v_column) INTO v_payload USING NEW;
        v_content_type := 'application/octet-stream';
    ELSIF v_type = 'json' THEN
        EXECUTE format('SELECT ($1).%I::text', v_column) INTO v_text USING NEW;
        v_payload := convert_to(v_text, 'UTF8');
        v_content_type := 'application/json';
    ELSIF v_type = 'jsonb' THEN
        v_payload := convert_to((v_row -> v_column)::text, 'UTF8');
        v_content_type := 'application/json';
    ELSIF v_type IN ('text', 'character varying') THEN
        v_payload := convert_to(v_row ->> v_column, 'UTF8');
        v_content_type := 'text/plain; charset=utf-8';
    ELSE
        RAISE EXCEPTION 'outbox: the payload column % of the adopted table % is of type %, which a payload cannot take: after changing the columns of an adopted table, run outbox-relay adopt on it again', quote_ident(v_column), v_table, v_type
            USING ERRCODE = '42804';
    END IF;

    FOR v_header IN SELECT h.key, h.value FROM jsonb_each_text(v_map -> 'headers') AS h LOOP
        IF v_row ->> v_header.value IS NOT NULL THEN
            v_headers := v_headers || jsonb_build_object(v_header.key, v_row ->> v_header.value);
        END IF;
    END LOOP;
    v_trace := substring(v_row ->> (v_map ->> 'trace') FROM 'traceparent=([0-9A-Za-z-]+)');
    IF v_trace IS NOT NULL THEN
        v_headers := v_headers || jsonb_build_object('traceparent', v_trace);
    END IF;

    v_topic := coalesce(v_row ->> (v_map ->> 'topic'), v_map ->> 'topic_value');
    IF coalesce(v_topic, '') = '' THEN
        PERFORM outbox.invalid_argument(v_map ->> 'topic',
            format('the topic column %I of the adopted table %s is NULL or empty in an inserted row',
                   v_map ->> 'topic', v_table));
    END IF;

    PERFORM outbox.enqueue(
        v_topic,
        v_payload,
        v_row ->> (v_map ->> 'key'),
        v_headers,
        (v_row ->> (v_map ->> 'available_at'))::timestamptz,
        (v_row ->> (v_map ->> 'id'))::uuid,
        (v_map ->> 'max_attempts')::integer,
        v_content_type);
    RETURN NULL;
END;
$$;

COMMENT ON FUNCTION outbox.adopted_row() IS
    'Trigger outbox_adopt of an adopted table: enqueues each inserted row as a message, mapped by the trigger''s argument, in the inserting transaction and with the inserter''s rights.';

REVOKE ALL ON FUNCTION outbox.adopted_row() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.adopted_row() TO outbox_relay;


-- outbox.adopted_row_updated: the statement trigger of an adopted table (trigger
-- outbox_adopt_updates, AFTER UPDATE FOR EACH STATEMENT, REFERENCING NEW TABLE AS
-- outbox_adopt_updated_rows). Not callable other than as a trigger.
--
-- Returns:    NULL; relays nothing.
-- Raises:     a WARNING naming the table, once per UPDATE statement that updated rows
--             (however many): an update of an outbox row is not an event, as Debezium's
--             router also ignores it with a warning. An UPDATE of no rows, and an
--             INSERT … ON CONFLICT DO UPDATE that updated none, do not warn.
-- Shape:      the transition table holds the statement's updated rows; it is read for one
--             row only.
CREATE OR REPLACE FUNCTION outbox.adopted_row_updated() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM outbox_adopt_updated_rows) THEN
        RETURN NULL;
    END IF;
    RAISE WARNING 'outbox: an UPDATE of the adopted table %.% is not relayed (only inserted rows are)',
        quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME);
    RETURN NULL;
END;
$$;

COMMENT ON FUNCTION outbox.adopted_row_updated() IS
    'Trigger outbox_adopt_updates of an adopted table: warns once per statement that updated rows that updates are not relayed.';

REVOKE ALL ON FUNCTION outbox.adopted_row_updated() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.adopted_row_updated() TO outbox_relay;


-- outbox.adopt_table: adopts a table: from the caller's commit on, each row inserted into
-- it is enqueued as a message.
--
-- Inputs:     p_table    the table (a regular or partitioned table outside schema outbox)
--             p_preset   'debezium' (the default) or NULL for none (p_mapping alone)
--             p_mapping  mapping keys (see the header) that replace the preset's
-- Returns:    the resolved mapping the trigger holds.
-- Locks:      the table, SHARE ROW EXCLUSIVE (CREATE TRIGGER): concurrent inserts wait
--             for the caller's commit, so that no row commits between "not adopted" and
--             "adopted" unseen.
-- Guarantees: idempotent: adopting an adopted table replaces its mapping. The table's
--             columns, rows, rights and other triggers are not changed.
-- Raises:     P7001 (p_table) for a table of schema outbox, a relation that is not a
--             table, a partition (adopt its partitioned table), or, with the preset
--             debezium, a table without the preset's columns (all those missing named);
--             P7001 (p_preset) for an unknown preset; P7001 (p_mapping) for a key that is
--             not a mapping key, a column the table lacks, a column of a type the key
--             cannot take, no topic, no payload, or a max_attempts that is not a whole
--             number from 1 to 2147483647. 42710 when the table has a trigger of its own
--             named outbox_adopt or outbox_adopt_updates (it is not replaced). 42501 when
--             the caller lacks the TRIGGER right on the table.
-- Shape:      SECURITY INVOKER: it creates triggers with the caller's rights, so that it
--             gives no one a way onto a table they could not put a trigger on.
CREATE OR REPLACE FUNCTION outbox.adopt_table(
    p_table regclass,
    p_preset text DEFAULT 'debezium',
    p_mapping jsonb DEFAULT NULL
) RETURNS jsonb
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_map jsonb := '{}';
    v_key text;
    v_type text;
    v_header record;
    v_headers jsonb := '{}';
    v_columns jsonb;
    v_missing text;
BEGIN
    IF p_table IS NULL THEN
        PERFORM outbox.invalid_argument('p_table', 'must not be NULL');
    END IF;
    IF (SELECT c.relkind NOT IN ('r', 'p') FROM pg_class AS c WHERE c.oid = p_table) THEN
        PERFORM outbox.invalid_argument('p_table', format('%s is not a table', p_table));
    END IF;
    -- A partition's triggers are its parent's: the parent is adopted (and unadopted).
    IF (SELECT c.relispartition FROM pg_class AS c WHERE c.oid = p_table) THEN
        PERFORM outbox.invalid_argument('p_table', format(
            '%s is a partition of %s: adopt (and unadopt) the partitioned table instead',
            p_table, (SELECT i.inhparent::regclass FROM pg_inherits AS i WHERE i.inhrelid = p_table)));
    END IF;
    -- A trigger of the adoption's names that is not the adoption's is the table's own:
    -- CREATE OR REPLACE TRIGGER would replace it.
    SELECT string_agg(t.tgname, ' and ') INTO v_key
      FROM pg_trigger AS t
     WHERE t.tgrelid = p_table
       AND ((t.tgname = 'outbox_adopt' AND t.tgfoid <> 'outbox.adopted_row()'::regprocedure)
            OR (t.tgname = 'outbox_adopt_updates'
                AND t.tgfoid <> 'outbox.adopted_row_updated()'::regprocedure));
    IF v_key IS NOT NULL THEN
        RAISE EXCEPTION 'outbox: % already has a trigger named % that is not the adoption''s', p_table, v_key
            USING ERRCODE = '42710',
                  HINT = 'Rename that trigger (ALTER TRIGGER … RENAME TO …), then adopt the table.';
    END IF;
    IF (SELECT c.relnamespace = p.pronamespace
          FROM pg_class AS c, pg_proc AS p
         WHERE c.oid = p_table AND p.oid = 'outbox.adopted_row()'::regprocedure) THEN
        PERFORM outbox.invalid_argument('p_table', format('%s is a table of the outbox itself', p_table));
    END IF;
    IF p_mapping IS NOT NULL AND jsonb_typeof(p_mapping) <> 'object' THEN
        PERFORM outbox.invalid_argument('p_mapping', 'must be a JSON object');
    END IF;

    -- The columns of the table: name → type.
    SELECT coalesce(jsonb_object_agg(a.attname, format_type(a.atttypid, NULL)), '{}')
      INTO v_columns
      FROM pg_attribute AS a
     WHERE a.attrelid = p_table AND a.attnum > 0 AND NOT a.attisdropped;

    IF p_preset = 'debezium' THEN
        v_map := jsonb_build_object('topic', 'aggregatetype', 'key', 'aggregateid',
                                    'id', 'id', 'payload', 'payload');
        FOREACH v_key IN ARRAY ARRAY['type', 'timestamp', 'tracingspancontext'] LOOP
            IF v_columns ? v_key THEN
                v_headers := v_headers || jsonb_build_object(v_key, v_key);
            END IF;
        END LOOP;
        v_map := v_map || jsonb_build_object('headers', v_headers);
        IF v_columns ? 'tracingspancontext' THEN
            v_map := v_map || jsonb_build_object('trace', 'tracingspancontext');
        END IF;
    ELSIF p_preset IS NOT NULL THEN
        PERFORM outbox.invalid_argument('p_preset', format('%L is not a preset: ''debezium'' or NULL', p_preset));
    END IF;
    v_map := jsonb_strip_nulls(v_map || coalesce(p_mapping, '{}'));

    -- The preset's columns the table lacks (and the mapping does not replace), all at once.
    IF p_preset = 'debezium' THEN
        SELECT string_agg(quote_ident(m.value), ', ' ORDER BY m.value) INTO v_missing
          FROM jsonb_each_text(v_map) AS m
         WHERE m.key IN ('topic', 'key', 'id', 'payload') AND NOT v_columns ? m.value
           AND NOT coalesce(p_mapping, '{}') ? m.key;
        IF v_missing IS NOT NULL THEN
            PERFORM outbox.invalid_argument('p_table', format(
                '%s lacks the column(s) %s that the preset debezium expects (Debezium''s outbox '
                'table: id, aggregatetype, aggregateid, payload); map its own columns with '
                'p_mapping (--mapping), or give no preset (--preset none)', p_table, v_missing));
        END IF;
    END IF;

    FOR v_key IN SELECT jsonb_object_keys(v_map) LOOP
        IF v_key NOT IN ('topic', 'topic_value', 'key', 'id', 'payload', 'headers',
                         'available_at', 'trace', 'max_attempts') THEN
            PERFORM outbox.invalid_argument('p_mapping', format('%L is not a mapping key', v_key));
        END IF;
        IF v_key NOT IN ('topic_value', 'headers', 'max_attempts') THEN
            IF jsonb_typeof(v_map -> v_key) <> 'string' THEN
                PERFORM outbox.invalid_argument('p_mapping', format('%s must name a column', v_key));
            END IF;
            v_type := v_columns ->> (v_map ->> v_key);
            IF v_type IS NULL THEN
                PERFORM outbox.invalid_argument('p_mapping', format('%s: %s has no column %L', v_key, p_table, v_map ->> v_key));
            END IF;
            IF (v_key = 'id' AND v_type NOT IN ('uuid', 'text', 'character varying'))
               OR (v_key = 'available_at' AND v_type NOT IN ('timestamp with time zone', 'timestamp without time zone'))
               OR (v_key = 'payload' AND v_type NOT IN ('jsonb', 'json', 'text', 'character varying', 'bytea')) THEN
                PERFORM outbox.invalid_argument('p_mapping', format('%s: column %I is of type %s', v_key, v_map ->> v_key, v_type));
            END IF;
        END IF;
    END LOOP;
    IF jsonb_typeof(v_map -> 'headers') IS DISTINCT FROM 'object' AND v_map ? 'headers' THEN
        PERFORM outbox.invalid_argument('p_mapping', 'headers must be an object of header name → column');
    END IF;
    FOR v_header IN SELECT h.key, h.value FROM jsonb_each_text(coalesce(v_map -> 'headers', '{}')) AS h LOOP
        IF NOT v_columns ? v_header.value THEN
            PERFORM outbox.invalid_argument('p_mapping', format('headers.%s: %s has no column %L', v_header.key, p_table, v_header.value));
        END IF;
    END LOOP;
    IF (v_map ? 'topic') = (v_map ? 'topic_value') THEN
        PERFORM outbox.invalid_argument('p_mapping', 'needs one of topic (a column) and topic_value (a topic for every row)');
    END IF;
    IF v_map ? 'topic_value' AND coalesce(v_map ->> 'topic_value', '') = '' THEN
        PERFORM outbox.invalid_argument('p_mapping', 'topic_value must be a non-empty string');
    END IF;
    IF NOT v_map ? 'payload' THEN
        PERFORM outbox.invalid_argument('p_mapping', 'needs payload (a column)');
    END IF;
    IF v_map ? 'max_attempts' AND (jsonb_typeof(v_map -> 'max_attempts') <> 'number'
                                  OR (v_map ->> 'max_attempts')::numeric NOT BETWEEN 1 AND 2147483647
                                  OR (v_map ->> 'max_attempts')::numeric % 1 <> 0) THEN
        PERFORM outbox.invalid_argument('p_mapping', format(
            'max_attempts must be a whole number from 1 to 2147483647, got %s', v_map -> 'max_attempts'));
    END IF;

    EXECUTE format('CREATE OR REPLACE TRIGGER outbox_adopt AFTER INSERT ON %s '
                   'FOR EACH ROW EXECUTE FUNCTION outbox.adopted_row(%L)', p_table, v_map::text);
    EXECUTE format('CREATE OR REPLACE TRIGGER outbox_adopt_updates AFTER UPDATE ON %s '
                   'REFERENCING NEW TABLE AS outbox_adopt_updated_rows '
                   'FOR EACH STATEMENT EXECUTE FUNCTION outbox.adopted_row_updated()', p_table);
    RETURN v_map;
END;
$$;

COMMENT ON FUNCTION outbox.adopt_table(regclass, text, jsonb) IS
    'Adopts a table: installs the triggers that enqueue each inserted row as a message (preset debezium, or a mapping of columns); returns the resolved mapping; P7001 on a bad table, preset or mapping.';

REVOKE ALL ON FUNCTION outbox.adopt_table(regclass, text, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.adopt_table(regclass, text, jsonb) TO outbox_relay;


-- outbox.unadopt_table: ends an adoption: drops the triggers outbox_adopt and
-- outbox_adopt_updates that adopt_table installed on the table.
--
-- Inputs:     p_table, the table.
-- Returns:    true when the table was adopted, false when it was not (nothing changed).
-- Locks:      the table, ACCESS EXCLUSIVE (DROP TRIGGER), until the caller's commit.
-- Guarantees: the table is as it was before adopt_table: columns, rows, rights and its
--             other triggers untouched (a trigger of another function that happens to be
--             named outbox_adopt is left alone). Messages already enqueued stay in the
--             outbox and are delivered.
-- Raises:     P7001 (p_table) when it is NULL or a partition (unadopt its partitioned
--             table); 42501 without the right to drop triggers
--             of the table (its owner).
CREATE OR REPLACE FUNCTION outbox.unadopt_table(p_table regclass) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_adopted boolean := false;
BEGIN
    IF p_table IS NULL THEN
        PERFORM outbox.invalid_argument('p_table', 'must not be NULL');
    END IF;
    -- A partition's triggers are its parent's: the parent is adopted (and unadopted).
    IF (SELECT c.relispartition FROM pg_class AS c WHERE c.oid = p_table) THEN
        PERFORM outbox.invalid_argument('p_table', format(
            '%s is a partition of %s: adopt (and unadopt) the partitioned table instead',
            p_table, (SELECT i.inhparent::regclass FROM pg_inherits AS i WHERE i.inhrelid = p_table)));
    END IF;
    IF EXISTS (SELECT 1 FROM pg_trigger AS t
                WHERE t.tgrelid = p_table AND t.tgname = 'outbox_adopt'
                  AND t.tgfoid = 'outbox.adopted_row()'::regprocedure) THEN
        EXECUTE format('DROP TRIGGER outbox_adopt ON %s', p_table);
        v_adopted := true;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_trigger AS t
                WHERE t.tgrelid = p_table AND t.tgname = 'outbox_adopt_updates'
                  AND t.tgfoid = 'outbox.adopted_row_updated()'::regprocedure) THEN
        EXECUTE format('DROP TRIGGER outbox_adopt_updates ON %s', p_table);
    END IF;
    RETURN v_adopted;
END;
$$;

COMMENT ON FUNCTION outbox.unadopt_table(regclass) IS
    'Ends the adoption of a table: drops the triggers adopt_table installed and nothing else; returns whether it was adopted; P7001 on a NULL table.';

REVOKE ALL ON FUNCTION outbox.unadopt_table(regclass) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.unadopt_table(regclass) TO outbox_relay;


-- outbox.adopted_tables: the tables adopted in this database, one row each (a partitioned
-- table once, not its partitions, whose triggers are clones of its own): table_name (the
-- table, schema-qualified always), mapping (the resolved mapping its trigger holds), enabled
-- (false when the trigger outbox_adopt was disabled with ALTER TABLE … DISABLE TRIGGER:
-- rows inserted then are not relayed). Read from the catalogue (pg_trigger), which is the
-- adoption's only state.
CREATE VIEW outbox.adopted_tables AS
SELECT format('%I.%I', n.nspname, c.relname)                                      AS table_name,
       convert_from(substring(t.tgargs FROM 1 FOR length(t.tgargs) - 1), 'UTF8')::jsonb AS mapping,
       t.tgenabled <> 'D'                                                         AS enabled
  FROM pg_catalog.pg_trigger AS t
  JOIN pg_catalog.pg_class AS c ON c.oid = t.tgrelid
  JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
 WHERE t.tgfoid = 'outbox.adopted_row()'::regprocedure
   AND t.tgname = 'outbox_adopt'
   AND t.tgparentid = 0;

COMMENT ON VIEW outbox.adopted_tables IS
    'The tables adopted in this database (adopt_table): the table, the mapping its trigger holds, and whether the trigger is enabled.';

REVOKE ALL ON outbox.adopted_tables FROM PUBLIC;
GRANT SELECT ON outbox.adopted_tables TO outbox_reader, outbox_relay;

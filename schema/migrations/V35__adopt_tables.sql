-- Adopting a table an application already writes (Debezium's outbox table, or any table
-- by a mapping of its columns): adopt_table installs an AFTER INSERT row trigger whose
-- function, adopted_row, enqueues each inserted row through outbox.enqueue in the
-- inserting transaction; adopted_row_updated warns of an UPDATE; unadopt_table removes
-- both triggers; the view adopted_tables lists the adoptions from the catalogue. Contracts
-- in full: 10_adopt.sql.


-- outbox.adopted_row: the row trigger of an adopted table (trigger outbox_adopt). Not
-- callable other than as a trigger.
--
-- Inputs:     TG_ARGV[0], the resolved mapping (see the header) as adopt_table wrote it;
--             NEW, the inserted row.
-- Returns:    NULL (an AFTER trigger: the row is inserted as given).
-- Locks:      those of outbox.enqueue.
-- Guarantees: exactly one outbox.enqueue call per inserted row, in the inserting
--             transaction and with its rights.
-- Raises:     what outbox.enqueue raises for the row (P7001 for a NULL topic, 23505 for a
--             known id); 22P02 for an id that is not a uuid, 22007/22008 for a bad time.
--             Each fails the producer's INSERT: nothing is inserted that is not relayed.
-- Shape:      the row is read through to_jsonb(NEW) once, so one function serves every
--             table and mapping; the mapping is parsed from the trigger argument per row.
CREATE OR REPLACE FUNCTION outbox.adopted_row() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_map jsonb := TG_ARGV[0]::jsonb;
    v_row jsonb := to_jsonb(NEW);
    v_kind text := v_map ->> 'payload_kind';
    v_payload bytea;
    v_content_type text;
    v_headers jsonb := '{}';
    v_header record;
    v_trace text;
BEGIN
    IF v_row ->> (v_map ->> 'payload') IS NULL THEN
        -- No payload: an empty one, of no type (a tombstone for the debezium envelope).
        v_payload := '\x'::bytea;
        v_content_type := 'application/octet-stream';
    ELSIF v_kind = 'json' THEN
        v_payload := convert_to((v_row -> (v_map ->> 'payload'))::text, 'UTF8');
        v_content_type := 'application/json';
    ELSIF v_kind = 'text' THEN
        v_payload := convert_to(v_row ->> (v_map ->> 'payload'), 'UTF8');
        v_content_type := 'text/plain; charset=utf-8';
    ELSE
        -- to_jsonb writes a bytea as the text of its hex form, \x…
        v_payload := decode(substr(v_row ->> (v_map ->> 'payload'), 3), 'hex');
        v_content_type := 'application/octet-stream';
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

    PERFORM outbox.enqueue(
        coalesce(v_row ->> (v_map ->> 'topic'), v_map ->> 'topic_value'),
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
-- outbox_adopt_updates, AFTER UPDATE FOR EACH STATEMENT). Not callable other than as a
-- trigger.
--
-- Returns:    NULL; relays nothing.
-- Raises:     a WARNING naming the table, once per UPDATE statement (however many rows it
--             changed): an update of an outbox row is not an event, as Debezium's router
--             also ignores it with a warning.
CREATE OR REPLACE FUNCTION outbox.adopted_row_updated() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE WARNING 'outbox: an UPDATE of the adopted table %.% is not relayed (only inserted rows are)',
        quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME);
    RETURN NULL;
END;
$$;

COMMENT ON FUNCTION outbox.adopted_row_updated() IS
    'Trigger outbox_adopt_updates of an adopted table: warns once per UPDATE statement that updates are not relayed.';

REVOKE ALL ON FUNCTION outbox.adopted_row_updated() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.adopted_row_updated() TO outbox_relay;


-- outbox.adopt_table: adopts a table: from the caller's commit on, each row inserted into
-- it is enqueued as a message.
--
-- Inputs:     p_table    the table (a regular or partitioned table outside schema outbox)
--             p_preset   'debezium' (the default) or NULL for none (p_mapping alone)
--             p_mapping  mapping keys (see the header) that replace the preset's
-- Returns:    the resolved mapping the trigger holds (with payload_kind, from the payload
--             column's type).
-- Locks:      the table, SHARE ROW EXCLUSIVE (CREATE TRIGGER): concurrent inserts wait
--             for the caller's commit, so that no row commits between "not adopted" and
--             "adopted" unseen.
-- Guarantees: idempotent: adopting an adopted table replaces its mapping. The table's
--             columns, rows, rights and other triggers are not changed.
-- Raises:     P7001 (p_table) for a table of schema outbox or a relation that is not a
--             table; P7001 (p_preset) for an unknown preset; P7001 (p_mapping) for a key
--             that is not a mapping key, a column the table lacks, a column of a type the
--             key cannot take, no topic, or no payload. 42501 when the caller lacks the
--             TRIGGER right on the table.
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
BEGIN
    IF p_table IS NULL THEN
        PERFORM outbox.invalid_argument('p_table', 'must not be NULL');
    END IF;
    IF (SELECT c.relkind NOT IN ('r', 'p') FROM pg_class AS c WHERE c.oid = p_table) THEN
        PERFORM outbox.invalid_argument('p_table', format('%s is not a table', p_table));
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
                                  OR (v_map ->> 'max_attempts')::numeric < 1) THEN
        PERFORM outbox.invalid_argument('p_mapping', 'max_attempts must be a number of at least 1');
    END IF;

    v_type := v_columns ->> (v_map ->> 'payload');
    v_map := v_map || jsonb_build_object('payload_kind', CASE
        WHEN v_type IN ('jsonb', 'json') THEN 'json'
        WHEN v_type = 'bytea' THEN 'bytea'
        ELSE 'text' END);

    EXECUTE format('CREATE OR REPLACE TRIGGER outbox_adopt AFTER INSERT ON %s '
                   'FOR EACH ROW EXECUTE FUNCTION outbox.adopted_row(%L)', p_table, v_map::text);
    EXECUTE format('CREATE OR REPLACE TRIGGER outbox_adopt_updates AFTER UPDATE ON %s '
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
-- Raises:     P7001 (p_table) when it is NULL; 42501 without the right to drop triggers
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


-- outbox.adopted_tables: the tables adopted in this database, one row each: table_name (the
-- table, schema-qualified), mapping (the resolved mapping its trigger holds), enabled
-- (false when the trigger outbox_adopt was disabled with ALTER TABLE … DISABLE TRIGGER:
-- rows inserted then are not relayed). Read from the catalogue (pg_trigger), which is the
-- adoption's only state.
CREATE VIEW outbox.adopted_tables AS
SELECT t.tgrelid::regclass::text                                                  AS table_name,
       convert_from(substring(t.tgargs FROM 1 FOR length(t.tgargs) - 1), 'UTF8')::jsonb AS mapping,
       t.tgenabled <> 'D'                                                         AS enabled
  FROM pg_catalog.pg_trigger AS t
 WHERE t.tgfoid = 'outbox.adopted_row()'::regprocedure
   AND t.tgname = 'outbox_adopt';

COMMENT ON VIEW outbox.adopted_tables IS
    'The tables adopted in this database (adopt_table): the table, the mapping its trigger holds, and whether the trigger is enabled.';

REVOKE ALL ON outbox.adopted_tables FROM PUBLIC;
GRANT SELECT ON outbox.adopted_tables TO outbox_reader, outbox_relay;

-- Each rule of the claim and the completion written once. claim_outbox_batch, a copy of
-- claim_outbox_batch_seq's body less seq, becomes one statement that calls
-- claim_outbox_batch_seq (same signature, row type, leases and errors). The slot dispatches
-- of claim_outbox_batch_seq, lease_candidates and complete_outbox_batch are written with the
-- arm for slot 0 alone, and the new dispatch_for_slots writes the arms of slots 1 to 3 when
-- the function is created, as copy_for_slots writes the copies of a slot 0 template. Both
-- now check the rule they rewrite by and refuse, with SQLSTATE 42P13 naming the function, a
-- function that does not follow it. Behaviour is unchanged: the dispatches have the same
-- arms, a CASE where there was an IF chain. Contracts in full: 04_claim.sql and
-- 05_completion.sql.

-- outbox.copy_for_slots (internal): creates the copies for slots 1 to 3 of a slot 0
-- template, or refuses a function that does not follow the copying rule.
--
-- The rule: a slot 0 template is a function named <stem>_slot0 that names slot 0's table
-- only as `outbox.messages_0 AS <alias>`, and no table or function of slots 1 to 3. Its
-- copy for slot n is its definition with every `outbox.messages_0 AS` reading
-- `outbox.messages_n AS`, and every name ending in _slot0 (its own, and those of the slot 0
-- templates it calls) ending in _slotn; with its comment (`slot 0` reading `slot n`) and
-- no grant. Called once per template by the area file (and the migration) that creates it.
--
-- Raises:     42P13 (invalid_function_definition), naming the function and what the rule
--             expected, and creating nothing, when the name does not end in _slot0; when
--             the template names messages_0 other than as `outbox.messages_0 AS alias`
--             (a copy would keep it, reading slot 0 whatever its slot); when it names a
--             table or function of slots 1 to 3 (every copy would keep it); or when it
--             names neither slot 0's table nor a slot 0 function (its copies would be
--             itself).
CREATE OR REPLACE FUNCTION outbox.copy_for_slots(p_template regprocedure) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_rule constant text := 'A slot 0 template is named <stem>_slot0 and names slot 0''s table '
        'only as `outbox.messages_0 AS alias`, and no table or function of slots 1 to 3; '
        'each copy renumbers both (outbox.copy_for_slots, schema/04_claim.sql).';
    v_name text;
    v_def text;
    v_body text;
    v_found text;
    v_copy text;
    v_oid regprocedure;
BEGIN
    SELECT p.proname, pg_get_functiondef(p.oid), p.prosrc
      INTO v_name, v_def, v_body
      FROM pg_proc AS p
     WHERE p.oid = p_template;
    IF v_name NOT LIKE '%\_slot0' THEN
        RAISE EXCEPTION 'copy_for_slots: % is not a slot 0 template: its name does not end in _slot0',
                        p_template
              USING ERRCODE = 'invalid_function_definition', HINT = v_rule;
    END IF;
    -- slot 0's table named other than `outbox.messages_0 AS alias`: a copy would keep it
    SELECT l INTO v_found
      FROM regexp_split_to_table(v_body, E'\n') AS l
     WHERE regexp_replace(l, '\moutbox\.messages_0 AS ', '', 'g') ~ '\mmessages_0\M'
     LIMIT 1;
    IF v_found IS NOT NULL THEN
        RAISE EXCEPTION 'copy_for_slots: % names messages_0 other than as `outbox.messages_0 AS alias`, which each copy renumbers',
                        p_template
              USING ERRCODE = 'invalid_function_definition',
                    DETAIL = format('In the line: %s', btrim(v_found)), HINT = v_rule;
    END IF;
    v_found := substring(v_body FROM '\m(messages_[1-3]|[a-z0-9_]+_slot[1-3])\M');
    IF v_found IS NOT NULL THEN
        RAISE EXCEPTION 'copy_for_slots: % names %, of slot %: every copy would keep it',
                        p_template, v_found, right(v_found, 1)
              USING ERRCODE = 'invalid_function_definition', HINT = v_rule;
    END IF;
    IF v_body !~ '\moutbox\.messages_0 AS |_slot0\M' THEN
        RAISE EXCEPTION 'copy_for_slots: % names neither `outbox.messages_0 AS alias` nor a slot 0 function: its copies would be the same function',
                        p_template
              USING ERRCODE = 'invalid_function_definition', HINT = v_rule;
    END IF;
    FOR v_slot IN 1 .. 3 LOOP
        v_copy := regexp_replace(v_def, '\moutbox\.messages_0 AS ', 'outbox.messages_' || v_slot || ' AS ', 'g');
        v_copy := regexp_replace(v_copy, '_slot0\M', '_slot' || v_slot, 'g');
        EXECUTE v_copy;
        v_oid := to_regprocedure(regexp_replace(p_template::text, '_slot0\(', '_slot' || v_slot || '('));
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', v_oid);
        EXECUTE format('COMMENT ON FUNCTION %s IS %L', v_oid,
                       replace(obj_description(p_template, 'pg_proc'), 'slot 0', 'slot ' || v_slot));
    END LOOP;
END;
$$;

COMMENT ON FUNCTION outbox.copy_for_slots(regprocedure) IS
    'Internal: creates the copies for slots 1 to 3 of a slot 0 template (<stem>_slot0, naming slot 0''s table only as `outbox.messages_0 AS alias`); 42P13 naming the function for one that does not follow that rule.';
REVOKE ALL ON FUNCTION outbox.copy_for_slots(regprocedure) FROM PUBLIC;


-- outbox.dispatch_for_slots (internal): writes out the slot dispatches of a function that
-- calls slot 0 templates, or refuses one that does not follow the dispatch rule.
--
-- The rule: a function that calls the copies of a slot 0 template chooses the slot in a
-- dispatch written with the arm for slot 0 alone, each of these lines on a line of its own:
--
--     CASE <the slot>
--     WHEN 0 THEN
--         <statements calling <stem>_slot0 functions>
--     END CASE;
--
-- (END CASE; at the indentation of its CASE). This function re-creates the function with
-- each dispatch holding four arms, WHEN 0 to WHEN 3, the arm of slot n being the arm of
-- slot 0 with every name ending in _slot0 ending in _slotn; a slot outside 0 to 3 raises
-- CASE_NOT_FOUND (20000). Its comment and grants are kept. Called once per function by the
-- area file (and the migration) that creates it, after its CREATE.
--
-- Raises:     42P13 (invalid_function_definition), naming the function and what the rule
--             expected, and changing nothing, when the function is itself a slot 0
--             template; names a function or table of slots 1 to 3 (an arm written by hand,
--             or a dispatch already written out); names a slot 0 function outside a
--             dispatch, in its code (it would run for slot 0 whatever the slot); holds a dispatch with no
--             END CASE; at its CASE's indentation, or whose arm calls no slot 0 function;
--             or holds no dispatch.
CREATE FUNCTION outbox.dispatch_for_slots(p_function regprocedure) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_rule constant text := 'A slot dispatch is written `CASE <the slot>`, `WHEN 0 THEN`, the arm '
        'for slot 0 (calling <stem>_slot0 functions) and `END CASE;` at the CASE''s indentation, '
        'each on a line of its own; outbox.dispatch_for_slots writes the arms of slots 1 to 3 '
        '(schema/04_claim.sql).';
    v_name text;
    v_def text;
    v_body text;
    v_lines text[];
    v_out text[] := '{}';
    v_i integer := 1;
    v_end integer;
    v_indent text;
    v_when text;
    v_arm text;
    v_found text;
    v_dispatches integer := 0;
BEGIN
    SELECT p.proname, pg_get_functiondef(p.oid), p.prosrc
      INTO v_name, v_def, v_body
      FROM pg_proc AS p
     WHERE p.oid = p_function;
    IF v_name LIKE '%\_slot0' THEN
        RAISE EXCEPTION 'dispatch_for_slots: % is a slot 0 template: outbox.copy_for_slots makes its copies',
                        p_function
              USING ERRCODE = 'invalid_function_definition', HINT = v_rule;
    END IF;
    v_found := substring(v_body FROM '\m(messages_[1-3]|[a-z0-9_]+_slot[1-3])\M');
    IF v_found IS NOT NULL THEN
        RAISE EXCEPTION 'dispatch_for_slots: % names %, of slot %: expected the arm for slot 0 alone in each dispatch',
                        p_function, v_found, right(v_found, 1)
              USING ERRCODE = 'invalid_function_definition', HINT = v_rule;
    END IF;
    v_lines := string_to_array(v_body, E'\n');
    WHILE v_i <= cardinality(v_lines) LOOP
        IF v_lines[v_i] ~ '^\s*CASE \S' AND v_lines[v_i + 1] ~ '^\s*WHEN 0 THEN$' THEN
            v_indent := substring(v_lines[v_i] FROM '^\s*');
            v_when := substring(v_lines[v_i + 1] FROM '^\s*');
            v_end := NULL;
            FOR v_j IN v_i + 2 .. cardinality(v_lines) LOOP
                IF v_lines[v_j] = v_indent || 'END CASE;' THEN
                    v_end := v_j;
                    EXIT;
                END IF;
            END LOOP;
            IF v_end IS NULL THEN
                RAISE EXCEPTION 'dispatch_for_slots: % holds a dispatch with no `END CASE;` at its CASE''s indentation',
                                p_function
                      USING ERRCODE = 'invalid_function_definition',
                            DETAIL = format('The dispatch: %s', btrim(v_lines[v_i])), HINT = v_rule;
            END IF;
            v_arm := array_to_string(v_lines[v_i + 2 : v_end - 1], E'\n');
            IF v_arm IS NULL OR v_arm !~ '_slot0\M' THEN
                RAISE EXCEPTION 'dispatch_for_slots: % holds a dispatch whose arm calls no slot 0 function',
                                p_function
                      USING ERRCODE = 'invalid_function_definition',
                            DETAIL = format('The dispatch: %s', btrim(v_lines[v_i])), HINT = v_rule;
            END IF;
            v_out := v_out || v_lines[v_i : v_end - 1];
            FOR v_slot IN 1 .. 3 LOOP
                v_out := v_out || (v_when || 'WHEN ' || v_slot || ' THEN')
                               || string_to_array(regexp_replace(v_arm, '_slot0\M', '_slot' || v_slot, 'g'), E'\n');
            END LOOP;
            v_out := v_out || v_lines[v_end];
            v_dispatches := v_dispatches + 1;
            v_i := v_end + 1;
        ELSE
            -- (comments aside)
            IF regexp_replace(v_lines[v_i], '--.*$', '') ~ '_slot0\M' THEN
                RAISE EXCEPTION 'dispatch_for_slots: % names a slot 0 function outside a dispatch: it would run for slot 0 whatever the slot',
                                p_function
                      USING ERRCODE = 'invalid_function_definition',
                            DETAIL = format('In the line: %s', btrim(v_lines[v_i])), HINT = v_rule;
            END IF;
            v_out := v_out || v_lines[v_i];
            v_i := v_i + 1;
        END IF;
    END LOOP;
    IF v_dispatches = 0 THEN
        RAISE EXCEPTION 'dispatch_for_slots: % holds no slot dispatch', p_function
              USING ERRCODE = 'invalid_function_definition', HINT = v_rule;
    END IF;
    EXECUTE replace(v_def, v_body, array_to_string(v_out, E'\n'));
END;
$$;

COMMENT ON FUNCTION outbox.dispatch_for_slots(regprocedure) IS
    'Internal: writes out the slot dispatches of a function (each written `CASE <slot>` / `WHEN 0 THEN` / the arm for slot 0 / `END CASE;`) with the arms of slots 1 to 3; 42P13 naming the function for one that does not follow that rule.';
REVOKE ALL ON FUNCTION outbox.dispatch_for_slots(regprocedure) FROM PUBLIC;


CREATE OR REPLACE FUNCTION outbox.claim_outbox_batch_seq(
    p_batch_size integer,
    p_worker_id text,
    p_lease_seconds integer,
    p_topics text[] DEFAULT NULL,
    p_exclude_topics text[] DEFAULT NULL,
    p_max_bytes bigint DEFAULT NULL,
    p_max_message_bytes bigint DEFAULT NULL
) RETURNS TABLE (
    outbox_id uuid,
    lease_token uuid,
    topic text,
    message_key text,
    payload bytea,
    content_type text,
    headers jsonb,
    attempt_no integer,
    created_at timestamptz,
    lease_expires_at timestamptz,
    payload_bytes bigint,
    seq bigint
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_custom_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_sort = off
SET jit = off
AS $$
DECLARE
    v_start integer;
    v_shard integer;
    v_busy integer;
    v_turns integer := 0;
    v_ids uuid[] := '{}';
    v_ctids tid[] := '{}';
    v_slots smallint[] := '{}';
    v_slot integer;
    v_ring integer[] := outbox.ring();
    v_probes timestamptz[];
    v_other boolean;
    v_bytes bigint := 0;
    v_now timestamptz := clock_timestamp();
    v_floors timestamptz[];
    v_bound timestamptz;
    v_first timestamptz;
    v_raised timestamptz;
    -- each statement reads a snapshot newer than the bound: floors may be raised
    v_fresh boolean := current_setting('transaction_isolation') = 'read committed';
BEGIN
    IF p_batch_size IS NULL OR p_batch_size < 1 OR p_batch_size > 10000 THEN
        PERFORM outbox.invalid_argument('p_batch_size', format('must be between 1 and 10000, got %s', p_batch_size));
    END IF;
    PERFORM outbox.check_worker_id(p_worker_id);
    IF p_lease_seconds IS NULL OR p_lease_seconds < 1 OR p_lease_seconds > 86400 THEN
        PERFORM outbox.invalid_argument('p_lease_seconds', format('must be between 1 and 86400, got %s', p_lease_seconds));
    END IF;
    IF p_max_bytes IS NOT NULL AND p_max_bytes < 1 THEN
        PERFORM outbox.invalid_argument('p_max_bytes', format('must be at least 1 or NULL, got %s', p_max_bytes));
    END IF;
    IF p_max_message_bytes IS NOT NULL AND p_max_message_bytes < 1 THEN
        PERFORM outbox.invalid_argument('p_max_message_bytes', format('must be at least 1 or NULL, got %s', p_max_message_bytes));
    END IF;
    PERFORM set_config('synchronous_commit', 'off', true);
    v_floors := outbox.claim_floors();
    v_bound := outbox.claim_floor_bound();

    -- The shards in turn from a random one. Each is probed for a ready entry before its
    -- turn is taken, so that an idle queue costs no turn; the probe is a hint only (it
    -- stops at the first entry, leased or not): the shard is read again under its turn.
    -- Shards that other claims hold are skipped. Only when pass 1 took no turn while some
    -- shard has work (all such shards are held) does pass 2 wait, for the turn of the first
    -- shard it found with work, and then go on round the others, skipping those held.
    v_start := floor(random() * 16)::integer;
    FOR v_pass IN 1 .. 2 LOOP
        EXIT WHEN v_turns > 0 OR (v_pass = 2 AND v_busy IS NULL);
        FOR v_i IN 0 .. 15 LOOP
            v_shard := (v_start + v_i) % 16;
            IF v_pass = 2 AND v_shard = v_busy THEN
                PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'claim:' || v_shard FOR UPDATE;
            ELSE
                -- The shard's first entry from its floor, leased or not: it raises the floor
                -- (claim_floor_bound), and no entry due by now means no work.
                v_probes := outbox.claim_probe_slots(v_shard, v_floors[v_shard + 1]);
                v_first := least(v_probes[1], v_probes[2], v_probes[3], v_probes[4]);
                v_raised := least(coalesce(v_first, 'infinity'), v_bound);
                IF v_raised > v_floors[v_shard + 1] AND v_fresh THEN
                    v_floors[v_shard + 1] := outbox.raise_claim_floor(v_shard, v_floors[v_shard + 1], v_raised);
                END IF;
                CONTINUE WHEN v_first IS NULL OR v_first > v_now;
                CONTINUE WHEN (p_topics IS NOT NULL OR p_exclude_topics IS NOT NULL) AND NOT EXISTS (
                    SELECT 1
                      FROM outbox.messages AS c
                     WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = v_shard
                       AND NOT c.behind
                       AND c.available_at >= v_floors[v_shard + 1]
                       AND c.available_at <= v_now
                       AND (p_topics IS NULL OR c.topic = ANY (p_topics))
                       AND (p_exclude_topics IS NULL OR NOT c.topic LIKE ANY (p_exclude_topics)));
                v_busy := coalesce(v_busy, v_shard);
                PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'claim:' || v_shard FOR UPDATE SKIP LOCKED;
                CONTINUE WHEN NOT FOUND;
            END IF;
            v_turns := v_turns + 1;
            IF v_pass = 2 THEN
                v_probes := outbox.claim_probe_slots(v_shard, v_floors[v_shard + 1]);
            END IF;
            -- The shard's candidates slot by slot, oldest first, in the slots it has work in.
            FOREACH v_slot IN ARRAY v_ring LOOP
                EXIT WHEN cardinality(v_ids) >= p_batch_size
                       OR (p_max_bytes IS NOT NULL AND v_bytes >= p_max_bytes);
                CONTINUE WHEN v_probes[v_slot + 1] IS NULL OR v_probes[v_slot + 1] > v_now;
                -- Keys are checked in the other slots only where the shard has entries.
                v_other := num_nonnulls(v_probes[1], v_probes[2], v_probes[3], v_probes[4]) > 1;
                -- the arm for slot 0; outbox.dispatch_for_slots writes the others
                CASE v_slot
                WHEN 0 THEN
                    SELECT v_ids || s.ids, v_ctids || s.ctids,
                           v_slots || array_fill(v_slot::smallint, ARRAY[cardinality(s.ids)]),
                           v_bytes + s.bytes
                      INTO v_ids, v_ctids, v_slots, v_bytes
                      FROM outbox.claim_shard_candidates_slot0(v_shard, v_floors[v_shard + 1], v_now,
                               p_batch_size - cardinality(v_ids), v_bytes, p_topics, p_exclude_topics,
                               p_max_bytes, p_max_message_bytes, v_other) AS s;
                END CASE;
            END LOOP;
            EXIT WHEN cardinality(v_ids) >= p_batch_size
                   OR (p_max_bytes IS NOT NULL AND v_bytes >= p_max_bytes);
        END LOOP;
    END LOOP;

    -- Nothing chosen: nothing to lease (and no UPDATE to plan).
    IF cardinality(v_ids) = 0 THEN
        RETURN;
    END IF;
    -- The lease, in each slot by tuple address: in one slot's copy of lease_slot0 (the arm
    -- for slot 0; outbox.dispatch_for_slots writes the others), or slot by slot.
    v_slot := v_slots[1];
    IF v_slot = ALL (v_slots) THEN
        CASE v_slot
        WHEN 0 THEN
            RETURN QUERY
            SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
                   l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes, l.seq
              FROM outbox.lease_slot0(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes) AS l
             ORDER BY l.seq;
        END CASE;
    ELSE
        RETURN QUERY
        SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
               l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes, l.seq
          FROM outbox.lease_candidates(v_ids, v_ctids, v_slots, p_worker_id, p_lease_seconds,
                                       p_max_message_bytes) AS l
         ORDER BY l.seq;
    END IF;
END;
$$;

COMMENT ON FUNCTION outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint) IS
    'Leases up to p_batch_size ready messages (unkeyed ones, heads of keys, and the runs behind keyed heads) to p_worker_id for p_lease_seconds, within the topic filters and byte budget; rows in enqueue order, each with its seq; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint) TO outbox_relay;
SELECT outbox.dispatch_for_slots('outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint)');


-- outbox.claim_outbox_batch: claim_outbox_batch_seq without the seq column, kept for the
-- callers of the claim's signature before seq (relayers of releases before V25, which
-- prepare statements of its row type: docs/upgrades.md). It calls claim_outbox_batch_seq and
-- returns its rows in the same order (enqueue order) less seq: its inputs, locks,
-- guarantees, errors and crash behaviour are claim_outbox_batch_seq's, and it has no rule
-- of its own. A later release's migration drops it, once nothing that calls it can still
-- be running.
CREATE OR REPLACE FUNCTION outbox.claim_outbox_batch(
    p_batch_size integer,
    p_worker_id text,
    p_lease_seconds integer,
    p_topics text[] DEFAULT NULL,
    p_exclude_topics text[] DEFAULT NULL,
    p_max_bytes bigint DEFAULT NULL,
    p_max_message_bytes bigint DEFAULT NULL
) RETURNS TABLE (
    outbox_id uuid,
    lease_token uuid,
    topic text,
    message_key text,
    payload bytea,
    content_type text,
    headers jsonb,
    attempt_no integer,
    created_at timestamptz,
    lease_expires_at timestamptz,
    payload_bytes bigint
)
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT c.outbox_id, c.lease_token, c.topic, c.message_key, c.payload, c.content_type,
           c.headers, c.attempt_no, c.created_at, c.lease_expires_at, c.payload_bytes
      FROM outbox.claim_outbox_batch_seq(p_batch_size, p_worker_id, p_lease_seconds, p_topics,
                                         p_exclude_topics, p_max_bytes, p_max_message_bytes) AS c
$$;

COMMENT ON FUNCTION outbox.claim_outbox_batch(integer, text, integer, text[], text[], bigint, bigint) IS
    'Kept for callers of the claim before seq: claim_outbox_batch_seq, which it calls, without the seq column (same leases, rows in enqueue order; P7001 on a bad argument). Dropped by a later release.';

REVOKE ALL ON FUNCTION outbox.claim_outbox_batch(integer, text, integer, text[], text[], bigint, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.claim_outbox_batch(integer, text, integer, text[], text[], bigint, bigint) TO outbox_relay;


-- outbox.lease_candidates (internal): leases what the claim chose when it spans slots,
-- slot by slot.
CREATE OR REPLACE FUNCTION outbox.lease_candidates(
    p_ids uuid[],
    p_ctids tid[],
    p_slots smallint[],
    p_worker_id text,
    p_lease_seconds integer,
    p_max_message_bytes bigint
) RETURNS TABLE (
    outbox_id uuid,
    lease_token uuid,
    topic text,
    message_key text,
    payload bytea,
    content_type text,
    headers jsonb,
    attempt_no integer,
    created_at timestamptz,
    lease_expires_at timestamptz,
    payload_bytes bigint,
    seq bigint
)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_slot integer;
    v_ids uuid[];
    v_ctids tid[];
BEGIN
    -- in slot order, the completions' lock order
    FOREACH v_slot IN ARRAY ARRAY(SELECT DISTINCT u.slot FROM unnest(p_slots) AS u(slot) ORDER BY 1) LOOP
        SELECT array_agg(u.id), array_agg(u.ctid) INTO v_ids, v_ctids
          FROM unnest(p_ids, p_ctids, p_slots) AS u(id, ctid, slot)
         WHERE u.slot = v_slot;
        -- the arm for slot 0; outbox.dispatch_for_slots writes the others
        CASE v_slot
        WHEN 0 THEN
            RETURN QUERY SELECT * FROM outbox.lease_slot0(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes);
        END CASE;
    END LOOP;
END;
$$;

COMMENT ON FUNCTION outbox.lease_candidates(uuid[], tid[], smallint[], text, integer, bigint) IS
    'Internal: leases a claim''s chosen rows slot by slot, in slot order.';
REVOKE ALL ON FUNCTION outbox.lease_candidates(uuid[], tid[], smallint[], text, integer, bigint) FROM PUBLIC;
SELECT outbox.dispatch_for_slots('outbox.lease_candidates(uuid[], tid[], smallint[], text, integer, bigint)');


CREATE OR REPLACE FUNCTION outbox.complete_outbox_batch(
    p_worker_id text,
    p_outbox_ids uuid[],
    p_lease_tokens uuid[],
    p_states outbox.attempt_state[],
    p_errors text[],
    p_retry_ats timestamptz[]
) RETURNS TABLE (outbox_id uuid, attempt_no integer, lease_lost boolean, dead_lettered boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = force_custom_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    v_slot integer;
    v_slots integer[];
    v_ids uuid[];
    v_tokens uuid[];
    v_states outbox.attempt_state[];
    v_errors text[];
    v_retry_ats timestamptz[];
    v_out_ids uuid[] := '{}';
    v_out_nos integer[] := '{}';
    v_out_lost boolean[] := '{}';
    v_out_dead boolean[] := '{}';
BEGIN
    PERFORM outbox.check_worker_id(p_worker_id);
    PERFORM outbox.check_leases(p_outbox_ids, p_lease_tokens);
    IF p_states IS NULL OR cardinality(p_states) <> cardinality(p_outbox_ids) THEN
        PERFORM outbox.invalid_argument('p_states', 'must have one state per outbox id');
    END IF;
    IF array_position(p_states, NULL) IS NOT NULL THEN
        PERFORM outbox.invalid_argument('p_states', 'must not contain NULL');
    END IF;
    IF 'ZOMBIE_REQUEUE' = ANY (p_states) THEN
        PERFORM outbox.invalid_argument('p_states',
            'ZOMBIE_REQUEUE is recorded by repair_expired_leases, not by a completion');
    END IF;
    IF p_errors IS NOT NULL AND cardinality(p_errors) <> cardinality(p_outbox_ids) THEN
        PERFORM outbox.invalid_argument('p_errors', 'must be NULL or have one element per outbox id');
    END IF;
    IF p_retry_ats IS NOT NULL AND cardinality(p_retry_ats) <> cardinality(p_outbox_ids) THEN
        PERFORM outbox.invalid_argument('p_retry_ats', 'must be NULL or have one element per outbox id');
    END IF;
    IF EXISTS (SELECT 1
                 FROM unnest(p_states, p_retry_ats) AS u(state, retry_at)
                WHERE u.retry_at IS NOT NULL AND u.state <> 'RETRYABLE') THEN
        PERFORM outbox.invalid_argument('p_retry_ats',
            'a retry time is only allowed with state RETRYABLE, not with a terminal state');
    END IF;

    -- Each listed message is in the slot its lease token names; a token naming no slot
    -- (not issued by a claim) matches no lease.
    v_slot := outbox.token_slot(p_lease_tokens[1]);
    IF v_slot < 4 AND NOT EXISTS (SELECT 1
                                     FROM unnest(p_lease_tokens) AS u(token)
                                    WHERE outbox.token_slot(u.token) <> v_slot) THEN
        -- the arm for slot 0; outbox.dispatch_for_slots writes the others
        CASE v_slot
        WHEN 0 THEN
            RETURN QUERY SELECT * FROM outbox.complete_outbox_batch_slot0(p_worker_id, p_outbox_ids,
                             p_lease_tokens, p_states, p_errors, p_retry_ats);
        END CASE;
        RETURN;
    END IF;
    SELECT array_agg(DISTINCT outbox.token_slot(u.token) ORDER BY outbox.token_slot(u.token))
      INTO v_slots
      FROM unnest(p_lease_tokens) AS u(token);

    -- Several slots: the completion locks of all their keys first, in one order, then
    -- slot by slot in slot order; rows in the call's order.
    PERFORM outbox.lock_keys(ARRAY(SELECT u.id
                                     FROM unnest(p_outbox_ids, p_lease_tokens) AS u(id, token)
                                    WHERE outbox.token_keyed(u.token)));
    FOREACH v_slot IN ARRAY coalesce(v_slots, '{}') LOOP
        CONTINUE WHEN v_slot > 3;
        SELECT array_agg(u.id ORDER BY u.ord), array_agg(u.token ORDER BY u.ord),
               array_agg(u.state ORDER BY u.ord), array_agg(u.error ORDER BY u.ord),
               array_agg(u.retry_at ORDER BY u.ord)
          INTO v_ids, v_tokens, v_states, v_errors, v_retry_ats
          FROM unnest(p_outbox_ids, p_lease_tokens, p_states, p_errors, p_retry_ats)
                   WITH ORDINALITY AS u(id, token, state, error, retry_at, ord)
         WHERE outbox.token_slot(u.token) = v_slot;
        IF p_errors IS NULL THEN
            v_errors := NULL;
        END IF;
        IF p_retry_ats IS NULL THEN
            v_retry_ats := NULL;
        END IF;
        CASE v_slot
        WHEN 0 THEN
            SELECT v_out_ids || array_agg(r.outbox_id), v_out_nos || array_agg(r.attempt_no),
                   v_out_lost || array_agg(r.lease_lost), v_out_dead || array_agg(r.dead_lettered)
              INTO v_out_ids, v_out_nos, v_out_lost, v_out_dead
              FROM outbox.complete_outbox_batch_slot0(p_worker_id, v_ids, v_tokens, v_states,
                                                      v_errors, v_retry_ats) AS r;
        END CASE;
    END LOOP;
    RETURN QUERY
    SELECT u.id, r.attempt_no, coalesce(r.lease_lost, true), coalesce(r.dead_lettered, false)
      FROM unnest(p_outbox_ids) WITH ORDINALITY AS u(id, ord)
      LEFT JOIN unnest(v_out_ids, v_out_nos, v_out_lost, v_out_dead) AS r(id, attempt_no, lease_lost, dead_lettered)
             ON r.id = u.id
     ORDER BY u.ord;
END;
$$;

COMMENT ON FUNCTION outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) IS
    'Records each listed outcome (DISPATCHED, FAILED, RETRYABLE) whose lease p_worker_id still holds with that token; returns per id, in call order, attempt_no, lease_lost and dead_lettered; a lost lease changes nothing; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) TO outbox_relay;
SELECT outbox.dispatch_for_slots('outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[])');

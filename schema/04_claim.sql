-- The claim: a worker leases a batch of ready messages, and gets with each one the lease
-- token that fences every later call about it (05_completion.sql).
--
-- Called by: outbox_relay, through claim_outbox_batch_seq (the relayer) or
-- claim_outbox_batch (the same claim without seq, kept for callers of the claim before seq,
-- which prepare statements of its row type; docs/upgrades.md). The other functions are
-- internal: the claims call them, and no role may execute them.
--
-- Functions:
--   outbox.claim_outbox_batch_seq  leases up to a batch of ready messages to one worker,
--                                  with each message's seq
--   outbox.claim_outbox_batch_seq (seven arguments)
--                                  the same with every topic its other filters admit, by
--                                  calling it; for psql and callers before p_include_topics
--   outbox.claim_outbox_batch      the same without seq, by calling it; kept for callers of
--                                  the claim before seq
--   outbox.copy_for_slots          internal: copies a slot 0 template for slots 1 to 3
--   outbox.dispatch_for_slots      internal: writes out the slot dispatches of its callers
--   outbox.token_slot, token_keyed internal: what a lease token says of its message
--   outbox.ring                    internal: the four slots, oldest first
--   outbox.claim_shard_candidates_slot0 (and _slot1 … _slot3)
--                                  internal: chooses and locks one shard's messages in
--                                  one slot
--   outbox.lease_slot0 (and _slot1 … _slot3)
--                                  internal: leases chosen rows of one slot
--   outbox.lease_candidates        internal: leases chosen rows of several slots
--   outbox.key_pending_before      internal: a key's earlier message in any slot
--   outbox.claim_probe_slots       internal: a shard's first entry from its floor, per slot
--   outbox.claim_floors            internal: where each shard's walk starts (the floors)
--   outbox.raise_claim_floor       internal: sets one shard's floor
--   outbox.claim_floor_bound       internal: the bound every floor is capped by
--   outbox.lower_claim_floor       internal trigger function: messages dated in the past
--
-- Conventions shared by all of them:
-- * Ready: available_at at or before the claim's start (the clock when it is called, so a
--   message enqueued earlier in the caller's own transaction counts), no lease
--   (lease_token IS NULL), topic in p_topics when given, matching one of the LIKE
--   patterns of p_include_topics when given and none of those of p_exclude_topics when
--   given.
-- * Heads and runs. "Its key" is the message's order_key: its message_key, or its
--   message_key on its topic alone when its topic's key order is scoped per topic, as
--   enqueue decided it (mark_behind, 01_tables.sql). A keyed message is `behind` when an
--   earlier message of its key is pending (set by a trigger on insert, 01_tables.sql;
--   cleared on the key's next message by the completion that deletes the head,
--   promote_heads in 05_completion.sql). Claims walk only messages_shard_heads_idx, which
--   holds unkeyed messages and heads (NOT behind), so the messages waiting behind a head
--   cost a claim nothing. A keyed head is taken only when no earlier message of its key is
--   pending at all (one probe of messages_order_key_seq_idx), so a stale `behind = false`
--   never breaks key order. A run is
--   what a claim takes behind a keyed head it holds: the messages that follow it in its
--   key, consecutively, while each is ready, unleased, on the head's topic and within the
--   payload limit.
-- * Shards and turns. A message's shard is hashtext(coalesce(message_key, outbox_id::text))
--   & 15, written out the same way in every query and in the index, so the planner matches
--   messages_shard_heads_idx (shard, available_at, seq). All messages of a message_key
--   share a shard, and so do those of an order key, but for two message_keys that share
--   one (a key holding the unit separator, mark_behind in 01_tables.sql): their chain may
--   span two shards, and keeps its order because the head check and the runs look the
--   order key up in messages_order_key_seq_idx, whatever the shard. Each shard has a
--   turn, the row 'claim:<shard>' of outbox.turns, locked FOR UPDATE by the claim that
--   reads the shard and held until its transaction ends; only the schema owner can lock
--   those rows, so only these SECURITY DEFINER functions take turns.
-- * Floors. Each shard's walk starts at the shard's floor, a time at or before every entry
--   of the shard that is live or being written (the floors' section at the end of this
--   file), so the dead entries of delivered messages that a held MVCC horizon keeps in the
--   index are not stepped over again by every claim.
-- * Slots. outbox.messages is a ring of four slots (01_tables.sql). The claim's probe, its
--   walk and its lease read and write each slot's own table (outbox.messages_0 … _3), not
--   the partitioned parent: through the parent they cost the drain 11–13 %. (A claim with
--   topic filters checks a shard for due entries within them through the parent, before
--   the shard's turn.) Such a function is written once, for slot 0 (a template named
--   <stem>_slot0), and copied for the others by copy_for_slots when the schema is loaded;
--   a function that calls the copies writes the arm for slot 0 of each dispatch, and
--   dispatch_for_slots writes the other arms. Both check the rule they copy by, and refuse
--   a function that does not follow it (below). A claim takes a shard's candidates
--   slot by slot in ring order from the slot after the current one (outbox.ring), which is
--   the oldest first unless a rotation passed over a slot still pending.
-- * Leases: claimed_by, lease_token and lease_expires_at are set together (CHECK
--   messages_lease_complete). They are in no index, so leasing is a HOT update. The token
--   is random (gen_random_uuid()) but for its last hex digit, which names the message's
--   slot (bits 0 and 1) and whether it has a key (bit 2; bit 3 is clear), so that the
--   completion, the heartbeat and the release go straight to the message's slot, and a
--   completion looks up the keys of keyed messages only.
-- * Plans: each statement is planned per call with its arrays and limits as constants
--   (plan_cache_mode = force_custom_plan); sequential scans, bitmap scans, sorts and JIT
--   are off, which leaves ordered index scans that stop at the batch. The probe of a shard
--   (claim_probe_slots, all four slots in one statement), which has no arrays and constant
--   LIMITs, keeps one generic plan per session instead: an idle claim probes all 16 shards.
-- * Errors: P7001 (invalid argument; the message and DETAIL name it), raised by
--   outbox.invalid_argument before anything is read or locked.
-- * Isolation: READ COMMITTED, the relayer's. Under REPEATABLE READ or SERIALIZABLE a row
--   changed after the snapshot raises 40001 where READ COMMITTED checks it again.
-- * Commit: both claims set synchronous_commit off for their transaction
--   (set_config(…, true)); see Crash.


-- outbox.copy_for_slots (internal): creates the copies for slots 1 to 3 of a slot 0
-- template, or refuses a function that does not follow the copying rule.
--
-- The rule: a slot 0 template is a function named <stem>_slot0 that names slot 0's table
-- only as `outbox.messages_0 AS <alias>`, and no table or function of slots 1 to 3. Its
-- copy for slot n is its definition with every `outbox.messages_0 AS` reading
-- `outbox.messages_n AS`, and every name ending in _slot0 (its own, and those of the slot 0
-- templates it calls) ending in _slotn; with its comment (`slot 0` reading `slot n`) and
-- no grant. `outbox` stands for the template's own schema: the outbox in a schema of
-- another name (src/store/naming.rs) is copied by the same rule. Called once per template
-- by the area file (and the migration) that creates it.
--
-- Raises:     42P13 (invalid_function_definition), naming the function and what the rule
--             expected, and creating nothing, when the name does not end in _slot0; when
--             the template names messages_0 other than as `outbox.messages_0 AS alias`
--             (a copy would keep it, reading slot 0 whatever its slot); when it names a
--             table or function of slots 1 to 3 (every copy would keep it); or when it
--             names neither slot 0's table nor a slot 0 function (its copies would be
--             itself).
CREATE FUNCTION outbox.copy_for_slots(p_template regprocedure) RETURNS void
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
    -- the template's schema, as its definition qualifies slot 0's table
    v_table text;
BEGIN
    SELECT p.proname, pg_get_functiondef(p.oid), p.prosrc, n.nspname || '\.messages_'
      INTO v_name, v_def, v_body, v_table
      FROM pg_proc AS p
      JOIN pg_namespace AS n ON n.oid = p.pronamespace
     WHERE p.oid = p_template;
    IF v_name NOT LIKE '%\_slot0' THEN
        RAISE EXCEPTION 'copy_for_slots: % is not a slot 0 template: its name does not end in _slot0',
                        p_template
              USING ERRCODE = 'invalid_function_definition', HINT = v_rule;
    END IF;
    -- slot 0's table named other than `outbox.messages_0 AS alias`: a copy would keep it
    SELECT l INTO v_found
      FROM regexp_split_to_table(v_body, E'\n') AS l
     WHERE regexp_replace(l, '\m' || v_table || '0 AS ', '', 'g') ~ '\mmessages_0\M'
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
    IF v_body !~ ('\m' || v_table || '0 AS |_slot0\M') THEN
        RAISE EXCEPTION 'copy_for_slots: % names neither `outbox.messages_0 AS alias` nor a slot 0 function: its copies would be the same function',
                        p_template
              USING ERRCODE = 'invalid_function_definition', HINT = v_rule;
    END IF;
    FOR v_slot IN 1 .. 3 LOOP
        v_copy := regexp_replace(v_def, '\m' || v_table || '0 AS ',
                                 replace(v_table, '\', '') || v_slot || ' AS ', 'g');
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

-- Lease tokens. A claim's token is random but for its last hex digit, which says where
-- the message is: bits 0 and 1 its slot, bit 2 whether it has a key (so that a completion
-- looks up the keys of keyed messages only), bit 3 clear. A token with bit 3 set was not
-- issued by a claim and matches no lease.

-- outbox.token_slot (internal): the slot a lease token names, or 8 to 11 (no slot).
CREATE FUNCTION outbox.token_slot(p_token uuid) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT get_byte(uuid_send(p_token), 15) & 11
$$;

COMMENT ON FUNCTION outbox.token_slot(uuid) IS
    'Internal: the slot a lease token names (bits 0 and 1 of its last hex digit), or 8 to 11 when bit 3 is set (no slot: not a claim''s token).';
REVOKE ALL ON FUNCTION outbox.token_slot(uuid) FROM PUBLIC;

-- outbox.token_keyed (internal): whether a lease token was issued for a keyed message.
CREATE FUNCTION outbox.token_keyed(p_token uuid) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT get_byte(uuid_send(p_token), 15) & 4 = 4
$$;

COMMENT ON FUNCTION outbox.token_keyed(uuid) IS
    'Internal: whether a lease token was issued for a keyed message (bit 2 of its last hex digit).';
REVOKE ALL ON FUNCTION outbox.token_keyed(uuid) FROM PUBLIC;

-- outbox.ring (internal): the four slots, oldest first: the one after the current slot
-- first, the current slot last.
CREATE FUNCTION outbox.ring() RETURNS integer[]
LANGUAGE sql VOLATILE
AS $$
    SELECT ARRAY[(c + 1) % 4, (c + 2) % 4, (c + 3) % 4, c]
      FROM (SELECT coalesce(pg_sequence_last_value('outbox.message_slot'::regclass), 0)::integer AS c) AS r
$$;

COMMENT ON FUNCTION outbox.ring() IS
    'Internal: the four slots, oldest first (the current slot last).';
REVOKE ALL ON FUNCTION outbox.ring() FROM PUBLIC;


-- outbox.claim_outbox_batch_seq: leases up to p_batch_size ready messages to p_worker_id:
-- unkeyed messages and the heads of keys, and behind each keyed head the run of its key
-- that fits, taken shard by shard starting from a random shard.
--
-- Inputs:     p_batch_size         most messages returned: 1 to 10000.
--             p_worker_id          the worker's id, non-empty; stored in claimed_by, and
--                                  required by every later call about these leases.
--             p_lease_seconds      lease length in seconds, 1 to 86400, counted from now()
--                                  (the start of the caller's transaction).
--             p_topics             claim only these topics (exact names); NULL: every
--                                  topic; an empty array claims nothing.
--             p_exclude_topics     LIKE patterns of topics not to claim (the relayer passes
--                                  those whose destination is down, so that their attempts
--                                  are not spent); NULL (or empty): none.
--             p_max_bytes          byte budget of the batch, at least 1: a message is taken
--                                  while the payload bytes counted before it, in claim
--                                  order, stay under the budget, so the first is always
--                                  taken and the batch exceeds the budget by less than its
--                                  last payload; NULL: no budget.
--             p_max_message_bytes  payload limit, at least 1: a larger message is still
--                                  leased and returned when it is unkeyed or a head (a run
--                                  stops before it), with payload NULL, so the caller can
--                                  dead-letter it without loading it; it counts 0 bytes
--                                  against the budget; NULL: no limit.
--             p_include_topics     LIKE patterns (`\` escapes `%`, `_` and itself) of the
--                                  topics to claim: a topic is claimed only when it
--                                  matches one of them (the relayer passes those its
--                                  routes cover, so that it never takes a message it has
--                                  no destination for); NULL: every topic; an empty array
--                                  claims nothing. Combined with p_topics and
--                                  p_exclude_topics: a topic is claimed when all three
--                                  admit it.
--             Every argument is required: the signature of seven arguments with their
--             defaults (below) is this claim with p_include_topics NULL.
-- Returns:    one row per message leased, in enqueue order (seq): outbox_id; lease_token
--             (new, random but for its last hex digit: see Leases above); topic; message_key; payload (NULL when over
--             p_max_message_bytes); content_type; headers; attempt_no (the number the
--             attempt now starting will get, attempt_count + 1); created_at;
--             lease_expires_at (now() + p_lease_seconds); payload_bytes (the stored
--             payload's length, read from the datum's header without fetching it); seq (the
--             message's enqueue order, outbox.messages.seq: see Guarantees). No rows when
--             nothing is ready in the shards it could take.
-- Locks:      It goes round the 16 shards once, from a random one. Per shard: a probe (no
--             lock) for the first entry of messages_shard_heads_idx from the shard's floor
--             in each slot, leased or not, which raises the floor (raise_claim_floor); none due by the
--             claim's start, or (with topic filters) none due within them, and the shard
--             is passed without its turn. Then the shard's turn, FOR UPDATE SKIP LOCKED;
--             held by another claim, and the shard is passed. Under the turn, the slots'
--             copies of claim_shard_candidates_slot0, in ring order (outbox.ring) and only
--             in slots where the probe found an entry, lock the shard's heads FOR UPDATE
--             SKIP LOCKED, oldest first (a message any other transaction holds is skipped,
--             never waited for), and choose the runs behind them. The round stops as soon as the batch or the budget is full. Only
--             when the round took no turn while some shard had a ready entry (every such
--             shard held) does it go round again, waiting (FOR UPDATE) for the turn of the
--             first shard it found with work, with no lock of its own meanwhile, and
--             skipping held turns for the rest. Last, when it chose any, one UPDATE per
--             slot (lease_slot0 … _slot3, in slot order) leases the chosen rows by tuple
--             address (TID scan), checking the id and that no
--             lease is set; this locks the run messages, which no other claim can reach
--             (their head is locked here). A run message that changed since it was chosen
--             is left out; a later claim takes it. Turns and row locks are held until the
--             caller's transaction ends: call it in a short transaction.
-- Guarantees: * Each row returned was unleased when leased (checked on the locked row) and
--               is now leased to p_worker_id alone, under a fresh random token.
--             * Key order: a keyed message is returned only as its key's head (no earlier
--               message of the key pending: leased, delayed, waiting for a retry, or parked)
--               or in the run right behind a head of the same batch. The key is the
--               order key enqueue gave the message (key_order_scope, 03_enqueue.sql): its
--               message_key across the whole outbox (the default), or on its topic alone.
--               The topic filters do not change it: where a key's order spans topics, a
--               message waiting behind an earlier message of its key on a topic this claim
--               leaves out (a topic no filter admits, one another relayer covers, or one no
--               relayer covers) is not returned until that message is delivered or
--               dead-lettered. Rows come back in seq
--               order, so a run is in enqueue order. Within a shard, heads come first,
--               oldest (available_at, seq) first, and runs take the room left, in the heads'
--               order.
--             * No global order: a batch holds the oldest ready heads of the shards it
--               visited, not of the table. Each claim starts at a random shard, so no shard
--               waits for the others' backlogs.
--             * An empty or all-delayed outbox costs 16 probes and no turn; a shard whose
--               ready messages are all leased costs its turn and yields nothing.
--             * Two claims never walk one shard at once, and a claim waits for another only
--               when every shard with a ready entry is held, for one turn, holding none.
--             * seq is the message's place in enqueue order, numbered when enqueue (or a
--               replay) inserted it, increasing across the whole table (with gaps within a
--               key). A message keeps it across retries, lease expiries and redeliveries;
--               a replay from dead letters inserts it again with a new, higher seq. The
--               first deliveries of a key follow seq, with one exception: a transaction
--               that enqueued under a key and commits after a later-numbered message of
--               that key was claimed gets its message delivered after that one, with the
--               lower seq (overlapping producers of one key have no order between them;
--               03_enqueue.sql). What a consumer does with it: docs/guarantees.md.
-- Raises:     P7001 when p_batch_size is NULL or outside 1..10000, p_worker_id is NULL or
--             blank, p_lease_seconds is NULL or outside 1..86400, or p_max_bytes or
--             p_max_message_bytes is below 1. Nothing else (no P7002: the caller holds no
--             lease yet).
-- Crash:      One transaction, committed with synchronous_commit off (set for the caller's
--             whole transaction). A crash or disconnect before the commit costs nothing:
--             the locks go, nothing is leased. A database crash just after the commit may
--             lose the claim: its messages are claimable again, the worker's completion
--             reports lease_lost, and a message may be delivered twice under the same
--             outbox_id (at-least-once). A worker that dies holding leases costs each
--             message one attempt: once the lease expires, repair_expired_leases records
--             ZOMBIE_REQUEUE and the message is ready again.
-- Shape:      Turns, because two claims at once lock each other's freshly leased rows (the
--             row lock follows the update before the lease check rejects it): 4 claimers
--             drained 16k msg/s without turns, 46k with one. Per shard, because one turn
--             became a fleet's queue (16 relays: 90 % of the sessions' time waiting on
--             locks; 13–15 % with 16 shard turns). From a random shard with a probe each,
--             because ranking the shards first took 6.3 ms of a 13.2 ms claim; the probe
--             stops at the first ready entry, leased or not, because stepping over the
--             leases in flight took 31 s of the claims' 112 s at 16 relays. Leasing by
--             tuple address: 1.5 ms per 500 rows against 2.7 ms for a second primary-key
--             descent. The plan settings, because stale statistics chose a bitmap scan and
--             a sort of the whole ready set; JIT off, because the disabled paths' inflated
--             cost made it compile for 190 ms per claim. Asynchronous commit passes the
--             turns on sooner. Details: docs/performance.md.
--             The topic filters are checked on each entry the walk reaches, after the
--             index gives it: entries of topics they leave out are stepped over by every
--             claim of this caller, as leased entries are (docs/performance.md).
--             A function of its own, not a changed claim_outbox_batch: relayers of the
--             previous release hold prepared statements of that function's row type, and
--             a new column would break them during a rolling upgrade (docs/upgrades.md).
CREATE OR REPLACE FUNCTION outbox.claim_outbox_batch_seq(
    p_batch_size integer,
    p_worker_id text,
    p_lease_seconds integer,
    p_topics text[],
    p_exclude_topics text[],
    p_max_bytes bigint,
    p_max_message_bytes bigint,
    p_include_topics text[]
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
                CONTINUE WHEN (p_topics IS NOT NULL OR p_exclude_topics IS NOT NULL
                               OR p_include_topics IS NOT NULL) AND NOT EXISTS (
                    SELECT 1
                      FROM outbox.messages AS c
                     WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = v_shard
                       AND NOT c.behind
                       AND c.available_at >= v_floors[v_shard + 1]
                       AND c.available_at <= v_now
                       AND (p_topics IS NULL OR c.topic = ANY (p_topics))
                       AND (p_include_topics IS NULL OR c.topic LIKE ANY (p_include_topics))
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
                               p_include_topics, p_max_bytes, p_max_message_bytes, v_other) AS s;
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

COMMENT ON FUNCTION outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint, text[]) IS
    'Leases up to p_batch_size ready messages (unkeyed ones, heads of keys, and the runs behind keyed heads) to p_worker_id for p_lease_seconds, within the topic filters (p_topics, p_include_topics, p_exclude_topics) and byte budget; rows in enqueue order, each with its seq; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint, text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint, text[]) TO outbox_relay;
SELECT outbox.dispatch_for_slots('outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint, text[])');


-- outbox.claim_outbox_batch_seq (seven arguments, with defaults): the claim with
-- p_include_topics NULL (every topic within p_topics and p_exclude_topics), by calling the
-- claim of eight arguments. The form for psql and for callers of the claim before
-- p_include_topics (relayers of the previous release: docs/upgrades.md); its inputs,
-- returns, locks, guarantees, errors and crash behaviour are those of the claim it calls,
-- and it has no rule of its own. Its defaults are the reason the claim of eight arguments
-- has none: a call two signatures with defaults could both take is refused as ambiguous.
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
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT *
      FROM outbox.claim_outbox_batch_seq(p_batch_size, p_worker_id, p_lease_seconds, p_topics,
                                         p_exclude_topics, p_max_bytes, p_max_message_bytes,
                                         NULL::text[])
$$;

COMMENT ON FUNCTION outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint) IS
    'claim_outbox_batch_seq with p_include_topics NULL (every topic within p_topics and p_exclude_topics), by calling it: same leases, rows and errors.';

REVOKE ALL ON FUNCTION outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.claim_outbox_batch_seq(integer, text, integer, text[], text[], bigint, bigint) TO outbox_relay;


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
                                         p_exclude_topics, p_max_bytes, p_max_message_bytes,
                                         NULL::text[]) AS c
$$;

COMMENT ON FUNCTION outbox.claim_outbox_batch(integer, text, integer, text[], text[], bigint, bigint) IS
    'Kept for callers of the claim before seq: claim_outbox_batch_seq, which it calls, without the seq column (same leases, rows in enqueue order; P7001 on a bad argument). Dropped by a later release.';

REVOKE ALL ON FUNCTION outbox.claim_outbox_batch(integer, text, integer, text[], text[], bigint, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.claim_outbox_batch(integer, text, integer, text[], text[], bigint, bigint) TO outbox_relay;


-- outbox.claim_shard_candidates_slot0 (internal): chooses the messages one claim takes from
-- one shard in slot 0 and locks its heads; outbox.copy_for_slots makes the same function for
-- slots 1 to 3 (claim_shard_candidates_slot1 … _slot3, each on its slot's table). Called
-- only by claim_outbox_batch_seq, while the claim holds the shard's
-- turn, slot by slot in ring order (outbox.ring); no role may execute it.
--
-- Inputs:     p_shard (0 to 15); p_floor, the shard's floor, where the walk starts; p_now,
--             the claim's start (ready: available_at at or before it); p_room, the most ids
--             to return (at least 1); p_used, the
--             payload bytes the batch has counted so far; p_topics, p_exclude_topics,
--             p_include_topics, p_max_bytes and p_max_message_bytes as the claim received
--             them;
--             p_other_slots, whether the shard has entries in another slot: only then is
--             a keyed head checked for an earlier message of its key in the other slots
--             (key_pending_before), besides its own slot.
-- Returns:    ids and ctids, parallel: the heads in claim order (available_at, seq), then
--             the runs, head after head, each in seq order, a run ending at the end of
--             the slot (the key's message in the next slot becomes its head when the run
--             is delivered); bytes, the payload bytes they
--             count against the budget (a head over p_max_message_bytes counts 0).
-- Locks:      at most p_room heads, FOR UPDATE SKIP LOCKED, in the order of the shard's
--             walk of messages_shard_heads_idx; heads the budget then leaves out stay
--             locked until the claim ends and are not returned. Run messages are not locked
--             here: they are reached only through a head this transaction holds, in a
--             shard whose turn it holds (the lease's UPDATE locks them).
-- Guarantees: the heads are ready, unleased, within the topic filters, and no earlier
--             message of their key is pending; the budget keeps a prefix of the heads, then
--             a prefix of the runs (p_used + bytes counted before each < p_max_bytes).
-- Raises:     nothing of its own.
-- Shape:      one ordered scan of the shard's index from p_floor that stops after p_room
--             heads: its cost grows with the leased entries and the dead ones above the
--             floor it steps over, not with the backlog, the messages behind heads, or how
--             long the MVCC horizon has been held. A plain index scan also marks
--             the entries of deleted rows dead, so the next claim skips them without
--             visiting the heap (a bitmap scan would not). Each run is one probe of
--             messages_order_key_seq_idx, limited to the room left.
CREATE OR REPLACE FUNCTION outbox.claim_shard_candidates_slot0(
    p_shard integer,
    p_floor timestamptz,
    p_now timestamptz,
    p_room integer,
    p_used bigint,
    p_topics text[],
    p_exclude_topics text[],
    p_include_topics text[],
    p_max_bytes bigint,
    p_max_message_bytes bigint,
    p_other_slots boolean,
    OUT ids uuid[],
    OUT ctids tid[],
    OUT bytes bigint
)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_keys text[];
    v_seqs bigint[];
    v_topics text[];
    v_room integer;
    v_run uuid[];
    v_run_ctids tid[];
    v_run_bytes bigint;
BEGIN
    -- Heads. The budget is a running sum over the candidates in claim order; rows past it
    -- were locked by the inner scan and are left untouched.
    SELECT coalesce(array_agg(b.outbox_id), '{}'),
           coalesce(array_agg(b.ctid), '{}'),
           coalesce(sum(b.counted), 0),
           array_agg(b.order_key) FILTER (WHERE b.order_key IS NOT NULL),
           array_agg(b.seq) FILTER (WHERE b.order_key IS NOT NULL),
           array_agg(b.topic) FILTER (WHERE b.order_key IS NOT NULL)
      INTO ids, ctids, bytes, v_keys, v_seqs, v_topics
      FROM (SELECT w.*,
                   sum(w.counted) OVER (ROWS UNBOUNDED PRECEDING) - w.counted AS before
              FROM (SELECT c.outbox_id, c.ctid, c.order_key, c.seq, c.topic,
                           CASE WHEN octet_length(c.payload) > p_max_message_bytes THEN 0
                                ELSE octet_length(c.payload)::bigint END AS counted
                      FROM outbox.messages_0 AS c
                     WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
                       AND NOT c.behind
                       AND c.available_at >= p_floor
                       AND c.available_at <= p_now
                       AND c.lease_token IS NULL
                       AND (p_topics IS NULL OR c.topic = ANY (p_topics))
                       AND (p_include_topics IS NULL OR c.topic LIKE ANY (p_include_topics))
                       AND (p_exclude_topics IS NULL OR NOT c.topic LIKE ANY (p_exclude_topics))
                       AND (c.order_key IS NULL OR NOT (
                               EXISTS (SELECT 1
                                         FROM outbox.messages_0 AS e
                                        WHERE e.order_key = c.order_key
                                          AND e.seq < c.seq)
                               OR (p_other_slots AND outbox.key_pending_before(c.order_key, c.seq))))
                     ORDER BY c.available_at, c.seq
                     LIMIT p_room
                       FOR UPDATE SKIP LOCKED) AS w) AS b
     WHERE p_max_bytes IS NULL OR p_used + b.before < p_max_bytes;

    -- Runs: for each keyed head, in the heads' order, the messages that follow it in its
    -- key while each is claimable; at most the room left, within the budget.
    v_room := p_room - cardinality(ids);
    IF v_keys IS NOT NULL AND v_room > 0 AND (p_max_bytes IS NULL OR p_used + bytes < p_max_bytes) THEN
        SELECT array_agg(r.outbox_id), array_agg(r.ctid), sum(r.len)
          INTO v_run, v_run_ctids, v_run_bytes
          FROM (SELECT q.outbox_id, q.ctid, q.len,
                       count(*) OVER o AS nth,
                       sum(q.len) OVER o - q.len AS before
                  FROM (SELECT h.ord, x.outbox_id, x.ctid, x.seq, x.len
                          FROM unnest(v_keys, v_seqs, v_topics) WITH ORDINALITY AS h(key, seq, topic, ord)
                         CROSS JOIN LATERAL (
                                SELECT y.outbox_id, y.ctid, y.seq, y.len
                                  FROM (SELECT n.outbox_id, n.ctid, n.seq,
                                               octet_length(n.payload)::bigint AS len,
                                               bool_and(n.available_at <= p_now
                                                        AND n.lease_token IS NULL
                                                        AND n.topic = h.topic
                                                        AND (p_max_message_bytes IS NULL
                                                             OR octet_length(n.payload) <= p_max_message_bytes))
                                                   OVER (ORDER BY n.seq ROWS UNBOUNDED PRECEDING) AS unbroken
                                          FROM outbox.messages_0 AS n
                                         WHERE n.order_key = h.key
                                           AND n.seq > h.seq
                                         ORDER BY n.seq
                                         LIMIT v_room) AS y
                                 WHERE y.unbroken) AS x) AS q
                WINDOW o AS (ORDER BY q.ord, q.seq ROWS UNBOUNDED PRECEDING)) AS r
         WHERE r.nth <= v_room
           AND (p_max_bytes IS NULL OR p_used + bytes + r.before < p_max_bytes);
        ids := ids || coalesce(v_run, '{}');
        ctids := ctids || coalesce(v_run_ctids, '{}');
        bytes := bytes + coalesce(v_run_bytes, 0);
    END IF;
END;
$$;


COMMENT ON FUNCTION outbox.claim_shard_candidates_slot0(integer, timestamptz, timestamptz, integer, bigint, text[], text[], text[], bigint, bigint, boolean) IS
    'Internal: claim_shard_candidates in slot 0 (a run ends at the end of the slot).';
REVOKE ALL ON FUNCTION outbox.claim_shard_candidates_slot0(integer, timestamptz, timestamptz, integer, bigint, text[], text[], text[], bigint, bigint, boolean) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.claim_shard_candidates_slot0(integer, timestamptz, timestamptz, integer, bigint, text[], text[], text[], bigint, bigint, boolean)');


-- outbox.claim_shard_candidates_slot0 (internal, without p_include_topics): the walk above
-- with p_include_topics NULL, by calling it; kept, with its copies for slots 1 to 3, for
-- the claims of the previous release in flight while the migration that added
-- p_include_topics runs (docs/upgrades.md). A later release's migration drops it.
CREATE OR REPLACE FUNCTION outbox.claim_shard_candidates_slot0(
    p_shard integer,
    p_floor timestamptz,
    p_now timestamptz,
    p_room integer,
    p_used bigint,
    p_topics text[],
    p_exclude_topics text[],
    p_max_bytes bigint,
    p_max_message_bytes bigint,
    p_other_slots boolean,
    OUT ids uuid[],
    OUT ctids tid[],
    OUT bytes bigint
)
LANGUAGE sql VOLATILE
AS $$
    SELECT *
      FROM outbox.claim_shard_candidates_slot0(p_shard, p_floor, p_now, p_room, p_used, p_topics,
                                               p_exclude_topics, NULL::text[], p_max_bytes,
                                               p_max_message_bytes, p_other_slots)
$$;

COMMENT ON FUNCTION outbox.claim_shard_candidates_slot0(integer, timestamptz, timestamptz, integer, bigint, text[], text[], bigint, bigint, boolean) IS
    'Internal: claim_shard_candidates in slot 0 with p_include_topics NULL, kept for the previous release''s claims in flight.';
REVOKE ALL ON FUNCTION outbox.claim_shard_candidates_slot0(integer, timestamptz, timestamptz, integer, bigint, text[], text[], bigint, bigint, boolean) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.claim_shard_candidates_slot0(integer, timestamptz, timestamptz, integer, bigint, text[], text[], bigint, bigint, boolean)');



-- outbox.lease_slot0 (internal): leases the listed rows of slot 0 (tuple addresses, with
-- their ids as a check) that are still unleased, with a token naming the slot.
CREATE OR REPLACE FUNCTION outbox.lease_slot0(
    p_ids uuid[],
    p_ctids tid[],
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
BEGIN
    RETURN QUERY
    UPDATE outbox.messages_0 AS m
       SET claimed_by = p_worker_id,
           -- random but for its last hex digit: the slot, and 4 when keyed
           lease_token = (left(gen_random_uuid()::text, 35)
                          || (m.slot + CASE WHEN m.message_key IS NULL THEN 0 ELSE 4 END)::text)::uuid,
           lease_expires_at = now() + make_interval(secs => p_lease_seconds)
     WHERE m.ctid = ANY (p_ctids)
       -- a check, not a way in: written so that it cannot drive an index scan
       AND (m.outbox_id = ANY (p_ids)) IS TRUE
       AND m.lease_token IS NULL
    RETURNING m.outbox_id, m.lease_token, m.topic, m.message_key,
              CASE WHEN octet_length(m.payload) > p_max_message_bytes THEN NULL ELSE m.payload END,
              m.content_type, m.headers, m.attempt_count + 1, m.created_at,
              m.lease_expires_at, octet_length(m.payload)::bigint, m.seq;
END;
$$;

COMMENT ON FUNCTION outbox.lease_slot0(uuid[], tid[], text, integer, bigint) IS
    'Internal: leases the listed rows of slot 0 with a token naming the slot.';
REVOKE ALL ON FUNCTION outbox.lease_slot0(uuid[], tid[], text, integer, bigint) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.lease_slot0(uuid[], tid[], text, integer, bigint)');

-- outbox.lease_candidates (internal): leases what the claim chose when it spans slots,
-- slot by slot.
CREATE FUNCTION outbox.lease_candidates(
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


-- outbox.key_pending_before (internal): whether a message of order key p_key with a seq
-- below p_seq is pending in any slot: one probe of each slot's messages_order_key_seq_idx,
-- by a plan kept for the session. The claim asks it only of a shard with entries in more than one slot.
CREATE FUNCTION outbox.key_pending_before(p_key text, p_seq bigint) RETURNS boolean
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM outbox.messages_0 e0 WHERE e0.order_key = p_key AND e0.seq < p_seq)
        OR EXISTS (SELECT 1 FROM outbox.messages_1 e1 WHERE e1.order_key = p_key AND e1.seq < p_seq)
        OR EXISTS (SELECT 1 FROM outbox.messages_2 e2 WHERE e2.order_key = p_key AND e2.seq < p_seq)
        OR EXISTS (SELECT 1 FROM outbox.messages_3 e3 WHERE e3.order_key = p_key AND e3.seq < p_seq);
END;
$$;

COMMENT ON FUNCTION outbox.key_pending_before(text, bigint) IS
    'Internal: whether a message of the order key with a lower seq is pending in any slot.';
REVOKE ALL ON FUNCTION outbox.key_pending_before(text, bigint) FROM PUBLIC;


-- outbox.claim_probe_slots (internal): claim_probe in each slot: the available_at of the
-- first entry of shard p_shard at or after p_floor in slots 0 to 3 (NULL where none).
CREATE FUNCTION outbox.claim_probe_slots(p_shard integer, p_floor timestamptz)
RETURNS timestamptz[]
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN ARRAY[
        (SELECT c.available_at FROM outbox.messages_0 c
          WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
            AND NOT c.behind AND c.available_at >= p_floor
          ORDER BY c.available_at, c.seq LIMIT 1),
        (SELECT c.available_at FROM outbox.messages_1 c
          WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
            AND NOT c.behind AND c.available_at >= p_floor
          ORDER BY c.available_at, c.seq LIMIT 1),
        (SELECT c.available_at FROM outbox.messages_2 c
          WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
            AND NOT c.behind AND c.available_at >= p_floor
          ORDER BY c.available_at, c.seq LIMIT 1),
        (SELECT c.available_at FROM outbox.messages_3 c
          WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
            AND NOT c.behind AND c.available_at >= p_floor
          ORDER BY c.available_at, c.seq LIMIT 1)];
END;
$$;

COMMENT ON FUNCTION outbox.claim_probe_slots(integer, timestamptz) IS
    'Internal: the available_at of a shard''s first entry from its floor, in each of the four slots.';
REVOKE ALL ON FUNCTION outbox.claim_probe_slots(integer, timestamptz) FROM PUBLIC;


-- The claim floors: where each shard's walk starts.
--
-- A delivered message leaves a dead entry in messages_shard_heads_idx at the front of its
-- shard (entries sort by available_at) until vacuum removes it, and vacuum removes nothing
-- that a transaction older than the deletion could still see. While something holds the
-- MVCC horizon back (a long transaction, a REPEATABLE READ snapshot, a replication slot, a
-- standby's hot_standby_feedback), those entries pile up, and a walk from the start of a
-- shard steps over every one of them. Each shard has a floor, a time at or before every
-- entry of the shard that is live or will be; claims walk from it, so what they step over
-- is what was delivered since the shard's oldest live entry, however long the horizon is
-- held.
--
-- Storage: sequences, not rows. setval is not transactional and leaves no row version, so
-- keeping the floors current writes nothing that a held horizon keeps (a row updated by
-- every claim would pile up dead versions of its own). Each value is microseconds since the
-- Unix epoch; 0, the start value, stands for no floor (-infinity): the shard is walked from
-- its start.
--   outbox.claim_floor_0 … outbox.claim_floor_15  the floor of each shard
--   outbox.claim_floor_bound                      no entry to come is below it (below)
--   outbox.claim_floor_mark_at, _mark_xid         the next value of the bound, and the
--                                                 transaction id it waits for
--
-- The invariant: every entry of shard s that is live, or that a transaction in progress is
-- writing, is at or after floor s. It holds because:
-- * Every write that puts an entry into the index puts it either at or after the clock
--   (clock_timestamp()) of a moment at which its transaction holds a transaction id, or a
--   moment before it gets one within the same statement: enqueue and the column's default
--   (the clock when no time is given), replay_step (the clock), settle_behind (where its
--   own INSERT put it);
--   or at or after an entry that the same transaction changes or deletes, which holds the
--   floor below it until the transaction commits: a retry or a lease expiry (not before
--   now(), after the claim that leased the message), promote_heads (not before the head
--   the completion deleted).
--   A lease, its heartbeat and its release keep the entry where it is (HOT updates of
--   columns in no index).
-- * The bound is a time T less a margin of 200 ms, taken once every transaction that held a
--   transaction id at T has ended (claim_floor_bound). A write still in progress got its
--   transaction id after T, so its entry is at or after T less the margin.
-- * A floor rises only to the least of the bound and the first entry of the shard at or
--   after the floor in a snapshot taken after the bound was read, leased or not. An entry
--   that snapshot does not see was written by a transaction that got its id after the
--   bound's T, so it is above the bound.
-- A floor, once valid, stays valid: later entries are above the bound it was capped by.
-- Concurrent claims may set a floor in any order; a lower one only costs a longer walk.
-- A message written with an older available_at (enqueue with a past time, the schema
-- owner's own INSERT or UPDATE) lowers its shard's floor to it at its commit (the
-- deferred triggers of lower_claim_floor, below). The safety net: a message left below its
-- floor anyway (such a commit racing a claim that raises the floor, or a server clock
-- stepped back) is moved up to the clock by the next repair_expired_leases pass
-- (06_repair_retention.sql).
--
-- What a floor cannot pass: a live entry. A message that stays ready and unclaimed (its
-- topic excluded while its destination's circuit is open, or claimed by no relayer's topic
-- filter) or leased for long holds its shard's floor, and that shard's claims step over
-- what was delivered behind it, as every claim did before floors. A transaction that holds
-- a transaction id holds back the bound, and with it every floor: the horizon such a
-- transaction holds is not skipped (docs/performance.md).

CREATE SEQUENCE outbox.claim_floor_0 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_1 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_2 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_3 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_4 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_5 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_6 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_7 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_8 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_9 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_10 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_11 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_12 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_13 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_14 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_15 AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_bound AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_mark_at AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox.claim_floor_mark_xid AS bigint MINVALUE 0 START 0;

DO $$
BEGIN
    FOR v_shard IN 0 .. 15 LOOP
        EXECUTE format('COMMENT ON SEQUENCE outbox.%I IS %L', 'claim_floor_' || v_shard,
                       format('The claim floor of shard %s (microseconds since the Unix epoch): no live entry of the shard is below it. Set by the claims only.', v_shard));
        EXECUTE format('REVOKE ALL ON SEQUENCE outbox.%I FROM PUBLIC', 'claim_floor_' || v_shard);
    END LOOP;
END;
$$;

COMMENT ON SEQUENCE outbox.claim_floor_bound IS
    'No entry still to be written is below this time (microseconds since the Unix epoch); caps every claim floor. Set by claim_floor_bound only.';
COMMENT ON SEQUENCE outbox.claim_floor_mark_at IS
    'The next value of claim_floor_bound (microseconds since the Unix epoch, before its margin), taken once every transaction id below claim_floor_mark_xid has ended.';
COMMENT ON SEQUENCE outbox.claim_floor_mark_xid IS
    'The transaction id claim_floor_mark_at waits for: every id below it has ended before the mark is taken.';

REVOKE ALL ON SEQUENCE outbox.claim_floor_bound FROM PUBLIC;
REVOKE ALL ON SEQUENCE outbox.claim_floor_mark_at FROM PUBLIC;
REVOKE ALL ON SEQUENCE outbox.claim_floor_mark_xid FROM PUBLIC;


-- outbox.claim_floors (internal): the 16 floors, shard 0 first (index 1), 0 as -infinity.
-- Called by the claims, repair_expired_leases and lower_claim_floor; no role may execute
-- it. Reads the sequences, taking no row lock; raises nothing. One PL/pgSQL expression,
-- planned once per session (every claim calls it).
CREATE OR REPLACE FUNCTION outbox.claim_floors() RETURNS timestamptz[]
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- pg_sequence_last_value is NULL for a floor never set (its start value, 0)
    RETURN ARRAY(SELECT CASE WHEN coalesce(f.micros, 0) = 0 THEN timestamptz '-infinity'
                             ELSE timestamptz 'epoch' + f.micros * interval '1 microsecond' END
                   FROM unnest(ARRAY[
                            pg_sequence_last_value('outbox.claim_floor_0'),
                            pg_sequence_last_value('outbox.claim_floor_1'),
                            pg_sequence_last_value('outbox.claim_floor_2'),
                            pg_sequence_last_value('outbox.claim_floor_3'),
                            pg_sequence_last_value('outbox.claim_floor_4'),
                            pg_sequence_last_value('outbox.claim_floor_5'),
                            pg_sequence_last_value('outbox.claim_floor_6'),
                            pg_sequence_last_value('outbox.claim_floor_7'),
                            pg_sequence_last_value('outbox.claim_floor_8'),
                            pg_sequence_last_value('outbox.claim_floor_9'),
                            pg_sequence_last_value('outbox.claim_floor_10'),
                            pg_sequence_last_value('outbox.claim_floor_11'),
                            pg_sequence_last_value('outbox.claim_floor_12'),
                            pg_sequence_last_value('outbox.claim_floor_13'),
                            pg_sequence_last_value('outbox.claim_floor_14'),
                            pg_sequence_last_value('outbox.claim_floor_15')])
                        WITH ORDINALITY AS f(micros, shard)
                  ORDER BY f.shard);
END;
$$;

COMMENT ON FUNCTION outbox.claim_floors() IS
    'Internal (claims, repair_expired_leases): the claim floors of shards 0 to 15, as timestamps. Not granted.';

REVOKE ALL ON FUNCTION outbox.claim_floors() FROM PUBLIC;


-- outbox.raise_claim_floor (internal): sets the floor of shard p_shard from p_from (as the
-- claim read it at its start) to p_to, which the caller computed as the invariant above
-- requires, and returns the floor the shard has then. Called by the claims under READ
-- COMMITTED; no role may execute it.
--
-- Locks:      the shard's floor lock (a transaction-scoped advisory lock, 'outbox.floor'
--             and the shard number plus 1), tried without waiting and held until the
--             claim's transaction ends. lower_claim_floor takes it, waiting, and keeps it
--             until its own commit.
-- Guarantees: the floor is left as it is when the lock is held elsewhere (a message
--             dated in the past is committing or prepared), when the floor is no longer
--             p_from (lowered or raised since the claim read it), or when p_to is not
--             after the epoch (such a floor would be stored as none). So a floor is never
--             raised over a lowering whose message the claim's snapshot could not see.
-- Raises:     nothing for a shard of 0 to 15.
-- Crash:      not transactional (setval): a claim rolled back keeps the floor it raised,
--             which stays valid.
CREATE OR REPLACE FUNCTION outbox.raise_claim_floor(p_shard integer, p_from timestamptz, p_to timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_floor regclass := ('outbox.claim_floor_' || p_shard)::regclass;
    v_now bigint;
BEGIN
    IF p_to <= timestamptz 'epoch'
       OR NOT pg_try_advisory_xact_lock(hashtext('outbox.floor'), p_shard + 1) THEN
        RETURN p_from;
    END IF;
    v_now := coalesce(pg_sequence_last_value(v_floor), 0);
    IF v_now <> (CASE WHEN p_from = '-infinity' THEN 0
                      ELSE (extract(epoch FROM p_from) * 1000000)::bigint END) THEN
        RETURN (CASE WHEN v_now = 0 THEN timestamptz '-infinity'
                     ELSE timestamptz 'epoch' + v_now * interval '1 microsecond' END);
    END IF;
    PERFORM setval(v_floor, (extract(epoch FROM p_to) * 1000000)::bigint);
    RETURN p_to;
END;
$$;

COMMENT ON FUNCTION outbox.raise_claim_floor(integer, timestamptz, timestamptz) IS
    'Internal (claims): raises the claim floor of one shard from the value the claim read, under the shard''s floor lock tried without waiting; not transactional. Not granted.';

REVOKE ALL ON FUNCTION outbox.raise_claim_floor(integer, timestamptz, timestamptz) FROM PUBLIC;


-- outbox.claim_floor_bound (internal): returns the bound every floor is capped by, after
-- moving it up when it is due. Called by the claims at their start; no role may execute it.
--
-- Does:       at most once per 50 ms across the fleet (a transaction-scoped advisory lock
--             tried without waiting, 'outbox.floor'), and only under READ COMMITTED (a
--             snapshot of the transaction's start would see old transaction ids as the
--             newest) in a transaction that holds no id yet: when every transaction id
--             below the mark's has ended (the current snapshot's xmin), the bound becomes
--             the mark's time less 200 ms, and a new mark is taken: the clock, then this
--             transaction's own id, got after it, so every id got later is got after the
--             clock was read.
-- Locks:      the advisory lock, held until the caller's transaction ends.
-- Guarantees: every transaction holding a transaction id got before the bound's time plus
--             200 ms has ended. A transaction without one (a read-only snapshot, however old)
--             does not hold the bound back.
-- Raises:     nothing.
-- Crash:      the mark's id is written before its time, so a mark half written pairs an
--             older time with a newer id, which only delays the bound.
-- Shape:      assigns the claim's transaction id at most 20 times a second (raising a
--             floor, a setval, gives its claim one too and writes a WAL record, only when
--             the floor moves); sequences as
--             the floors, for the same reason. The margin covers a write that reads the
--             clock moments before its transaction gets its id, within one statement (a
--             multi-row INSERT reads its first row's default, then runs its BEFORE
--             triggers); one that takes longer than the margin is found by the safety net.
--             Every claim steps over the entries delivered in the bound's lag (the margin,
--             the 50 ms and the longest transaction in progress at the mark): with a lag
--             of 2.3 s at 2,000 msg/s held, about 450 entries per scan of a shard.
CREATE OR REPLACE FUNCTION outbox.claim_floor_bound() RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_bound bigint;
    v_at bigint;
    v_xid bigint;
    v_now bigint := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
BEGIN
    SELECT b.last_value, a.last_value
      INTO v_bound, v_at
      FROM outbox.claim_floor_bound AS b, outbox.claim_floor_mark_at AS a;
    IF v_now - v_at >= 50000
       AND current_setting('transaction_isolation') = 'read committed'
       AND pg_current_xact_id_if_assigned() IS NULL
       AND pg_try_advisory_xact_lock(hashtext('outbox.floor'), 0) THEN
        SELECT b.last_value, a.last_value, x.last_value
          INTO v_bound, v_at, v_xid
          FROM outbox.claim_floor_bound AS b, outbox.claim_floor_mark_at AS a,
               outbox.claim_floor_mark_xid AS x;
        -- The mark is taken up only once every id below its own has ended, and replaced
        -- only then: a transaction that holds an id for long keeps the bound where it was.
        IF v_now - v_at >= 50000
           AND (v_at = 0 OR pg_snapshot_xmin(pg_current_snapshot())::text::bigint >= v_xid) THEN
            -- The new mark's time first: the first setval gives this transaction its id.
            v_now := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
            IF v_at > 0 THEN
                v_bound := greatest(v_bound, v_at - 200000);
                PERFORM setval('outbox.claim_floor_bound', v_bound);
            END IF;
            PERFORM setval('outbox.claim_floor_mark_xid', pg_current_xact_id()::text::bigint);
            PERFORM setval('outbox.claim_floor_mark_at', v_now);
        END IF;
    END IF;
    RETURN timestamptz 'epoch' + v_bound * interval '1 microsecond';
END;
$$;

COMMENT ON FUNCTION outbox.claim_floor_bound() IS
    'Internal (claims): the time no entry still to be written is below, moved up at most every 50 ms once the transactions that held ids at its mark have ended. Not granted.';

REVOKE ALL ON FUNCTION outbox.claim_floor_bound() FROM PUBLIC;


-- outbox.lower_claim_floor (internal): the function of the deferred constraint triggers
-- messages_lower_claim_floor_on_insert (a message dated more than the bound's margin before
-- its insert: enqueue with a past p_available_at, now() of a transaction that began long
-- before, or the schema owner's own INSERT) and
-- messages_lower_claim_floor_on_update (an UPDATE that moves available_at earlier: the
-- owner's own, the SQL API never does). Not granted.
--
-- Such a message may be below its shard's floor. At the commit of its transaction (or at
-- PREPARE TRANSACTION, or at SET CONSTRAINTS … IMMEDIATE) this takes the floor locks of all
-- 16 shards in shard order (raise_claim_floor), waiting for claims that hold them, and
-- keeps them until the transaction ends; then it lowers the floor to the message's available_at (one before
-- the epoch removes the floor) when it is below it. No claim raises that floor again until
-- the message is committed and visible to its next statement: a claim that read the floor
-- before the lowering finds it changed, one that tries while the lock is held passes.
-- Not transactional: a transaction rolled back after it leaves the floor lower, which only
-- costs a longer walk. Raises nothing.
CREATE OR REPLACE FUNCTION outbox.lower_claim_floor() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_shard integer := hashtext(coalesce(NEW.message_key, NEW.outbox_id::text)) & 15;
BEGIN
    -- Every shard's floor lock, in shard order, so that two transactions lowering floors of
    -- several shards never wait for each other in a cycle.
    FOR v_lock IN 1 .. 16 LOOP
        PERFORM pg_advisory_xact_lock(hashtext('outbox.floor'), v_lock);
    END LOOP;
    IF NEW.available_at < (outbox.claim_floors())[v_shard + 1] THEN
        PERFORM setval(('outbox.claim_floor_' || v_shard)::regclass,
                       (extract(epoch FROM greatest(NEW.available_at, timestamptz 'epoch')) * 1000000)::bigint);
    END IF;
    RETURN NULL;
END;
$$;

COMMENT ON FUNCTION outbox.lower_claim_floor() IS
    'Internal (deferred triggers messages_lower_claim_floor_on_insert and _on_update, for a message dated in the past): lowers the shard''s claim floor to the message at commit. Not granted.';

REVOKE ALL ON FUNCTION outbox.lower_claim_floor() FROM PUBLIC;

CREATE CONSTRAINT TRIGGER messages_lower_claim_floor_on_insert
    AFTER INSERT ON outbox.messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.available_at < clock_timestamp() - interval '200 milliseconds')
    EXECUTE FUNCTION outbox.lower_claim_floor();

CREATE CONSTRAINT TRIGGER messages_lower_claim_floor_on_update
    AFTER UPDATE OF available_at ON outbox.messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.available_at < OLD.available_at)
    EXECUTE FUNCTION outbox.lower_claim_floor();

-- A relayer claims only the topics it covers. claim_outbox_batch_seq gains a trailing
-- argument, p_include_topics: LIKE patterns of the topics to claim (NULL: every topic),
-- which the shard walk (claim_shard_candidates_slot0 … _slot3) checks beside p_topics and
-- p_exclude_topics. The relayer passes the patterns of its routes, so that a relayer whose
-- routes cover some topics leaves the others to the relayers that cover them instead of
-- claiming and dead-lettering them. The claim of eight arguments has no defaults; the
-- signature of seven, with its defaults, stays (a call both could take would be refused as
-- ambiguous) and calls it with p_include_topics NULL, as claim_outbox_batch now does. The
-- walk of ten arguments stays for one release, calling the new one, for the previous
-- release's claims in flight during this migration. Each relayer reports the topics it
-- claims (report_coverage, into the new table coverage_reports), and uncovered_topics names
-- the topics with ready messages that no running relayer claims. copy_for_slots, first
-- called by a migration here since V34, matches slot 0's table in the template's own
-- schema instead of `outbox`, so that an outbox in a schema of another name is copied by
-- the same rule (its checks refused every template there). Contracts in full:
-- 04_claim.sql, 01_tables.sql and 08_observation.sql.

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
--             messages_key_seq_idx, limited to the room left.
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
           array_agg(b.message_key) FILTER (WHERE b.message_key IS NOT NULL),
           array_agg(b.seq) FILTER (WHERE b.message_key IS NOT NULL),
           array_agg(b.topic) FILTER (WHERE b.message_key IS NOT NULL)
      INTO ids, ctids, bytes, v_keys, v_seqs, v_topics
      FROM (SELECT w.*,
                   sum(w.counted) OVER (ROWS UNBOUNDED PRECEDING) - w.counted AS before
              FROM (SELECT c.outbox_id, c.ctid, c.message_key, c.seq, c.topic,
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
                       AND (c.message_key IS NULL OR NOT (
                               EXISTS (SELECT 1
                                         FROM outbox.messages_0 AS e
                                        WHERE e.message_key = c.message_key
                                          AND e.seq < c.seq)
                               OR (p_other_slots AND outbox.key_pending_before(c.message_key, c.seq))))
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
                                         WHERE n.message_key = h.key
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
--               or in the run right behind a head of the same batch. The topic filters
--               do not change it: a key's order spans topics, so a message waiting behind
--               an earlier message of its key on a topic this claim leaves out (a topic no
--               filter admits, one another relayer covers, or one no relayer covers) is not
--               returned until that message is delivered or dead-lettered. Rows come back in seq
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


-- outbox.coverage_reports: the topics each running relayer claims, as it last reported
-- them, one row per worker: include_topics (LIKE patterns of the topics its routes cover;
-- NULL: every topic) and topics (the exact topics it is limited to; NULL: no limit).
-- Written by report_coverage when the relayer starts and when it renews its report (never
-- per claim or batch), so it holds one row per relayer; a relayer that stopped renewing
-- leaves a row that expires (expires_at), deleted an hour after that by the next report of
-- any relayer. Read by uncovered_topics; owner only.
CREATE TABLE outbox.coverage_reports (
    worker_id      text        NOT NULL,
    include_topics text[],
    topics         text[],
    -- when the relayer last reported it (the database's clock)
    reported_at    timestamptz NOT NULL,
    -- after this the report is stale: the relayer did not renew it (stopped, or cut off)
    expires_at     timestamptz NOT NULL,
    CONSTRAINT coverage_reports_pkey PRIMARY KEY (worker_id)
);

COMMENT ON TABLE outbox.coverage_reports IS
    'The topics each running relayer claims (LIKE patterns of its routes, exact topics it is limited to) and until when the report holds; written by report_coverage, read by uncovered_topics; owner only.';

REVOKE ALL ON TABLE outbox.coverage_reports FROM PUBLIC;


-- outbox.report_coverage: the topics one relayer claims, so that a topic no running relayer
-- claims can be named (uncovered_topics).
--
-- Inputs:     p_worker_id       the relayer's worker id
--             p_include_topics  the claim's p_include_topics: LIKE patterns of the topics
--                               its routes cover (NULL: every topic)
--             p_topics          the claim's p_topics: the exact topics it is limited to
--                               (NULL: no limit)
--             p_ttl             how long the report holds without being renewed; 0
--                               withdraws it (a relayer that stops)
-- Returns:    nothing.
-- Locks:      the row of outbox.coverage_reports of p_worker_id, and rows expired for more
--             than an hour that no other call holds (FOR UPDATE SKIP LOCKED, never waits).
-- Guarantees: afterwards the worker's row holds these topics, reported_at now() and
--             expires_at now() + p_ttl (no row when p_ttl is 0). Rows of any worker
--             expired for more than an hour are deleted.
-- Raises:     P7001 (p_worker_id) when it is NULL or blank; P7001 (p_include_topics,
--             p_topics) when it holds a NULL; P7001 (p_ttl) when it is NULL or negative.
-- Crash:      nothing: one transaction; the previous report stands until it commits.
-- Shape:      the relayer calls it at start and to renew its report (a third of the way to
--             its expiry), never per claim or batch.
CREATE OR REPLACE FUNCTION outbox.report_coverage(
    p_worker_id text,
    p_include_topics text[],
    p_topics text[],
    p_ttl interval
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
    IF p_ttl IS NULL OR p_ttl < interval '0' THEN
        PERFORM outbox.invalid_argument('p_ttl', 'must be an interval of 0 or more');
    END IF;

    IF p_ttl = interval '0' THEN
        DELETE FROM outbox.coverage_reports AS r WHERE r.worker_id = p_worker_id;
    ELSE
        INSERT INTO outbox.coverage_reports AS r
               (worker_id, include_topics, topics, reported_at, expires_at)
        VALUES (p_worker_id, p_include_topics, p_topics, now(), now() + p_ttl)
        ON CONFLICT (worker_id) DO UPDATE
            SET include_topics = excluded.include_topics,
                topics = excluded.topics,
                reported_at = excluded.reported_at,
                expires_at = excluded.expires_at;
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

COMMENT ON FUNCTION outbox.report_coverage(text, text[], text[], interval) IS
    'The topics a relayer claims (LIKE patterns of its routes, exact topics it is limited to), holding for p_ttl (0 withdraws it); deletes reports expired for an hour; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.report_coverage(text, text[], text[], interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.report_coverage(text, text[], text[], interval) TO outbox_relay;


-- outbox.uncovered_topics: the topics whose ready messages no running relayer claims.
--
-- Inputs:     p_older_than  how long a message must have been ready (available_at at least
--                           this long ago) to count; 0 or more.
-- Returns:    one row per topic that has messages ready (unleased, available_at at or
--             before now() - p_older_than) and that no unexpired report of
--             outbox.coverage_reports covers (a report covers a topic when its topics is
--             NULL or holds it, and its include_topics is NULL or has a pattern it is LIKE):
--             topic; ready (those messages); oldest_ready_age (now() minus the oldest
--             available_at of them); held_keys (keys that have a message of this topic
--             pending before a message of another topic: by per-key order, those messages
--             wait for this topic's to be delivered or dead-lettered); held_topics (the
--             other topics those messages are on, sorted). Oldest first.
-- Locks:      nothing (reads only).
-- Guarantees: a topic claimed by a relayer that reports (this release's relayers, through
--             report_coverage) is not returned while its report holds. A relayer that does
--             not report (a release before it) is not seen: during a rolling upgrade its
--             topics may be returned.
-- Raises:     P7001 (p_older_than) when it is NULL or negative.
-- Shape:      reads outbox.messages whole (a sequential scan, as the observation does),
--             grouped by topic before the reports are checked, so the patterns are matched
--             once per topic, not per message; each uncovered topic's keyed messages are
--             read in one more scan, and the messages behind them probed through
--             messages_key_seq_idx.
--             Called once per observe interval by each relayer, and by `outbox-relay
--             status`.
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
    ), uncovered AS (
        SELECT w.topic, w.ready, w.oldest
          FROM waiting AS w
         WHERE NOT EXISTS (
                   SELECT 1
                     FROM outbox.coverage_reports AS r
                    WHERE r.expires_at > now()
                      AND (r.topics IS NULL OR w.topic = ANY (r.topics))
                      AND (r.include_topics IS NULL OR w.topic LIKE ANY (r.include_topics)))
    )
    SELECT u.topic, u.ready, now() - u.oldest,
           coalesce(h.keys, 0),
           coalesce(h.topics, '{}')
      FROM uncovered AS u
      LEFT JOIN LATERAL (
               SELECT count(DISTINCT m.message_key) AS keys,
                      array_agg(DISTINCT b.topic ORDER BY b.topic) AS topics
                 FROM outbox.messages AS m
                 JOIN outbox.messages AS b
                   ON b.message_key = m.message_key
                  AND b.seq > m.seq
                  AND b.topic <> m.topic
                WHERE m.topic = u.topic
                  AND m.message_key IS NOT NULL) AS h ON true
     ORDER BY u.oldest, u.topic;
END;
$$;

COMMENT ON FUNCTION outbox.uncovered_topics(interval) IS
    'Topics with messages ready for at least p_older_than that no running relayer''s coverage report covers: how many, the oldest''s age, and the keys whose messages on other topics wait behind them; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.uncovered_topics(interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.uncovered_topics(interval) TO outbox_reader, outbox_relay;

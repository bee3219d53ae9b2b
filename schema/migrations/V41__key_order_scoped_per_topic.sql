-- The scope of a key's order becomes a choice, per topic pattern: the whole outbox (the
-- default, and what every earlier release did) or the message's topic. The rules are the
-- new table outbox.key_order_rules, set with outbox.set_key_order_scope and
-- outbox.unset_key_order_scope, read with outbox.key_order_scope and the view
-- outbox.key_order_scopes. Each message gets its order key when it is inserted, in the new
-- column outbox.messages.order_key (set by mark_behind): its message_key, or its
-- message_key, a unit separator and its topic when its topic is scoped per topic. Every
-- question of order (mark_behind, settle_behind, the claim's head check and runs,
-- key_pending_before, the completions' promotion of a key's next head, stalled_topics'
-- held keys, the console's key position) asks it of order_key instead of message_key,
-- through messages_order_key_seq_idx (order_key, seq), which replaces messages_key_seq_idx;
-- the console's search by message_key is a range of it (order_key is in the C collation).
-- What is shown and sent keeps message_key, and so do the shard expression and the
-- completions' key locks (coarser, never less than needed). The pending messages get
-- order_key = message_key, the order they had: the migration writes every keyed pending
-- message once and builds the new index while it holds the table's lock, so producers,
-- claims and completions wait for it (2.5 s at a backlog of 1,000,000 messages, 100,000 of
-- them keyed, on the 2-core development machine). Contracts in full: 01_tables.sql,
-- 03_enqueue.sql, 04_claim.sql, 05_completion.sql, 08_observation.sql, 11_console.sql.


CREATE TABLE outbox.key_order_rules (
    -- a LIKE pattern of topics
    topic_pattern text        NOT NULL,
    scope         text        NOT NULL,
    set_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- the login role that set it (session_user: the functions run as their owner)
    set_by        text        NOT NULL DEFAULT session_user,
    CONSTRAINT key_order_rules_pkey PRIMARY KEY (topic_pattern),
    CONSTRAINT key_order_rules_pattern_not_empty CHECK (topic_pattern <> ''),
    CONSTRAINT key_order_rules_scope CHECK (scope IN ('global', 'topic'))
);

COMMENT ON TABLE outbox.key_order_rules IS
    'The scope of a key''s order (global: the whole outbox; topic: per topic) per LIKE pattern of topics, applied to messages enqueued after it is set; written by set_key_order_scope and unset_key_order_scope; owner only.';

REVOKE ALL ON TABLE outbox.key_order_rules FROM PUBLIC;


ALTER TABLE outbox.messages ADD COLUMN order_key text COLLATE "C";

UPDATE outbox.messages SET order_key = message_key WHERE message_key IS NOT NULL;

ALTER TABLE outbox.messages
    ADD CONSTRAINT messages_order_key_with_key CHECK ((order_key IS NULL) = (message_key IS NULL));

DROP INDEX outbox.messages_key_seq_idx;

CREATE INDEX messages_order_key_seq_idx ON outbox.messages (order_key, seq)
    WHERE order_key IS NOT NULL;


COMMENT ON COLUMN outbox.messages.behind IS
    'an earlier message of the same order_key is pending; not a claim candidate';
COMMENT ON COLUMN outbox.messages.order_key IS
    'what the message keeps order with, set at insert: message_key (the whole outbox) or message_key, unit separator, topic (per topic; key_order_rules)';


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


-- outbox.mark_behind: internal; the function of trigger messages_mark_behind (BEFORE INSERT
-- of a message with a key: enqueue, replay_step, an adopted table's trigger, or an INSERT
-- by the owner). Not granted.
--
-- Sets NEW.order_key, what the message keeps order with: NEW.message_key when its topic's
-- key order spans the whole outbox, NEW.message_key || E'\x1f' || NEW.topic when it is
-- scoped per topic (key_order_scope, 03_enqueue.sql, as the rules stand at this insert);
-- except while a message of the same key and topic given the other scope's order key is
-- pending (the rule changed since it was enqueued): then the new message takes that order
-- key, so that a key's messages on one topic are never delivered out of enqueue order, and
-- the new scope begins for the key on that topic once nothing of it is pending there. That
-- check is one more probe of messages_order_key_seq_idx; under a per-topic rule it steps
-- over the key's messages pending on other topics under the whole outbox, if any.
-- A key holding the unit separator (\x1f) may then share its order key with another key's
-- on another topic: the two wait for each other, and each keeps its own order.
-- Sets NEW.behind when any message of the same order key is pending, as this statement
-- sees it. Every pending message it sees was enqueued, and numbered, earlier; a VOLATILE
-- trigger function sees the rows inserted earlier by the same statement, so a multi-row
-- INSERT of one key marks all but the first. A message marked as a head while it is not
-- one (an earlier message of its key not yet committed) is harmless: the claim takes a
-- head only when no earlier message of its key is pending. Locks nothing; raises nothing.
-- SECURITY DEFINER: it reads the tables with the owner's rights, whoever inserts.
-- It reads the key's entries of messages_order_key_seq_idx newest first and stops at the
-- first pending one: while the MVCC horizon is held, the key's delivered messages leave
-- dead entries below its pending ones, and a key with a message pending (a busy key)
-- answers at its newest entries instead of stepping over every message it delivered since
-- the hold began. A key with nothing pending still steps over them all.
CREATE OR REPLACE FUNCTION outbox.mark_behind() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_whole    text := NEW.message_key;
    v_by_topic text := NEW.message_key || E'\x1f' || NEW.topic;
    v_scoped   boolean := outbox.key_order_scope(NEW.topic) = 'topic';
BEGIN
    -- The key's messages pending on this topic under the other scope keep theirs.
    NEW.order_key := CASE WHEN EXISTS (SELECT 1
                                         FROM outbox.messages AS e
                                        WHERE e.order_key = CASE WHEN v_scoped THEN v_whole
                                                                 ELSE v_by_topic END
                                          AND e.topic = NEW.topic)
                          THEN CASE WHEN v_scoped THEN v_whole ELSE v_by_topic END
                          ELSE CASE WHEN v_scoped THEN v_by_topic ELSE v_whole END
                     END;
    NEW.behind := coalesce((SELECT true
                              FROM outbox.messages AS e
                             WHERE e.order_key = NEW.order_key
                             ORDER BY e.seq DESC
                             LIMIT 1), false);
    RETURN NEW;
END;
$$;

COMMENT ON FUNCTION outbox.mark_behind() IS
    'Internal (trigger messages_mark_behind, before insert of a keyed message): sets the message''s order_key by its topic''s key order scope and marks it behind when an earlier message of that order key is pending. Not granted.';

REVOKE ALL ON FUNCTION outbox.mark_behind() FROM PUBLIC;


-- outbox.settle_behind: internal; the function of the deferred constraint trigger
-- messages_settle_behind, which runs at the commit of a transaction that inserted a
-- message marked behind. Not granted.
--
-- Guarantees: the first pending message of a key is never left marked behind with nobody
--   to clear it. The completion that deletes a key's head clears the mark of the key's next
--   message, but it cannot see a message whose producer has not committed yet. So, at the
--   producer's commit, under READ COMMITTED this locks the nearest earlier message of the
--   key (its order_key) FOR KEY SHARE: its deletion then waits for this commit, and the
--   completion's later statement sees the new message. When there is no earlier message
--   left to lock, the new message clears its own mark.
-- Locks: that one earlier message, FOR KEY SHARE SKIP LOCKED, until the commit; a message
--   that a completion is deleting (or that a claim holds FOR UPDATE during its short
--   transaction) is passed over for the next earlier one. The producer never waits here.
--   Under REPEATABLE READ or SERIALIZABLE, where that lock could fail the commit with a
--   serialization error, it locks nothing and clears the new message's own mark. Its
--   entry in messages_shard_heads_idx is then where this transaction's INSERT put it: at
--   or after the clock of the insert, or, for a message dated in the past, where this same
--   commit lowers its shard's claim floor to (lower_claim_floor, 04_claim.sql).
-- Raises: nothing.
-- Crash: nothing; it runs inside the producer's transaction, and a crash before the commit
--   completes loses the message with the rest of that transaction.
-- Shape: SKIP LOCKED so that a producer's commit never waits for a completion. Waiting, a
--   producer that enqueued behind two messages of one batch locked the first while the
--   completion, having deleted the second, waited for the first: a deadlock, and Postgres
--   failed the application's COMMIT (40P01) within seconds under multi-row enqueues with
--   10 % keyed traffic. The cost is an early head candidate per message that met such a
--   lock: the claim's head check skips it (one probe per claim of its shard) until its key
--   reaches it. SECURITY DEFINER: at commit it runs as the producer's role, which has no
--   rights on the table.
CREATE OR REPLACE FUNCTION outbox.settle_behind() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
BEGIN
    IF current_setting('transaction_isolation') = 'read committed' THEN
        -- The nearest earlier message of the key that no completion is deleting. Locked,
        -- its deletion waits for this commit; none, and this message is the head to come.
        PERFORM 1
           FROM outbox.messages AS e
          WHERE e.order_key = NEW.order_key
            AND e.seq < NEW.seq
          ORDER BY e.seq DESC
          LIMIT 1
            FOR KEY SHARE SKIP LOCKED;
        IF FOUND THEN
            RETURN NULL;
        END IF;
    END IF;
    UPDATE outbox.messages AS m
       SET behind = false
     WHERE m.outbox_id = NEW.outbox_id
       AND m.behind;
    RETURN NULL;
END;
$$;

COMMENT ON FUNCTION outbox.settle_behind() IS
    'Internal (deferred trigger messages_settle_behind, at commit): locks the nearest earlier message of the key FOR KEY SHARE SKIP LOCKED, or clears the new message''s own mark. Not granted.';

REVOKE ALL ON FUNCTION outbox.settle_behind() FROM PUBLIC;


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


-- outbox.key_pending_before (internal): whether a message of order key p_key with a seq
-- below p_seq is pending in any slot: one probe of each slot's messages_order_key_seq_idx,
-- by a plan kept for the session. The claim asks it only of a shard with entries in more than one slot.
CREATE OR REPLACE FUNCTION outbox.key_pending_before(p_key text, p_seq bigint) RETURNS boolean
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


-- outbox.complete_outbox_batch_slot0 (internal): complete_outbox_batch (below) for messages
-- whose tokens name slot 0, called by it once its arguments are checked and, when the
-- batch spans slots, once every key's completion lock is held; copied for slots 1 to 3.
-- The fence, the attempts, the deletion of delivered messages and the promotion of the
-- next heads are those of complete_outbox_batch, on slot 0's table.
CREATE OR REPLACE FUNCTION outbox.complete_outbox_batch_slot0(
    p_worker_id text,
    p_outbox_ids uuid[],
    p_lease_tokens uuid[],
    p_states outbox.attempt_state[],
    p_errors text[],
    p_retry_ats timestamptz[]
) RETURNS TABLE (outbox_id uuid, attempt_no integer, lease_lost boolean, dead_lettered boolean)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_ids uuid[];
    v_nos integer[];
    v_ords bigint[];
    v_states outbox.attempt_state[];
    v_tokens uuid[];
    v_errors text[];
    v_retry_ats timestamptz[];
    v_exhausted boolean[];
    v_keys text[];
    v_after timestamptz[];
    v_seqs bigint[];
    v_mixed boolean;
    v_reused boolean := false;
BEGIN
    -- One completion at a time per key, so that promote_heads sees what the key's other
    -- completions did.
    PERFORM outbox.lock_keys_slot0(ARRAY(SELECT u.id
                                           FROM unnest(p_outbox_ids, p_lease_tokens) AS u(id, token)
                                          WHERE outbox.token_keyed(u.token)));

    IF 'DISPATCHED' = ALL (p_states) THEN
        BEGIN
            -- The fence is the deletion: this worker, the token listed with the id, an
            -- unexpired lease; a row changed by a concurrent commit (a repair, another
            -- claim) is checked again after the wait. The attempts are inserted in the
            -- call's order (ord).
            WITH gone AS (
                DELETE FROM outbox.messages_0 AS m
                 WHERE m.outbox_id = ANY (p_outbox_ids)
                   AND m.lease_token = ANY (p_lease_tokens)
                   AND m.claimed_by = p_worker_id
                   AND m.lease_expires_at > now()
                RETURNING m.outbox_id, m.attempt_count + 1 AS attempt_no, m.lease_token,
                          m.order_key, m.available_at, m.seq, m.behind
            ), done AS (
                SELECT u.ord, g.outbox_id, g.attempt_no, g.lease_token, g.order_key,
                       g.available_at, g.seq, g.behind, u.error,
                       g.lease_token <> u.token AS mixed
                  FROM gone AS g
                  JOIN unnest(p_outbox_ids, p_lease_tokens, p_errors)
                           WITH ORDINALITY AS u(id, token, error, ord)
                    ON u.id = g.outbox_id
            ), recorded AS (
                -- the log's current slot read once, not as each row's default
                INSERT INTO outbox.attempts (outbox_id, attempt_no, state, worker_id, lease_token, error, slot)
                SELECT d.outbox_id, d.attempt_no, 'DISPATCHED', p_worker_id, d.lease_token, d.error, l.slot
                  FROM done AS d, (SELECT outbox.attempt_slot() AS slot) AS l
                 ORDER BY d.ord
            )
            SELECT array_agg(d.ord), array_agg(d.attempt_no),
                   array_agg(d.order_key) FILTER (WHERE d.order_key IS NOT NULL AND NOT d.behind),
                   array_agg(d.available_at) FILTER (WHERE d.order_key IS NOT NULL AND NOT d.behind),
                   array_agg(d.seq) FILTER (WHERE d.order_key IS NOT NULL AND NOT d.behind),
                   coalesce(bool_or(d.mixed), false)
              INTO v_ords, v_nos, v_keys, v_after, v_seqs, v_mixed
              FROM done AS d;
        EXCEPTION WHEN unique_violation THEN
            -- An id with an earlier history: the deletion is undone with the INSERT, and
            -- the call goes the general way below, once its pairs are checked as the
            -- deletion checks them.
            v_reused := true;
            v_mixed := EXISTS (
                SELECT 1
                  FROM unnest(p_outbox_ids, p_lease_tokens) AS u(id, token)
                  JOIN outbox.messages_0 AS m ON m.outbox_id = u.id
                 WHERE m.lease_token <> u.token
                   AND m.lease_token = ANY (p_lease_tokens)
                   AND m.claimed_by = p_worker_id
                   AND m.lease_expires_at > now());
        END;

        IF v_mixed THEN
            -- The caller mixed up its pairs (tokens are random): the call fails and its
            -- deletions are undone.
            PERFORM outbox.invalid_argument('p_lease_tokens',
                'a lease token is listed with the id of another message');
        END IF;
        IF NOT v_reused THEN
            IF v_keys IS NOT NULL THEN
                PERFORM outbox.promote_heads(v_keys, v_after, v_seqs);
            END IF;
            RETURN QUERY
            SELECT u.id, h.attempt_no, h.ord IS NULL, false
              FROM unnest(p_outbox_ids) WITH ORDINALITY AS u(id, ord)
              LEFT JOIN unnest(v_ords, v_nos) AS h(ord, attempt_no) ON h.ord = u.ord
             ORDER BY u.ord;
            RETURN;
        END IF;
    END IF;

    -- Fence: lock only the rows this worker still holds with these tokens and an
    -- unexpired lease, one primary-key probe per listed id, in id order. Under READ
    -- COMMITTED a row changed by a concurrent commit (repair, another claim) is re-checked
    -- against these conditions after the lock is granted. The rows locked are then listed
    -- in the order of the call (ord), which is the order their attempts are written in.
    SELECT array_agg(h.outbox_id ORDER BY i.ord), array_agg(h.attempt_no ORDER BY i.ord),
           array_agg(i.state ORDER BY i.ord), array_agg(h.lease_token ORDER BY i.ord),
           array_agg(i.error ORDER BY i.ord), array_agg(i.retry_at ORDER BY i.ord),
           array_agg(h.exhausted ORDER BY i.ord)
      INTO v_ids, v_nos, v_states, v_tokens, v_errors, v_retry_ats, v_exhausted
      FROM (SELECT *
              FROM unnest(p_outbox_ids, p_lease_tokens, p_states, p_errors, p_retry_ats)
                       WITH ORDINALITY AS u(id, token, state, error, retry_at, ord)
             ORDER BY u.id) AS i
     CROSS JOIN LATERAL (
            SELECT m.outbox_id,
                   m.attempt_count + 1 AS attempt_no,
                   m.lease_token,
                   m.attempt_count + 1 >= m.attempt_base + m.max_attempts AS exhausted
              FROM outbox.messages_0 AS m
             WHERE m.outbox_id = i.id
               AND m.lease_token = i.token
               AND m.claimed_by = p_worker_id
               AND m.lease_expires_at > now()
               FOR NO KEY UPDATE) AS h;

    IF v_ids IS NOT NULL THEN
        PERFORM outbox.apply_outcomes(v_ids, v_nos, v_states,
                                      array_fill(p_worker_id, ARRAY[cardinality(v_ids)]),
                                      v_tokens, v_errors, v_retry_ats, v_exhausted);
    END IF;

    RETURN QUERY
    SELECT u.id, h.attempt_no, h.id IS NULL,
           coalesce(h.state = 'FAILED' OR (h.state = 'RETRYABLE' AND h.exhausted), false)
      FROM unnest(p_outbox_ids) WITH ORDINALITY AS u(id, ord)
      LEFT JOIN unnest(v_ids, v_nos, v_states, v_exhausted) AS h(id, attempt_no, state, exhausted)
             ON h.id = u.id
     ORDER BY u.ord;
END;
$$;


COMMENT ON FUNCTION outbox.complete_outbox_batch_slot0(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) IS
    'Internal: complete_outbox_batch for messages of slot 0, its arguments checked.';
REVOKE ALL ON FUNCTION outbox.complete_outbox_batch_slot0(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.complete_outbox_batch_slot0(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[])');


-- outbox.apply_outcomes (internal): settles rows its caller has already locked and fenced.
-- Called by complete_outbox_batch (a call not all DISPATCHED, or listing a reused id) and
-- by repair_expired_leases (ZOMBIE_REQUEUE); no role may execute it.
--
-- Inputs:     parallel arrays, one element per message, in the order the attempts are
--             written: ids, attempt numbers (attempt_count + 1), states, worker ids, lease
--             tokens, errors, retry times (a NULL array or element: now), exhausted (no
--             attempt left after this one).
-- Does:       record_attempts, then: DISPATCHED deleted; FAILED, or another state when
--             exhausted, moved to outbox.dead_letters, or parked (lease cleared,
--             available_at = infinity, last_error saying why) when a dead letter with its id
--             exists; RETRYABLE or ZOMBIE_REQUEUE otherwise: lease cleared, attempt_count =
--             the attempt number, available_at = the retry time but not before now(),
--             last_error. Last, promote_heads for the keys that lost a message, in a
--             statement after the deletions.
-- Returns:    the number moved to dead letters (parked messages not counted).
-- Locks:      the caller's rows, and the keys' next heads that promote_heads updates; a
--             deletion waits for a producer's FOR KEY SHARE for the instant of its commit.
-- Raises:     nothing of its own.
-- Shape:      every statement finds its rows by primary key (outbox_id = ANY); sequential
--             scans are off because under 0-row statistics one read every pending row
--             instead (3 ms at 20,000 rows, 150 ms at 1,000,000, per batch).
CREATE OR REPLACE FUNCTION outbox.apply_outcomes(
    p_outbox_ids uuid[],
    p_attempt_nos integer[],
    p_states outbox.attempt_state[],
    p_worker_ids text[],
    p_lease_tokens uuid[],
    p_errors text[],
    p_retry_ats timestamptz[],
    p_exhausted boolean[]
) RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_dead uuid[];
    v_done uuid[];
    v_retry uuid[];
    v_parked uuid[];
    v_keys text[] := '{}';
    v_after timestamptz[] := '{}';
    v_seqs bigint[] := '{}';
BEGIN
    PERFORM outbox.record_attempts(p_outbox_ids, p_attempt_nos, p_states, p_worker_ids,
                                   p_lease_tokens, p_errors);

    SELECT coalesce(array_agg(u.id) FILTER (WHERE u.state = 'DISPATCHED'), '{}'),
           coalesce(array_agg(u.id) FILTER (WHERE u.state = 'FAILED'
                                            OR (u.state <> 'DISPATCHED' AND u.exhausted)), '{}'),
           coalesce(array_agg(u.id) FILTER (WHERE u.state IN ('RETRYABLE', 'ZOMBIE_REQUEUE')
                                            AND NOT u.exhausted), '{}')
      INTO v_done, v_dead, v_retry
      FROM unnest(p_outbox_ids, p_states, p_exhausted) AS u(id, state, exhausted);

    IF cardinality(v_done) > 0 THEN
        WITH gone AS (
            DELETE FROM outbox.messages WHERE outbox_id = ANY (v_done)
            RETURNING order_key, available_at, seq, behind
        )
        SELECT coalesce(array_agg(g.order_key) FILTER (WHERE g.order_key IS NOT NULL AND NOT g.behind), '{}'),
               coalesce(array_agg(g.available_at) FILTER (WHERE g.order_key IS NOT NULL AND NOT g.behind), '{}'),
               coalesce(array_agg(g.seq) FILTER (WHERE g.order_key IS NOT NULL AND NOT g.behind), '{}')
          INTO v_keys, v_after, v_seqs
          FROM gone AS g;
    END IF;

    IF cardinality(v_dead) > 0 THEN
        SELECT coalesce(array_agg(d.outbox_id), '{}')
          INTO v_parked
          FROM outbox.dead_letters AS d
         WHERE d.outbox_id = ANY (v_dead);
        IF cardinality(v_parked) > 0 THEN
            UPDATE outbox.messages AS m
               SET claimed_by = NULL, lease_token = NULL, lease_expires_at = NULL,
                   attempt_count = u.attempt_no,
                   available_at = 'infinity',
                   last_error = format('parked instead of dead-lettered: a dead letter with this id exists '
                                       '(delete or replay it, then set available_at); last error: %s', u.error)
              FROM unnest(p_outbox_ids, p_attempt_nos, p_errors) AS u(id, attempt_no, error)
             WHERE m.outbox_id = ANY (v_parked)
               AND m.outbox_id = u.id;
            v_dead := ARRAY(SELECT x FROM unnest(v_dead) AS x WHERE x <> ALL (v_parked));
        END IF;

        WITH gone AS (
            DELETE FROM outbox.messages WHERE outbox_id = ANY (v_dead)
            RETURNING *
        ), buried AS (
            INSERT INTO outbox.dead_letters (outbox_id, topic, message_key, payload, content_type, headers,
                                             created_at, attempt_count, max_attempts, last_error)
            SELECT g.outbox_id, g.topic, g.message_key, g.payload, g.content_type, g.headers,
                   g.created_at, u.attempt_no, g.max_attempts, u.error
              FROM gone AS g
              JOIN unnest(p_outbox_ids, p_attempt_nos, p_errors) AS u(id, attempt_no, error)
                ON u.id = g.outbox_id
        )
        SELECT v_keys || coalesce(array_agg(g.order_key) FILTER (WHERE g.order_key IS NOT NULL AND NOT g.behind), '{}'),
               v_after || coalesce(array_agg(g.available_at) FILTER (WHERE g.order_key IS NOT NULL AND NOT g.behind), '{}'),
               v_seqs || coalesce(array_agg(g.seq) FILTER (WHERE g.order_key IS NOT NULL AND NOT g.behind), '{}')
          INTO v_keys, v_after, v_seqs
          FROM gone AS g;
    END IF;

    IF cardinality(v_retry) > 0 THEN
        UPDATE outbox.messages AS m
           SET claimed_by = NULL,
               lease_token = NULL,
               lease_expires_at = NULL,
               attempt_count = u.attempt_no,
               available_at = greatest(coalesce(u.retry_at, now()), now()),
               last_error = u.error
          FROM unnest(p_outbox_ids, p_attempt_nos, p_errors, p_retry_ats) AS u(id, attempt_no, error, retry_at)
         WHERE m.outbox_id = ANY (v_retry)
           AND m.outbox_id = u.id;
    END IF;

    IF cardinality(v_keys) > 0 THEN
        PERFORM outbox.promote_heads(v_keys, v_after, v_seqs);
    END IF;

    RETURN cardinality(v_dead);
END;
$$;

COMMENT ON FUNCTION outbox.apply_outcomes(uuid[], integer[], outbox.attempt_state[], text[], uuid[], text[], timestamptz[], boolean[]) IS
    'Internal (complete_outbox_batch, repair_expired_leases): records the attempts of rows the caller has locked and fenced, then deletes, dead-letters (or parks) or requeues each and promotes keys'' next heads; returns the number dead-lettered.';

REVOKE ALL ON FUNCTION outbox.apply_outcomes(uuid[], integer[], outbox.attempt_state[], text[], uuid[], text[], timestamptz[], boolean[]) FROM PUBLIC;


-- outbox.promote_slot0 (internal): makes the listed messages of slot 0 that are still
-- behind heads, not before the given times; returns their order keys.
CREATE OR REPLACE FUNCTION outbox.promote_slot0(p_ids uuid[], p_after timestamptz[])
RETURNS SETOF text
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RETURN QUERY
    UPDATE outbox.messages_0 AS m
       SET behind = false,
           available_at = greatest(m.available_at, p_after[array_position(p_ids, m.outbox_id)])
     WHERE m.outbox_id = ANY (p_ids)
       AND m.behind
    RETURNING m.order_key;
END;
$$;

COMMENT ON FUNCTION outbox.promote_slot0(uuid[], timestamptz[]) IS
    'Internal: promote_heads'' update in slot 0.';
REVOKE ALL ON FUNCTION outbox.promote_slot0(uuid[], timestamptz[]) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.promote_slot0(uuid[], timestamptz[])');


-- outbox.promote_heads (internal): the first pending message of each listed order key
-- (a key as enqueue scoped it: messages.order_key, 01_tables.sql) becomes
-- its head (behind = false) where it is not already. Called by complete_outbox_batch and
-- apply_outcomes after they delete keyed messages, as a statement of its own, so that its
-- snapshot sees a producer's message whose commit the deletion waited for; no role may
-- execute it.
--
-- Inputs:     parallel arrays, one element per head the caller deleted (a keyed message
--             not behind: it had an entry in messages_shard_heads_idx): its key, its
--             available_at and its seq. A key whose deletions held no head is not listed:
--             its head is still pending and nothing behind it is due.
-- Raises:     nothing of its own.
-- Locks:      each key's first pending message while it is marked behind (FOR NO KEY
--             UPDATE, through the UPDATE), waiting for a transaction that holds it.
-- Guarantees: when the caller commits, each listed key's first pending message, as any
--             later statement sees it, is not marked behind, or is being deleted by a
--             completion that has not committed and promotes the key itself. The message
--             it finds may be one that another completion is deleting (two completions of
--             consecutive messages of one key at once): the UPDATE waits for that
--             completion and, the row gone, updates nothing; the key is then looked up
--             again, in a new statement whose snapshot sees that deletion, until its first
--             pending message is found already a head, is updated, or the key has none.
--             The other completion, which saw this one's message still there and a head,
--             changed nothing. Each round ends with a message of the key gone or promoted,
--             so the loop ends. The key's first pending message is looked for after the
--             lowest seq deleted under it (the head: nothing earlier is pending but a
--             message whose late commit cleared its own mark, settle_behind), so the walk
--             skips the key's delivered entries. A promoted message's available_at moves
--             up to the latest available_at of the heads deleted under its key, if it was
--             earlier: its entry enters messages_shard_heads_idx at or after that of a head
--             that held its shard's claim floor (04_claim.sql) until this transaction
--             commits, so the new entry is never below the floor. It keeps its place among
--             the messages enqueued after it.
-- Shape:      the heads are found first (one probe of messages_order_key_seq_idx per distinct
--             key) and then updated by primary key: joined in one statement, the planner
--             could walk all of outbox.messages per call (11.7 s at a 480,000 backlog).
--             PL/pgSQL with plan_cache_mode = auto keeps the plans between calls (they do
--             not depend on the arrays). A call without a concurrent deletion makes one
--             round: the lookup and the UPDATE.
CREATE OR REPLACE FUNCTION outbox.promote_heads(p_keys text[], p_after timestamptz[], p_seqs bigint[])
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET plan_cache_mode = auto
SET enable_seqscan = off
AS $$
DECLARE
    v_keys     text[];       -- the keys to promote a message of
    v_after    timestamptz[]; -- for each, the latest available_at the caller deleted
    v_from     bigint[];     -- for each, the lowest seq the caller deleted
    v_ids      uuid[];       -- the first pending message of a key, still marked behind
    v_id_keys  text[];       -- its key
    v_id_after timestamptz[]; -- its key's v_after
    v_id_from  bigint[];     -- its key's v_from
    v_id_slots smallint[];   -- its slot
    v_promoted text[];       -- the keys whose message this round's UPDATE changed
BEGIN
    SELECT array_agg(k.key), array_agg(k.after), array_agg(k.from_seq)
      INTO v_keys, v_after, v_from
      FROM (SELECT u.key, max(u.after) AS after, min(u.seq) AS from_seq
              FROM unnest(p_keys, p_after, p_seqs) AS u(key, after, seq)
             WHERE u.key IS NOT NULL
             GROUP BY u.key) AS k;
    WHILE cardinality(v_keys) > 0 LOOP
        SELECT array_agg(f.outbox_id), array_agg(k.key), array_agg(k.after), array_agg(k.from_seq),
               array_agg(f.slot)
          INTO v_ids, v_id_keys, v_id_after, v_id_from, v_id_slots
          FROM unnest(v_keys, v_after, v_from) AS k(key, after, from_seq)
         CROSS JOIN LATERAL (
                SELECT a.outbox_id, a.behind, a.slot
                  FROM ((SELECT n0.outbox_id, n0.seq, n0.behind, n0.slot FROM outbox.messages_0 n0
                          WHERE n0.order_key = k.key AND n0.seq > k.from_seq ORDER BY n0.seq LIMIT 1)
                        UNION ALL
                        (SELECT n1.outbox_id, n1.seq, n1.behind, n1.slot FROM outbox.messages_1 n1
                          WHERE n1.order_key = k.key AND n1.seq > k.from_seq ORDER BY n1.seq LIMIT 1)
                        UNION ALL
                        (SELECT n2.outbox_id, n2.seq, n2.behind, n2.slot FROM outbox.messages_2 n2
                          WHERE n2.order_key = k.key AND n2.seq > k.from_seq ORDER BY n2.seq LIMIT 1)
                        UNION ALL
                        (SELECT n3.outbox_id, n3.seq, n3.behind, n3.slot FROM outbox.messages_3 n3
                          WHERE n3.order_key = k.key AND n3.seq > k.from_seq ORDER BY n3.seq LIMIT 1)) AS a
                 ORDER BY a.seq
                 LIMIT 1) AS f
         WHERE f.behind;
        EXIT WHEN v_ids IS NULL;

        SELECT coalesce(array_agg(p.key), '{}') INTO v_promoted
          FROM (SELECT outbox.promote_slot0(v_ids, v_id_after) AS key WHERE 0 = ANY (v_id_slots)
                UNION ALL
                SELECT outbox.promote_slot1(v_ids, v_id_after) WHERE 1 = ANY (v_id_slots)
                UNION ALL
                SELECT outbox.promote_slot2(v_ids, v_id_after) WHERE 2 = ANY (v_id_slots)
                UNION ALL
                SELECT outbox.promote_slot3(v_ids, v_id_after) WHERE 3 = ANY (v_id_slots)) AS p;

        -- A message not updated was deleted (or made a head) by another transaction while
        -- this one waited for it: its key is looked up again.
        SELECT array_agg(k.key), array_agg(k.after), array_agg(k.from_seq)
          INTO v_keys, v_after, v_from
          FROM unnest(v_id_keys, v_id_after, v_id_from) AS k(key, after, from_seq)
         WHERE k.key <> ALL (v_promoted);
    END LOOP;
END;
$$;

COMMENT ON FUNCTION outbox.promote_heads(text[], timestamptz[], bigint[]) IS
    'Internal (complete_outbox_batch, apply_outcomes): marks the first pending message of each listed key as its head (behind = false), not before the latest available_at deleted under the key.';

REVOKE ALL ON FUNCTION outbox.promote_heads(text[], timestamptz[], bigint[]) FROM PUBLIC;


-- outbox.stalled_topics: the topics whose ready messages wait because no running relayer
-- claims them (uncovered) or because every running relayer that claims them leaves them
-- unclaimed while their destination's circuit is open (circuit_open), with the keys held
-- behind them on other topics: where a key's order spans the whole outbox (the default,
-- key_order_scope in 03_enqueue.sql), a key's later messages on any topic wait for these;
-- a message whose topic's key order is scoped per topic holds nothing on other topics.
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
--             held_keys (order keys that have a message of this topic pending before a
--             message of another topic: keys ordered across the whole outbox); held_topics (the other topics those messages are on,
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
--             through messages_order_key_seq_idx. Called by each relayer's observer in place of
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
               SELECT count(DISTINCT m.order_key) AS keys,
                      array_agg(DISTINCT b.topic ORDER BY b.topic) AS topics
                 FROM outbox.messages AS m
                 JOIN outbox.messages AS b
                   ON b.order_key = m.order_key
                  AND b.seq > m.seq
                  AND b.topic <> m.topic
                WHERE m.topic = s.topic
                  AND m.order_key IS NOT NULL) AS h ON true
     ORDER BY s.oldest, s.topic;
END;
$$;

COMMENT ON FUNCTION outbox.stalled_topics(interval) IS
    'Topics with messages ready for at least p_older_than that wait because no running relayer claims them (uncovered) or every relayer claiming them has its destination''s circuit open (circuit_open, naming the destinations): how many, the oldest''s age, and the keys whose messages on other topics wait behind them; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.stalled_topics(interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.stalled_topics(interval) TO outbox_reader, outbox_relay;


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

-- Tables: the data the SQL API works on, and what keeps them fast under a queue's churn.
--
-- Objects (in this order):
--   outbox.attempt_state              enum: the outcome of one attempt
--   outbox.uuid_v7()                  time-ordered ids (default of messages.outbox_id)
--   outbox.message_slot               sequence: the slot of outbox.messages producers write to
--   outbox.message_slot()             that slot (default of messages.slot)
--   outbox.message_slots              when each slot became the one producers write to
--   outbox.key_order_rules            the scope of a key's order, per topic pattern
--   outbox.messages                   pending work, one row per undelivered message, in 4 slots
--   outbox.mark_behind()              trigger function: gives a keyed message its order key
--                                     and marks it behind that key
--   outbox.settle_behind()            trigger function: at commit, keeps a key's head findable
--   outbox.attempt_slot               sequence: the slot of outbox.attempts attempts go to
--   outbox.attempt_slot()             that slot (default of attempts.slot)
--   outbox.attempt_slots              when each slot became the one attempts go to
--   outbox.attempts                   the append-only attempt log, in 4 slots and a kept one
--   outbox.dead_letters               messages out of attempts or refused for good
--   outbox.turns                      rows locked to take turns (claim shards, repair, observe)
--   outbox.observations               the fleet's latest observation snapshot
--   outbox.attempt_minutes            attempts per minute of the last hour, counted once
--   outbox.replays                    the audit of dead-letter replays
--   outbox.circuit_reports            each relayer's circuit state per destination
--   outbox.coverage_reports           the topics each relayer claims
--
-- Who calls what: nobody but the schema owner reads or writes these tables. Producers
-- (outbox_producer) write through outbox.enqueue, the relayer (outbox_relay) through the
-- claim, completion, repair, retention and replay functions, and readers (outbox_reader,
-- outbox_relay) read the views (08_observation.sql; replay_log in 07_dead_letters.sql).
-- Those functions are SECURITY DEFINER with a fixed search_path: they act with the owner's
-- rights on the tables below.
--
-- Conventions:
-- * Every table has REVOKE ALL … FROM PUBLIC and no GRANT: owner only.
-- * Every function finds a message by its primary key (one index probe per id, whatever the
--   backlog) or walks one of the two indexes of outbox.messages named below; at real
--   backlogs no statement on the hot path reads outbox.messages sequentially. Repair (once per repair interval),
--   the observation (once per observe interval) and the views read the whole table.
-- * Timestamps are timestamptz. A row's own time (messages.created_at, attempts.created_at,
--   dead_letters.dead_lettered_at, replays.started_at) defaults to clock_timestamp(): the
--   moment of the row, not of its transaction's start.
-- * The measurements behind the settings below are in docs/performance.md.


-- outbox.attempt_state: the outcome of one attempt at delivering a message, as recorded in
-- outbox.attempts.state.
--   DISPATCHED      the destination acknowledged it (terminal: the message is deleted)
--   FAILED          the destination refused it for good (terminal: dead-lettered)
--   RETRYABLE       a transient failure: tried again at its available_at, or dead-lettered
--                   when it was the last attempt allowed
--   ZOMBIE_REQUEUE  the lease expired without a completion (written by
--                   repair_expired_leases only); it counts as an attempt, so a message that
--                   kills its worker is dead-lettered in the end
-- There is no state for "being delivered": in-flight state is the lease in outbox.messages.
-- Completions name a state (complete_outbox_attempt, complete_outbox_batch); PUBLIC may use
-- the type to name it in a cast, which is no right on any data.
CREATE TYPE outbox.attempt_state AS ENUM (
    'DISPATCHED',
    'FAILED',
    'RETRYABLE',
    'ZOMBIE_REQUEUE'
);

COMMENT ON TYPE outbox.attempt_state IS
    'Outcome of one attempt: DISPATCHED (delivered), FAILED (refused for good), RETRYABLE (tried again or, if last, dead-lettered), ZOMBIE_REQUEUE (lease expired without a completion; repair only).';


-- outbox.uuid_v7: internal; the default of outbox.messages.outbox_id and the id enqueue
-- gives a message when the producer gives none. Granted to no one.
--
-- Returns a version 7 UUID: 48 bits of Unix time in milliseconds (clock_timestamp()), then
-- random bits, with the version and variant bits of RFC 9562. Ids sort by the millisecond
-- of their creation, so inserts land at the right edge of messages_pkey; within one
-- millisecond their order is random, which is why the order of a key is seq, not the id.
-- Postgres before 18 has no built-in uuidv7(); this sets the timestamp and version bits of
-- gen_random_uuid()'s version 4 UUID. Raises nothing.
CREATE OR REPLACE FUNCTION outbox.uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$
    SELECT encode(
        set_bit(
            set_bit(
                overlay(uuid_send(gen_random_uuid())
                        PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                        FROM 1 FOR 6),
                52, 1),
            53, 1),
        'hex')::uuid
$$;

COMMENT ON FUNCTION outbox.uuid_v7() IS
    'Internal: a version 7 UUID (48-bit Unix milliseconds, then random bits); the default of messages.outbox_id and the id enqueue gives a message. Not granted.';

REVOKE ALL ON FUNCTION outbox.uuid_v7() FROM PUBLIC;


-- The slots of outbox.messages. The table is partitioned by slot into a ring of four
-- partitions, outbox.messages_0 … outbox.messages_3. Producers write to one slot at a time,
-- the current slot; outbox.rotate_messages (06_repair_retention.sql) moves them to the next
-- empty slot once the current one has been current for its period, and truncates a slot
-- that is not current once no message in it is pending. A message stays in the slot it was
-- inserted into until it is delivered or dead-lettered: nothing moves a row between slots.
-- While a snapshot holds the MVCC horizon back, the dead rows and index entries that
-- delivered messages leave are confined to the slots written since, and truncation removes
-- them, which vacuum may not: the table, its indexes and what a claim steps over stay
-- bounded by the traffic of a few periods instead of growing with the hold.


-- outbox.message_slot: the current slot (0 to 3), a register rather than a counter: only
-- outbox.rotate_messages sets it (setval), and outbox.message_slot() reads it. A sequence,
-- so that reading it on every insert and setting it leave no row version behind; setval is
-- not transactional, and takes effect at once for every producer.
CREATE SEQUENCE outbox.message_slot AS smallint MINVALUE 0 MAXVALUE 3 START 0;

COMMENT ON SEQUENCE outbox.message_slot IS
    'The slot of outbox.messages producers write to (0 to 3); set only by rotate_messages.';

REVOKE ALL ON SEQUENCE outbox.message_slot FROM PUBLIC;


-- outbox.message_slot: internal; the default of outbox.messages.slot: the current slot, as
-- outbox.message_slot holds it when the row is inserted. Granted to no one (it runs as the
-- owner, who alone inserts into the table). Raises nothing.
CREATE OR REPLACE FUNCTION outbox.message_slot() RETURNS smallint
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    -- a function call, not a scan of the sequence: callers that run with enable_seqscan
    -- off would cost that scan past every JIT threshold, and compile it on every insert
    SELECT coalesce(pg_sequence_last_value('outbox.message_slot'::regclass), 0)::smallint
$$;

COMMENT ON FUNCTION outbox.message_slot() IS
    'Internal: the slot of outbox.messages producers write to now; the default of messages.slot. Not granted.';

REVOKE ALL ON FUNCTION outbox.message_slot() FROM PUBLIC;


-- outbox.message_slots: one row per slot: since when it is (or last was) the current slot.
-- Written only by rotate_messages, once per rotation, and read by it (is the current
-- slot's period over?). Owner only.
CREATE TABLE outbox.message_slots (
    slot      smallint    NOT NULL,
    opened_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT message_slots_pkey PRIMARY KEY (slot),
    CONSTRAINT message_slots_slot CHECK (slot BETWEEN 0 AND 3)
);

INSERT INTO outbox.message_slots (slot) SELECT s FROM generate_series(0, 3) AS s;

COMMENT ON TABLE outbox.message_slots IS
    'Since when each slot of outbox.messages is (or last was) the one producers write to; written by rotate_messages; owner only.';

REVOKE ALL ON TABLE outbox.message_slots FROM PUBLIC;


-- outbox.key_order_rules: the scope of a key's order, chosen per topic pattern. Messages
-- that share a message_key are delivered in enqueue order within a scope:
--   outbox  the whole outbox (the default, for a topic no rule matches): a key's messages
--           wait for every earlier message of the key on any topic ordered so
--   topic   the message's topic: a key's messages wait only for earlier messages of the key
--           on the same topic, and no message of another topic waits for them
-- A topic takes the scope of the most specific rule whose pattern it matches (LIKE, with
-- `\` escaping `%`, `_` and `\`): a pattern without `%` before one with it, then the
-- longer, then the first in byte order. The scope is decided when a message is inserted
-- (mark_behind): a change applies to messages enqueued after it, and messages already
-- pending keep the order they were given. A key's messages on one topic never pass each
-- other: while one of them given the other scope is pending, the key's new messages on
-- that topic take its order key, and the new scope begins for the key on that topic once
-- nothing of it is pending there.
-- Written only by set_key_order_scope and unset_key_order_scope, read by key_order_scope
-- (on every keyed insert) and the view key_order_scopes (03_enqueue.sql). Owner only.
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


-- outbox.messages: pending work, one row per undelivered message.
--
-- Written only through the SQL API: enqueue and replay insert; a claim leases (UPDATE of
-- the three lease columns); extend_outbox_leases and release_outbox_leases change the
-- lease; a completion deletes a delivered message, moves a dead one to dead_letters, or
-- clears the lease and sets available_at for a retry; repair_expired_leases does the same
-- for expired leases. Read by the views in_flight, status, topic_lag, worker_activity,
-- recent_failures and by the observation; no role but the owner reads the table itself.
--
-- The table is a queue (insert, lease by UPDATE, delete), and its layout is set for that:
-- * Slots: the table is partitioned by slot (LIST), one partition per slot, outbox.messages_0
--   to outbox.messages_3 (the slots' section above). A message's slot is the current slot
--   when it is inserted and never changes, so every update stays in its partition. The
--   hot path (the claim's probe, walk and lease, and the completion of delivered messages
--   with its key locks and promotions, 04_claim.sql and 05_completion.sql) reads and writes
--   each slot's own table, the slot it knows from the walk or from the lease token: through
--   the parent the same statements cost the drain 11–13 %. The other functions read the
--   table through the parent, so a statement that finds a message by id probes each partition's index (an
--   empty partition answers from its metapage). Every
--   function that finds messages by id or key sets enable_seqscan off (as the claims do): a
--   slot emptied by truncation has no page, a plan made then reads it sequentially, and a
--   plan a session keeps would go on doing so once the slot fills.
-- * The lease columns (claimed_by, lease_token, lease_expires_at) are in no index, so a
--   lease, a heartbeat and a release are HOT updates: the new row version stays on its page
--   and no index entry is written or left dead. Measured against a claim index that leaves
--   leased messages out (which makes the lease a non-HOT update): 51,300–56,800 against
--   45,700–50,100 msg/s, and the variant wrote 8 % more WAL.
-- * fillfactor 70 keeps 30 % of every page free, so that those HOT versions find room on
--   their page. The price is a larger table at the same backlog.
-- * Autovacuum is set per table, with fixed thresholds and no scale factor: every delivered
--   message leaves a dead row and a dead entry in each index, and claims step over dead
--   entries of their index until vacuum removes them. Under the default (a vacuum once 20 %
--   of the table is dead) a backlog of a million would leave 200,000 dead rows first; here
--   a vacuum is due after 5,000 dead rows, after 20,000 inserts (a burst of enqueues is
--   vacuumed at the same pace before anything deletes it) and runs with no cost delay, at
--   any backlog. The statistics are analyzed every 20,000 changed rows; the statements on
--   the hot path do not depend on them (their plans are pinned and tests/database/plans.rs reads them
--   at 0-row statistics), since a drained queue is often analyzed empty.
--   What these settings cannot change is how often autovacuum visits the database
--   (autovacuum_naptime, a server setting, default 1 minute): at 20,000 msg/s the first
--   vacuum met 1.45 million dead rows and took 18 s, and deliveries fell; with
--   autovacuum_naptime = 5s and max_wal_size = 4GB the same rate held for 10 minutes. The
--   README's Operating section says when to set them.
--
-- Indexes:
-- * messages_pkey (outbox_id, slot): every function that names a message finds it by id,
--   one probe per id and partition whatever the backlog. UUIDv7 ids keep its inserts at the
--   right edge. A partitioned table's unique index must hold the partition key, so it makes
--   an id unique within a slot; enqueue checks every slot before it inserts a given id
--   (03_enqueue.sql), and generated ids are new.
-- * messages_shard_heads_idx (shard, available_at, seq) WHERE NOT behind: the claim's walk.
--   - WHERE NOT behind: it holds unkeyed messages and the head of each key, never the
--     messages waiting behind a head, so a key with 50,000 messages queued costs a claim
--     no more than a key with one. Without it, every claim stepped over all 50,000
--     (0.7–2.2 s per claim); with it, unkeyed messages drain beside such a key at a median
--     of 1.00 × their rate alone (5 rounds).
--   - shard = hashtext(coalesce(message_key, outbox_id::text)) & 15: 16 shards, each with
--     its own turn in outbox.turns, and all messages of a key in one shard. With one turn
--     for the whole table, 4 relays spent 58 % of their sessions' active time waiting for
--     it; with 16 shard turns, 1–2 %. The claim writes the same expression: the planner
--     uses an expression index only for a query that has that expression.
--   - available_at, seq: ready messages oldest first, delayed ones and retries (available_at
--     in the future) after them, so a walk stops at the first entry not yet due.
--   - leased messages stay in it (see the lease columns above); a claim skips them by the
--     heap check, which costs at most the messages in flight.
--   - claims walk each shard from its floor (04_claim.sql), so the dead entries of
--     delivered messages that vacuum may not remove yet (the MVCC horizon held) are not
--     stepped over by every claim.
-- * messages_order_key_seq_idx (order_key, seq) WHERE order_key IS NOT NULL: an order key's
--   messages in enqueue order. One probe answers "is an earlier message of this key
--   pending?" (the claim's head check, mark_behind) and "which message is next in this
--   key?" (the claim's runs, settle_behind, the completion's promotion of a key's next
--   head). Unkeyed messages have no entry. order_key is in the C collation, so the
--   console's search for a message_key is one range of it (11_console.sql).
--
-- Triggers (functions below): messages_mark_behind (BEFORE INSERT of a keyed message) and
-- messages_settle_behind (deferred to commit, for a message inserted behind); in
-- 04_claim.sql, messages_lower_claim_floor_on_insert and _on_update (deferred to commit,
-- for a message dated in the past).
CREATE TABLE outbox.messages (
    outbox_id        uuid        NOT NULL DEFAULT outbox.uuid_v7(),
    -- enqueue order; decides which message is the head of its key; sent to consumers of
    -- keyed messages as their per-key sequence (claim_outbox_batch_seq, 04_claim.sql)
    seq              bigint      NOT NULL GENERATED ALWAYS AS IDENTITY,
    topic            text        NOT NULL,
    -- NULL: no order; otherwise delivered one at a time, in seq order, with its key
    message_key      text,
    payload          bytea       NOT NULL,
    content_type     text        NOT NULL DEFAULT 'application/json',
    headers          jsonb       NOT NULL DEFAULT '{}',
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- not before: delays and retry backoff (a time before the write lowers the claim
    -- floor of its shard at commit, 04_claim.sql)
    available_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- attempts recorded so far; the next attempt is number attempt_count + 1
    attempt_count    integer     NOT NULL DEFAULT 0,
    -- attempts recorded in earlier lives (before the latest replay from dead letters):
    -- this life's budget ends at attempt number attempt_base + max_attempts
    attempt_base     integer     NOT NULL DEFAULT 0,
    -- attempts allowed per life (a replay starts a new life)
    max_attempts     integer     NOT NULL DEFAULT 10,
    -- the lease: all three set (leased) or all three NULL (not leased)
    claimed_by       text,
    lease_token      uuid,
    lease_expires_at timestamptz,
    -- the error of the latest failed attempt
    last_error       text,
    behind           boolean     NOT NULL DEFAULT false,
    -- the partition: the slot producers wrote to when the message was inserted
    slot             smallint    NOT NULL DEFAULT outbox.message_slot(),
    -- what the message keeps order with, set by mark_behind at insert: message_key when
    -- its topic's key order spans the whole outbox, message_key || E'\x1f' || topic when
    -- it is scoped per topic (key_order_rules); NULL exactly when message_key is
    order_key        text        COLLATE "C",
    CONSTRAINT messages_pkey PRIMARY KEY (outbox_id, slot),
    CONSTRAINT messages_topic_not_empty CHECK (topic <> ''),
    CONSTRAINT messages_max_attempts_positive CHECK (max_attempts >= 1),
    CONSTRAINT messages_headers_object CHECK (jsonb_typeof(headers) = 'object'),
    CONSTRAINT messages_lease_complete CHECK (
        (claimed_by IS NULL) = (lease_token IS NULL)
        AND (lease_token IS NULL) = (lease_expires_at IS NULL)),
    CONSTRAINT messages_order_key_with_key CHECK ((order_key IS NULL) = (message_key IS NULL))
) PARTITION BY LIST (slot);

-- The partitions, one per slot, each with the storage settings above.
CREATE TABLE outbox.messages_0 PARTITION OF outbox.messages FOR VALUES IN (0) WITH (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 20000,
    autovacuum_vacuum_cost_delay = 0
);

CREATE TABLE outbox.messages_1 PARTITION OF outbox.messages FOR VALUES IN (1) WITH (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 20000,
    autovacuum_vacuum_cost_delay = 0
);

CREATE TABLE outbox.messages_2 PARTITION OF outbox.messages FOR VALUES IN (2) WITH (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 20000,
    autovacuum_vacuum_cost_delay = 0
);

CREATE TABLE outbox.messages_3 PARTITION OF outbox.messages FOR VALUES IN (3) WITH (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 20000,
    autovacuum_vacuum_cost_delay = 0
);

CREATE INDEX messages_shard_heads_idx
    ON outbox.messages ((hashtext(coalesce(message_key, outbox_id::text)) & 15), available_at, seq)
    WHERE NOT behind;

CREATE INDEX messages_order_key_seq_idx ON outbox.messages (order_key, seq)
    WHERE order_key IS NOT NULL;

COMMENT ON TABLE outbox.messages IS
    'Pending work, one row per undelivered message, with its lease while in flight; written only by the SQL API, owner only (read it through the views).';
COMMENT ON COLUMN outbox.messages.behind IS
    'an earlier message of the same order_key is pending; not a claim candidate';
COMMENT ON COLUMN outbox.messages.order_key IS
    'what the message keeps order with, set at insert: message_key (the whole outbox) or message_key, unit separator, topic (per topic; key_order_rules)';
COMMENT ON COLUMN outbox.messages.slot IS
    'the partition (0 to 3): the slot producers wrote to when the message was inserted';

REVOKE ALL ON TABLE outbox.messages FROM PUBLIC;

COMMENT ON TABLE outbox.messages_0 IS
    'Slot 0 of outbox.messages (a partition); truncated by rotate_messages once nothing in it is pending; owner only.';
REVOKE ALL ON TABLE outbox.messages_0 FROM PUBLIC;

COMMENT ON TABLE outbox.messages_1 IS
    'Slot 1 of outbox.messages (a partition); truncated by rotate_messages once nothing in it is pending; owner only.';
REVOKE ALL ON TABLE outbox.messages_1 FROM PUBLIC;

COMMENT ON TABLE outbox.messages_2 IS
    'Slot 2 of outbox.messages (a partition); truncated by rotate_messages once nothing in it is pending; owner only.';
REVOKE ALL ON TABLE outbox.messages_2 FROM PUBLIC;

COMMENT ON TABLE outbox.messages_3 IS
    'Slot 3 of outbox.messages (a partition); truncated by rotate_messages once nothing in it is pending; owner only.';
REVOKE ALL ON TABLE outbox.messages_3 FROM PUBLIC;


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

CREATE TRIGGER messages_mark_behind
    BEFORE INSERT ON outbox.messages
    FOR EACH ROW
    WHEN (NEW.message_key IS NOT NULL)
    EXECUTE FUNCTION outbox.mark_behind();

CREATE CONSTRAINT TRIGGER messages_settle_behind
    AFTER INSERT ON outbox.messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.behind)
    EXECUTE FUNCTION outbox.settle_behind();


-- The slots of outbox.attempts. The log is partitioned by slot into a ring of four
-- partitions, outbox.attempts_0 … outbox.attempts_3, and a fifth, outbox.attempts_kept
-- (slot 4). Completions and repair append to one slot of the ring at a time, the current
-- slot. prune_attempts, the log's retention (06_repair_retention.sql), deletes old
-- attempts of finished messages row by row, and through outbox.rotate_attempts moves the
-- log on to the next slot once the current one has been current for half the retention,
-- and truncates a slot once all its attempts are older than the retention, after copying
-- to slot 4 the histories it keeps (of messages pending or dead-lettered). While a snapshot
-- holds the MVCC horizon back, the rows that pruning deletes cannot be vacuumed; they are
-- confined to the slots written since, and truncation removes them: the log stays within
-- about twice the retention's attempts, dead or alive, instead of growing with the hold.
-- Without a call of prune_attempts the log neither moves on nor shrinks.

-- outbox.attempt_slot: the current slot of outbox.attempts (0 to 3), a register rather
-- than a counter: only outbox.rotate_attempts sets it (setval), and outbox.attempt_slot()
-- reads it. A sequence, so that reading it on every insert and setting it leave no row
-- version behind; setval is not transactional, and takes effect at once for every writer.
CREATE SEQUENCE outbox.attempt_slot AS smallint MINVALUE 0 MAXVALUE 3 START 0;

COMMENT ON SEQUENCE outbox.attempt_slot IS
    'The slot of outbox.attempts completions and repair append to (0 to 3); set only by rotate_attempts.';

REVOKE ALL ON SEQUENCE outbox.attempt_slot FROM PUBLIC;


-- outbox.attempt_slot(): internal; the default of outbox.attempts.slot: the current slot,
-- as outbox.attempt_slot holds it when the row is inserted. Granted to no one (it runs as
-- the owner, who alone inserts into the log). Raises nothing.
CREATE OR REPLACE FUNCTION outbox.attempt_slot() RETURNS smallint
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    -- a function call, not a scan of the sequence (see outbox.message_slot())
    SELECT coalesce(pg_sequence_last_value('outbox.attempt_slot'::regclass), 0)::smallint
$$;

COMMENT ON FUNCTION outbox.attempt_slot() IS
    'Internal: the slot of outbox.attempts attempts are appended to now; the default of attempts.slot. Not granted.';

REVOKE ALL ON FUNCTION outbox.attempt_slot() FROM PUBLIC;


-- outbox.attempt_slots: one row per slot of the ring: since when it is (or last was) the
-- current slot. Written only by rotate_attempts, once per rotation; read by
-- rotate_attempts (is the current slot's half retention over?). Owner only.
CREATE TABLE outbox.attempt_slots (
    slot      smallint    NOT NULL,
    opened_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT attempt_slots_pkey PRIMARY KEY (slot),
    CONSTRAINT attempt_slots_slot CHECK (slot BETWEEN 0 AND 3)
);

INSERT INTO outbox.attempt_slots (slot) SELECT s FROM generate_series(0, 3) AS s;

COMMENT ON TABLE outbox.attempt_slots IS
    'Since when each slot of outbox.attempts is (or last was) the one attempts are appended to; written by rotate_attempts; owner only.';

REVOKE ALL ON TABLE outbox.attempt_slots FROM PUBLIC;


-- outbox.attempts: the append-only outcome log, one row per attempt, numbered 1, 2, 3 … per
-- message with no gap (a ZOMBIE_REQUEUE counts; a replayed message continues its numbering).
--
-- Written by the completions (complete_outbox_attempt, complete_outbox_batch) and by
-- repair_expired_leases; rows are never updated, and removed only by prune_attempts (row by
-- row, or with their slot through rotate_attempts), which keeps the whole history of a
-- message that is still pending or dead-lettered. Read by the views recent_failures,
-- worker_activity and attempt_rates, by the observation, and by enqueue (is this id known?).
-- Owner only.
--
-- Slots: the table is partitioned by slot (LIST), outbox.attempts_0 to outbox.attempts_3
-- and outbox.attempts_kept (the slots' section above). Reads by id or by time read every
-- slot (five index probes or ranges): the claims and completions never read the log, and
-- enqueue reads it only for a given id.
--
-- Indexes:
-- * attempts_N_pkey (outbox_id, attempt_no), one per slot: a second attempt with the same
--   number in a slot is refused. Completions and repair rely on that refusal for a message
--   whose id already has a history of another life in the current slot: they record its
--   attempt under the next free number (record_attempts, 05_completion.sql). A partitioned
--   table's unique index must hold the partition's column, so uniqueness across slots is
--   not the index's: each attempt's number is its message's attempt_count + 1 under the
--   completion's fence, and enqueue refuses an id that has a history. Only a row inserted
--   into outbox.messages directly, with the id of an earlier life's history in another
--   slot, can repeat a number across slots.
-- * attempts_created_at_idx (created_at), a B-tree in each slot (attempts_N_created_at_idx):
--   the time ranges of prune_attempts (older than), attempt_rates and the observation (the
--   last minutes). A BRIN index stays small only while rows arrive on new pages; once
--   vacuum frees pruned space, new attempts go into old pages, every range covers every
--   time, and a range query reads the whole log. Measured at 10,000 msg/s with a 60 s
--   retention pruned every 3 s: prune passes grew from 1 s to over 2 minutes, held back the
--   MVCC horizon, and deliveries fell to 2,000–2,700 msg/s; with the B-tree, the slowest of
--   150 passes took 9.7 s. Its price is one entry per attempt: without it the drain ran
--   about 3 % faster at 2 relays, 6–9 % at 16.
-- * attempts_failures_idx (created_at DESC) WHERE state <> 'DISPATCHED', in each slot
--   (attempts_N_failures_idx): failures are rare and read newest first (recent_failures),
--   without reading the delivered attempts.
--
-- Autovacuum: the log grows by inserts. With no scale factor, a vacuum follows every
-- 100,000 inserted attempts whatever the slot's size, so that marking pages all-visible and
-- freezing keep up with the inserts in small steps; space freed by pruning is vacuumed
-- through the default dead-row thresholds. (A round figure, not a measured optimum.)
CREATE TABLE outbox.attempts (
    outbox_id   uuid                 NOT NULL,
    attempt_no  integer              NOT NULL,
    state       outbox.attempt_state NOT NULL,
    worker_id   text                 NOT NULL,
    -- the lease the outcome was reported under (for ZOMBIE_REQUEUE: the expired lease)
    lease_token uuid                 NOT NULL,
    error       text,
    created_at  timestamptz          NOT NULL DEFAULT clock_timestamp(),
    -- the partition: 0 to 3, the slot of the ring the attempt was appended to; 4, a
    -- history kept when its slot was truncated
    slot        smallint             NOT NULL DEFAULT outbox.attempt_slot(),
    CONSTRAINT attempts_attempt_no_positive CHECK (attempt_no >= 1)
) PARTITION BY LIST (slot);

CREATE INDEX attempts_created_at_idx ON outbox.attempts (created_at);

CREATE INDEX attempts_failures_idx ON outbox.attempts (created_at DESC)
    WHERE state <> 'DISPATCHED';

-- The partitions, one per slot and one for kept histories, each with the storage settings
-- above, its own primary key, and the parent's two time indexes (the failures index renamed
-- from the name Postgres gives it).
CREATE TABLE outbox.attempts_0 PARTITION OF outbox.attempts FOR VALUES IN (0) WITH (
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 100000
);
ALTER TABLE outbox.attempts_0 ADD CONSTRAINT attempts_0_pkey PRIMARY KEY (outbox_id, attempt_no);
ALTER INDEX outbox.attempts_0_created_at_idx1 RENAME TO attempts_0_failures_idx;

CREATE TABLE outbox.attempts_1 PARTITION OF outbox.attempts FOR VALUES IN (1) WITH (
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 100000
);
ALTER TABLE outbox.attempts_1 ADD CONSTRAINT attempts_1_pkey PRIMARY KEY (outbox_id, attempt_no);
ALTER INDEX outbox.attempts_1_created_at_idx1 RENAME TO attempts_1_failures_idx;

CREATE TABLE outbox.attempts_2 PARTITION OF outbox.attempts FOR VALUES IN (2) WITH (
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 100000
);
ALTER TABLE outbox.attempts_2 ADD CONSTRAINT attempts_2_pkey PRIMARY KEY (outbox_id, attempt_no);
ALTER INDEX outbox.attempts_2_created_at_idx1 RENAME TO attempts_2_failures_idx;

CREATE TABLE outbox.attempts_3 PARTITION OF outbox.attempts FOR VALUES IN (3) WITH (
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 100000
);
ALTER TABLE outbox.attempts_3 ADD CONSTRAINT attempts_3_pkey PRIMARY KEY (outbox_id, attempt_no);
ALTER INDEX outbox.attempts_3_created_at_idx1 RENAME TO attempts_3_failures_idx;

CREATE TABLE outbox.attempts_kept PARTITION OF outbox.attempts FOR VALUES IN (4) WITH (
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 100000
);
ALTER TABLE outbox.attempts_kept ADD CONSTRAINT attempts_kept_pkey PRIMARY KEY (outbox_id, attempt_no);
ALTER INDEX outbox.attempts_kept_created_at_idx1 RENAME TO attempts_kept_failures_idx;

COMMENT ON TABLE outbox.attempts IS
    'Append-only outcome log: one row per attempt, numbered 1, 2, 3 … per message with no gap; written by completions and repair, pruned by prune_attempts; owner only.';
COMMENT ON COLUMN outbox.attempts.slot IS
    'the partition: 0 to 3, the slot of the ring the attempt was appended to; 4, a history kept when its slot was truncated';

REVOKE ALL ON TABLE outbox.attempts FROM PUBLIC;

COMMENT ON TABLE outbox.attempts_0 IS
    'Slot 0 of outbox.attempts (a partition); truncated by rotate_attempts once its attempts are older than the retention; owner only.';
REVOKE ALL ON TABLE outbox.attempts_0 FROM PUBLIC;

COMMENT ON TABLE outbox.attempts_1 IS
    'Slot 1 of outbox.attempts (a partition); truncated by rotate_attempts once its attempts are older than the retention; owner only.';
REVOKE ALL ON TABLE outbox.attempts_1 FROM PUBLIC;

COMMENT ON TABLE outbox.attempts_2 IS
    'Slot 2 of outbox.attempts (a partition); truncated by rotate_attempts once its attempts are older than the retention; owner only.';
REVOKE ALL ON TABLE outbox.attempts_2 FROM PUBLIC;

COMMENT ON TABLE outbox.attempts_3 IS
    'Slot 3 of outbox.attempts (a partition); truncated by rotate_attempts once its attempts are older than the retention; owner only.';
REVOKE ALL ON TABLE outbox.attempts_3 FROM PUBLIC;

COMMENT ON TABLE outbox.attempts_kept IS
    'Slot 4 of outbox.attempts (a partition): histories of messages pending or dead-lettered when their slot was truncated; pruned row by row; owner only.';
REVOKE ALL ON TABLE outbox.attempts_kept FROM PUBLIC;


-- outbox.dead_letters: messages that ran out of attempts or were refused for good, kept
-- with everything needed to replay them (payload, headers, key, budget, last error).
--
-- Written by the completions and repair_expired_leases (a message moves here from
-- messages in the transaction that records its last attempt), emptied by
-- replay_step (the replay functions move rows back to messages). Read by
-- dead_letters_matching (the one definition of the dead-letter filter), the views, the
-- observation, and by enqueue (is this id known?). Owner only.
--
-- Indexes:
-- * dead_letters_pkey (outbox_id): one dead letter per id; replays and id checks by id.
-- * dead_letters_topic_idx (topic): the filter by topic (dead-letters list and replay
--   --topic), without reading other topics' dead letters.
CREATE TABLE outbox.dead_letters (
    outbox_id        uuid        NOT NULL,
    topic            text        NOT NULL,
    message_key      text,
    payload          bytea       NOT NULL,
    content_type     text        NOT NULL,
    headers          jsonb       NOT NULL,
    created_at       timestamptz NOT NULL,
    -- attempts recorded over all its lives; a replay continues from here
    attempt_count    integer     NOT NULL,
    max_attempts     integer     NOT NULL,
    last_error       text,
    dead_lettered_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    CONSTRAINT dead_letters_pkey PRIMARY KEY (outbox_id)
);

CREATE INDEX dead_letters_topic_idx ON outbox.dead_letters (topic);

COMMENT ON TABLE outbox.dead_letters IS
    'Messages out of attempts or refused for good, with payload, headers and last error, until replayed (replay_dead_letters, start_replay/replay_step); owner only.';

REVOKE ALL ON TABLE outbox.dead_letters FROM PUBLIC;


-- outbox.turns: one row per turn; a transaction that locks a row (FOR UPDATE) holds that
-- turn until it ends. Locking a row needs UPDATE on the table, which only the owner has,
-- so no other login of the database can hold a turn (an advisory lock, which needs no
-- right, could be held by any login and stop every claim).
--   claim:0 … claim:15  one per shard of messages_shard_heads_idx: a claim walks a shard
--                       only under its turn, so two claims never walk one shard at once
--   repair              one repair_expired_leases pass at a time across the fleet
--   rotate              one rotate_messages pass at a time across the fleet
--   prune               one rotate_attempts pass (prune_attempts' ring) at a time
--   observe             one computation of the observation at a time
-- Locked by the claims (claim_outbox_batch_seq, claim_outbox_batch), repair_expired_leases,
-- rotate_messages, rotate_attempts and observe; never updated. A missing row is a turn nobody can take: the
-- rows below are part of the contract.
CREATE TABLE outbox.turns (
    name text NOT NULL,
    CONSTRAINT turns_pkey PRIMARY KEY (name)
);

INSERT INTO outbox.turns (name)
SELECT 'claim:' || s FROM generate_series(0, 15) AS s;
INSERT INTO outbox.turns (name) VALUES ('repair'), ('observe'), ('rotate'), ('prune');

COMMENT ON TABLE outbox.turns IS
    'Rows locked by the claims (claim_outbox_batch_seq, claim_outbox_batch), repair_expired_leases, rotate_messages, rotate_attempts and observe to take turns; owner only.';

REVOKE ALL ON TABLE outbox.turns FROM PUBLIC;


-- outbox.observations: the latest observation (the fleet's gauges and the MVCC watchdog),
-- a single row replaced by each refresh. Written by observe under the 'observe' turn, read
-- by observe; owner only (callers get the snapshot from observe).
CREATE TABLE outbox.observations (
    singleton   boolean          NOT NULL DEFAULT true,
    observed_at timestamptz      NOT NULL,
    -- how long computing the snapshot took (paid once per interval for the whole fleet)
    took_ms     double precision NOT NULL,
    snapshot    jsonb            NOT NULL,
    CONSTRAINT observations_pkey PRIMARY KEY (singleton),
    CONSTRAINT observations_single_row CHECK (singleton)
);

COMMENT ON TABLE outbox.observations IS
    'The latest observation snapshot (one row), written by observe under its turn and read through observe; owner only.';

REVOKE ALL ON TABLE outbox.observations FROM PUBLIC;


-- outbox.attempt_minutes: the attempts of each whole minute of the last hour, delivered and
-- not, counted once by the refresh of the observation that first finds the minute over
-- (observe, under the 'observe' turn) and read by observed_attempt_rates. Rows older than
-- two hours are deleted by the same refresh. Owner only.
CREATE TABLE outbox.attempt_minutes (
    minute        timestamptz NOT NULL,
    -- attempts DISPATCHED in the minute
    delivered     bigint      NOT NULL,
    -- attempts RETRYABLE, FAILED or ZOMBIE_REQUEUE in the minute
    not_delivered bigint      NOT NULL,
    CONSTRAINT attempt_minutes_pkey PRIMARY KEY (minute)
);

COMMENT ON TABLE outbox.attempt_minutes IS
    'Attempts per whole minute of the last hour (delivered, not delivered), counted once by observe''s refresh; owner only.';

REVOKE ALL ON TABLE outbox.attempt_minutes FROM PUBLIC;


-- outbox.replays: the audit of dead-letter replays, one row per replay however many steps
-- it ran in. Written by start_replay (the row) and replay_step (the count, the end); read
-- through the view outbox.replay_log; owner only.
CREATE TABLE outbox.replays (
    replay_id   bigint      NOT NULL GENERATED ALWAYS AS IDENTITY,
    started_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- the login role that asked (session_user: the functions run as their owner); only
    -- that login may run the replay's steps
    replayed_by text        NOT NULL DEFAULT session_user,
    reason      text,
    -- {outbox_ids, topic, since, error_contains}: what was asked for (NULL: anything)
    filter      jsonb       NOT NULL,
    -- only dead letters dead-lettered up to the start are replayed: a message that fails
    -- again while a long replay runs is not replayed a second time by it
    up_to       timestamptz NOT NULL DEFAULT clock_timestamp(),
    replayed    bigint      NOT NULL DEFAULT 0,
    finished_at timestamptz,
    CONSTRAINT replays_pkey PRIMARY KEY (replay_id)
);

COMMENT ON TABLE outbox.replays IS
    'Audit of dead-letter replays: who, when, why, the filter, how many; one row per replay; written by start_replay and replay_step, read through outbox.replay_log; owner only.';

REVOKE ALL ON TABLE outbox.replays FROM PUBLIC;


-- outbox.circuit_reports: the circuit state of each destination as each relayer last
-- reported it, one row per (worker, destination). Written by report_circuits when a
-- circuit changes state and when the relayer renews its reports (never per claim or
-- batch), so the table holds a few rows per relayer whatever the traffic; a relayer that
-- stopped renewing leaves rows that expire (expires_at), kept an hour after that and then
-- deleted by the next report of any relayer. Read through the view outbox.circuits; owner
-- only.
CREATE TABLE outbox.circuit_reports (
    worker_id   text        NOT NULL,
    destination text        NOT NULL,
    state       text        NOT NULL,
    -- when the circuit entered this state, by the relayer's clock
    since       timestamptz NOT NULL,
    -- when the relayer last reported it (the database's clock)
    reported_at timestamptz NOT NULL,
    -- after this the report is stale: the relayer did not renew it (stopped, or cut off)
    expires_at  timestamptz NOT NULL,
    CONSTRAINT circuit_reports_pkey PRIMARY KEY (worker_id, destination),
    CONSTRAINT circuit_reports_state CHECK (state IN ('closed', 'open', 'half-open'))
);

COMMENT ON TABLE outbox.circuit_reports IS
    'Each relayer''s circuit state per destination (closed, open, half-open), since when, and until when the report holds; written by report_circuits, read through outbox.circuits; owner only.';

REVOKE ALL ON TABLE outbox.circuit_reports FROM PUBLIC;


-- outbox.coverage_reports: the topics each running relayer claims, as it last reported
-- them, one row per worker: include_topics (LIKE patterns of the topics its routes cover;
-- NULL: every topic) and topics (the exact topics it is limited to; NULL: no limit).
-- Written by report_coverage when the relayer starts and when it renews its report (never
-- per claim or batch), so it holds one row per relayer; a relayer that stopped renewing
-- leaves a row that expires (expires_at), deleted an hour after that by the next report of
-- any relayer. route_patterns and route_destinations are the relayer's routes in its
-- configuration's order (each route's topic as a LIKE pattern, and the destination it
-- goes to, whose circuit the relayer reports by that name in outbox.circuit_reports);
-- NULL from a relayer that does not report its routes. Read by uncovered_topics and
-- stalled_topics; owner only.
CREATE TABLE outbox.coverage_reports (
    worker_id      text        NOT NULL,
    include_topics text[],
    topics         text[],
    -- when the relayer last reported it (the database's clock)
    reported_at    timestamptz NOT NULL,
    -- after this the report is stale: the relayer did not renew it (stopped, or cut off)
    expires_at     timestamptz NOT NULL,
    -- the routes' topics (LIKE patterns) and destinations, in the configuration's order;
    -- both NULL or both of one length
    route_patterns     text[],
    route_destinations text[],
    CONSTRAINT coverage_reports_pkey PRIMARY KEY (worker_id),
    CONSTRAINT coverage_reports_routes CHECK (
        (route_patterns IS NULL) = (route_destinations IS NULL)
        AND cardinality(route_patterns) IS NOT DISTINCT FROM cardinality(route_destinations))
);

COMMENT ON TABLE outbox.coverage_reports IS
    'The topics each running relayer claims (LIKE patterns of its routes, exact topics it is limited to), its routes'' destinations, and until when the report holds; written by report_coverage, read by uncovered_topics and stalled_topics; owner only.';

REVOKE ALL ON TABLE outbox.coverage_reports FROM PUBLIC;


-- outbox.source_leases: which relayers serve this outbox, when a fleet serves many outboxes
-- (many sources). One row per slot: a source may be served by at most as many processes as
-- it has slots, and a slot is held by one worker until expires_at. token counts the
-- takeovers of the slot: it grows by one each time a worker takes it, so a worker that held
-- it and lost it (expired, taken by another) sees a different token. Written only by
-- serve_source and leave_source, a few rows whatever the traffic; owner only.
CREATE TABLE outbox.source_leases (
    slot        integer     NOT NULL,
    -- the worker holding the slot; NULL when free
    worker_id   text,
    token       bigint      NOT NULL DEFAULT 0,
    acquired_at timestamptz,
    -- the slot is free again after this (the holder did not renew it)
    expires_at  timestamptz,
    CONSTRAINT source_leases_pkey PRIMARY KEY (slot),
    CONSTRAINT source_leases_slot CHECK (slot >= 0)
);

COMMENT ON TABLE outbox.source_leases IS
    'The slots of the relayers serving this outbox when a fleet serves many: holder, takeover count (token) and expiry per slot; written by serve_source and leave_source; owner only.';

REVOKE ALL ON TABLE outbox.source_leases FROM PUBLIC;


-- outbox.source_members: every relayer of a fleet serving many outboxes that asked for this
-- one lately, served or not, with the time its membership lapses. The fleet's size, as
-- each outbox sees it, is the count of unexpired rows: a relayer takes its fair share of
-- the sources from it. Written only by serve_source and leave_source (rows expired for an
-- hour are deleted by the next call); owner only.
CREATE TABLE outbox.source_members (
    worker_id  text        NOT NULL,
    seen_at    timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    CONSTRAINT source_members_pkey PRIMARY KEY (worker_id)
);

COMMENT ON TABLE outbox.source_members IS
    'The relayers of a many-source fleet that asked for this outbox lately, and when each membership lapses; written by serve_source and leave_source; owner only.';

REVOKE ALL ON TABLE outbox.source_members FROM PUBLIC;

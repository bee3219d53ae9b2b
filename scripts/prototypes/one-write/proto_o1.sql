-- Prototype O1 (issue 58), loaded after proto_o.sql: the one-statement claim without the
-- shard walk. One UPDATE per slot chooses and leases the slot's oldest ready heads
-- (available_at, seq) of every shard at once, from an index that holds every head with no
-- shard in front, instead of messages_shard_heads_idx:
--
--     messages_heads_idx ON messages (available_at, seq) WHERE NOT behind
--
-- (it replaces the shard index, so an enqueue writes as many index entries as today).
-- Besides what proto_o.sql drops, it drops:
--   * the shards and their claim floors: every claim walks the slot from its oldest entry,
--     over the entries of rows that other claims hold (skipped by SKIP LOCKED) or leased
--     (visited on the heap), and, under a held MVCC horizon, over every dead entry since the
--     horizon: the held-horizon bound of 04_claim.sql is gone, not deferred;
--   * the shards' independence: the claims of a fleet all start at the same entries, and
--     the order of a batch is the slot's order (available_at, seq) instead of per shard
--     from a random one (no shard waits for another's backlog today; here none has one).
-- Loaded over a copy of the released schema (run.sh rewrites `outbox.` to the copy's name).

CREATE OR REPLACE FUNCTION outbox.claim_by_shard() RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$ SELECT false $$;

DROP INDEX outbox.messages_shard_heads_idx;
CREATE INDEX messages_heads_idx ON outbox.messages (available_at, seq) WHERE NOT behind;

-- V13: a producer's commit never waits for a completion, so the two cannot deadlock.
--
-- Since V11, a producer's transaction that enqueued a keyed message behind an earlier one
-- locks, at commit (settle_behind), that earlier message FOR KEY SHARE, one message per
-- row it inserted, in the order it inserted them. A completion deletes the messages of a
-- batch in its own order, and each deletion waits for those locks. A producer that enqueued
-- behind two messages of one batch could therefore lock the first while the completion
-- had deleted the second and waited for the first: a deadlock, which Postgres breaks by
-- failing one of the two. When it failed the producer, the application's own transaction
-- failed at COMMIT (40P01). Seen under a steady producer of multi-row enqueues with 10 %
-- keyed traffic: a producer and completions deadlocked within seconds.
--
-- Now the lock is taken with SKIP LOCKED: a message that a completion is deleting is
-- passed over, and the nearest earlier message that is not is locked instead. When there
-- is none, the new message clears its own mark, as it already did when the earlier
-- messages were gone (a message marked as a head while it is not one is harmless: the
-- claim takes a head only when no earlier message of its key is pending). The producer
-- therefore never waits for a row lock at commit; a completion may still wait for the
-- producer's lock, for the instant of the producer's commit, which is what makes the
-- completion's later statement see the new message (V11).
--
-- SKIP LOCKED also passes over a message that a claim or a completion's lease check holds
-- FOR UPDATE for the instant of its statement. The cost of that is an early head candidate,
-- at most one per enqueued message that met such a lock: it sits in the claim's index until
-- its key reaches it, and each claim that walks its shard meanwhile spends one probe on it.
-- It happens when a producer appends to a key whose newest message is in flight, that is
-- when the key's backlog is short, so the early candidates are few.

-- settle_behind (deferred constraint trigger, at the commit of a message inserted behind):
-- as in V11, skipping the earlier messages being deleted; see the header.
CREATE OR REPLACE FUNCTION outbox.settle_behind() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF current_setting('transaction_isolation') = 'read committed' THEN
        -- The nearest earlier message of the key that no completion is deleting. Locked,
        -- its deletion waits for this commit; none, and this message is the head to come.
        PERFORM 1
           FROM outbox.messages AS e
          WHERE e.message_key = NEW.message_key
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
REVOKE ALL ON FUNCTION outbox.settle_behind() FROM PUBLIC;

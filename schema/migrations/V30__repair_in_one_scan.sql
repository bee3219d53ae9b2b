-- Repair in one scan: repair_expired_leases finds the expired leases and the messages below
-- their shard's claim floor (the floors' safety net) in one sequential scan of
-- outbox.messages that locks nothing, then locks each by tuple address and checks it again
-- on the row's newest version. Before, the pass scanned the table twice (the safety net,
-- then the leases): while the MVCC horizon is held the table grows with dead rows and each
-- scan reads them all (2.3–2.4 s a pass at 655 MB). The full contract is in
-- 06_repair_retention.sql.

CREATE OR REPLACE FUNCTION outbox.repair_expired_leases(p_limit integer DEFAULT 1000)
RETURNS TABLE (requeued integer, dead_lettered integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET jit = off
AS $$
DECLARE
    v_ids uuid[];
    v_nos integer[];
    v_workers text[];
    v_tokens uuid[];
    v_errors text[];
    v_exhausted boolean[];
    v_dead integer;
    v_lifted integer;
    v_floors timestamptz[];
    v_low tid[];
    v_expired tid[];
BEGIN
    IF p_limit IS NULL OR p_limit < 1 THEN
        PERFORM outbox.invalid_argument('p_limit', format('must be at least 1, got %s', p_limit));
    END IF;
    PERFORM 1 FROM outbox.turns AS t WHERE t.name = 'repair' FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 0, 0;
        RETURN;
    END IF;

    -- One sequential scan finds both kinds of work, without locking: the messages ready to
    -- claim below their shard's claim floor (the floors' safety net, 04_claim.sql) and the
    -- first p_limit expired leases in scan order. Each kind is then locked by tuple address
    -- and its conditions checked again on the newest version of the row: a row updated
    -- since the scan (its version moved) or held by another transaction is left for the
    -- next pass.
    v_floors := outbox.claim_floors();
    SELECT coalesce(array_agg(f.ctid) FILTER (WHERE NOT f.expired), '{}'),
           coalesce(array_agg(f.ctid) FILTER (WHERE f.expired AND f.nth <= p_limit), '{}')
      INTO v_low, v_expired
      FROM (SELECT b.ctid, b.expired,
                   count(*) FILTER (WHERE b.expired) OVER (ROWS UNBOUNDED PRECEDING) AS nth
              FROM (SELECT c.ctid, coalesce(c.lease_expires_at <= now(), false) AS expired
                      FROM outbox.messages AS c
                     WHERE c.lease_expires_at <= now()
                        OR (c.lease_token IS NULL
                            AND NOT c.behind
                            AND c.available_at < v_floors[(hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) + 1])) AS b) AS f;

    -- The safety net: a message below its floor moves up to the clock, where the claims'
    -- walks find it.
    IF cardinality(v_low) > 0 THEN
        UPDATE outbox.messages AS m
           SET available_at = clock_timestamp()
         WHERE m.ctid = ANY (ARRAY(
                   SELECT b.ctid
                     FROM outbox.messages AS b
                    WHERE b.ctid = ANY (v_low)
                      AND b.lease_token IS NULL
                      AND NOT b.behind
                      AND b.available_at < v_floors[(hashtext(coalesce(b.message_key, b.outbox_id::text)) & 15) + 1]
                      FOR UPDATE SKIP LOCKED))
           AND m.lease_token IS NULL
           AND NOT m.behind;
        GET DIAGNOSTICS v_lifted = ROW_COUNT;
        IF v_lifted > 0 THEN
            RAISE WARNING 'outbox: % message(s) were below their shard''s claim floor and were moved up to now', v_lifted
                USING HINT = 'a message dated in the past committed while a claim raised its floor, or the server clock went back';
            PERFORM pg_notify('outbox_new', 'repaired');
        END IF;
    END IF;

    IF cardinality(v_expired) = 0 THEN
        RETURN QUERY SELECT 0, 0;
        RETURN;
    END IF;
    SELECT array_agg(z.outbox_id), array_agg(z.attempt_no), array_agg(z.claimed_by),
           array_agg(z.lease_token), array_agg(z.error), array_agg(z.exhausted)
      INTO v_ids, v_nos, v_workers, v_tokens, v_errors, v_exhausted
      FROM (SELECT m.outbox_id,
                   m.attempt_count + 1 AS attempt_no,
                   m.claimed_by,
                   m.lease_token,
                   format('lease expired at %s without a completion from worker %s',
                          m.lease_expires_at, m.claimed_by) AS error,
                   m.attempt_count + 1 >= m.attempt_base + m.max_attempts AS exhausted
              FROM outbox.messages AS m
             WHERE m.ctid = ANY (v_expired)
               AND m.lease_expires_at <= now()
               FOR UPDATE SKIP LOCKED) AS z;

    IF v_ids IS NULL THEN
        RETURN QUERY SELECT 0, 0;
        RETURN;
    END IF;

    v_dead := outbox.apply_outcomes(
        v_ids, v_nos, array_fill('ZOMBIE_REQUEUE'::outbox.attempt_state, ARRAY[cardinality(v_ids)]),
        v_workers, v_tokens, v_errors, NULL, v_exhausted);
    PERFORM pg_notify('outbox_new', 'repaired');
    RETURN QUERY SELECT cardinality(v_ids) - v_dead, v_dead;
END;
$$;

COMMENT ON FUNCTION outbox.repair_expired_leases(integer) IS
    'Requeues up to p_limit messages whose lease expired (a ZOMBIE_REQUEUE attempt each) and dead-letters those out of attempts; one pass at a time (''repair'' turn, else (0, 0) at once); returns (requeued, dead_lettered); P7001 on a bad limit.';

REVOKE ALL ON FUNCTION outbox.repair_expired_leases(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.repair_expired_leases(integer) TO outbox_relay;

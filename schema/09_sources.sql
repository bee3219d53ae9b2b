-- Serving many outboxes with one fleet: the slots through which relayers share the sources.
--
-- Objects: the view source_holders; the functions serve_source and leave_source (the
-- tables source_leases and source_members are in 01_tables.sql).
--
-- A fleet may serve many outboxes (sources: databases, or schemas in a database). Each
-- outbox decides for itself who serves it: it has a number of slots (the most processes
-- that may serve it at once), each held by one relayer under an expiring lease that the
-- relayer renews. A relayer that stops renewing (killed, frozen, cut off) loses its slot
-- when the lease expires and another takes it. No coordinator and no other store: the
-- leases live in the outbox they are about. The per-message leases still fence every
-- outcome (P7002); the slots decide who claims.


-- outbox.source_holders: who serves this outbox now, one row per slot held.
--
-- Reads:      outbox.source_leases, the slots whose lease has not expired.
-- Columns:    slot, worker_id, token (the slot's takeover count), acquired_at, expires_at.
-- Readers:    outbox_reader, outbox_relay (`outbox-relay status --all-sources`).
CREATE VIEW outbox.source_holders AS
SELECT l.slot,
       l.worker_id,
       l.token,
       l.acquired_at,
       l.expires_at
  FROM outbox.source_leases AS l
 WHERE l.worker_id IS NOT NULL
   AND l.expires_at > now();

COMMENT ON VIEW outbox.source_holders IS
    'The relayers serving this outbox now in a many-source fleet: slot, worker, takeover count (token), since when and until when the lease holds unless renewed.';

REVOKE ALL ON outbox.source_holders FROM PUBLIC;
GRANT SELECT ON outbox.source_holders TO outbox_reader, outbox_relay;

-- outbox.serve_source: a relayer's periodic call for this outbox: it says the relayer is
-- alive, and takes, keeps or gives back a slot.
--
-- Inputs:     p_worker_id   the relayer's worker id
--             p_slots       how many processes may serve this outbox at once, 1..1024
--                           (slots 0 .. p_slots-1; a slot numbered higher is not given out)
--             p_want        true: keep the slot held (renewing its lease), or take a free
--                           or expired one; false: give back the slot held, if any
--             p_ttl         how long the slot holds without a new call (more than 0)
--             p_member_ttl  how long the membership holds without a new call (more than 0;
--                           a relayer that does not serve this outbox calls less often)
-- Returns:    one row: the slot held and its token (both NULL when none), the number of
--             relayers whose membership has not lapsed (this one included), and the
--             workers holding a slot, in slot order.
-- Locks:      the caller's row of outbox.source_members; the slot it renews, takes or gives
--             back; memberships expired for an hour and the caller's other slots. Every
--             row it does not already own is locked FOR UPDATE SKIP LOCKED, so two
--             relayers calling at once never wait for each other (a row skipped is dealt
--             with by a later call). No lock on the outbox's messages.
-- Guarantees: a slot is held by at most one worker at a time; a worker holds at most one
--             slot (the lowest unexpired one it holds is kept, others lapse); a slot taken
--             over gets token + 1, so a worker that lost its slot and takes it again sees
--             another token. A worker whose slot has expired does not get it back by
--             renewing: it takes a slot anew. Slot rows are made when first taken: the
--             table holds one row per slot ever held, not p_slots rows.
-- Raises:     P7001 (p_worker_id) when it is NULL or blank; P7001 (p_slots) when it is NULL
--             or outside 1..1024; P7001 (p_want) when it is NULL; P7001 (p_ttl) and P7001
--             (p_member_ttl) when NULL or not positive.
-- Crash:      nothing: one transaction; a slot taken is held until its lease expires.
-- Shape:      called once per source per renewal period (a third of the lease) by each
--             relayer serving it, and once per discovery interval by the others, never per
--             claim or batch; its writes follow the fleet's membership, not the traffic.
CREATE OR REPLACE FUNCTION outbox.serve_source(
    p_worker_id text,
    p_slots integer,
    p_want boolean,
    p_ttl interval,
    p_member_ttl interval
) RETURNS TABLE (slot integer, token bigint, members integer, holders text[])
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_slot  integer;
    v_token bigint;
BEGIN
    PERFORM outbox.check_worker_id(p_worker_id);
    IF p_slots IS NULL OR p_slots < 1 OR p_slots > 1024 THEN
        PERFORM outbox.invalid_argument('p_slots', 'must be between 1 and 1024');
    END IF;
    IF p_want IS NULL THEN
        PERFORM outbox.invalid_argument('p_want', 'must be true or false');
    END IF;
    IF p_ttl IS NULL OR p_ttl <= interval '0' THEN
        PERFORM outbox.invalid_argument('p_ttl', 'must be a positive interval');
    END IF;
    IF p_member_ttl IS NULL OR p_member_ttl <= interval '0' THEN
        PERFORM outbox.invalid_argument('p_member_ttl', 'must be a positive interval');
    END IF;

    INSERT INTO outbox.source_members AS m (worker_id, seen_at, expires_at)
    VALUES (p_worker_id, now(), now() + p_member_ttl)
    ON CONFLICT (worker_id) DO UPDATE
        SET seen_at = excluded.seen_at,
            expires_at = excluded.expires_at;
    DELETE FROM outbox.source_members AS m
     WHERE m.worker_id IN (
               SELECT o.worker_id
                 FROM outbox.source_members AS o
                WHERE o.expires_at < now() - interval '1 hour'
                  FOR UPDATE SKIP LOCKED);

    IF p_want THEN
        -- keep the lowest unexpired slot held
        SELECT l.slot INTO v_slot
          FROM outbox.source_leases AS l
         WHERE l.worker_id = p_worker_id
           AND l.expires_at > now()
           AND l.slot < p_slots
         ORDER BY l.slot
         LIMIT 1
           FOR UPDATE SKIP LOCKED;
        IF FOUND THEN
            UPDATE outbox.source_leases AS l
               SET expires_at = now() + p_ttl
             WHERE l.slot = v_slot
            RETURNING l.token INTO v_token;
        ELSE
            -- take a free or expired slot
            SELECT l.slot INTO v_slot
              FROM outbox.source_leases AS l
             WHERE l.slot < p_slots
               AND (l.worker_id IS NULL OR l.expires_at <= now())
             ORDER BY l.slot
             LIMIT 1
               FOR UPDATE SKIP LOCKED;
            IF FOUND THEN
                UPDATE outbox.source_leases AS l
                   SET worker_id = p_worker_id,
                       token = l.token + 1,
                       acquired_at = now(),
                       expires_at = now() + p_ttl
                 WHERE l.slot = v_slot
                RETURNING l.token INTO v_token;
            ELSE
                -- or make the lowest slot that has no row yet (a call making the same one
                -- at once gets it; this one takes none this time)
                INSERT INTO outbox.source_leases AS l
                       (slot, worker_id, token, acquired_at, expires_at)
                SELECT s, p_worker_id, 1, now(), now() + p_ttl
                  FROM generate_series(0, p_slots - 1) AS s
                 WHERE NOT EXISTS (SELECT FROM outbox.source_leases AS o WHERE o.slot = s)
                 ORDER BY s
                 LIMIT 1
                ON CONFLICT ON CONSTRAINT source_leases_pkey DO NOTHING
                RETURNING l.slot, l.token INTO v_slot, v_token;
            END IF;
        END IF;
        -- any other slot this worker still holds lapses: a worker holds one slot
        UPDATE outbox.source_leases AS l
           SET worker_id = NULL,
               expires_at = NULL
         WHERE l.slot IN (SELECT o.slot
                            FROM outbox.source_leases AS o
                           WHERE o.worker_id = p_worker_id
                             AND o.slot IS DISTINCT FROM v_slot
                             FOR UPDATE SKIP LOCKED);
    ELSE
        UPDATE outbox.source_leases AS l
           SET worker_id = NULL,
               expires_at = NULL
         WHERE l.slot IN (SELECT o.slot
                            FROM outbox.source_leases AS o
                           WHERE o.worker_id = p_worker_id
                             FOR UPDATE SKIP LOCKED);
    END IF;

    RETURN QUERY
    SELECT v_slot,
           v_token,
           (SELECT count(*)::integer
              FROM outbox.source_members AS m
             WHERE m.expires_at > now()),
           ARRAY(SELECT l.worker_id
                   FROM outbox.source_leases AS l
                  WHERE l.worker_id IS NOT NULL
                    AND l.expires_at > now()
                  ORDER BY l.slot);
END;
$$;

COMMENT ON FUNCTION outbox.serve_source(text, integer, boolean, interval, interval) IS
    'A relayer''s periodic call in a many-source fleet: renews its membership (for p_member_ttl), keeps or takes a slot (p_want, for p_ttl) or gives it back; returns the slot, its token, the live members and the holders; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.serve_source(text, integer, boolean, interval, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.serve_source(text, integer, boolean, interval, interval) TO outbox_relay;

-- outbox.leave_source: a relayer that stops gives back its slot and its membership at once,
-- so that another relayer takes the outbox over without waiting for the lease to expire.
--
-- Inputs:     p_worker_id  the relayer's worker id
-- Returns:    nothing.
-- Locks:      the caller's rows of outbox.source_leases and outbox.source_members.
-- Guarantees: afterwards p_worker_id holds no slot and is not a member.
-- Raises:     P7001 (p_worker_id) when it is NULL or blank.
-- Crash:      nothing: one transaction; without it the slot and the membership lapse when
--             their leases expire.
CREATE OR REPLACE FUNCTION outbox.leave_source(p_worker_id text) RETURNS void
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox.check_worker_id(p_worker_id);
    UPDATE outbox.source_leases AS l
       SET worker_id = NULL,
           expires_at = NULL
     WHERE l.worker_id = p_worker_id;
    DELETE FROM outbox.source_members AS m
     WHERE m.worker_id = p_worker_id;
END;
$$;

COMMENT ON FUNCTION outbox.leave_source(text) IS
    'A relayer leaving a many-source fleet: gives back its slot and its membership of this outbox at once; P7001 on a bad argument.';

REVOKE ALL ON FUNCTION outbox.leave_source(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.leave_source(text) TO outbox_relay;

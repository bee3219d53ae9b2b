-- The completions' key locks (lock_keys, and lock_keys_slot0 with its copies for slots 1 to
-- 3) are taken per order key as well as per message_key: one lock for the order chain whose
-- next head promote_heads promotes, and one for the message_key, as before. Under V41 two
-- message_keys could share an order key (a key holding the unit separator under the whole
-- outbox, E'a\x1fb', and key 'a' ordered per topic on topic 'b'): their completions took
-- different locks while promoting heads of one chain, and two of them at once could leave
-- the chain without a head. The message_key's lock is kept so that a completion already
-- running when this commits, which holds it alone, still excludes the new ones of its key.
-- Every keyed message has an order key (constraint messages_order_key_with_key). Contract
-- in full: 05_completion.sql.


CREATE OR REPLACE FUNCTION outbox.lock_keys_slot0(p_outbox_ids uuid[]) RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_hash integer;
BEGIN
    FOR v_hash IN
        SELECT DISTINCT k.hash
          FROM unnest(p_outbox_ids) AS u(id)
         CROSS JOIN LATERAL (
                SELECT x.message_key, x.order_key
                  FROM outbox.messages_0 AS x
                 WHERE x.outbox_id = u.id
                 LIMIT 1) AS m
         CROSS JOIN LATERAL (VALUES (hashtext(m.order_key)), (hashtext(m.message_key))) AS k(hash)
         WHERE m.order_key IS NOT NULL
         ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock(hashtext('outbox.key'), v_hash);
    END LOOP;
END;
$$;

COMMENT ON FUNCTION outbox.lock_keys_slot0(uuid[]) IS
    'Internal: lock_keys for messages of slot 0.';
REVOKE ALL ON FUNCTION outbox.lock_keys_slot0(uuid[]) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.lock_keys_slot0(uuid[])');


CREATE OR REPLACE FUNCTION outbox.lock_keys(p_outbox_ids uuid[]) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    v_hash integer;
BEGIN
    FOR v_hash IN
        SELECT DISTINCT k.hash
          FROM unnest(p_outbox_ids) AS u(id)
         CROSS JOIN LATERAL (
                SELECT x.message_key, x.order_key
                  FROM ((SELECT x0.message_key, x0.order_key FROM outbox.messages_0 x0 WHERE x0.outbox_id = u.id)
                        UNION ALL
                        (SELECT x1.message_key, x1.order_key FROM outbox.messages_1 x1 WHERE x1.outbox_id = u.id)
                        UNION ALL
                        (SELECT x2.message_key, x2.order_key FROM outbox.messages_2 x2 WHERE x2.outbox_id = u.id)
                        UNION ALL
                        (SELECT x3.message_key, x3.order_key FROM outbox.messages_3 x3 WHERE x3.outbox_id = u.id)) AS x
                 LIMIT 1) AS m
         CROSS JOIN LATERAL (VALUES (hashtext(m.order_key)), (hashtext(m.message_key))) AS k(hash)
         WHERE m.order_key IS NOT NULL
         ORDER BY 1
    LOOP
        PERFORM pg_advisory_xact_lock(hashtext('outbox.key'), v_hash);
    END LOOP;
END;
$$;

COMMENT ON FUNCTION outbox.lock_keys(uuid[]) IS
    'Internal (complete_outbox_batch): takes the transaction-scoped completion locks of the order key and of the message_key of each listed keyed message, in one order.';

REVOKE ALL ON FUNCTION outbox.lock_keys(uuid[]) FROM PUBLIC;

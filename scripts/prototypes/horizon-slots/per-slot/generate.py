#!/usr/bin/env python3
"""Writes schema/migrations/V33__per_slot_hot_path.sql: the hot path of the slots patch
(../product.patch) addressing each slot's own table. Run from the root of a checkout with
the patch applied; it reads the area files schema/04_claim.sql and schema/05_completion.sql
(the patch's functions) and rewrites the hot-path functions as slot 0 templates, their
copies for slots 1 to 3 (made by outbox.copy_for_slots when the migration runs) and the
dispatching functions the callers know. A measurement prototype: the area files are not
updated, so tests/schema_contract.rs fails until the change is folded into them and V32.
../product.patch already holds its output, which running it overwrites; each rewrite of a
function is asserted (must_replace), so a change of the patch's area files that it does
not expect stops it with the text it did not find.
"""
import re


def func(path, name):
    s=open(path).read()
    i=s.index("CREATE OR REPLACE FUNCTION outbox.%s(" % name)
    j=s.index("\n$$;\n", i)+5
    return s[i:j]

C='schema/04_claim.sql'; P='schema/05_completion.sql'
out=[]
def w(s): out.append(s)

def must_replace(s, old, new, count=1):
    n=s.count(old)
    assert n==count, (old[:60], n)
    return s.replace(old,new)

w('''-- The hot path addresses each slot's own table: a statement on the partitioned table
-- costs the drain 11-13 % (docs/performance.md), one on a slot's table does not. The
-- functions that claim, lease, delete delivered messages, lock keys and promote heads are
-- written once for slot 0 (the *_slot0 functions) and copied for slots 1 to 3 by
-- outbox.copy_for_slots; the functions the callers know dispatch to them by slot: the
-- claim walks the slots oldest first, and the slot of a leased message travels in its
-- lease token (its last hex digit).

-- outbox.copy_for_slots (internal): creates the copies for slots 1 to 3 of a function
-- written for slot 0: its definition with every `outbox.messages_0 AS` and every name
-- ending in _slot0 renumbered, its comment, and no grant.
CREATE FUNCTION outbox.copy_for_slots(p_template regprocedure) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_def text := pg_get_functiondef(p_template);
    v_copy text;
    v_oid oid;
BEGIN
    IF v_def !~ '_slot0\\(' THEN
        RAISE EXCEPTION 'copy_for_slots: % is not a slot 0 template', p_template;
    END IF;
    FOR v_slot IN 1 .. 3 LOOP
        -- the template's own table is written `outbox.messages_0 AS alias`; a reference to
        -- one given slot is written without AS and kept
        v_copy := regexp_replace(v_def, '\\mmessages_0 AS ', 'messages_' || v_slot || ' AS ', 'g');
        v_copy := regexp_replace(v_copy, '_slot0\\M', '_slot' || v_slot, 'g');
        EXECUTE v_copy;
        v_oid := to_regprocedure(regexp_replace(p_template::text, '_slot0\\(', '_slot' || v_slot || '('));
        EXECUTE format('REVOKE ALL ON FUNCTION %s FROM PUBLIC', v_oid::regprocedure);
        EXECUTE format('COMMENT ON FUNCTION %s IS %L', v_oid::regprocedure,
                       replace(obj_description(p_template, 'pg_proc'), 'slot 0', 'slot ' || v_slot));
    END LOOP;
END;
$$;

REVOKE ALL ON FUNCTION outbox.copy_for_slots(regprocedure) FROM PUBLIC;

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

REVOKE ALL ON FUNCTION outbox.token_slot(uuid) FROM PUBLIC;

-- outbox.token_keyed (internal): whether a lease token was issued for a keyed message.
CREATE FUNCTION outbox.token_keyed(p_token uuid) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT get_byte(uuid_send(p_token), 15) & 4 = 4
$$;

REVOKE ALL ON FUNCTION outbox.token_keyed(uuid) FROM PUBLIC;

-- outbox.ring (internal): the four slots, oldest first: the one after the current slot
-- first, the current slot last.
CREATE FUNCTION outbox.ring() RETURNS integer[]
LANGUAGE sql VOLATILE
AS $$
    SELECT ARRAY[(c + 1) % 4, (c + 2) % 4, (c + 3) % 4, c]
      FROM (SELECT coalesce(pg_sequence_last_value('outbox.message_slot'::regclass), 0)::integer AS c) AS r
$$;

REVOKE ALL ON FUNCTION outbox.ring() FROM PUBLIC;

-- outbox.key_pending_before (internal): whether a message of p_key with a seq below p_seq
-- is pending in any slot: one probe of each slot's messages_key_seq_idx, by a plan kept
-- for the session. The claim asks it only of a shard with entries in more than one slot.
CREATE FUNCTION outbox.key_pending_before(p_key text, p_seq bigint) RETURNS boolean
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM outbox.messages_0 e0 WHERE e0.message_key = p_key AND e0.seq < p_seq)
        OR EXISTS (SELECT 1 FROM outbox.messages_1 e1 WHERE e1.message_key = p_key AND e1.seq < p_seq)
        OR EXISTS (SELECT 1 FROM outbox.messages_2 e2 WHERE e2.message_key = p_key AND e2.seq < p_seq)
        OR EXISTS (SELECT 1 FROM outbox.messages_3 e3 WHERE e3.message_key = p_key AND e3.seq < p_seq);
END;
$$;

REVOKE ALL ON FUNCTION outbox.key_pending_before(text, bigint) FROM PUBLIC;
''')

# 1. probes: one statement over the four slots, generic plan
PROBES = ',\n'.join("""        (SELECT c.available_at FROM outbox.messages_%d c
          WHERE (hashtext(coalesce(c.message_key, c.outbox_id::text)) & 15) = p_shard
            AND NOT c.behind AND c.available_at >= p_floor
          ORDER BY c.available_at, c.seq LIMIT 1)""" % n for n in range(4))
w('''
-- outbox.claim_probe_slots (internal): claim_probe in each slot: the available_at of the
-- first entry of shard p_shard at or after p_floor in slots 0 to 3 (NULL where none).
CREATE FUNCTION outbox.claim_probe_slots(p_shard integer, p_floor timestamptz)
RETURNS timestamptz[]
LANGUAGE plpgsql STABLE
SET plan_cache_mode = force_generic_plan
AS $$
BEGIN
    RETURN ARRAY[
'''+PROBES+'''];
END;
$$;

REVOKE ALL ON FUNCTION outbox.claim_probe_slots(integer, timestamptz) FROM PUBLIC;

DROP FUNCTION outbox.claim_probe(integer, timestamptz);
''')

# 2. candidates
cand=func(C,'claim_shard_candidates')
t=must_replace(cand,'outbox.claim_shard_candidates(','outbox.claim_shard_candidates_slot0(')
t=must_replace(t,'FROM outbox.messages AS c','FROM outbox.messages_0 AS c')
t=must_replace(t,'''AND (c.message_key IS NULL OR NOT EXISTS (
                               SELECT 1
                                 FROM outbox.messages AS e
                                WHERE e.message_key = c.message_key
                                  AND e.seq < c.seq))''','''AND (c.message_key IS NULL OR NOT (
                               EXISTS (SELECT 1
                                         FROM outbox.messages_0 AS e
                                        WHERE e.message_key = c.message_key
                                          AND e.seq < c.seq)
                               OR (p_other_slots AND outbox.key_pending_before(c.message_key, c.seq))))''')
t=must_replace(t,'''    p_max_message_bytes bigint,
    OUT ids uuid[],''','''    p_max_message_bytes bigint,
    p_other_slots boolean,
    OUT ids uuid[],''')
t=must_replace(t,'FROM outbox.messages AS n','FROM outbox.messages_0 AS n')
w('\n'+t)
sig='integer, timestamptz, timestamptz, integer, bigint, text[], text[], bigint, bigint'
sig2=sig+', boolean'
w(f'''
COMMENT ON FUNCTION outbox.claim_shard_candidates_slot0({sig2}) IS
    'Internal: claim_shard_candidates in slot 0 (a run ends at the end of the slot).';
REVOKE ALL ON FUNCTION outbox.claim_shard_candidates_slot0({sig2}) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.claim_shard_candidates_slot0({sig2})');

DROP FUNCTION outbox.claim_shard_candidates({sig});
''')

# 3. lease per slot
# what a lease returns: the claim's rows, with seq (claim_outbox_batch_seq's row type)
seqclaim = func(C, 'claim_outbox_batch_seq')
LEASED = seqclaim[seqclaim.index(') RETURNS TABLE ('):seqclaim.index('\n)\n') + 3]

w('''
-- outbox.lease_slot0 (internal): leases the listed rows of slot 0 (tuple addresses, with
-- their ids as a check) that are still unleased, with a token naming the slot.
CREATE OR REPLACE FUNCTION outbox.lease_slot0(
    p_ids uuid[],
    p_ctids tid[],
    p_worker_id text,
    p_lease_seconds integer,
    p_max_message_bytes bigint
'''+LEASED+'''LANGUAGE plpgsql VOLATILE
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
'''+LEASED+'''LANGUAGE plpgsql VOLATILE
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
        IF v_slot = 0 THEN
            RETURN QUERY SELECT * FROM outbox.lease_slot0(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes);
        ELSIF v_slot = 1 THEN
            RETURN QUERY SELECT * FROM outbox.lease_slot1(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes);
        ELSIF v_slot = 2 THEN
            RETURN QUERY SELECT * FROM outbox.lease_slot2(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes);
        ELSE
            RETURN QUERY SELECT * FROM outbox.lease_slot3(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes);
        END IF;
    END LOOP;
END;
$$;

REVOKE ALL ON FUNCTION outbox.lease_candidates(uuid[], tid[], smallint[], text, integer, bigint) FROM PUBLIC;
''')

# 4. claims
def chain(indent, cond, stmt):
    parts=[]
    for n in range(4):
        kw = 'IF' if n == 0 else 'ELSIF'
        parts.append(indent + kw + ' ' + cond + ' = %d THEN\n' % n + stmt.replace('SLOT', str(n)))
    return '\n'.join(parts) + '\n' + indent + 'END IF;'
for name in ('claim_outbox_batch_seq','claim_outbox_batch'):
    t=func(C,name)
    t=must_replace(t,"    v_ctids tid[] := '{}';\n","    v_ctids tid[] := '{}';\n    v_slots smallint[] := '{}';\n    v_slot integer;\n    v_ring integer[] := outbox.ring();\n    v_probes timestamptz[];\n    v_other boolean;\n")
    t=must_replace(t,"""                v_first := outbox.claim_probe(v_shard, v_floors[v_shard + 1]);""",
                     """                v_probes := outbox.claim_probe_slots(v_shard, v_floors[v_shard + 1]);
                v_first := least(v_probes[1], v_probes[2], v_probes[3], v_probes[4]);""")
    cand_old = """            SELECT v_ids || s.ids, v_ctids || s.ctids, v_bytes + s.bytes
              INTO v_ids, v_ctids, v_bytes
              FROM outbox.claim_shard_candidates(v_shard, v_floors[v_shard + 1], v_now,
                                                 p_batch_size - cardinality(v_ids), v_bytes,
                                                 p_topics, p_exclude_topics, p_max_bytes,
                                                 p_max_message_bytes) AS s;"""
    stmt = """                    SELECT v_ids || s.ids, v_ctids || s.ctids,
                           v_slots || array_fill(v_slot::smallint, ARRAY[cardinality(s.ids)]),
                           v_bytes + s.bytes
                      INTO v_ids, v_ctids, v_slots, v_bytes
                      FROM outbox.claim_shard_candidates_slotSLOT(v_shard, v_floors[v_shard + 1], v_now,
                               p_batch_size - cardinality(v_ids), v_bytes, p_topics, p_exclude_topics,
                               p_max_bytes, p_max_message_bytes, v_other) AS s;"""
    cand_new = """            IF v_pass = 2 THEN
                v_probes := outbox.claim_probe_slots(v_shard, v_floors[v_shard + 1]);
            END IF;
            -- The shard's candidates slot by slot, oldest first, in the slots it has work in.
            FOREACH v_slot IN ARRAY v_ring LOOP
                EXIT WHEN cardinality(v_ids) >= p_batch_size
                       OR (p_max_bytes IS NOT NULL AND v_bytes >= p_max_bytes);
                CONTINUE WHEN v_probes[v_slot + 1] IS NULL OR v_probes[v_slot + 1] > v_now;
                -- Keys are checked in the other slots only where the shard has entries.
                v_other := num_nonnulls(v_probes[1], v_probes[2], v_probes[3], v_probes[4]) > 1;
%s
            END LOOP;""" % chain('                ', 'v_slot', stmt)
    t=must_replace(t,cand_old,cand_new)
    k=t.index('    RETURN QUERY\n    WITH leased AS (')
    e=t.index('END;\n$$;',k)
    seqcol=', l.seq' if name.endswith('_seq') else ''
    lstmt = """        RETURN QUERY
        SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
               l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes%s
          FROM outbox.lease_slotSLOT(v_ids, v_ctids, p_worker_id, p_lease_seconds, p_max_message_bytes) AS l
         ORDER BY l.seq;""" % seqcol
    t=t[:k]+"""    -- The lease, in each slot by tuple address.
    v_slot := v_slots[1];
    IF v_slot = ALL (v_slots) THEN
%s
    ELSE
        RETURN QUERY
        SELECT l.outbox_id, l.lease_token, l.topic, l.message_key, l.payload, l.content_type,
               l.headers, l.attempt_no, l.created_at, l.lease_expires_at, l.payload_bytes%s
          FROM outbox.lease_candidates(v_ids, v_ctids, v_slots, p_worker_id, p_lease_seconds,
                                       p_max_message_bytes) AS l
         ORDER BY l.seq;
    END IF;
""" % (chain('    ', 'v_slot', lstmt), seqcol) + t[e:]
    w('\n'+t)

# 5. the completion: the whole delivered/general completion per slot
lk=func(P,'lock_keys')
t=must_replace(lk,'outbox.lock_keys(','outbox.lock_keys_slot0(')
t=must_replace(t,'FROM outbox.messages AS x','FROM outbox.messages_0 AS x')
w('\n'+t)
w("""
COMMENT ON FUNCTION outbox.lock_keys_slot0(uuid[]) IS
    'Internal: lock_keys for messages of slot 0.';
REVOKE ALL ON FUNCTION outbox.lock_keys_slot0(uuid[]) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.lock_keys_slot0(uuid[])');
""")
# cross-slot lock_keys (same name and signature as before)
t=lk
t=must_replace(t,"""                SELECT x.message_key
                  FROM outbox.messages AS x
                 WHERE x.outbox_id = u.id
                 LIMIT 1) AS m""","""                SELECT x.message_key
                  FROM ((SELECT x0.message_key FROM outbox.messages_0 x0 WHERE x0.outbox_id = u.id)
                        UNION ALL
                        (SELECT x1.message_key FROM outbox.messages_1 x1 WHERE x1.outbox_id = u.id)
                        UNION ALL
                        (SELECT x2.message_key FROM outbox.messages_2 x2 WHERE x2.outbox_id = u.id)
                        UNION ALL
                        (SELECT x3.message_key FROM outbox.messages_3 x3 WHERE x3.outbox_id = u.id)) AS x
                 LIMIT 1) AS m""")
w('\n'+t)
w("""
-- outbox.promote_slot0 (internal): makes the listed messages of slot 0 that are still
-- behind heads, not before the given times; returns their keys.
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
    RETURNING m.message_key;
END;
$$;

COMMENT ON FUNCTION outbox.promote_slot0(uuid[], timestamptz[]) IS
    'Internal: promote_heads'' update in slot 0.';
REVOKE ALL ON FUNCTION outbox.promote_slot0(uuid[], timestamptz[]) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.promote_slot0(uuid[], timestamptz[])');
""")

ph=func(P,'promote_heads')
old_lookup=ph[ph.index('        SELECT array_agg(f.outbox_id), array_agg(k.key)'):ph.index('        EXIT WHEN v_ids IS NULL;')]
def sub(n):
    return ("(SELECT n%d.outbox_id, n%d.seq, n%d.behind, n%d.slot FROM outbox.messages_%d n%d\n"
            "                          WHERE n%d.message_key = k.key AND n%d.seq > k.from_seq ORDER BY n%d.seq LIMIT 1)") % ((n,)*9)
new_lookup="""        SELECT array_agg(f.outbox_id), array_agg(k.key), array_agg(k.after), array_agg(k.from_seq),
               array_agg(f.slot)
          INTO v_ids, v_id_keys, v_id_after, v_id_from, v_id_slots
          FROM unnest(v_keys, v_after, v_from) AS k(key, after, from_seq)
         CROSS JOIN LATERAL (
                SELECT a.outbox_id, a.behind, a.slot
                  FROM (%s
                        UNION ALL
                        %s
                        UNION ALL
                        %s
                        UNION ALL
                        %s) AS a
                 ORDER BY a.seq
                 LIMIT 1) AS f
         WHERE f.behind;
""" % (sub(0), sub(1), sub(2), sub(3))
t=must_replace(ph,old_lookup,new_lookup)
old_upd=t[t.index('        WITH promoted AS ('):t.index('        -- A message not updated')]
new_upd="""        SELECT coalesce(array_agg(p.key), '{}') INTO v_promoted
          FROM (SELECT outbox.promote_slot0(v_ids, v_id_after) AS key WHERE 0 = ANY (v_id_slots)
                UNION ALL
                SELECT outbox.promote_slot1(v_ids, v_id_after) WHERE 1 = ANY (v_id_slots)
                UNION ALL
                SELECT outbox.promote_slot2(v_ids, v_id_after) WHERE 2 = ANY (v_id_slots)
                UNION ALL
                SELECT outbox.promote_slot3(v_ids, v_id_after) WHERE 3 = ANY (v_id_slots)) AS p;

"""
t=must_replace(t,old_upd,new_upd)
t=must_replace(t,"    v_promoted text[];","    v_id_slots smallint[];   -- its slot\n    v_promoted text[];")
w('\n'+t)

cb=func(P,'complete_outbox_batch')
t=must_replace(cb,'outbox.complete_outbox_batch(','outbox.complete_outbox_batch_slot0(')
a=t.index('    PERFORM outbox.check_worker_id(p_worker_id);')
b=t.index('    -- One completion at a time per key')
t=t[:a]+t[b:]
t=must_replace(t,'    PERFORM outbox.lock_keys(p_outbox_ids);',
'''    PERFORM outbox.lock_keys_slot0(ARRAY(SELECT u.id
                                           FROM unnest(p_outbox_ids, p_lease_tokens) AS u(id, token)
                                          WHERE outbox.token_keyed(u.token)));''')
t=must_replace(t,'DELETE FROM outbox.messages AS m','DELETE FROM outbox.messages_0 AS m')
t=must_replace(t,'JOIN outbox.messages AS m ON m.outbox_id = u.id','JOIN outbox.messages_0 AS m ON m.outbox_id = u.id')
t=must_replace(t,"""              FROM outbox.messages AS m
             WHERE m.outbox_id = i.id""","""              FROM outbox.messages_0 AS m
             WHERE m.outbox_id = i.id""")
for k in ['SET search_path = pg_catalog, pg_temp\n','SET plan_cache_mode = force_custom_plan\n','SET enable_seqscan = off\n','SET enable_bitmapscan = off\n','SET jit = off\n']:
    t=must_replace(t,k,'')
t=must_replace(t,'LANGUAGE plpgsql VOLATILE SECURITY DEFINER\n','LANGUAGE plpgsql VOLATILE\n')
w('\n'+t)
csig='text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]'
w("""
COMMENT ON FUNCTION outbox.complete_outbox_batch_slot0(%s) IS
    'Internal: complete_outbox_batch for messages of slot 0, its arguments checked.';
REVOKE ALL ON FUNCTION outbox.complete_outbox_batch_slot0(%s) FROM PUBLIC;
SELECT outbox.copy_for_slots('outbox.complete_outbox_batch_slot0(%s)');
""" % (csig, csig, csig))

a=cb.index('    PERFORM outbox.check_worker_id(p_worker_id);')
b=cb.index('    -- One completion at a time per key')
checks=cb[a:b]
head=cb[:cb.index('DECLARE')]
disp=head+"""DECLARE
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
""" + checks + """    -- Each listed message is in the slot its lease token names; a token naming no slot
    -- (not issued by a claim) matches no lease.
    v_slot := outbox.token_slot(p_lease_tokens[1]);
    IF v_slot < 4 AND NOT EXISTS (SELECT 1
                                     FROM unnest(p_lease_tokens) AS u(token)
                                    WHERE outbox.token_slot(u.token) <> v_slot) THEN
""" + chain('        ', 'v_slot', """            RETURN QUERY SELECT * FROM outbox.complete_outbox_batch_slotSLOT(p_worker_id, p_outbox_ids,
                             p_lease_tokens, p_states, p_errors, p_retry_ats);""") + """
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
""" + chain('        ', 'v_slot', """            SELECT v_out_ids || array_agg(r.outbox_id), v_out_nos || array_agg(r.attempt_no),
                   v_out_lost || array_agg(r.lease_lost), v_out_dead || array_agg(r.dead_lettered)
              INTO v_out_ids, v_out_nos, v_out_lost, v_out_dead
              FROM outbox.complete_outbox_batch_slotSLOT(p_worker_id, v_ids, v_tokens, v_states,
                                                      v_errors, v_retry_ats) AS r;""") + """
    END LOOP;
    RETURN QUERY
    SELECT u.id, r.attempt_no, coalesce(r.lease_lost, true), coalesce(r.dead_lettered, false)
      FROM unnest(p_outbox_ids) WITH ORDINALITY AS u(id, ord)
      LEFT JOIN unnest(v_out_ids, v_out_nos, v_out_lost, v_out_dead) AS r(id, attempt_no, lease_lost, dead_lettered)
             ON r.id = u.id
     ORDER BY u.ord;
END;
$$;
"""
w('\n-- The public completion: checks its arguments, then completes slot by slot.\n'+disp)

# heartbeat and release: lock in the completions' order, (slot, id), each id in its token's slot
for name in ('extend_outbox_leases', 'release_outbox_leases'):
    t=func(P,name)
    t=must_replace(t,"""                        ORDER BY u.id) AS i""","""                        ORDER BY outbox.token_slot(u.token), u.id) AS i""")
    t=must_replace(t,"""                        WHERE l.outbox_id = i.id
                          AND l.lease_token = i.token""","""                        WHERE l.outbox_id = i.id
                          AND l.slot = outbox.token_slot(i.token)
                          AND l.lease_token = i.token""")
    t=must_replace(t,"""                          FOR NO KEY UPDATE) AS h))""","""                          FOR NO KEY UPDATE) AS h))
       AND m.lease_token = ANY (p_lease_tokens)""")
    w('\n'+t)

# Internal functions called only from functions that set the planner settings have no SET
# clause of their own (each would be saved and restored on every call): the ones taken
# from the area files lose theirs here.
text = '\n'.join(out).rstrip('\n') + '\n'
for n in ['claim_shard_candidates_slot0', 'lock_keys_slot0']:
    m = re.search(r'CREATE (?:OR REPLACE )?FUNCTION outbox\.%s\(' % n, text)
    assert m, n
    i = m.start()
    j = text.index('AS $$', i)
    text = text[:i] + re.sub(r'\nSET [^\n]*', '', text[i:j]) + text[j:]
open('schema/migrations/V33__per_slot_hot_path.sql', 'w').write(text)
print('written schema/migrations/V33__per_slot_hot_path.sql')

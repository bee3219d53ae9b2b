-- public.complete_all: the relayer's completion of a claimed batch, all delivered, from the
-- claim's rows in text form ('outbox_id:lease_token,…'), for the prototypes' pgbench drains
-- (horizon-ring/drain.sh, and horizon-slots/drain_mix.sh, which renames it and its schema
-- per release) against the outbox's own functions.
CREATE FUNCTION public.complete_all(p_worker text, p_leased text) RETURNS integer
LANGUAGE sql AS $$
    SELECT count(*)::integer
      FROM outbox.complete_outbox_batch(
               p_worker,
               (SELECT array_agg(split_part(t, ':', 1)::uuid ORDER BY o) FROM unnest(string_to_array(p_leased, ',')) WITH ORDINALITY AS u(t, o)),
               (SELECT array_agg(split_part(t, ':', 2)::uuid ORDER BY o) FROM unnest(string_to_array(p_leased, ',')) WITH ORDINALITY AS u(t, o)),
               array_fill('DISPATCHED'::outbox.attempt_state, ARRAY[cardinality(string_to_array(p_leased, ','))]),
               array_fill(NULL::text, ARRAY[cardinality(string_to_array(p_leased, ','))]),
               array_fill(NULL::timestamptz, ARRAY[cardinality(string_to_array(p_leased, ','))]))
$$;

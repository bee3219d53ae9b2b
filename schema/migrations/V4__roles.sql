-- Roles and rights (cluster-wide roles, per-database grants).
--
--   outbox_relay     the relayer: EXECUTE on the worker and maintenance functions, SELECT on
--                    the views; no rights on the tables, so every change goes through the
--                    lease checks of the SQL API
--   outbox_producer  applications: EXECUTE on enqueue only
--   outbox_reader    dashboards and operators: SELECT on the views only
--
-- The roles are NOLOGIN groups: grant them to login roles (GRANT outbox_relay TO app_relay).
-- Roles are shared by every database of the cluster, so creating one that already exists
-- (another database migrated first, possibly at the same moment) is not an error.

DO $$
DECLARE
    v_role text;
BEGIN
    FOREACH v_role IN ARRAY ARRAY['outbox_relay', 'outbox_producer', 'outbox_reader'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = v_role) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', v_role);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL; -- created concurrently by another migration
            END;
        END IF;
    END LOOP;
END;
$$;

-- Functions are executable by PUBLIC by default; nothing here should be.
REVOKE ALL ON SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox FROM PUBLIC;

GRANT USAGE ON SCHEMA outbox TO outbox_relay, outbox_producer, outbox_reader;

GRANT EXECUTE ON FUNCTION
    outbox.enqueue(text, bytea, text, jsonb, timestamptz, uuid, integer, text),
    outbox.enqueue(text, jsonb, text, jsonb, timestamptz, uuid, integer)
    TO outbox_producer, outbox_relay;

GRANT EXECUTE ON FUNCTION
    outbox.claim_outbox_batch(integer, text, integer, text[], text[]),
    outbox.complete_outbox_attempt(uuid, uuid, text, outbox.attempt_state, text, timestamptz),
    outbox.complete_outbox_batch(text, uuid[], uuid[], outbox.attempt_state[], text[], timestamptz[]),
    outbox.extend_outbox_leases(text, uuid[], uuid[], integer),
    outbox.release_outbox_leases(text, uuid[], uuid[]),
    outbox.repair_expired_leases(integer),
    outbox.replay_dead_letters(uuid[], text),
    outbox.prune_attempts(interval)
    TO outbox_relay;

GRANT SELECT ON
    outbox.status, outbox.in_flight, outbox.topic_lag, outbox.worker_activity,
    outbox.recent_failures, outbox.attempt_rates
    TO outbox_reader, outbox_relay;

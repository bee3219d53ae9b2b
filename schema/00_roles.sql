-- Roles, the schema, and the rights the schema itself grants.
--
-- This file is the first of the SQL contract's area files (schema/NN_*.sql, loaded in
-- file-name order, each in one transaction). It creates the three group roles the rest of
-- the contract grants to, and schema `outbox` with USAGE for each of them. Every other
-- right sits beside its object in the later files: a function's REVOKE ALL … FROM PUBLIC
-- and GRANT EXECUTE follow its definition, a view's GRANT SELECT follows the view.
--
-- The roles, and what each may do:
--
--   outbox_relay     the relayer and the operators' CLI: EXECUTE on the worker functions
--                    (claim, complete, extend, release, report_circuits, serve_source,
--                    leave_source), on maintenance
--                    (repair, prune, replay and its filter, observe), on enqueue and on
--                    schema_version; SELECT on the views. No right on any table: every
--                    change goes through the lease checks of the SQL API.
--   outbox_producer  applications: EXECUTE on the two enqueue overloads and on
--                    schema_version, nothing else.
--   outbox_reader    dashboards and operators who only look: SELECT on the views, EXECUTE
--                    on observe and schema_version, and on the console's read functions
--                    (11_console.sql), which return messages and dead letters with their
--                    payloads and headers, a bounded page at a time.
--
-- The roles are NOLOGIN groups. Grant them to login roles, as the owner of the database:
--   CREATE ROLE app_relay LOGIN PASSWORD '…' IN ROLE outbox_relay;
--   GRANT outbox_producer TO your_app_login;
-- The schema owner (the role that runs `outbox-relay migrate`) owns every table and
-- function; the SECURITY DEFINER functions act with its rights and a fixed search_path.
--
-- Conventions for every object of the schema:
-- * PUBLIC holds no right on anything in schema `outbox`. Postgres grants EXECUTE on every
--   new function to PUBLIC; each function's REVOKE ALL … FROM PUBLIC beside its definition
--   takes that back. A new table or view carries no PUBLIC right; its REVOKE ALL … FROM
--   PUBLIC states that it stays so.
-- * Rights are granted to these three roles only, never to a login.

-- Roles belong to the cluster, not to one database: another database of the cluster may
-- have created them already, or be migrating at this moment. A role that exists, or that
-- a concurrent transaction creates first, is therefore not an error.
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

-- Schema `outbox`: every table, view, type and function of the contract. Usage alone gives
-- no right on any object in it; the three roles need it to name the objects they are
-- granted.
CREATE SCHEMA outbox;

COMMENT ON SCHEMA outbox IS
    'The transactional outbox: pending messages, attempt log, dead letters, and the SQL API that is the only way to change them (schema/ holds its contract by area).';

REVOKE ALL ON SCHEMA outbox FROM PUBLIC;
GRANT USAGE ON SCHEMA outbox TO outbox_relay;
GRANT USAGE ON SCHEMA outbox TO outbox_producer;
GRANT USAGE ON SCHEMA outbox TO outbox_reader;

-- outbox.schema_version(): the version of the newest migration applied to this database.
--
-- Every verb of the relayer and its /readyz compare it with the version their embedded
-- migrations reach, so that a database that was never migrated, or is older than the binary,
-- is reported by name ("schema outbox is at version 4, this build needs 5") instead of
-- failing later on a missing function.
--
-- refinery records applied migrations in its history table, which only the migrating role
-- can read; this function reads it with the owner's rights, so that logins holding only
-- outbox_relay, outbox_producer or outbox_reader can ask. The body is parsed when this
-- migration runs (BEGIN ATOMIC), which binds it to the history table of this migration run
-- whatever search_path a caller has. Needs Postgres 14 or later.

CREATE FUNCTION outbox.schema_version() RETURNS integer
    LANGUAGE sql
    STABLE
    SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
BEGIN ATOMIC
    SELECT max(version) FROM refinery_schema_history;
END;

COMMENT ON FUNCTION outbox.schema_version() IS
    'Version of the newest applied migration; compared by the relayer with the version it needs.';

REVOKE ALL ON FUNCTION outbox.schema_version() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox.schema_version() TO outbox_relay, outbox_producer, outbox_reader;

-- Errors: the SQLSTATE contract of the whole SQL API, and the argument checks every area
-- shares.
--
-- Objects:
--   outbox.invalid_argument(text, text)    raises P7001 naming the argument
--   outbox.check_worker_id(text)           the worker id every worker function takes
--   outbox.check_leases(uuid[], uuid[])    the id/token arrays of the lease functions
-- All three are internal: the public functions of the later files call them, and they are
-- granted to no one (a caller that holds EXECUTE on a SECURITY DEFINER function reaches
-- them through it, as the owner).
--
-- The SQLSTATEs a caller of the API can meet, stated once for every function:
--
-- * P7001, invalid argument. An argument the function refuses: NULL where a value is
--   needed, out of range, arrays of unequal length, a state that the call does not allow.
--   The message is "invalid argument <name>: <problem>" and DETAIL is the argument's name,
--   e.g. `invalid argument p_batch_size: must be between 1 and 10000, got 0`. Every
--   function checks its arguments before it changes anything, so a P7001 means the call
--   changed nothing (and, like any error, aborts the caller's transaction or
--   subtransaction). Raised only through outbox.invalid_argument.
-- * P7002, LEASE_LOST. The lease named is not the current one: another worker holds it, the
--   token is not the latest one, it expired, repair_expired_leases requeued it, or the
--   message was completed already. complete_outbox_attempt, which reports the outcome of
--   one lease, raises it (message `LEASE_LOST: worker … does not hold the lease … on message
--   …`) and records nothing. The functions that take a batch of leases never raise it, so
--   that one lost lease does not fail the others: complete_outbox_batch returns lease_lost
--   = true for that row, extend_outbox_leases leaves the row out of its result, and
--   release_outbox_leases does not count it. None of them changes a row whose lease is lost.
-- * 23505, unique_violation. enqueue with an outbox_id that is pending, dead-lettered or
--   already has attempts; the message names the id and which of the three, DETAIL is the
--   id, and HINT says that a retry of one's own enqueue finds the message already there.
--   Two enqueues of one new id at the same moment: the second waits for the first and
--   gets Postgres's own 23505 from messages_pkey when the first commits.
-- Everything else is Postgres's own (a lost connection, a statement timeout, a
-- serialization failure under the caller's isolation level) and is not part of the
-- contract. The relayer's store maps P7002 to StoreError::LeaseLost and P7001 to
-- StoreError::InvalidArgument (src/store/mod.rs). Warnings (RAISE WARNING) report rows a call
-- set aside and are no errors.
--
-- Conventions of the three helpers: LANGUAGE plpgsql, IMMUTABLE (they read no table and
-- depend on nothing but their arguments), a fixed search_path, no SECURITY DEFINER (they
-- touch no table). Being IMMUTABLE, a call with constant arguments may be evaluated while
-- the calling statement is planned; it raises the same error then.


-- outbox.invalid_argument: internal; called by every public function's argument checks and
-- by check_worker_id and check_leases. Not granted.
--
-- Inputs:     p_argument, the parameter's name as the caller declares it (e.g. 'p_topic');
--             p_problem, what is wrong with it, in words a caller can act on.
-- Returns:    never; it always raises.
-- Raises:     P7001 with message "invalid argument <p_argument>: <p_problem>" and DETAIL
--             p_argument.
CREATE OR REPLACE FUNCTION outbox.invalid_argument(p_argument text, p_problem text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'invalid argument %: %', p_argument, p_problem
        USING ERRCODE = 'P7001', DETAIL = p_argument;
END;
$$;

COMMENT ON FUNCTION outbox.invalid_argument(text, text) IS
    'Internal: raises P7001 "invalid argument <p_argument>: <p_problem>" with DETAIL p_argument; the one place the API raises P7001. Not granted.';

REVOKE ALL ON FUNCTION outbox.invalid_argument(text, text) FROM PUBLIC;


-- outbox.check_worker_id: internal; called by claim_outbox_batch, complete_outbox_batch
-- (and through it complete_outbox_attempt), extend_outbox_leases, release_outbox_leases
-- and report_circuits. Not granted.
--
-- Inputs:     p_worker_id, the caller's worker id (it is written to leases and attempts).
-- Returns:    nothing when the id is valid.
-- Raises:     P7001 (p_worker_id) when it is NULL, empty or only white space.
CREATE OR REPLACE FUNCTION outbox.check_worker_id(p_worker_id text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_worker_id IS NULL OR btrim(p_worker_id) = '' THEN
        PERFORM outbox.invalid_argument('p_worker_id', 'must be a non-empty string');
    END IF;
END;
$$;

COMMENT ON FUNCTION outbox.check_worker_id(text) IS
    'Internal: P7001 (p_worker_id) unless the worker id is a non-empty string other than white space. Not granted.';

REVOKE ALL ON FUNCTION outbox.check_worker_id(text) FROM PUBLIC;


-- outbox.check_leases: internal; called by complete_outbox_batch (and through it
-- complete_outbox_attempt), extend_outbox_leases and release_outbox_leases. Not granted.
--
-- Inputs:     p_outbox_ids and p_lease_tokens, element i of one going with element i of
--             the other. Empty arrays are valid (the call then does nothing).
-- Returns:    nothing when the pair is valid.
-- Raises:     P7001, checked in this order: p_outbox_ids NULL; p_lease_tokens NULL;
--             p_lease_tokens of another length than p_outbox_ids (the message gives both
--             lengths); a NULL element in p_outbox_ids; a NULL element in p_lease_tokens;
--             the same id twice in p_outbox_ids.
-- Shape:      duplicate ids are refused here because every caller locks and changes each
--             listed row once; the count of distinct ids costs one pass over the array.
CREATE OR REPLACE FUNCTION outbox.check_leases(p_outbox_ids uuid[], p_lease_tokens uuid[]) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_outbox_ids IS NULL THEN
        PERFORM outbox.invalid_argument('p_outbox_ids', 'must not be NULL');
    END IF;
    IF p_lease_tokens IS NULL THEN
        PERFORM outbox.invalid_argument('p_lease_tokens', 'must not be NULL');
    END IF;
    IF cardinality(p_lease_tokens) <> cardinality(p_outbox_ids) THEN
        PERFORM outbox.invalid_argument('p_lease_tokens', format(
            'has %s elements but p_outbox_ids has %s; arrays must have equal length',
            cardinality(p_lease_tokens), cardinality(p_outbox_ids)));
    END IF;
    IF array_position(p_outbox_ids, NULL) IS NOT NULL THEN
        PERFORM outbox.invalid_argument('p_outbox_ids', 'must not contain NULL');
    END IF;
    IF array_position(p_lease_tokens, NULL) IS NOT NULL THEN
        PERFORM outbox.invalid_argument('p_lease_tokens', 'must not contain NULL');
    END IF;
    IF (SELECT count(DISTINCT id) FROM unnest(p_outbox_ids) AS id) <> cardinality(p_outbox_ids) THEN
        PERFORM outbox.invalid_argument('p_outbox_ids', 'must not contain the same id twice');
    END IF;
END;
$$;

COMMENT ON FUNCTION outbox.check_leases(uuid[], uuid[]) IS
    'Internal: P7001 unless p_outbox_ids and p_lease_tokens are both non-NULL, of equal length, without NULL elements, and without a repeated id. Not granted.';

REVOKE ALL ON FUNCTION outbox.check_leases(uuid[], uuid[]) FROM PUBLIC;

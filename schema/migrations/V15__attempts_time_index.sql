-- V15: the attempt log's time index is a B-tree, so retention and rates stay cheap once the
-- log's pages are reused.
--
-- V1 indexed attempts.created_at with BRIN, which is tiny and cheap only while rows arrive
-- in time order on new pages. Under steady load with retention, that stops after the first
-- vacuum of the log: pruned space is reused by new attempts all over the table, every block
-- range soon holds both old and new rows, and a range query (`created_at < now() - 60 s`
-- in prune_attempts, the last minutes in attempt_rates and observe) reads the whole log.
-- Measured at 10,000 msg/s with attempts older than 60 s pruned every 3 s: about 150 s
-- into the run, prune passes went from 1 s to over 2 minutes, and a pass that long held
-- back the MVCC horizon, so dead messages stayed in the claim's index and deliveries fell
-- to a fifth. A B-tree reads only the rows in range, whatever their page, for one more
-- index entry per attempt, appended at its right edge.
--
-- Building the index locks the attempt log against writes while it runs (a few seconds
-- per million attempts): migrate when the relayers are stopped or the log is small.
CREATE INDEX attempts_created_at_idx ON outbox.attempts (created_at);
DROP INDEX outbox.attempts_created_at_brin;

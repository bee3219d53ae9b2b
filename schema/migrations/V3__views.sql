-- Operator views: what is queued, what is in flight, who is working, what is failing.
-- Readable by outbox_reader (V4); documented in the README with example queries.

-- One row: the state of the whole outbox right now.
CREATE VIEW outbox.status AS
SELECT count(*) FILTER (WHERE m.lease_token IS NULL AND m.available_at <= now())   AS ready,
       count(*) FILTER (WHERE m.lease_token IS NULL AND m.available_at > now())    AS delayed,
       count(*) FILTER (WHERE m.lease_expires_at > now())                          AS in_flight,
       count(*) FILTER (WHERE m.lease_expires_at <= now())                         AS expired_leases,
       (SELECT count(*) FROM outbox.dead_letters)                                  AS dead_letters,
       now() - min(m.available_at) FILTER (WHERE m.lease_token IS NULL
                                            AND m.available_at <= now())           AS oldest_ready_age
  FROM outbox.messages AS m;

-- Every leased message: who holds it, with which token, until when.
CREATE VIEW outbox.in_flight AS
SELECT m.outbox_id,
       m.topic,
       m.message_key,
       m.claimed_by,
       m.lease_token,
       m.lease_expires_at,
       m.lease_expires_at <= now() AS expired,
       m.attempt_count + 1         AS attempt_no,
       m.created_at
  FROM outbox.messages AS m
 WHERE m.lease_token IS NOT NULL;

-- Per topic: backlog, delivery lag and dead letters.
CREATE VIEW outbox.topic_lag AS
WITH pending AS (
    SELECT m.topic,
           count(*) FILTER (WHERE m.lease_token IS NULL AND m.available_at <= now()) AS ready,
           count(*) FILTER (WHERE m.lease_token IS NULL AND m.available_at > now())  AS delayed,
           count(*) FILTER (WHERE m.lease_token IS NOT NULL)                         AS in_flight,
           min(m.created_at)                                                         AS oldest_created_at
      FROM outbox.messages AS m
     GROUP BY m.topic
), dead AS (
    SELECT d.topic, count(*) AS dead_letters
      FROM outbox.dead_letters AS d
     GROUP BY d.topic
)
SELECT coalesce(p.topic, d.topic)        AS topic,
       coalesce(p.ready, 0)              AS ready,
       coalesce(p.delayed, 0)            AS delayed,
       coalesce(p.in_flight, 0)          AS in_flight,
       coalesce(d.dead_letters, 0)       AS dead_letters,
       now() - p.oldest_created_at       AS lag
  FROM pending AS p
  FULL JOIN dead AS d ON d.topic = p.topic;

-- Per worker: leases held now and outcomes in the last 5 minutes.
CREATE VIEW outbox.worker_activity AS
WITH recent AS (
    SELECT a.worker_id,
           count(*) FILTER (WHERE a.state = 'DISPATCHED')     AS dispatched_5m,
           count(*) FILTER (WHERE a.state = 'RETRYABLE')      AS retried_5m,
           count(*) FILTER (WHERE a.state = 'FAILED')         AS failed_5m,
           count(*) FILTER (WHERE a.state = 'ZOMBIE_REQUEUE') AS zombie_requeues_5m,
           max(a.created_at)                                  AS last_attempt_at
      FROM outbox.attempts AS a
     WHERE a.created_at > now() - interval '5 minutes'
     GROUP BY a.worker_id
), held AS (
    SELECT m.claimed_by AS worker_id,
           count(*) AS leases_held,
           min(m.lease_expires_at) AS next_lease_expiry
      FROM outbox.messages AS m
     WHERE m.claimed_by IS NOT NULL
     GROUP BY m.claimed_by
)
SELECT coalesce(h.worker_id, r.worker_id)   AS worker_id,
       coalesce(h.leases_held, 0)           AS leases_held,
       h.next_lease_expiry,
       coalesce(r.dispatched_5m, 0)         AS dispatched_5m,
       coalesce(r.retried_5m, 0)            AS retried_5m,
       coalesce(r.failed_5m, 0)             AS failed_5m,
       coalesce(r.zombie_requeues_5m, 0)    AS zombie_requeues_5m,
       r.last_attempt_at
  FROM held AS h
  FULL JOIN recent AS r ON r.worker_id = h.worker_id;

-- The 100 most recent attempts that did not deliver, newest first, with their topic.
CREATE VIEW outbox.recent_failures AS
SELECT a.outbox_id,
       coalesce(m.topic, d.topic) AS topic,
       a.attempt_no,
       a.state,
       a.worker_id,
       a.error,
       a.created_at,
       CASE WHEN m.outbox_id IS NOT NULL THEN 'pending'
            WHEN d.outbox_id IS NOT NULL THEN 'dead_letter'
            ELSE 'delivered' END AS now_in
  FROM (SELECT * FROM outbox.attempts
         WHERE state <> 'DISPATCHED'
         ORDER BY created_at DESC
         LIMIT 100) AS a
  LEFT JOIN outbox.messages AS m ON m.outbox_id = a.outbox_id
  LEFT JOIN outbox.dead_letters AS d ON d.outbox_id = a.outbox_id
 ORDER BY a.created_at DESC;

-- Attempts per minute and state over the last hour.
CREATE VIEW outbox.attempt_rates AS
SELECT date_trunc('minute', a.created_at) AS minute,
       a.state,
       count(*) AS attempts
  FROM outbox.attempts AS a
 WHERE a.created_at > now() - interval '1 hour'
 GROUP BY 1, 2
 ORDER BY 1 DESC, 2;

-- one relay's loop: claim up to 500 (its own transaction), complete them all (another);
-- 20 ms of sleep when the claim found nothing
SELECT ring.claim(500, 'w' || :client_id, 30) AS leased \gset
SELECT ring.complete(':leased') AS n \gset
\if :n = 0
\sleep 20 ms
\endif

//! `slow-freeze`: a relayer frozen part-way through a batch to a destination that takes one
//! request per message. Several relayers deliver keyed messages to an HTTP server that
//! answers each request after 50 ms; one of them is stopped (SIGSTOP) while it is delivering,
//! for longer than its lease, so that the others take its messages over, then woken
//! (SIGTERM, then SIGCONT: it stops claiming once it reads the SIGTERM). The leases it took
//! before it woke
//! are read from the database while it is still stopped: those it holds and those it has an
//! attempt for (an outcome it recorded, or repair's ZOMBIE_REQUEUE of a lease that expired).
//! The publish window is checked before every request, so the woken relayer starts no request
//! for what it held before the freeze. What the check cannot cover (docs/guarantees.md) is a
//! request checked just before the freeze and written after it: the woken relayer may send
//! at most the requests it can have had started at once ([`STARTED_AT_ONCE`]: the
//! destination's `concurrency` times its batches in flight, `max_in_flight` of them and as
//! many more whose first wave was recorded and whose runs' later waves go on), where a window
//! checked once per batch would send the rest of its batches. A claim the woken relayer sends
//! in the instant before its runtime reads the pending SIGTERM takes fresh leases; their
//! requests are legitimate, and counted apart: at most a batch for each batch in flight
//! ([`FRESH_AFTER_WAKE`]), or the relayer went on claiming after the signal.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use uuid::Uuid;

use crate::common::{Relayer, TestDb, pending};
use crate::hook::recording_hook;
use crate::{Outcome, Sizes, check, wait_for};

const LEASE_SECS: &str = "5";
const FROZEN: Duration = Duration::from_secs(7);
const ANSWER_AFTER: Duration = Duration::from_millis(50);
const KEYS: i64 = 500;
/// Requests in flight per batch (the destination's `concurrency`).
const CONCURRENCY: usize = 8;
/// Batches in flight (the destination's `max_in_flight`).
const BATCHES_IN_FLIGHT: usize = 3;
/// Messages per claim (`--batch-size`).
const BATCH_SIZE: usize = 200;
/// The requests a woken relayer may send of leases it took after waking: the claims it can
/// send before it reads the pending SIGTERM, one per batch in flight.
const FRESH_AFTER_WAKE: usize = BATCH_SIZE * BATCHES_IN_FLIGHT;
/// The requests a relayer can have started at once: `concurrency` for each batch in its
/// destination's budget, and for each of as many batches with only their runs' later waves
/// left (docs/destinations.md, keyed messages).
const STARTED_AT_ONCE: usize = CONCURRENCY * BATCHES_IN_FLIGHT * 2;

fn worker(db: &TestDb, base: &str, name: &str) -> Result<Relayer, String> {
    let config = db.scratch_dir().join(format!("{name}.toml"));
    std::fs::write(
        &config,
        format!(
            "[destinations.hook]\ntype = \"http\"\nurl = \"{base}/{name}/{{topic}}\"\n\
             timeout_ms = 30000\nconcurrency = {CONCURRENCY}\nmax_in_flight = {BATCHES_IN_FLIGHT}\n\n\
             [[routes]]\ntopic = \"*\"\ndestination = \"hook\"\n"
        ),
    )
    .map_err(|e| e.to_string())?;
    Ok(Relayer::start(
        db,
        name,
        &[
            "--config",
            &config.display().to_string(),
            "--lease-secs",
            LEASE_SECS,
            "--batch-size",
            &BATCH_SIZE.to_string(),
            "--no-telemetry",
            "--repair-interval-secs",
            "1",
        ],
    ))
}

pub async fn slow_freeze(sizes: &Sizes) -> Outcome {
    let db = TestDb::new().await;
    let c = db.client().await;
    let n = (sizes.messages * 2).clamp(20_000, 100_000);
    outbox_relay::store::fill_messages_returning_ids(&c, "slow", n, Some(1), KEYS, 0)
        .await
        .map_err(|e| e.to_string())?;
    let order = crate::order_of(&c).await;
    let (base, arrivals) = recording_hook(ANSWER_AFTER).await;
    let others = [
        worker(&db, &base, "steady-1")?,
        worker(&db, &base, "steady-2")?,
    ];
    let by = |name: &str| {
        arrivals
            .lock()
            .unwrap()
            .iter()
            .filter(|(w, _, _)| w == name)
            .count()
    };
    let planned = if sizes.kills > 4 { 3 } else { 2 };
    // (sleeper, the messages it took a lease on before waking, woken) per freeze. Each
    // sleeper is frozen once and asked to stop as it wakes (SIGTERM, then SIGCONT), so that
    // it stops claiming; a request it sends after waking of a lease it took before the
    // freeze must not be sent, beyond those it had started.
    let mut freezes: Vec<(String, HashSet<Uuid>, Instant)> = Vec::new();
    let mut sleepers = Vec::new();
    for i in 1..=planned {
        let name = format!("sleeper-{i}");
        let sleeper = worker(&db, &base, &name)?;
        // Stopped while it is delivering: its requests are still arriving.
        wait_for(
            Duration::from_secs(60),
            "the sleeper to be delivering",
            async || by(&name) >= 100 || pending(&c).await < 2_000,
        )
        .await?;
        if pending(&c).await < 2_000 {
            break;
        }
        sleeper.signal("STOP");
        tokio::time::sleep(FROZEN).await;
        let held = taken_by(&c, &name).await;
        sleeper.signal("TERM");
        sleeper.signal("CONT");
        freezes.push((name, held, Instant::now()));
        sleepers.push(sleeper);
    }
    check(!freezes.is_empty(), || {
        "the backlog drained before the sleeper could be frozen: raise --messages".to_owned()
    })?;
    wait_for(
        Duration::from_secs(600),
        "the slow-freeze backlog to drain",
        async || pending(&c).await == 0,
    )
    .await?;
    let broken = crate::broken_histories(&c).await;
    let dead = crate::common::dead_letters(&c).await.len();
    drop((sleepers, others));

    let arrivals = arrivals.lock().unwrap().clone();
    // For a request a frozen sleeper sent after it woke, the leases it took before.
    let woken = |w: &str, at: Instant| {
        freezes
            .iter()
            .find(|(name, _, woke)| name == w && at >= *woke)
            .map(|(_, held, _)| held)
    };
    // A request a frozen sleeper sent after it woke, of a lease it took before.
    let of_a_lease_before =
        |w: &str, id: &Uuid, at: Instant| woken(w, at).is_some_and(|held| held.contains(id));
    // Requests by a woken sleeper of a message delivered before.
    let mut delivered_first: HashMap<Uuid, Instant> = HashMap::new();
    for (_, id, at) in &arrivals {
        delivered_first.entry(*id).or_insert(*at);
    }
    let stale = arrivals
        .iter()
        .filter(|(w, id, at)| {
            of_a_lease_before(w, id, *at) && delivered_first.get(id).is_some_and(|first| first < at)
        })
        .count();
    // Keys where an older message arrived after a newer one, by the woken sleeper from a
    // lease it took before the freeze.
    let mut newest: HashMap<&str, i64> = HashMap::new();
    let mut rewound_by_stale: HashSet<&str> = HashSet::new();
    let mut rewound: HashSet<&str> = HashSet::new();
    for (w, id, at) in &arrivals {
        if let Some((seq, Some(key))) = order.get(id) {
            let top = newest.entry(key.as_str()).or_insert(*seq);
            if *seq < *top {
                rewound.insert(key);
                if of_a_lease_before(w, id, *at) {
                    rewound_by_stale.insert(key);
                }
            }
            *top = (*top).max(*seq);
        }
    }
    let seen: HashSet<Uuid> = arrivals.iter().map(|(_, id, _)| *id).collect();
    let lost = order.keys().filter(|id| !seen.contains(id)).count();
    let after_wake = arrivals
        .iter()
        .filter(|(w, id, at)| of_a_lease_before(w, id, *at))
        .count();
    let fresh = arrivals
        .iter()
        .filter(|(w, _, at)| woken(w, *at).is_some())
        .count()
        - after_wake;
    // Only requests checked before the freeze may follow it: at most what was started.
    let allowed = STARTED_AT_ONCE * freezes.len();
    check(after_wake <= allowed, || {
        format!(
            "{after_wake} requests by a relayer after it woke from a freeze past its leases, of \
             leases it took before ({stale} of messages delivered before), more than the \
             {allowed} it can have started before its freezes ({fresh} more of leases it took \
             after waking)"
        )
    })?;
    let fresh_allowed = FRESH_AFTER_WAKE * freezes.len();
    check(fresh <= fresh_allowed, || {
        format!(
            "{fresh} requests by a relayer after it woke, of leases it took after waking: more \
             than the {fresh_allowed} its claims in flight as it read the SIGTERM can hold"
        )
    })?;
    check(lost == 0 && dead == 0, || {
        format!("{lost} messages never arrived, {dead} dead-lettered")
    })?;
    check(broken == 0, || {
        format!("{broken} attempt histories with gaps")
    })?;
    db.finish().await;
    Ok(format!(
        "{n} keyed messages ({KEYS} keys), 3 processes, HTTP answering after 50 ms, batch 200, \
         {CONCURRENCY} requests at once per batch, lease {LEASE_SECS} s, {} SIGSTOP of {} s \
         mid-batch (each woken with SIGTERM: it finishes what it holds and stops claiming); \
         requests {} ({} duplicates), by a relayer after it woke of leases it took before \
         {after_wake} (at most {allowed}: those started before a freeze), of those already \
         delivered {stale}, of leases it took after waking {fresh} (at most {fresh_allowed}); keys \
         seeing an older message after a newer one: from a woken relayer {}, in all {}; lost 0",
        freezes.len(),
        FROZEN.as_secs(),
        arrivals.len(),
        arrivals.len() - seen.len(),
        rewound_by_stale.len(),
        rewound.len()
    ))
}

/// The messages `worker` took a lease on, read while it is stopped: those it holds, and those
/// it has an attempt for (an outcome it recorded, or repair's ZOMBIE_REQUEUE of its lease).
/// By message, not by lease: one of these messages repaired and claimed again by the same
/// relayer after it woke counts as a lease taken before, on the strict side.
async fn taken_by(c: &tokio_postgres::Client, worker: &str) -> HashSet<Uuid> {
    c.query(
        "SELECT outbox_id FROM outbox.messages WHERE claimed_by = $1 \
         UNION SELECT outbox_id FROM outbox.attempts WHERE worker_id = $1",
        &[&worker],
    )
    .await
    .expect("read the leases a stopped relayer took")
    .iter()
    .map(|r| r.get(0))
    .collect()
}

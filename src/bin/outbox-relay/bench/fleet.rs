//! `bench --fleet 1,2,4,8,16`: does throughput hold as relays are added? Each count drains
//! the same backlog, while a sampler reads `pg_stat_activity` to show where the database
//! sessions spend their time (a fleet that queues on one lock shows it here first).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use tokio_util::sync::CancellationToken;

use super::{Options, Recorder, connect, fill, report, settle, shutdown_relays, start_relays};

pub(super) async fn run(url: &str, o: &Options, sql: &tokio_postgres::Client) -> Result<()> {
    let recorder = Recorder::new(None);
    for &workers in &o.fleet {
        let o = Options {
            workers,
            ..o.clone()
        };
        fill(sql, o.messages).await?;
        sql.batch_execute("VACUUM ANALYZE outbox.messages").await?;
        settle(sql).await;
        let target = recorder.target(o.messages);
        let sampler = Sampler::start(url).await?;
        let shutdown = CancellationToken::new();
        let started = Instant::now();
        let relays = start_relays(url, &o, &recorder, &shutdown)?;
        recorder.reached(target, "draining").await?;
        let took = started.elapsed();
        let waits = sampler.stop().await?;
        shutdown_relays(&shutdown, relays).await;
        report(
            &format!(
                "fleet: {workers} relays x {} batches in flight",
                o.in_flight
            ),
            o.messages,
            o.messages,
            took,
            workers,
        );
        outln!("  {waits}");
    }
    Ok(())
}

/// Samples the bench database's client sessions every 20 ms until stopped.
struct Sampler {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<Waits>>,
}

/// What the samples saw: active sessions, the ones among them waiting for a lock by wait
/// event, and the other waits (I/O, internal locks, the client) by type and event; an
/// active session that waits on nothing is running on a CPU.
#[derive(Default)]
struct Waits {
    samples: u64,
    active: u64,
    on_locks: BTreeMap<String, u64>,
    other: BTreeMap<String, u64>,
}

impl Sampler {
    async fn start(url: &str) -> Result<Self> {
        let c = connect(url).await?;
        let stop = CancellationToken::new();
        let until = stop.clone();
        let task = tokio::spawn(async move {
            let mut waits = Waits::default();
            let stmt = c
                .prepare(
                    "SELECT wait_event_type, coalesce(wait_event, '')
                       FROM pg_stat_activity
                      WHERE datname = current_database()
                        AND backend_type = 'client backend'
                        AND state = 'active'
                        AND pid <> pg_backend_pid()",
                )
                .await?;
            while !until.is_cancelled() {
                waits.samples += 1;
                for row in c.query(&stmt, &[]).await? {
                    waits.active += 1;
                    let event: String = row.get(1);
                    match row.get::<_, Option<&str>>(0) {
                        Some("Lock") => *waits.on_locks.entry(event).or_default() += 1,
                        Some(kind) => {
                            *waits.other.entry(format!("{kind}:{event}")).or_default() += 1
                        }
                        None => {}
                    }
                }
                tokio::select! {
                    () = until.cancelled() => {}
                    () = tokio::time::sleep(Duration::from_millis(20)) => {}
                }
            }
            Ok(waits)
        });
        Ok(Self { stop, task })
    }

    async fn stop(self) -> Result<Waits> {
        self.stop.cancel();
        self.task.await?
    }
}

impl std::fmt::Display for Waits {
    #[allow(clippy::cast_precision_loss)]
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let locked: u64 = self.on_locks.values().sum();
        let share = |n: u64| 100.0 * n as f64 / self.active.max(1) as f64;
        write!(
            f,
            "database: {:.1} sessions active on average, {:.0} % of their time waiting on locks",
            self.active as f64 / self.samples.max(1) as f64,
            share(locked)
        )?;
        for (event, n) in &self.on_locks {
            write!(f, "; {event} {:.0} %", share(*n))?;
        }
        let mut other: Vec<_> = self.other.iter().collect();
        other.sort_by_key(|(_, n)| std::cmp::Reverse(**n));
        let waiting: u64 = self.other.values().sum();
        write!(f, "\n  other waits {:.0} % (top: ", share(waiting))?;
        for (i, (event, n)) in other.iter().take(4).enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{event} {:.0} %", share(**n))?;
        }
        write!(
            f,
            "); on a CPU {:.0} %",
            share(self.active - locked - waiting)
        )
    }
}

//! `bench --memory-messages N`: a relayer's resident memory must not grow with what it
//! delivered; N messages in ten rounds, the RSS after each.

use anyhow::Result;
use tokio_util::sync::CancellationToken;

use super::{Options, Recorder, drain, per_sec, progress, shutdown_relays, start_relays};

/// Delivers `o.memory_messages` in ten rounds (each enqueued, then drained) and prints the
/// resident memory after each: a relayer's memory must not grow with what it delivered.
pub(super) async fn run(url: &str, o: &Options, sql: &tokio_postgres::Client) -> Result<()> {
    let recorder = Recorder::new(None);
    let shutdown = CancellationToken::new();
    let relays = start_relays(url, o, &recorder, &shutdown)?;
    let round = o.memory_messages.div_ceil(10);
    let mut delivered = 0;
    outln!("memory: RSS {:.1} MiB before delivering", rss_mib("VmRSS:"));
    for _ in 0..10 {
        let t = drain(sql, &recorder, round).await?;
        delivered += round;
        // What autovacuum does to a drained queue: the table's statistics now say empty.
        sql.batch_execute("VACUUM outbox.messages").await?;
        progress("");
        outln!(
            "memory: RSS {:.1} MiB after {delivered} delivered ({:.0} msg/s this round)",
            rss_mib("VmRSS:"),
            per_sec(round, t)
        );
    }
    shutdown_relays(&shutdown, relays).await;
    outln!("memory: peak RSS {:.1} MiB", peak_rss_mib());
    Ok(())
}

/// VmHWM of this process, in MiB.
pub(super) fn peak_rss_mib() -> f64 {
    rss_mib("VmHWM:")
}

/// A memory figure of this process from /proc/self/status (`VmRSS:`, `VmHWM:`), in MiB.
fn rss_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

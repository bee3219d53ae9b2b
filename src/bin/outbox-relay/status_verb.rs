//! The `status` verb: the fleet's figures per topic and what is wrong (from
//! `outbox.observe`), and each destination's circuit as the relayers last reported it
//! (`outbox.circuits`), once or, with `--watch`, redrawn every second with rates, like `top`
//! (plain blocks of lines when stdout is not a terminal). Rates below one a second are
//! shown per minute, so that a few dead letters do not read as none; every dead letter is
//! counted, those out of attempts too (their last attempt is recorded as RETRYABLE), in
//! the same words in the text and in `--json` (`last_minute`); a topic's delayed
//! messages show when the first of them is due; the key order rules (`key-order set`),
//! when any is set, a line each and one for the default. With `--all-sources`, a line per
//! source of a many-source configuration: its backlog, who serves it and its health.

use std::fmt::Write as _;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use chrono::{DateTime, Utc};
use futures_util::stream::{self, StreamExt};
use outbox_relay::observe::{self, Observation, TopicFigures};
use outbox_relay::sources::SourcesSettings;
use outbox_relay::store::{KeyOrderScope, ReportedCircuit, StalledTopic, Status, Store};

use crate::all_sources;
use crate::key_order_verb::route_pattern;

#[derive(clap::Args)]
pub struct Args {
    /// Only this topic (topics beyond the --top-topics largest are summed as `other`).
    #[arg(long)]
    topic: Option<String>,
    /// One JSON object.
    #[arg(long, conflicts_with = "watch")]
    pub json: bool,
    /// Redraw every second with rates until interrupted.
    #[arg(long)]
    watch: bool,
    /// Topics shown by name, 1..=1000.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(i32).range(1..=1000))]
    top_topics: i32,
    /// A transaction holding back the MVCC horizon this long is a problem, 1..=86400.
    #[arg(long, env = "OUTBOX_HORIZON_WARN_SECS", default_value_t = 300,
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    horizon_warn_secs: u64,
    /// A topic whose messages have been ready this long, claimed by no running relayer, is
    /// named, 0..=86400.
    #[arg(long, env = "OUTBOX_OBSERVE_UNCOVERED_SECS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(0..=86_400))]
    uncovered_secs: u64,
    /// Every source of a many-source configuration, a line each: backlog, oldest ready
    /// age, dead letters, who serves it, its health.
    #[arg(long, conflicts_with_all = ["watch", "topic"])]
    pub all_sources: bool,
}

/// One destination's circuit in one state, as the relayers in `workers` reported it: the
/// reports of a destination grouped by state, the stale ones apart.
#[derive(serde::Serialize)]
struct Circuit<'a> {
    destination: &'a str,
    state: &'a str,
    /// Not renewed before they expired: the relayers stopped, or cannot reach the database.
    stale: bool,
    /// The earliest of the reports' `since`.
    since: DateTime<Utc>,
    workers: Vec<CircuitWorker<'a>>,
}

#[derive(serde::Serialize)]
struct CircuitWorker<'a> {
    worker_id: &'a str,
    since: DateTime<Utc>,
    reported_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
}

/// `reports` (ordered by destination, stale, state, worker) grouped.
fn circuits(reports: &[ReportedCircuit]) -> Vec<Circuit<'_>> {
    let mut out: Vec<Circuit<'_>> = Vec::new();
    for r in reports {
        let worker = CircuitWorker {
            worker_id: &r.worker_id,
            since: r.report.since,
            reported_at: r.reported_at,
            expires_at: r.expires_at,
        };
        match out.last_mut() {
            Some(c)
                if c.destination == r.report.destination
                    && c.state == r.report.state
                    && c.stale == r.stale =>
            {
                c.since = c.since.min(r.report.since);
                c.workers.push(worker);
            }
            _ => out.push(Circuit {
                destination: &r.report.destination,
                state: &r.report.state,
                stale: r.stale,
                since: r.report.since,
                workers: vec![worker],
            }),
        }
    }
    out
}

/// The scope of a key's order on a topic no rule matches (`outbox.key_order_scope`).
const DEFAULT_KEY_ORDER_SCOPE: &str = "global";

/// The key order rules as `status --json` shows them (`key_order`): the default, and the
/// rules most specific first.
#[derive(serde::Serialize)]
struct KeyOrder<'a> {
    default: &'static str,
    rules: Vec<KeyOrderRule<'a>>,
}

#[derive(serde::Serialize)]
struct KeyOrderRule<'a> {
    /// As a route names it (`orders.*`), as `key-order list` shows it.
    pattern: String,
    /// The SQL `LIKE` pattern the rule holds.
    topic_pattern: &'a str,
    /// `topic` (per topic) or `global` (the whole outbox).
    scope: &'a str,
    set_at: DateTime<Utc>,
    set_by: &'a str,
}

fn key_order(rules: &[KeyOrderScope]) -> KeyOrder<'_> {
    KeyOrder {
        default: DEFAULT_KEY_ORDER_SCOPE,
        rules: rules
            .iter()
            .map(|r| KeyOrderRule {
                pattern: route_pattern(&r.topic_pattern),
                topic_pattern: &r.topic_pattern,
                scope: &r.scope,
                set_at: r.set_at,
                set_by: &r.set_by,
            })
            .collect(),
    }
}

/// Sums of the topics shown.
#[derive(Default, serde::Serialize)]
struct Totals {
    ready: i64,
    delayed: i64,
    in_flight: i64,
    expired_leases: i64,
    dead_letters: i64,
    oldest_ready_age_secs: Option<f64>,
    next_due_at: Option<DateTime<Utc>>,
}

fn totals<'a>(topics: impl Iterator<Item = &'a TopicFigures>) -> Totals {
    let mut t = Totals::default();
    for f in topics {
        t.ready += f.ready;
        t.delayed += f.delayed;
        t.in_flight += f.in_flight;
        t.expired_leases += f.expired_leases;
        t.dead_letters += f.dead_letters;
        if let Some(age) = f.oldest_ready_age_seconds {
            t.oldest_ready_age_secs = Some(t.oldest_ready_age_secs.map_or(age, |a| a.max(age)));
        }
        if let Some(due) = f.next_due_at {
            t.next_due_at = Some(t.next_due_at.map_or(due, |d| d.min(due)));
        }
    }
    t
}

/// What the fleet did in the minute before the observation, in the words the text uses
/// (`attempts_last_minute` in the JSON has the attempts by state as recorded).
#[derive(serde::Serialize)]
struct LastMinute {
    delivered: i64,
    /// Failed attempts after which the message is tried again.
    retried: i64,
    /// Every message dead-lettered: refused for good, out of attempts (its last attempt is
    /// recorded as RETRYABLE) or by a lease repair.
    dead_lettered: i64,
    zombie_requeues: i64,
}

/// The minute before `o` was observed: its attempts by state, and the dead letters made in
/// it (counted apart: the attempt that exhausts a budget is recorded as RETRYABLE).
async fn last_minute(store: &Store, o: &Observation) -> Result<LastMinute> {
    let attempts = |state: &str| {
        o.snapshot
            .attempts_last_minute
            .get(state)
            .copied()
            .unwrap_or(0)
    };
    let dead = store
        .dead_lettered_between(o.observed_at - chrono::Duration::minutes(1), o.observed_at)
        .await
        .context("status: the dead letters of the last minute")?;
    // At least the permanent refusals, whichever way the dead letters were counted.
    let dead_lettered = dead.max(attempts("FAILED"));
    // The other dead letters ran out of attempts, their last one recorded as RETRYABLE
    // though nothing retries it (or, rarely, a lease repair made them).
    let out_of_attempts = dead_lettered - attempts("FAILED");
    Ok(LastMinute {
        delivered: attempts("DISPATCHED"),
        retried: (attempts("RETRYABLE") - out_of_attempts).max(0),
        dead_lettered,
        zombie_requeues: attempts("ZOMBIE_REQUEUE"),
    })
}

pub async fn run(store: &Store, args: &Args) -> Result<()> {
    let horizon_threshold = Duration::from_secs(args.horizon_warn_secs);
    let observe = async |max_age: Duration| -> Result<Observation> {
        let mut waited = Duration::ZERO;
        loop {
            // None only before the very first observation, while another process computes it.
            if let Some(o) = observe::fetch(store, args.top_topics, max_age)
                .await
                .context("status")?
            {
                return Ok(o);
            }
            anyhow::ensure!(
                waited < Duration::from_secs(30),
                "no observation after 30 s"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
            waited += Duration::from_millis(200);
        }
    };
    if !args.watch {
        // Whether LISTEN through this URL hears (not through a transaction pooler), asked
        // while the observation is read.
        let (o, heard, reports, stalled, rules) = tokio::join!(
            observe(Duration::ZERO),
            store.wake_ups_heard(Duration::from_secs(1)),
            store.circuits(),
            store.stalled_topics(Duration::from_secs(args.uncovered_secs)),
            store.key_order_scopes()
        );
        let o = o?;
        let reports = reports.context("status: the circuits")?;
        let stalled = stalled.map_err(|e| format!("{:#}", anyhow::Error::from(e)));
        let rules = rules.map_err(|e| format!("{:#}", anyhow::Error::from(e)));
        let rates = last_minute(store, &o).await?;
        let wake_ups = match heard {
            Ok(true) => "heard",
            Ok(false) => "deaf",
            Err(_) => "unknown",
        };
        let shown: Vec<&TopicFigures> = o
            .snapshot
            .topics
            .iter()
            .filter(|t| wanted(args, t))
            .collect();
        if args.json {
            let problems = observe::diagnose(&o.snapshot, horizon_threshold);
            let mut value = serde_json::to_value(totals(shown.iter().copied()))?;
            value["observed_at"] = serde_json::to_value(o.observed_at)?;
            value["topics"] = serde_json::to_value(&shown)?;
            value["last_minute"] = serde_json::to_value(&rates)?;
            value["attempts_last_minute"] = serde_json::to_value(&o.snapshot.attempts_last_minute)?;
            value["horizon_holders"] = serde_json::to_value(&o.snapshot.horizon_holders)?;
            value["messages_table"] = serde_json::to_value(&o.snapshot.messages_table)?;
            value["problems"] = serde_json::to_value(problems)?;
            value["circuits"] = serde_json::to_value(circuits(&reports))?;
            match &stalled {
                Ok(found) => {
                    let (uncovered, held): (Vec<&StalledTopic>, Vec<&StalledTopic>) =
                        found.iter().partition(|s| s.is_uncovered());
                    value["uncovered_topics"] = serde_json::to_value(uncovered)?;
                    value["circuit_held_topics"] = serde_json::to_value(held)?;
                }
                Err(e) => {
                    // Unknown, not none: both lists null beside the reason.
                    value["uncovered_topics"] = serde_json::Value::Null;
                    value["circuit_held_topics"] = serde_json::Value::Null;
                    value["stalled_topics_error"] = e.clone().into();
                }
            }
            match &rules {
                Ok(rules) => value["key_order"] = serde_json::to_value(key_order(rules))?,
                Err(e) => {
                    // Unknown, not the default alone.
                    value["key_order"] = serde_json::Value::Null;
                    value["key_order_error"] = e.clone().into();
                }
            }
            value["wake_ups"] = wake_ups.into();
            outln!("{}", serde_json::to_string(&value)?);
        } else {
            out!(
                "{}",
                render(
                    args,
                    &o,
                    &rates,
                    &reports,
                    &stalled,
                    &rules,
                    None,
                    horizon_threshold
                )
            );
            if wake_ups == "deaf" {
                outln!(
                    "wake-ups: deaf: LISTEN through this database URL did not hear a test \
                     notification (a transaction pooler?); relayers on it poll at most every 200 ms: give \
                     them listen_url (OUTBOX_LISTEN_URL), a direct connection (docs/poolers.md)"
                );
            }
        }
        return Ok(());
    }

    let terminal = std::io::stdout().is_terminal();
    let mut previous: Option<(Instant, Totals)> = None;
    loop {
        let o = observe(Duration::from_secs(1)).await?;
        let reports = store.circuits().await.context("status: the circuits")?;
        let stalled = store
            .stalled_topics(Duration::from_secs(args.uncovered_secs))
            .await
            .map_err(|e| format!("{:#}", anyhow::Error::from(e)));
        let rules = store
            .key_order_scopes()
            .await
            .map_err(|e| format!("{:#}", anyhow::Error::from(e)));
        let rates = last_minute(store, &o).await?;
        let now = Instant::now();
        let shown = totals(o.snapshot.topics.iter().filter(|t| wanted(args, t)));
        let change = previous.as_ref().and_then(|(at, before)| {
            let secs = now.duration_since(*at).as_secs_f64();
            #[allow(clippy::cast_precision_loss)] // counts far below 2^52
            (secs > 0.0).then(|| (pending(&shown) - pending(before)) as f64 / secs)
        });
        let screen = render(
            args,
            &o,
            &rates,
            &reports,
            &stalled,
            &rules,
            change,
            horizon_threshold,
        );
        if terminal {
            // Home the cursor and clear the screen, then draw: `top`'s way.
            out!("\x1b[H\x1b[2J{screen}");
        } else {
            outln!("{screen}");
        }
        previous = Some((now, shown));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn wanted(args: &Args, t: &TopicFigures) -> bool {
    args.topic.as_deref().is_none_or(|want| want == t.topic)
}

fn pending(t: &Totals) -> i64 {
    t.ready + t.delayed + t.in_flight + t.expired_leases
}

/// The figures as a table, then the fleet's rates, the circuits, the stalled topics, the
/// key order rules and the diagnosis.
#[allow(clippy::too_many_arguments)] // one per block of the screen
fn render(
    args: &Args,
    o: &Observation,
    rates: &LastMinute,
    reports: &[ReportedCircuit],
    stalled: &Result<Vec<StalledTopic>, String>,
    rules: &Result<Vec<KeyOrderScope>, String>,
    backlog_change_per_sec: Option<f64>,
    horizon_threshold: Duration,
) -> String {
    let s = &o.snapshot;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "outbox-relay status  observed {}",
        o.observed_at.format("%Y-%m-%d %H:%M:%S UTC")
    );
    let _ = writeln!(
        out,
        "{:<24} {:>10} {:>10} {:>10} {:>10} {:>10} {:>14} {:>10}",
        "TOPIC", "READY", "DELAYED", "IN FLIGHT", "EXPIRED", "DEAD", "OLDEST READY", "NEXT DUE"
    );
    let shown: Vec<&TopicFigures> = s.topics.iter().filter(|t| wanted(args, t)).collect();
    let age = |a: Option<f64>| a.map_or_else(|| "-".to_owned(), |a| format!("{a:.1}s"));
    let due =
        |d: Option<DateTime<Utc>>| d.map_or_else(|| "-".to_owned(), |d| due_in(d, o.observed_at));
    for t in &shown {
        let _ = writeln!(
            out,
            "{:<24} {:>10} {:>10} {:>10} {:>10} {:>10} {:>14} {:>10}",
            t.topic,
            t.ready,
            t.delayed,
            t.in_flight,
            t.expired_leases,
            t.dead_letters,
            age(t.oldest_ready_age_seconds),
            due(t.next_due_at)
        );
    }
    if shown.is_empty() {
        let _ = writeln!(out, "(no messages)");
    }
    if shown.len() > 1 {
        let t = totals(shown.iter().copied());
        let _ = writeln!(
            out,
            "{:<24} {:>10} {:>10} {:>10} {:>10} {:>10} {:>14} {:>10}",
            "total",
            t.ready,
            t.delayed,
            t.in_flight,
            t.expired_leases,
            t.dead_letters,
            age(t.oldest_ready_age_secs),
            due(t.next_due_at)
        );
    }
    let _ = write!(
        out,
        "fleet, last minute: {} delivered, {} retried, {} dead-lettered, {} zombie requeues",
        rate(rates.delivered),
        rate(rates.retried),
        rate(rates.dead_lettered),
        rate(rates.zombie_requeues)
    );
    match backlog_change_per_sec {
        Some(change) => {
            let _ = writeln!(out, "; backlog {}", signed_rate(change));
        }
        None => out.push('\n'),
    }
    if let Some(table) = &s.messages_table {
        let vacuumed = table.last_autovacuum.map_or_else(
            || "never".to_owned(),
            |at| at.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
        );
        let _ = writeln!(
            out,
            "outbox.messages: {} live, {} dead tuples; last autovacuum {vacuumed}",
            table.live_tuples, table.dead_tuples
        );
    }
    render_circuits(&mut out, reports);
    render_stalled(&mut out, stalled);
    render_key_order(&mut out, rules);
    let problems = observe::diagnose(s, horizon_threshold);
    if problems.is_empty() {
        let oldest = s
            .horizon_holders
            .iter()
            .filter_map(|h| h.age_seconds)
            .fold(0.0, f64::max);
        let _ = writeln!(
            out,
            "health: ok (oldest snapshot held {oldest:.0}s; the watchdog warns at {}s)",
            horizon_threshold.as_secs()
        );
    } else {
        let _ = writeln!(out, "health: {} problem(s)", problems.len());
        for p in problems {
            let _ = writeln!(out, "  ! {}\n    what to do: {}", p.what, p.advice);
        }
    }
    out
}

/// The topics that stall, a line each: those no running relayer claims, and those every
/// relayer claiming them leaves out behind an open circuit, with the keys they hold on
/// other topics; nothing when every topic with ready messages is claimed. A failure to
/// read them is a line of its own, and the rest of the status stands.
fn render_stalled(out: &mut String, stalled: &Result<Vec<StalledTopic>, String>) {
    let found = match stalled {
        Ok(found) => found,
        Err(e) => {
            let _ = writeln!(out, "stalled topics: unknown ({e})");
            return;
        }
    };
    for s in found {
        if s.is_uncovered() {
            let _ = write!(
                out,
                "uncovered: topic {:?}: {} ready, the oldest for {:.0}s, claimed by no running relayer",
                s.topic, s.ready, s.oldest_ready_age_secs
            );
        } else {
            let _ = write!(
                out,
                "held by an open circuit: topic {:?}: {} ready, the oldest for {:.0}s, left out by every \
                 relayer claiming it while the circuit of {} is open",
                s.topic,
                s.ready,
                s.oldest_ready_age_secs,
                s.destinations.join(", ")
            );
        }
        if s.held_keys > 0 {
            let _ = write!(
                out,
                "; it holds {} key(s) whose messages on {} wait behind it",
                s.held_keys,
                s.held_topics.join(", ")
            );
        }
        let advice = if s.is_uncovered() {
            " (start a relayer whose routes cover it, or widen a relayer's routes)"
        } else {
            " (bring the destination back, or route the topic to another)"
        };
        let _ = writeln!(out, "{advice}");
    }
}

/// The key order rules, a line each, most specific first (as `key-order list` shows them),
/// then the default's unless a `*` rule leaves it no topic; nothing while no rule is set
/// and every key is ordered across the whole outbox. A failure to read them is a line of its own.
fn render_key_order(out: &mut String, rules: &Result<Vec<KeyOrderScope>, String>) {
    let rules = match rules {
        Ok(rules) if rules.is_empty() => return,
        Ok(rules) => rules,
        Err(e) => {
            let _ = writeln!(out, "key order: unknown ({e})");
            return;
        }
    };
    let what = |scope: &str| match scope {
        "topic" => "per topic",
        "global" => "across the whole outbox",
        _ => "?",
    };
    for r in rules {
        let _ = writeln!(
            out,
            "key order: {} {} (keys ordered {}; set {} by {})",
            route_pattern(&r.topic_pattern),
            r.scope,
            what(&r.scope),
            r.set_at.format("%Y-%m-%d %H:%M:%S UTC"),
            r.set_by
        );
    }
    // A `*` rule matches every topic: the default then orders none.
    if rules.iter().all(|r| r.topic_pattern != "%") {
        let _ = writeln!(
            out,
            "key order: default {DEFAULT_KEY_ORDER_SCOPE} (keys ordered {} on the topics no rule matches)",
            what(DEFAULT_KEY_ORDER_SCOPE)
        );
    }
}

/// The circuits as the relayers last reported them, a line per destination and state.
fn render_circuits(out: &mut String, reports: &[ReportedCircuit]) {
    let grouped = circuits(reports);
    if grouped.is_empty() {
        let _ = writeln!(out, "circuits: no relayer has reported any");
        return;
    }
    let time = |t: DateTime<Utc>| t.format("%Y-%m-%d %H:%M:%S UTC").to_string();
    let _ = writeln!(
        out,
        "{:<24} {:<18} {:<24} REPORTED BY",
        "DESTINATION", "CIRCUIT", "SINCE"
    );
    for c in grouped {
        let workers: Vec<&str> = c.workers.iter().map(|w| w.worker_id).collect();
        let state = if c.stale {
            format!("{} (stale)", c.state)
        } else {
            c.state.to_owned()
        };
        let _ = write!(
            out,
            "{:<24} {:<18} {:<24} {}",
            c.destination,
            state,
            time(c.since),
            workers.join(", ")
        );
        if c.stale {
            let expired = c.workers.iter().map(|w| w.expires_at).max();
            if let Some(at) = expired {
                let _ = write!(out, " (not renewed; expired {})", time(at));
            }
        }
        out.push('\n');
    }
}

/// How long after `now` a delayed message is due: `in 42s`, `in 12m05s`, `in 3h20m`, `in 2d04h`.
fn due_in(due: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let secs = (due - now).num_seconds();
    if secs <= 0 {
        return "now".to_owned();
    }
    let (m, h, d) = (secs / 60, secs / 3600, secs / 86_400);
    match secs {
        ..60 => format!("in {secs}s"),
        60..3600 => format!("in {m}m{:02}s", secs % 60),
        3600..86_400 => format!("in {h}h{:02}m", m % 60),
        _ => format!("in {d}d{:02}h", h % 24),
    }
}

/// `n` events in the last minute as a rate: per second from one a second up, per minute
/// below, where a per-second figure would round a handful of dead letters to `0.0/s`.
fn rate(n: i64) -> String {
    if n >= 60 {
        #[allow(clippy::cast_precision_loss)] // counts far below 2^52
        let per_sec = n as f64 / 60.0;
        format!("{per_sec:.1}/s")
    } else {
        format!("{n}/min")
    }
}

/// A change per second, signed, in the unit [`rate`] would choose.
fn signed_rate(per_sec: f64) -> String {
    if per_sec.abs() >= 1.0 {
        format!("{per_sec:+.1}/s")
    } else {
        format!("{:+.0}/min", per_sec * 60.0)
    }
}

/// One source's line of `status --all-sources`.
#[derive(serde::Serialize)]
struct Line {
    source: String,
    /// `ok`, or why the source cannot be served.
    health: String,
    schema_version: Option<i32>,
    #[serde(flatten)]
    figures: Option<Status>,
    /// The processes serving it now (`outbox.source_holders`).
    served_by: Vec<String>,
    /// `serving`; `queued` (ready messages and nobody serving it: it waits for its turn) or
    /// `waiting` (so for longer than the turns' bound, `sources::wait_bound`); `idle`.
    state: Option<&'static str>,
    /// Its server (host and port): the bound counts the sources of one server.
    #[serde(skip)]
    server: String,
}

async fn line(name: String, url: String) -> Line {
    let figures = async {
        let store = Store::connect(&url, 2)?;
        let version = store.check_schema().await?;
        let status = store.status().await?;
        let holders = store.source_holders().await?;
        Ok::<_, outbox_relay::store::StoreError>((
            version,
            status,
            holders,
            store.target().address(),
        ))
    }
    .await;
    match figures {
        Ok((version, status, holders, server)) => Line {
            source: name,
            health: "ok".to_owned(),
            schema_version: Some(version),
            figures: Some(status),
            served_by: holders,
            state: None,
            server,
        },
        Err(e) => Line {
            source: name,
            health: e.to_string(),
            schema_version: None,
            figures: None,
            served_by: Vec::new(),
            state: None,
            server: String::new(),
        },
    }
}

/// Each readable source's state, as the fleet would report it: a source with ready
/// messages and nobody serving it is queued, and waiting once its oldest ready message is
/// older than the turns' bound for its server's sources and the processes serving now.
fn states(settings: &SourcesSettings, lines: &mut [Line]) {
    let processes = lines
        .iter()
        .flat_map(|l| &l.served_by)
        .collect::<std::collections::HashSet<_>>()
        .len();
    let mut on_server = std::collections::HashMap::<String, usize>::new();
    for l in lines.iter().filter(|l| l.figures.is_some()) {
        *on_server.entry(l.server.clone()).or_default() += 1;
    }
    for l in lines.iter_mut() {
        let Some(f) = &l.figures else { continue };
        let bound = outbox_relay::sources::wait_bound(settings, on_server[&l.server], processes);
        l.state = Some(if !l.served_by.is_empty() {
            "serving"
        } else if f.ready == 0 {
            "idle"
        } else if f.oldest_ready_age_secs.unwrap_or(0.0) > bound.as_secs_f64() {
            "waiting"
        } else {
            "queued"
        });
    }
}

/// `--all-sources`: every source's backlog, oldest ready age, dead letters, who serves it
/// and its health.
pub async fn run_all(settings: &SourcesSettings, json: bool) -> Result<()> {
    let sources = all_sources::all(settings).await?;
    let mut lines: Vec<Line> = stream::iter(sources)
        .map(|(name, url)| line(name, url))
        .buffered(8)
        .collect()
        .await;
    states(settings, &mut lines);
    if json {
        outln!("{}", serde_json::to_string_pretty(&lines)?);
        return Ok(());
    }
    let width = lines
        .iter()
        .map(|l| l.source.len())
        .max()
        .unwrap_or(6)
        .max(6);
    row(
        width,
        [
            "SOURCE",
            "READY",
            "DELAYED",
            "IN FLIGHT",
            "DEAD",
            "OLDEST",
            "SERVED BY",
        ]
        .map(str::to_owned),
        "HEALTH",
    );
    for l in &lines {
        let cells = match &l.figures {
            Some(f) => [
                l.source.clone(),
                f.ready.to_string(),
                f.delayed.to_string(),
                f.in_flight.to_string(),
                f.dead_letters.to_string(),
                f.oldest_ready_age_secs
                    .map_or("-".to_owned(), |s| format!("{s:.1}s")),
                if l.served_by.is_empty() {
                    match l.state {
                        Some(state @ ("queued" | "waiting")) => format!("nobody: {state}"),
                        _ => "nobody".to_owned(),
                    }
                } else {
                    l.served_by.join(",")
                },
            ],
            None => [l.source.as_str(), "-", "-", "-", "-", "-", "-"].map(str::to_owned),
        };
        row(width, cells, &l.health);
    }
    let down = lines.iter().filter(|l| l.figures.is_none()).count();
    if down > 0 {
        outln!("{down} of {} sources cannot be read", lines.len());
    }
    Ok(())
}

/// One line of the `status --all-sources` table.
fn row(
    width: usize,
    [source, ready, delayed, in_flight, dead, oldest, served_by]: [String; 7],
    health: &str,
) {
    outln!(
        "{source:<width$}  {ready:>8} {delayed:>8} {in_flight:>9} {dead:>7} {oldest:>10}  {served_by:<20} {health}"
    );
}

#[cfg(test)]
mod tests {
    use super::{KeyOrderScope, Line, Status, due_in, rate, render_key_order, signed_rate, states};

    #[test]
    fn key_order_rules_are_a_line_each_then_the_default_unless_a_star_rule_and_nothing_without_one()
    {
        let mut out = String::new();
        render_key_order(&mut out, &Ok(Vec::new()));
        assert_eq!(out, "", "no rule: no line");
        let set_at = chrono::DateTime::parse_from_rfc3339("2026-11-29T04:40:00Z")
            .unwrap()
            .to_utc();
        let rule = |pattern: &str, scope: &str| KeyOrderScope {
            topic_pattern: pattern.to_owned(),
            scope: scope.to_owned(),
            set_at,
            set_by: "ops".to_owned(),
        };
        render_key_order(
            &mut out,
            &Ok(vec![
                rule("orders.audit", "global"),
                rule("orders.%", "topic"),
            ]),
        );
        assert_eq!(
            out,
            "key order: orders.audit global (keys ordered across the whole outbox; set 2026-11-29 04:40:00 UTC by ops)\n\
             key order: orders.* topic (keys ordered per topic; set 2026-11-29 04:40:00 UTC by ops)\n\
             key order: default global (keys ordered across the whole outbox on the topics no rule matches)\n"
        );
        // A `*` rule leaves the default no topic: no default line.
        let mut out = String::new();
        render_key_order(
            &mut out,
            &Ok(vec![rule("orders.%", "global"), rule("%", "topic")]),
        );
        assert_eq!(
            out,
            "key order: orders.* global (keys ordered across the whole outbox; set 2026-11-29 04:40:00 UTC by ops)\n\
             key order: * topic (keys ordered per topic; set 2026-11-29 04:40:00 UTC by ops)\n"
        );
        let mut out = String::new();
        render_key_order(&mut out, &Err("permission denied".to_owned()));
        assert_eq!(out, "key order: unknown (permission denied)\n");
    }

    #[test]
    fn a_source_with_ready_messages_and_nobody_serving_it_is_queued_then_waiting() {
        let line = |name: &str, ready: i64, oldest: Option<f64>, served_by: &[&str]| Line {
            source: name.to_owned(),
            health: "ok".to_owned(),
            schema_version: Some(1),
            figures: Some(Status {
                ready,
                delayed: 0,
                in_flight: 0,
                expired_leases: 0,
                dead_letters: 0,
                oldest_ready_age_secs: oldest,
            }),
            served_by: served_by.iter().map(|s| (*s).to_owned()).collect(),
            state: None,
            server: "db:5432".to_owned(),
        };
        // I = 10 s, L = 15 s, no budget: the bound is 3I + L/3 = 35 s.
        let settings = outbox_relay::sources::SourcesSettings {
            discover_interval: std::time::Duration::from_secs(10),
            lease: std::time::Duration::from_secs(15),
            ..Default::default()
        };
        let mut lines = [
            line("served", 5, Some(1.0), &["w1"]),
            line("idle", 0, None, &[]),
            line("queued", 3, Some(20.0), &[]),
            line("waiting", 3, Some(36.0), &[]),
        ];
        states(&settings, &mut lines);
        let got: Vec<_> = lines.iter().map(|l| l.state).collect();
        assert_eq!(
            got,
            [
                Some("serving"),
                Some("idle"),
                Some("queued"),
                Some("waiting")
            ]
        );
    }

    #[test]
    fn a_due_time_is_shown_as_how_long_from_the_observation() {
        let now = chrono::Utc::now();
        let after = |secs| due_in(now + chrono::Duration::seconds(secs), now);
        assert_eq!(after(-3), "now");
        assert_eq!(after(42), "in 42s");
        assert_eq!(after(725), "in 12m05s");
        assert_eq!(after(3 * 3600 + 20 * 60 + 59), "in 3h20m");
        assert_eq!(after(2 * 86_400 + 4 * 3600), "in 2d04h");
    }

    #[test]
    fn small_rates_are_counts_per_minute_and_large_ones_per_second() {
        assert_eq!(rate(0), "0/min");
        assert_eq!(rate(5), "5/min");
        assert_eq!(rate(59), "59/min");
        assert_eq!(rate(60), "1.0/s");
        assert_eq!(rate(6000), "100.0/s");
        assert_eq!(signed_rate(-0.5), "-30/min");
        assert_eq!(signed_rate(0.0), "+0/min");
        assert_eq!(signed_rate(12.34), "+12.3/s");
    }
}

//! One source's task. Not serving: every discovery interval it polls the source on one
//! session: checks the schema, says this process is alive and asks for a slot when the
//! process is under its share (`outbox.serve_source`). The session is kept open for the
//! next poll while the server's connection budget has room beside the sources this process
//! may serve there ([`Share::try_keep`](super::share::Share::try_keep); `application_name`
//! `outbox-relay standby`), and closed after the poll otherwise (`outbox-relay poll`): a new
//! session every interval costs the server a backend, its authentication and its first
//! catalogue reads, which many sources polled by several processes add up to.
//!
//! Serving: a relay of its own runs on a pool of its own, claiming only while the slot's
//! lease holds by this process's monotonic clock (four fifths of the lease from the call
//! that renewed it); the slot is renewed at a third of the lease, and the pool's
//! connections idle for as long are closed (a served source with nothing to do holds two
//! sessions: its LISTEN session and the one its polls use). While it serves the source, the
//! task also observes it (`outbox.observe`, every observe interval) for the backlog gauges
//! this process exports as the source's first holder, and stops exporting them as soon as
//! it stops serving. The source is given up when the slot is lost (the relay stops claiming
//! at once), given back when this process serves more than its share (after the relay
//! drained), and left when the source is no longer discovered or the process stops (after
//! the relay drained: its deliveries finish, or their leases are released).
//!
//! Turns, when the connection budget cannot hold every source of a server at once: a poll
//! that finds the source with ready messages and nobody serving it queues it
//! ([`Share::queued`](super::share::Share::queued)). A served source checks every
//! [`TURN_CHECK`] whether its turn is over ([`Held::turn_over`]: idle, or served for a
//! slot lease, while another source of its server is queued and this process has no room);
//! it then drains its relay, gives its slot back and closes its sessions, and only then
//! frees its room, which wakes the source queued longest here to poll and take it at once
//! rather than at its next interval.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::Fleet;
use super::board::SourceState;
use super::share::{Held, Kept, Refusal, Short};
use crate::observe;
use crate::relay::{Gate, Relay};
use crate::store::{SourceTurn, Store, StoreError};

/// Why serving a source ended.
enum End {
    /// The task was stopped (shutdown, or the source is no longer discovered).
    Stop,
    /// This process serves more than its share.
    GiveBack,
    /// Another source of its server is queued and this one's turn is over.
    TurnOver,
    /// The slot's lease may have lapsed, or the source says another holds it.
    Lost(String),
}

/// How often a served source checks whether its turn is over (an idle source goes as soon
/// as another of its server is queued and this process has no room for it).
const TURN_CHECK: Duration = Duration::from_millis(250);

/// How long a poll's leave takes at most when the task stops.
const LEAVE_WITHIN: Duration = Duration::from_secs(2);

/// How long a source taken here waits for the server's kept poll sessions to close before
/// it opens its pool (they close as soon as they are told to), beside the short polls that
/// borrowed its room ([`short_within`]).
const KEPT_CLOSE_WITHIN: Duration = Duration::from_secs(1);

/// The session a poll runs on: kept from the last poll, or opened for this one.
struct PollSession<'a> {
    store: Store,
    /// Counted in the server's kept sessions: kept open after the poll.
    kept: Option<Kept<'a>>,
    /// Not kept: its turn on the server's short sessions, held until it is closed.
    _short: Option<Short<'a>>,
}

impl<'a> PollSession<'a> {
    /// The session kept from the last poll, or a new one: kept after this poll when there
    /// is room for it now. `taking`: the source's room is already counted
    /// ([`Share::try_take`](super::share::Share::try_take)) and covers this session.
    async fn open(
        fleet: &'a Fleet,
        url: &str,
        server: &str,
        kept: Option<PollSession<'a>>,
        taking: bool,
    ) -> Result<Self, StoreError> {
        if let Some(session) = kept {
            return Ok(session);
        }
        if taking {
            return Ok(Self {
                store: Store::connect_as(url, 1, "outbox-relay poll")?,
                kept: None,
                _short: None,
            });
        }
        let kept = fleet.share.try_keep(server);
        let (name, short) = if kept.is_some() {
            ("outbox-relay standby", None)
        } else {
            ("outbox-relay poll", fleet.share.short_session(server).await)
        };
        Ok(Self {
            store: Store::connect_as(url, 1, name)?,
            kept,
            _short: short,
        })
    }

    /// This session, when it is to stay open for the next poll (it was counted, and its
    /// room is still there); a short session is closed, giving its turn back.
    fn keep(mut self) -> Option<Self> {
        (self.kept.is_some() && !self.excess()).then_some(self)
    }

    /// Whether it must be closed now: the server's kept sessions exceed their room.
    fn excess(&mut self) -> bool {
        self.kept.as_mut().is_some_and(Kept::excess)
    }
}

pub async fn run(fleet: Arc<Fleet>, name: String, url: String, stop: CancellationToken) {
    let server = server_of(&url);
    let mut backoff = Duration::from_millis(500);
    let mut kept: Option<PollSession> = None;
    // Woken as the next queued source to take, with room for it here.
    let mut next = false;
    loop {
        let reused = kept.is_some();
        let taking = if next && kept.is_none() && !joining(&fleet) {
            fleet.share.try_take(&server, &name)
        } else {
            None
        };
        next = false;
        let mut polled = poll_on(&fleet, &name, &url, &server, kept.take(), taking).await;
        if reused && polled.is_err() {
            // A kept session may have been closed meanwhile (a server restart, an idle
            // timeout): once more, on a new one.
            polled = poll_on(&fleet, &name, &url, &server, None, None).await;
        }
        fleet.share.polled(&name);
        match polled {
            // The session is closed: it may be what failed.
            Err(e) => {
                fleet.share.forget(&name);
                fleet.board.set(&name, SourceState::Down(e));
                let wait = backoff.min(fleet.settings.discover_interval);
                backoff = (backoff * 2).min(fleet.settings.discover_interval);
                tokio::select! {
                    () = stop.cancelled() => return leave(&fleet, &url, None).await,
                    () = tokio::time::sleep(jitter(wait)) => {}
                }
                continue;
            }
            Ok((
                Polled {
                    asked,
                    refusal,
                    turn,
                    held,
                    queued,
                },
                session,
            )) => {
                backoff = Duration::from_millis(500);
                fleet.share.members(&name, turn.members);
                fleet.board.holders(&name, turn.holders.clone());
                match (turn.held, held) {
                    (Some((slot, token)), Some(held)) => {
                        // Served, it polls on its own pool.
                        drop(session);
                        let until = asked + fleet.settings.lease * 4 / 5;
                        serve(&fleet, &name, &url, held, slot, token, until, &stop).await;
                        if stop.is_cancelled() {
                            return;
                        }
                    }
                    // Not served here (a slot is returned only when asked for): queued (or
                    // waiting, past the bound) when it has ready messages and nobody serves
                    // it, over the budget when that is why none was asked for, standby
                    // otherwise.
                    (slot, _) => {
                        let state = match queued {
                            Some(since) if waited(&fleet, since) > fleet.share.wait_bound() => {
                                SourceState::Waiting
                            }
                            Some(_) => SourceState::Queued,
                            None if slot.is_none() && refusal == Some(Refusal::Budget) => {
                                SourceState::OverBudget
                            }
                            None => SourceState::Standby,
                        };
                        fleet.board.set(&name, state);
                        kept = session.keep();
                    }
                }
            }
        }
        // Until the next poll; a kept session is closed as soon as its room is needed, and
        // a queued source polls as soon as a source served here frees its room.
        let due = tokio::time::Instant::now() + jitter(fleet.settings.discover_interval);
        loop {
            // Woken from here on, so that no wake-up falls between the check and the wait.
            let over = fleet.share.kept_over();
            let freed = fleet.share.room_freed();
            if kept.as_mut().is_some_and(PollSession::excess) {
                kept = None;
            }
            tokio::select! {
                () = stop.cancelled() => return leave(&fleet, &url, kept).await,
                () = tokio::time::sleep_until(due) => break,
                () = over, if kept.is_some() => {}
                () = freed => if fleet.share.next_to_take(&name) {
                    next = true;
                    break;
                },
            }
        }
    }
}

/// What one poll found.
struct Polled<'a> {
    asked: Instant,
    /// Why no slot was asked for, if none was.
    refusal: Option<Refusal>,
    turn: SourceTurn,
    /// This source, counted in the process's share while a slot was asked for.
    held: Option<Held<'a>>,
    /// Since when it has had ready messages and nobody serving it, if it has.
    queued: Option<Instant>,
}

/// One poll on the session kept from the last poll, or on a new one, within
/// [`poll_within`]; with that session. `taking`: the source, queued, counted in this
/// process's share before its poll (its room covers the poll's session).
async fn poll_on<'a>(
    fleet: &'a Fleet,
    name: &str,
    url: &str,
    server: &str,
    kept: Option<PollSession<'a>>,
    taking: Option<Held<'a>>,
) -> Result<(Polled<'a>, PollSession<'a>), String> {
    let session = PollSession::open(fleet, url, server, kept, taking.is_some())
        .await
        .map_err(|e| e.to_string())?;
    let within = poll_within(fleet, &session);
    let polled = poll(fleet, name, server, &session.store, taking);
    match tokio::time::timeout(within, polled).await {
        Ok(Ok(polled)) => Ok((polled, session)),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "the source's poll did not answer within {} s",
            within.as_secs()
        )),
    }
}

/// How long a poll may take: a slot lease, and at least 10 s (the connect timeout). A
/// session kept idle between polls may have lost its server without a word (a host gone,
/// a network partition), and its next query would wait for TCP to give up. A poll on one
/// of the server's short sessions, which the other polls wait for, a discovery interval
/// (at least 2 s): a source that hangs (a database being dropped) holds the others' polls,
/// and the memberships they renew, back no longer than that.
fn poll_within(fleet: &Fleet, session: &PollSession) -> Duration {
    if session._short.is_some() {
        short_within(fleet)
    } else {
        fleet.settings.lease.max(Duration::from_secs(10))
    }
}

/// One poll on `store`'s session: the schema is checked and `serve_source` renews this
/// process's membership and says who serves the source. When a slot is free, the source's
/// observation (shared by the fleet, at most an interval old) says whether it has ready
/// messages (it is then queued: [`Share::queued`](super::share::Share::queued)), and a slot
/// is asked for when this process is under its share and it is the source's turn (counted
/// before asking, so that sources polled together cannot all pass the check). The
/// membership holds until the next poll is due (two intervals and a lease: a late poll does
/// not make the fleet look smaller).
async fn poll<'a>(
    fleet: &'a Fleet,
    name: &str,
    server: &str,
    store: &Store,
    taking: Option<Held<'a>>,
) -> Result<Polled<'a>, StoreError> {
    store.check_schema().await?;
    let slots = fleet.share.slots();
    let ask = |want: bool| {
        store.serve_source(
            &fleet.relay.worker_id,
            slots,
            want,
            fleet.settings.lease,
            fleet.settings.membership_ttl(),
        )
    };
    let mut asked = Instant::now();
    let mut turn = ask(false).await?;
    let free = usize::try_from(slots).unwrap_or(usize::MAX) > turn.holders.len();
    let ready = if free && turn.holders.is_empty() {
        let interval = fleet.settings.discover_interval;
        store
            .observe(1, interval)
            .await?
            .and_then(|row| serde_json::from_value::<observe::Snapshot>(row.snapshot).ok())
            .is_some_and(|snapshot| snapshot.topics.iter().any(|t| t.ready > 0))
    } else {
        false
    };
    let queued = fleet.share.queued(name, server, ready);
    if !free {
        return Ok(Polled {
            asked,
            refusal: None,
            turn,
            held: None,
            queued,
        });
    }
    let (held, refusal) = if joining(fleet) {
        (None, Some(Refusal::Joining))
    } else if let Some(taking) = taking.filter(|_| queued.is_some()) {
        // Counted already: no longer queued.
        fleet.share.queued(name, server, false);
        (Some(taking), None)
    } else {
        match fleet.share.try_hold(server, name, queued) {
            Ok(held) => (Some(held), None),
            Err(refusal) => (None, Some(refusal)),
        }
    };
    if held.is_some() {
        asked = Instant::now();
        turn = ask(true).await?;
    }
    Ok(Polled {
        asked,
        refusal,
        turn,
        held,
        queued,
    })
}

/// How long a poll on a short session may take: see [`poll_within`].
fn short_within(fleet: &Fleet) -> Duration {
    fleet.settings.discover_interval.max(Duration::from_secs(2))
}

/// Whether this process is joining, and takes nothing: its first discovery interval (and
/// a renewal period and the give-back of a source after it, so that the others have seen
/// this process and given back what its share takes from theirs), and until every source
/// was polled once, but no longer than three intervals (a source whose poll hangs does not
/// keep the process from serving the others).
fn joining(fleet: &Fleet) -> bool {
    let up = fleet.started.elapsed();
    up < joining_time(fleet) || (!fleet.share.joined() && up < fleet.settings.discover_interval * 3)
}

/// The first part of [`joining`]: 1.1 I + L/3 + [`LEAVE_WITHIN`].
fn joining_time(fleet: &Fleet) -> Duration {
    fleet.settings.discover_interval * 11 / 10 + fleet.settings.lease / 3 + LEAVE_WITHIN
}

/// How long a source queued since `since` has waited for this process by the turns' bound,
/// which a process starting adds its joining time to: from then, or from the end of that
/// time.
fn waited(fleet: &Fleet, since: Instant) -> Duration {
    since
        .elapsed()
        .min(fleet.started.elapsed().saturating_sub(joining_time(fleet)))
}

/// Leaves a source this process does not serve (its membership), on the kept poll session
/// or a short one and within [`LEAVE_WITHIN`], so that the others' share grows at once when
/// it stops.
async fn leave(fleet: &Fleet, url: &str, kept: Option<PollSession<'_>>) {
    let left = tokio::time::timeout(LEAVE_WITHIN, async {
        let _short;
        let store = match kept {
            Some(session) => session.store,
            None => {
                _short = fleet.share.short_session(&server_of(url)).await;
                Store::connect_as(url, 1, "outbox-relay poll")?
            }
        };
        store.leave_source(&fleet.relay.worker_id).await
    })
    .await;
    if let Ok(Err(e)) = left {
        tracing::debug!(error = %e, "could not leave a source: its membership lapses by itself");
    }
}

/// Serves the source while the slot (`token`) holds; returns once it was given up, given
/// back or left, with the relay drained.
#[allow(clippy::too_many_arguments)]
async fn serve(
    fleet: &Fleet,
    name: &str,
    url: &str,
    mut held: Held<'_>,
    slot: i32,
    token: i64,
    until: Instant,
    stop: &CancellationToken,
) {
    fleet
        .share
        .kept_within(&server_of(url), KEPT_CLOSE_WITHIN + short_within(fleet))
        .await;
    let store = match Store::connect(url, fleet.settings.pool_size) {
        Ok(store) => {
            let store = store.with_statements(fleet.statements);
            match fleet.turns(&server_of(url)) {
                Some(turns) => store.with_turns(turns),
                None => store,
            }
        }
        Err(e) => {
            fleet.board.set(name, SourceState::Down(e.to_string()));
            return;
        }
    };
    let lease = fleet.settings.lease;
    let gate = Gate::until(until);
    let relay_stop = CancellationToken::new();
    let source = fleet.labels.label(name);
    let dispatcher = Arc::new(fleet.dispatcher.for_source(&source));
    let relay = Relay::new(fleet.relay.clone(), store.clone(), dispatcher.clone())
        .with_gate(gate.clone())
        .with_source(source.clone());
    let mut relay_task = tokio::spawn(relay.run(relay_stop.clone()));
    // The source's backlog, observed while it is served here.
    let observer = fleet.observe.map(|settings| {
        let latest = observe::Latest::new(settings);
        let worker = &fleet.relay.worker_id;
        let label = source.label().unwrap_or(name);
        fleet
            .board
            .observe(name, label, worker.as_str(), latest.clone());
        tokio::spawn(
            observe::run(
                store.clone(),
                worker.clone(),
                source.clone(),
                latest,
                relay_stop.clone(),
            )
            .instrument(tracing::info_span!("observe", source = name)),
        )
    });
    let mut relay_ended = None;
    fleet.board.set(name, SourceState::Serving { slot });
    let mut renew_at = tokio::time::Instant::now() + lease / 3;
    let end = loop {
        tokio::select! {
            () = stop.cancelled() => break End::Stop,
            ended = &mut relay_task => {
                relay_ended = Some(ended);
                break End::Lost("its relay stopped".to_owned());
            }
            () = tokio::time::sleep(TURN_CHECK.min(lease / 3)) => {}
        }
        if held.over_share() {
            break End::GiveBack;
        }
        if held.turn_over(store.latest_claim_empty()) {
            break End::TurnOver;
        }
        if tokio::time::Instant::now() < renew_at {
            continue;
        }
        renew_at = tokio::time::Instant::now() + lease / 3;
        // An idle source keeps the connection its polls use and its LISTEN session.
        store.close_idle(lease / 3);
        let asked = Instant::now();
        let renewed = tokio::time::timeout(
            lease * 4 / 5,
            store.serve_source(
                &fleet.relay.worker_id,
                fleet.share.slots(),
                true,
                lease,
                fleet.settings.membership_ttl(),
            ),
        )
        .await;
        match renewed {
            Ok(Ok(turn)) if turn.held.map(|(_, t)| t) == Some(token) => {
                gate.set(asked + lease * 4 / 5);
                fleet.share.members(name, turn.members);
                fleet.board.holders(name, turn.holders);
            }
            Ok(Ok(turn)) => {
                break End::Lost(format!(
                    "the source gave its slot to another process (holders now: {})",
                    turn.holders.join(", ")
                ));
            }
            Ok(Err(e)) if !gate.is_open() => break End::Lost(format!("cannot renew: {e}")),
            Err(_) if !gate.is_open() => break End::Lost("renewal did not answer".to_owned()),
            Ok(Err(e)) => tracing::warn!(source = name, error = %e,
                "source slot not renewed yet: retrying before its lease lapses"),
            Err(_) => tracing::warn!(
                source = name,
                "source slot renewal did not answer in time: retrying before its lease lapses"
            ),
        }
    };
    // Another process may serve it from now on: its backlog is theirs to export.
    fleet.board.unobserve(name);
    if let Some(observer) = observer {
        observer.abort();
        // Its store (a session) goes with it.
        let _ = observer.await;
    }
    relay_stop.cancel();
    let ended = match relay_ended {
        Some(ended) => ended,
        None => relay_task.await,
    };
    let summary = match ended {
        Ok(summary) => summary,
        Err(e) => {
            tracing::error!(source = name, error = %e, "the source's relay failed");
            Default::default()
        }
    };
    // Its circuits are gone with its relay: their gauges must not stay open here.
    dispatcher.circuits_gone();
    let worker = &fleet.relay.worker_id;
    match end {
        End::Stop => {
            if let Err(e) = store.leave_source(worker).await {
                tracing::warn!(source = name, error = %e,
                    "could not give the source back: its slot lapses when its lease expires");
            }
            tracing::info!(source = name, delivered = summary.delivered, "source left");
        }
        End::GiveBack | End::TurnOver => {
            if let Err(e) = store
                .serve_source(
                    worker,
                    fleet.share.slots(),
                    false,
                    lease,
                    fleet.settings.membership_ttl(),
                )
                .await
            {
                tracing::warn!(source = name, error = %e,
                    "could not give the source back: its slot lapses when its lease expires");
            }
            fleet.board.set(name, SourceState::Standby);
            let why = if matches!(end, End::TurnOver) {
                "its turn is over: another source of its server has ready messages and no room"
            } else {
                "this process served more than its share"
            };
            tracing::info!(
                source = name,
                delivered = summary.delivered,
                "source given back: {why}"
            );
        }
        End::Lost(why) => {
            fleet.board.set(name, SourceState::Standby);
            tracing::warn!(source = name, reason = %why, delivered = summary.delivered,
                "source lost: stopped claiming from it");
        }
    }
    // Its sessions closed, then its room given back: the source taken in its place opens
    // its own within the budget.
    drop(store);
    drop(held);
}

/// The server (host and port) of a connection string, for the connection budget and the
/// turns: read as the store reads it, so that the sources of one server (its databases and
/// their schemas, whatever their TLS settings) share them.
pub(super) fn server_of(url: &str) -> String {
    match crate::connection::Target::parse(url) {
        Ok(target) => target.address(),
        Err(_) => url.to_owned(),
    }
}

/// `d` ± 10%, so that the polls of many sources and processes spread out.
fn jitter(d: Duration) -> Duration {
    d.mul_f64(rand::random_range(0.9..=1.1))
}

#[cfg(test)]
mod tests {
    use super::server_of;

    #[test]
    fn the_sources_of_one_server_share_it_whatever_their_schema_and_tls_settings() {
        let plain = server_of("postgres://relay@db.internal:5433/a");
        assert_eq!(plain, "db.internal:5433");
        assert_eq!(
            server_of("postgres://relay@db.internal:5433/b?outbox_schema=tenant_1"),
            plain
        );
        assert_eq!(
            server_of("postgres://relay@db.internal:5433/c?sslmode=require&outbox_schema=t"),
            plain
        );
        assert_eq!(
            server_of("host=db.internal port=5433 dbname=d outbox_schema=t"),
            plain
        );
    }
}

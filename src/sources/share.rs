//! This process's fair share of the sources: with S sources of k slots each and P processes
//! in the fleet (the largest membership any source reports), a process serves at most
//! ceil(S·k / P) sources, so sources spread over the processes and move to a process that
//! joins; and at most its part of each server's connection budget (the budget divided by P,
//! in sources of `pool_size + 1` connections each). What its fair share leaves of that part
//! keeps the poll sessions of sources it does not serve open between polls ([`Kept`]), so
//! that their polls do not open a new session every interval.
//!
//! When the budget cannot hold every source of a server at once, the sources take turns
//! ([`Held::turn_over`]): a source found with ready messages and nobody serving it is
//! queued here, the longest-queued first; a process with no room for it gives up one of
//! the sources it serves on that server (an idle one at once, otherwise the one it served
//! longest, once it has had its turn), and a process with room takes the queued source
//! before any other. Every session this process opens to a server counts in its part of
//! the budget: [`SHORT_SESSIONS`] of it are kept for the polls that keep no session and
//! for discovery, which wait for them ([`Share::short_session`]).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::settings::SourcesSettings;

#[derive(Debug)]
pub struct Share {
    slots_setting: SourcesSettings,
    inner: Mutex<Inner>,
    /// Woken when a server's kept poll sessions exceed the room left for them (a source was
    /// taken there): the sources keeping them check [`Kept::excess`].
    kept_over: tokio::sync::Notify,
    /// Woken when a short session closes ([`Short`]).
    short_freed: tokio::sync::Notify,
    /// Woken when a source served here is no longer counted (its sessions are closed):
    /// the queued sources poll at once ([`Share::room_freed`]).
    room_freed: tokio::sync::Notify,
}

/// Sessions of each server this process keeps, in its part of the budget, for the polls
/// that keep no session open and for discovery's sessions: they take turns on it.
pub const SHORT_SESSIONS: usize = 1;

/// A source found with ready messages and no process serving it.
#[derive(Debug)]
struct Queued {
    server: String,
    /// When a poll first found it so (and every poll since).
    since: Instant,
    /// The latest poll that found it so: a report older than a membership's lifetime is
    /// stale (its task stopped polling it).
    seen: Instant,
}

/// A source this process serves.
#[derive(Debug)]
struct Served {
    server: String,
    /// When it was taken: its turn runs from then.
    since: Instant,
    /// Whether its latest claim found nothing (as of its latest check).
    idle: bool,
    /// Its turn is over: it is draining, and still counts until its sessions are closed.
    leaving: bool,
}

#[derive(Debug, Default)]
struct Inner {
    sources: usize,
    /// Membership each source reported last, and when, by source.
    members: HashMap<String, (i32, Instant)>,
    /// Sources served, in all and per server.
    held: usize,
    held_on: HashMap<String, usize>,
    /// Sources polled once since the process started, until it has polled them all.
    polled: HashSet<String>,
    joined: bool,
    /// Poll sessions kept open between polls, per server.
    kept_on: HashMap<String, usize>,
    /// Short sessions open, per server ([`Share::short_session`]).
    short_on: HashMap<String, usize>,
    /// Sources found with ready messages and nobody serving them, by name.
    queued: HashMap<String, Queued>,
    /// Sources served here, by name.
    served: HashMap<String, Served>,
}

impl Share {
    pub fn new(settings: &SourcesSettings) -> Self {
        Self {
            slots_setting: settings.clone(),
            inner: Mutex::default(),
            kept_over: tokio::sync::Notify::new(),
            short_freed: tokio::sync::Notify::new(),
            room_freed: tokio::sync::Notify::new(),
        }
    }

    /// A short session of `server`, for a session that is not counted otherwise (a poll
    /// that keeps no session, discovery, a leave); None without a budget. One of its
    /// [`SHORT_SESSIONS`], or room of this process's part that nothing uses now (sources it
    /// may serve and does not, kept poll sessions it does not keep): the polls then do not
    /// all wait for one session while the budget has room. Waits for one otherwise.
    pub async fn short_session(&self, server: &str) -> Option<Short<'_>> {
        self.slots_setting.max_connections_per_server?;
        loop {
            let freed = self.short_freed.notified();
            {
                let mut inner = self.inner.lock().expect("share lock");
                let open = inner.short_on.get(server).copied().unwrap_or(0);
                // Until it has joined, the process counts a fleet of one: it borrows nothing.
                if open < SHORT_SESSIONS || (inner.joined && self.unused(&inner, server) > 0) {
                    inner.short_on.insert(server.to_owned(), open + 1);
                    return Some(Short {
                        share: self,
                        server: server.to_owned(),
                    });
                }
            }
            freed.await;
        }
    }

    /// Sessions of this process's part of `server`'s budget that nothing uses now: its
    /// part, less the [`SHORT_SESSIONS`], the sources served (their pools and `LISTEN`
    /// sessions), the kept poll sessions and the short sessions beyond the
    /// [`SHORT_SESSIONS`].
    fn unused(&self, inner: &Inner, server: &str) -> usize {
        let Some(part) = self.part(inner) else {
            return usize::MAX;
        };
        let on = |m: &HashMap<String, usize>| m.get(server).copied().unwrap_or(0);
        let used = on(&inner.held_on) * self.slots_setting.connections_per_source()
            + on(&inner.kept_on)
            + on(&inner.short_on).saturating_sub(SHORT_SESSIONS);
        part.saturating_sub(SHORT_SESSIONS).saturating_sub(used)
    }

    /// Records what a poll found of `source`: `queued` when it has ready messages and no
    /// process serves it. Returns since when it has been queued, if it is.
    pub fn queued(&self, source: &str, server: &str, queued: bool) -> Option<Instant> {
        let mut inner = self.inner.lock().expect("share lock");
        if !queued {
            if let Some(gone) = inner.queued.remove(source)
                && self.has_room(&inner, &gone.server)
            {
                // The next in line may be taken now.
                drop(inner);
                self.room_freed.notify_waiters();
            }
            return None;
        }
        let now = Instant::now();
        let entry = inner
            .queued
            .entry(source.to_owned())
            .or_insert_with(|| Queued {
                server: server.to_owned(),
                since: now,
                seen: now,
            });
        entry.seen = now;
        Some(entry.since)
    }

    /// Whether `source` is the next to take on its server, and this process has room for
    /// it: queued (a poll found it with ready messages and nobody serving it, within a
    /// membership's lifetime), and before every other source queued there.
    pub fn next_to_take(&self, source: &str) -> bool {
        let fresh = self.slots_setting.membership_ttl();
        let inner = self.inner.lock().expect("share lock");
        inner.queued.get(source).is_some_and(|q| {
            q.seen.elapsed() <= fresh
                && self.has_room(&inner, &q.server)
                && self
                    .first_queued(&inner, &q.server, source)
                    .is_none_or(|(_, first)| q.since <= first)
        })
    }

    /// Resolves when there may be room for the source [`Share::next_to_take`]: a source
    /// served here stopped counting, its sessions closed, or the source queued before it
    /// left the queue (woken from its creation on: create it before checking). That source
    /// then polls at once rather than at its next interval.
    pub fn room_freed(&self) -> tokio::sync::futures::Notified<'_> {
        self.room_freed.notified()
    }

    /// [`Share::try_hold`] for `source`, queued, as the one [`Share::next_to_take`]: the
    /// room it takes covers the session its poll opens (it is not open yet), which does not
    /// wait for a short one.
    pub fn try_take<'a>(&'a self, server: &str, source: &str) -> Option<Held<'a>> {
        let since = self
            .inner
            .lock()
            .expect("share lock")
            .queued
            .get(source)?
            .since;
        self.try_hold(server, source, Some(since)).ok()
    }

    /// The source of `server` queued longest, other than `except`, with since when.
    fn first_queued<'i>(
        &self,
        inner: &'i Inner,
        server: &str,
        except: &str,
    ) -> Option<(&'i str, Instant)> {
        let fresh = self.slots_setting.membership_ttl();
        inner
            .queued
            .iter()
            .filter(|(name, q)| {
                q.server == server && name.as_str() != except && q.seen.elapsed() <= fresh
            })
            .map(|(name, q)| (name.as_str(), q.since))
            .min_by_key(|&(name, since)| (since, name))
    }

    /// How long a source serves on a budget that is short before it gives its place to a
    /// queued one: a slot lease.
    pub fn turn(&self) -> Duration {
        self.slots_setting.lease
    }

    /// [`wait_bound`] for this process's view of the fleet: its sources and its size.
    pub fn wait_bound(&self) -> Duration {
        let inner = self.inner.lock().expect("share lock");
        wait_bound(&self.slots_setting, inner.sources, self.processes(&inner))
    }

    pub fn set_sources(&self, sources: usize) {
        self.inner.lock().expect("share lock").sources = sources;
    }

    /// Slots of each source now.
    pub fn slots(&self) -> i32 {
        let sources = self.inner.lock().expect("share lock").sources;
        self.slots_setting.slots(sources)
    }

    /// Records the membership `source` reported. A fleet of another size has other parts of
    /// the budgets: the kept poll sessions check theirs.
    pub fn members(&self, source: &str, members: i32) {
        let mut inner = self.inner.lock().expect("share lock");
        let before = self.processes(&inner);
        inner
            .members
            .insert(source.to_owned(), (members, Instant::now()));
        if self.processes(&inner) != before && !inner.kept_on.is_empty() {
            drop(inner);
            self.kept_over.notify_waiters();
        }
    }

    /// Records that `source` was polled, whatever came of it (this process said it is alive
    /// there, or found that it cannot).
    pub fn polled(&self, source: &str) {
        let mut inner = self.inner.lock().expect("share lock");
        if inner.joined {
            return;
        }
        inner.polled.insert(source.to_owned());
        if inner.polled.len() >= inner.sources {
            inner.joined = true;
            inner.polled = HashSet::new();
        }
    }

    /// Whether this process has polled every source once since it started. Until then it
    /// takes nothing: the processes started with it may not have said they are alive in any
    /// source it polled yet, and it would count a fleet of one, with the whole connection
    /// budget to itself.
    pub fn joined(&self) -> bool {
        self.inner.lock().expect("share lock").joined
    }

    /// Forgets what `source` reported (no longer discovered, or not answering: a source
    /// that cannot be asked must not keep the fleet looking larger than it is).
    pub fn forget(&self, source: &str) {
        self.inner
            .lock()
            .expect("share lock")
            .members
            .remove(source);
    }

    /// The fleet's size: the largest membership a source reported within a membership's
    /// lifetime (older reports are of processes that may have gone).
    fn processes(&self, inner: &Inner) -> usize {
        let fresh = self.slots_setting.membership_ttl();
        inner
            .members
            .values()
            .filter(|(_, at)| at.elapsed() <= fresh)
            .map(|&(members, _)| members)
            .max()
            .unwrap_or(1)
            .max(1)
            .unsigned_abs() as usize
    }

    fn target(&self, inner: &Inner) -> usize {
        target(&self.slots_setting, inner.sources, self.processes(inner))
    }

    /// This process's part of each server's budget: the budget divided by the processes.
    fn part(&self, inner: &Inner) -> Option<usize> {
        let budget = self.slots_setting.max_connections_per_server?;
        Some(budget / self.processes(inner))
    }

    /// The sources this process may serve on a server under the connection budget: its part
    /// of it, less the [`SHORT_SESSIONS`], in sources of `pool_size + 1` connections.
    fn server_room(&self, inner: &Inner) -> usize {
        server_room(&self.slots_setting, self.processes(inner))
    }

    /// Whether this process may take one more source on `server`.
    fn has_room(&self, inner: &Inner, server: &str) -> bool {
        inner.held < self.target(inner)
            && inner.held_on.get(server).copied().unwrap_or(0) < self.server_room(inner)
    }

    /// Counts one more source on `server` when this process may take it (checked and
    /// counted at once, so that sources asked for together cannot all pass the check); the
    /// guard gives it back when dropped (when the source did not grant a slot, or once it
    /// is no longer served).
    ///
    /// With room, the source of `server` queued longest goes first: `source` (queued since
    /// `queued`, if it is) is refused its turn while another was queued before it, or while
    /// it has nothing ready and another is queued.
    pub fn try_hold<'a>(
        &'a self,
        server: &str,
        source: &str,
        queued: Option<Instant>,
    ) -> Result<Held<'a>, Refusal> {
        let mut inner = self.inner.lock().expect("share lock");
        if inner.held >= self.target(&inner) {
            return Err(Refusal::FairShare);
        }
        if inner.held_on.get(server).copied().unwrap_or(0) >= self.server_room(&inner) {
            return Err(Refusal::Budget);
        }
        if let Some((_, first)) = self.first_queued(&inner, server, source)
            && queued.is_none_or(|since| first < since)
        {
            return Err(Refusal::Turn);
        }
        let held = Self::count(&mut inner, self, server, source);
        if inner.kept_on.get(server).copied().unwrap_or(0) > self.keep_room(&inner, server) {
            self.kept_over.notify_waiters();
        }
        Ok(held)
    }

    /// Connections of `server` this process may keep for the poll sessions of sources it
    /// does not serve: its part of the server's budget, less the pools and `LISTEN`
    /// sessions of the sources it may serve there (its fair share, or what it serves now
    /// if that is more, within the budget). None without a budget: the polls keep no
    /// session, since nothing would bound processes × sources idle sessions.
    fn keep_room(&self, inner: &Inner, server: &str) -> usize {
        let Some(part) = self.part(inner) else {
            return 0;
        };
        let part = part.saturating_sub(SHORT_SESSIONS);
        let per_source = self.slots_setting.connections_per_source();
        let serving = inner.held_on.get(server).copied().unwrap_or(0);
        let reserved = self
            .target(inner)
            .min(part / per_source)
            .max(serving)
            .saturating_mul(per_source);
        part.saturating_sub(reserved)
    }

    /// Counts one more kept poll session on `server` when there is room for it (see
    /// [`Share::keep_room`]); the guard gives it back when dropped.
    pub fn try_keep<'a>(&'a self, server: &str) -> Option<Kept<'a>> {
        let mut inner = self.inner.lock().expect("share lock");
        // Until it has joined, the process counts a fleet of one and would keep sessions in
        // the whole budget.
        if !inner.joined {
            return None;
        }
        let kept = inner.kept_on.get(server).copied().unwrap_or(0);
        if kept >= self.keep_room(&inner, server) || self.unused(&inner, server) == 0 {
            return None;
        }
        inner.kept_on.insert(server.to_owned(), kept + 1);
        Some(Kept {
            share: self,
            server: server.to_owned(),
            released: false,
        })
    }

    /// Resolves when some server's kept poll sessions may exceed their room (woken from
    /// its creation on, polled or not: create it before checking [`Kept::excess`]).
    pub fn kept_over(&self) -> tokio::sync::futures::Notified<'_> {
        self.kept_over.notified()
    }

    /// Waits (at most `within`) until the kept poll sessions of `server` fit their room
    /// again, so that a source taken there opens its pool once they are closed.
    pub async fn kept_within(&self, server: &str, within: std::time::Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.kept_over.notified();
            let freed = self.short_freed.notified();
            {
                let inner = self.inner.lock().expect("share lock");
                if inner.kept_on.get(server).copied().unwrap_or(0) <= self.keep_room(&inner, server)
                    && !self.overdrawn(&inner, server)
                {
                    return;
                }
            }
            let closed = async {
                tokio::select! {
                    () = notified => {}
                    () = freed => {}
                }
            };
            if tokio::time::timeout_at(deadline, closed).await.is_err() {
                return;
            }
        }
    }

    /// Whether the short sessions borrowed from unused room, the kept poll sessions and
    /// the sources counted on `server` exceed this process's part (a source was just
    /// taken in room a short poll borrowed; it ends within its poll's limit).
    fn overdrawn(&self, inner: &Inner, server: &str) -> bool {
        let Some(part) = self.part(inner) else {
            return false;
        };
        let on = |m: &HashMap<String, usize>| m.get(server).copied().unwrap_or(0);
        on(&inner.held_on) * self.slots_setting.connections_per_source()
            + on(&inner.kept_on)
            + on(&inner.short_on).saturating_sub(SHORT_SESSIONS)
            > part.saturating_sub(SHORT_SESSIONS)
    }

    fn count<'a>(inner: &mut Inner, share: &'a Share, server: &str, source: &str) -> Held<'a> {
        inner.held += 1;
        *inner.held_on.entry(server.to_owned()).or_default() += 1;
        inner.queued.remove(source);
        inner.served.insert(
            source.to_owned(),
            Served {
                server: server.to_owned(),
                since: Instant::now(),
                idle: false,
                leaving: false,
            },
        );
        Held {
            share,
            server: server.to_owned(),
            source: source.to_owned(),
            released: false,
        }
    }
}

/// The longest a source with a ready message waits for a process to serve it, by the
/// turns' rule, while the fleet's size holds: with I the discovery interval, L the slot
/// lease (also the turn), C the sources the fleet may serve at once on the server (each
/// process's room there × the processes) and S the sources:
/// 3I + L/3 (found queued on a snapshot up to I old, a process with no room gives up a
/// source at its next renewal, the queued source is taken at its next poll), plus, for
/// each round of turns ahead of it, ceil((S − C) / C) of them, a turn, its renewal
/// period, the relay's drain (at most L) and two polls (the one that takes the next
/// queued source, and one that finds that the source queued first was taken by another
/// process): 2L + L/3 + 2I. A process killed adds the time its slots and membership
/// take to lapse, 2I + L, and a process starting its joining time (see
/// docs/sources.md). Here with `sources` sources on one server and a fleet of
/// `processes`; also what `status --all-sources` compares a queued source's oldest ready
/// message with.
pub fn wait_bound(settings: &SourcesSettings, sources: usize, processes: usize) -> Duration {
    let processes = processes.max(1);
    let at_once = server_room(settings, processes)
        .min(target(settings, sources, processes))
        .saturating_mul(processes)
        .max(1);
    let rounds = sources.saturating_sub(at_once).div_ceil(at_once);
    let (interval, lease) = (settings.discover_interval, settings.lease);
    let round = lease * 2 + lease / 3 + interval * 2;
    interval * 3 + lease / 3 + round * u32::try_from(rounds).unwrap_or(u32::MAX)
}

/// The sources a process serves at most, its fair share: with `sources` sources of k
/// slots each and a fleet of `processes`, ceil(sources·k / processes).
fn target(settings: &SourcesSettings, sources: usize, processes: usize) -> usize {
    let slots = settings.slots(sources).max(1).unsigned_abs() as usize;
    (sources * slots).div_ceil(processes.max(1)).max(1)
}

/// The sources a process may serve on one server under its connection budget: its part of
/// it (the budget divided by the processes), less the [`SHORT_SESSIONS`], in sources of
/// `pool_size + 1` connections; unbounded without a budget.
fn server_room(settings: &SourcesSettings, processes: usize) -> usize {
    settings
        .max_connections_per_server
        .map_or(usize::MAX, |budget| {
            (budget / processes.max(1)).saturating_sub(SHORT_SESSIONS)
                / settings.connections_per_source()
        })
}

/// A short session of a server, counted until dropped ([`Share::short_session`]).
pub struct Short<'a> {
    share: &'a Share,
    server: String,
}

impl Drop for Short<'_> {
    fn drop(&mut self) {
        let mut inner = self.share.inner.lock().expect("share lock");
        *inner.short_on.get_mut(&self.server).expect("short") -= 1;
        drop(inner);
        self.share.short_freed.notify_waiters();
    }
}

/// A poll session kept open between polls, counted on its server until dropped (or
/// released by [`Kept::excess`]).
pub struct Kept<'a> {
    share: &'a Share,
    server: String,
    released: bool,
}

impl Kept<'_> {
    /// Gives this session's room back when the server's kept sessions exceed their room now
    /// (one at a time: only the excess goes). Once it returned true the session no longer
    /// counts and must be closed.
    pub fn excess(&mut self) -> bool {
        if self.released {
            return true;
        }
        let mut inner = self.share.inner.lock().expect("share lock");
        let kept = inner.kept_on.get(&self.server).copied().unwrap_or(0);
        let over = kept > self.share.keep_room(&inner, &self.server);
        if over {
            inner.kept_on.insert(self.server.clone(), kept - 1);
            self.released = true;
            self.share.kept_over.notify_waiters();
        }
        over
    }
}

impl Drop for Kept<'_> {
    fn drop(&mut self) {
        if !self.released {
            let mut inner = self.share.inner.lock().expect("share lock");
            *inner.kept_on.get_mut(&self.server).expect("kept") -= 1;
            drop(inner);
            self.share.kept_over.notify_waiters();
        }
    }
}

/// Why a source is not taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The process is learning the fleet's size: it is in its first discovery interval, or
    /// has not polled every source yet.
    Joining,
    FairShare,
    Budget,
    /// Another source of the server was queued before it: that one is taken first.
    Turn,
}

/// A source this process serves, counted in its share until dropped (or given back).
pub struct Held<'a> {
    share: &'a Share,
    server: String,
    source: String,
    released: bool,
}

impl Held<'_> {
    /// Gives this source back when the process serves more than its share now (one at a
    /// time: of several sources over the share, each asks in turn, and only the excess
    /// goes). Once it returned true the source no longer counts.
    pub fn over_share(&mut self) -> bool {
        let mut inner = self.share.inner.lock().expect("share lock");
        let over = inner.held > self.share.target(&inner)
            || inner.held_on.get(&self.server).copied().unwrap_or(0)
                > self.share.server_room(&inner);
        if over {
            self.release(&mut inner);
        }
        over
    }

    /// Gives this source up for a queued one when its turn is over: another source of its
    /// server is queued, this process has no room for it, and this source is the one to go
    /// (an idle source first, the one served longest among them; otherwise the one served
    /// longest, once it has served for a [`Share::turn`]). `idle`: its latest claim found
    /// nothing. As many go as there are sources queued there: each is leaving until it is
    /// dropped, its sessions closed, and counts as gone meanwhile. Once it returned true the
    /// source is to be dropped as soon as its relay has drained: it counts until then, so
    /// that the source taken in its place does not open its sessions beside its own.
    pub fn turn_over(&mut self, idle: bool) -> bool {
        let mut inner = self.share.inner.lock().expect("share lock");
        if let Some(served) = inner.served.get_mut(&self.source) {
            served.idle = idle;
        }
        if self
            .share
            .first_queued(&inner, &self.server, &self.source)
            .is_none()
            || self.share.has_room(&inner, &self.server)
        {
            return false;
        }
        let turn = self.share.turn();
        let fresh = self.share.slots_setting.membership_ttl();
        let queued = inner
            .queued
            .values()
            .filter(|q| q.server == self.server && q.seen.elapsed() <= fresh)
            .count();
        let here = inner.served.iter().filter(|(_, s)| s.server == self.server);
        if here.clone().filter(|(_, s)| s.leaving).count() >= queued {
            return false;
        }
        let here = here.filter(|(_, s)| !s.leaving);
        let goes = match here
            .clone()
            .filter(|(_, s)| s.idle)
            .min_by_key(|(n, s)| (s.since, *n))
        {
            Some((name, _)) => Some(name),
            None => here
                .filter(|(_, s)| s.since.elapsed() >= turn)
                .min_by_key(|(n, s)| (s.since, *n))
                .map(|(name, _)| name),
        };
        let over = goes == Some(&self.source);
        if over && let Some(served) = inner.served.get_mut(&self.source) {
            served.leaving = true;
        }
        over
    }

    fn release(&mut self, inner: &mut Inner) {
        inner.held -= 1;
        *inner.held_on.get_mut(&self.server).expect("held") -= 1;
        inner.served.remove(&self.source);
        self.released = true;
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if !self.released {
            let mut inner = self.share.inner.lock().expect("share lock");
            self.release(&mut inner);
        }
        self.share.room_freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::sources::MAX_SLOTS;

    fn settings(per_source: Option<i32>, budget: Option<usize>) -> SourcesSettings {
        SourcesSettings {
            discover_interval: Duration::from_secs(10),
            processes_per_source: per_source,
            lease: Duration::from_secs(15),
            pool_size: 3,
            max_connections_per_server: budget,
            ..SourcesSettings::default()
        }
    }

    #[test]
    fn a_process_takes_its_fair_share_and_gives_back_the_excess_when_others_join() {
        let share = Share::new(&settings(None, None));
        share.set_sources(10);
        share.members("a", 1);
        let mut held: Vec<Held> = (0..10)
            .map(|_| hold(&share, "s").expect("alone, it takes every source"))
            .collect();
        assert_eq!(hold(&share, "s").err(), Some(Refusal::FairShare));
        // Two more processes: the share is ceil(10 / 3) = 4, so 6 are given back.
        share.members("a", 3);
        let given_back = held
            .iter_mut()
            .filter_map(|h| h.over_share().then_some(()))
            .count();
        assert_eq!(given_back, 6);
        assert_eq!(hold(&share, "s").err(), Some(Refusal::FairShare));
    }

    #[test]
    fn one_source_is_served_by_every_process_unless_capped() {
        let share = Share::new(&settings(None, None));
        share.set_sources(1);
        share.members("a", 5);
        assert_eq!(share.slots(), MAX_SLOTS);
        assert!(hold(&share, "s").is_ok());
        let capped = Share::new(&settings(Some(2), None));
        capped.set_sources(1);
        assert_eq!(capped.slots(), 2);
    }

    #[test]
    fn the_connection_budget_of_a_server_is_shared_out_among_the_processes() {
        // 40 connections, 2 processes: 20 each, one of them for short sessions, 4 per
        // source (pool 3 + LISTEN): 4 sources.
        let share = Share::new(&settings(None, Some(40)));
        share.set_sources(50);
        share.members("a", 2);
        let held: Vec<Held> = (0..4)
            .map(|_| hold(&share, "s").expect("within the budget"))
            .collect();
        assert_eq!(hold(&share, "s").err(), Some(Refusal::Budget));
        assert!(hold(&share, "other server").is_ok());
        drop(held);
        assert!(hold(&share, "s").is_ok());
    }

    /// Takes a source on `server` under a name of its own, queued nowhere.
    fn hold<'a>(share: &'a Share, server: &str) -> Result<Held<'a>, Refusal> {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        share.try_hold(server, &format!("source {n}"), None)
    }

    /// Polls `sources` sources once: the process has joined.
    fn join(share: &Share, sources: usize) {
        for i in 0..sources {
            share.polled(&i.to_string());
        }
        assert!(share.joined());
    }

    #[test]
    fn poll_sessions_are_kept_only_in_the_budget_its_fair_share_leaves() {
        assert!(
            Share::new(&settings(None, None)).try_keep("s").is_none(),
            "without a budget no poll session is kept"
        );
        // 40 connections, 2 processes: 20 each, one for short sessions; 6 sources, a fair
        // share of 3, 4 connections each (pool 3 + LISTEN): 12 reserved, 7 left for kept
        // poll sessions.
        let share = Share::new(&settings(None, Some(40)));
        share.set_sources(6);
        share.members("a", 2);
        assert!(
            share.try_keep("s").is_none(),
            "until it has polled every source, the process does not know the fleet's size"
        );
        join(&share, 6);
        let mut kept: Vec<Kept> = (0..7)
            .map(|_| share.try_keep("s").expect("within the room left"))
            .collect();
        assert!(share.try_keep("s").is_none());
        assert!(kept.iter_mut().all(|k| !k.excess()));
        // A third process: 13 each (12 and a short one), a fair share of 2 (8 connections):
        // 4 left, 3 must close.
        share.members("a", 3);
        assert_eq!(
            kept.iter_mut()
                .filter_map(|k| k.excess().then_some(()))
                .count(),
            3
        );
        assert!(share.try_keep("s").is_none());
        drop(kept);
        assert!(share.try_keep("s").is_some());
    }

    #[test]
    fn sources_served_beyond_the_fair_share_keep_their_room_from_kept_poll_sessions() {
        // 40 connections, one process, one for short sessions, 4 sources (4 connections
        // each): 16 reserved, 23 left.
        let share = Share::new(&settings(None, Some(40)));
        share.set_sources(4);
        share.members("a", 1);
        join(&share, 4);
        let mut kept: Vec<Kept> = (0..30).filter_map(|_| share.try_keep("s")).collect();
        assert_eq!(kept.len(), 23);
        let held: Vec<Held> = (0..4)
            .map(|_| hold(&share, "s").expect("its fair share"))
            .collect();
        assert_eq!(
            kept.iter_mut()
                .filter_map(|k| k.excess().then_some(()))
                .count(),
            0
        );
        // A second process: 20 each (19 and a short one) and a fair share of 2, but the 4
        // sources served until two are given back keep their 16: 3 left, 20 must close.
        share.members("a", 2);
        assert_eq!(
            kept.iter_mut()
                .filter_map(|k| k.excess().then_some(()))
                .count(),
            20
        );
        drop(held);
    }

    #[tokio::test]
    async fn short_sessions_borrow_the_room_nothing_uses_and_only_that() {
        // 20 connections, one process: 19 and a short one, 4 per source.
        let share = Share::new(&settings(None, Some(20)));
        share.set_sources(10);
        share.members("a", 1);
        let first = share.short_session("s").await.expect("a budget");
        let borrowing = tokio::time::timeout(Duration::from_millis(50), share.short_session("s"));
        assert!(
            borrowing.await.is_err(),
            "until the process has joined, it borrows nothing"
        );
        join(&share, 10);
        let held: Vec<Held> = (0..4).map(|_| hold(&share, "s").expect("room")).collect();
        // 16 for the sources, 3 unused: 3 short sessions beside the first.
        let mut short = Vec::new();
        for _ in 0..3 {
            short.push(share.short_session("s").await.expect("unused room"));
        }
        let waiting = tokio::time::timeout(Duration::from_millis(50), share.short_session("s"));
        assert!(waiting.await.is_err(), "no room left");
        assert!(
            share.try_keep("s").is_none(),
            "no room for a kept session either"
        );
        drop(held);
        let taken = hold(&share, "s").expect("room");
        assert!(
            !share.overdrawn(&share.inner.lock().unwrap(), "s"),
            "4 + 3 borrowed of 19"
        );
        drop((taken, short, first));
    }

    #[test]
    fn a_short_budget_serves_the_queued_sources_in_turns() {
        // 20 connections, one process: 19 and a short one, 4 sources of 4 connections.
        let share = Share::new(&settings(None, Some(20)));
        share.set_sources(10);
        share.members("a", 1);
        let mut held: Vec<Held> = (0..4)
            .map(|i| {
                share
                    .try_hold("s", &format!("busy{i}"), None)
                    .expect("room")
            })
            .collect();
        assert!(
            held.iter_mut().all(|h| !h.turn_over(false)),
            "nothing is queued: every source keeps its slot"
        );
        // Two sources are found with ready messages and nobody serving them.
        let first = share.queued("q1", "s", true);
        std::thread::sleep(Duration::from_millis(5));
        let second = share.queued("q2", "s", true);
        assert!(first < second);
        assert_eq!(
            share.try_hold("s", "q2", second).err(),
            Some(Refusal::Budget),
            "no room"
        );
        // None is idle and none has served its turn (a 15 s lease): all keep their slot.
        assert!(held.iter_mut().all(|h| !h.turn_over(false)));
        // One idle source: it goes (the others are busy, their turn not over).
        let given: Vec<bool> = held
            .iter_mut()
            .enumerate()
            .map(|(i, h)| h.turn_over(i == 2))
            .collect();
        assert_eq!(given, [false, false, true, false]);
        assert!(
            held.iter_mut().all(|h| !h.turn_over(false)),
            "the others are busy, their turn not over"
        );
        assert_eq!(
            share.try_hold("s", "q1", first).err(),
            Some(Refusal::Budget),
            "its sessions are not closed yet"
        );
        assert!(
            held[0].turn_over(true),
            "two are queued: a second idle source goes"
        );
        assert!(!held[1].turn_over(true), "as many as are queued");
        drop(held.remove(2));
        drop(held.remove(0));
        assert!(held.iter_mut().all(|h| !h.turn_over(true)), "room is there");
        // The room goes to the source queued longest: q2 waits for q1, an idle source for
        // both; q1 is taken.
        assert_eq!(share.try_hold("s", "q2", second).err(), Some(Refusal::Turn));
        assert_eq!(share.try_hold("s", "idle", None).err(), Some(Refusal::Turn));
        let q1 = share.try_hold("s", "q1", first).expect("the first queued");
        assert_eq!(
            share.queued("q2", "s", true),
            second,
            "still queued since then"
        );
        // Busy sources only: the one served longest goes once its turn is over.
        let short = Share::new(&SourcesSettings {
            lease: Duration::from_millis(20),
            ..settings(None, Some(9))
        });
        short.set_sources(3);
        short.members("a", 1);
        let mut a = short.try_hold("s", "a", None).expect("room");
        std::thread::sleep(Duration::from_millis(5));
        let mut b = short.try_hold("s", "b", None).expect("room");
        short.queued("c", "s", true);
        assert!(!a.turn_over(false) && !b.turn_over(false), "turn not over");
        std::thread::sleep(Duration::from_millis(30));
        assert!(!b.turn_over(false), "a was served longer");
        assert!(a.turn_over(false));
        assert!(!b.turn_over(false), "one per queued source");
        drop((held, q1));
    }

    #[test]
    fn the_wait_bound_counts_the_rounds_of_turns_ahead() {
        // I = 10 s, L = 15 s; 60 connections, 2 processes: 29 each for sources, 7 sources
        // each, 14 at once; 20 sources: one round ahead at most.
        let share = Share::new(&settings(None, Some(60)));
        share.set_sources(20);
        share.members("a", 2);
        assert_eq!(
            share.wait_bound(),
            Duration::from_secs(30 + 5 + (30 + 5 + 20))
        );
        assert_eq!(
            wait_bound(&settings(None, Some(60)), 20, 2),
            share.wait_bound(),
            "status --all-sources states the same bound"
        );
        let ample = Share::new(&settings(None, None));
        ample.set_sources(20);
        assert_eq!(ample.wait_bound(), Duration::from_secs(35));
    }

    #[test]
    fn a_process_joins_once_it_polled_every_source() {
        let share = Share::new(&settings(None, None));
        share.set_sources(3);
        share.polled("a");
        share.polled("b");
        share.polled("a");
        assert!(!share.joined(), "c was not polled yet");
        share.polled("c");
        assert!(share.joined());
        share.set_sources(4);
        assert!(
            share.joined(),
            "a source discovered later does not make it join again"
        );
    }
}

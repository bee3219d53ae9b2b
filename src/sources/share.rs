//! This process's fair share of the sources: with S sources of k slots each and P processes
//! in the fleet (the largest membership any source reports), a process serves at most
//! ceil(S·k / P) sources, so sources spread over the processes and move to a process that
//! joins; and at most its part of each server's connection budget (the budget divided by P,
//! in sources of `pool_size + 1` connections each). What its fair share leaves of that part
//! keeps the poll sessions of sources it does not serve open between polls ([`Kept`]), so
//! that their polls do not open a new session every interval.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Instant;

use super::settings::SourcesSettings;

#[derive(Debug)]
pub struct Share {
    slots_setting: SourcesSettings,
    inner: Mutex<Inner>,
    /// Woken when a server's kept poll sessions exceed the room left for them (a source was
    /// taken there): the sources keeping them check [`Kept::excess`].
    kept_over: tokio::sync::Notify,
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
}

impl Share {
    pub fn new(settings: &SourcesSettings) -> Self {
        Self {
            slots_setting: settings.clone(),
            inner: Mutex::default(),
            kept_over: tokio::sync::Notify::new(),
        }
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
        let slots = self
            .slots_setting
            .slots(inner.sources)
            .max(1)
            .unsigned_abs() as usize;
        (inner.sources * slots)
            .div_ceil(self.processes(inner))
            .max(1)
    }

    /// The sources this process may serve on `server` under the connection budget.
    fn server_room(&self, inner: &Inner) -> usize {
        match self.slots_setting.max_connections_per_server {
            None => usize::MAX,
            Some(budget) => {
                budget / self.processes(inner) / self.slots_setting.connections_per_source()
            }
        }
    }

    /// Counts one more source on `server` when this process may take it (checked and
    /// counted at once, so that sources asked for together cannot all pass the check); the
    /// guard gives it back when dropped (when the source did not grant a slot, or once it
    /// is no longer served).
    pub fn try_hold<'a>(&'a self, server: &str) -> Result<Held<'a>, Refusal> {
        let mut inner = self.inner.lock().expect("share lock");
        if inner.held >= self.target(&inner) {
            return Err(Refusal::FairShare);
        }
        if inner.held_on.get(server).copied().unwrap_or(0) >= self.server_room(&inner) {
            return Err(Refusal::Budget);
        }
        let held = Self::count(&mut inner, self, server);
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
        let Some(budget) = self.slots_setting.max_connections_per_server else {
            return 0;
        };
        let part = budget / self.processes(inner);
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
        if kept >= self.keep_room(&inner, server) {
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
            {
                let inner = self.inner.lock().expect("share lock");
                if inner.kept_on.get(server).copied().unwrap_or(0) <= self.keep_room(&inner, server)
                {
                    return;
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return;
            }
        }
    }

    fn count<'a>(inner: &mut Inner, share: &'a Share, server: &str) -> Held<'a> {
        inner.held += 1;
        *inner.held_on.entry(server.to_owned()).or_default() += 1;
        Held {
            share,
            server: server.to_owned(),
            released: false,
        }
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
}

/// A source this process serves, counted in its share until dropped (or given back).
pub struct Held<'a> {
    share: &'a Share,
    server: String,
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
            inner.held -= 1;
            *inner.held_on.get_mut(&self.server).expect("held") -= 1;
            self.released = true;
        }
        over
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if !self.released {
            let mut inner = self.share.inner.lock().expect("share lock");
            inner.held -= 1;
            *inner.held_on.get_mut(&self.server).expect("held") -= 1;
        }
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
            .map(|_| share.try_hold("s").expect("alone, it takes every source"))
            .collect();
        assert_eq!(share.try_hold("s").err(), Some(Refusal::FairShare));
        // Two more processes: the share is ceil(10 / 3) = 4, so 6 are given back.
        share.members("a", 3);
        let given_back = held
            .iter_mut()
            .filter_map(|h| h.over_share().then_some(()))
            .count();
        assert_eq!(given_back, 6);
        assert_eq!(share.try_hold("s").err(), Some(Refusal::FairShare));
    }

    #[test]
    fn one_source_is_served_by_every_process_unless_capped() {
        let share = Share::new(&settings(None, None));
        share.set_sources(1);
        share.members("a", 5);
        assert_eq!(share.slots(), MAX_SLOTS);
        assert!(share.try_hold("s").is_ok());
        let capped = Share::new(&settings(Some(2), None));
        capped.set_sources(1);
        assert_eq!(capped.slots(), 2);
    }

    #[test]
    fn the_connection_budget_of_a_server_is_shared_out_among_the_processes() {
        // 40 connections, 2 processes: 20 each, 4 per source (pool 3 + LISTEN): 5 sources.
        let share = Share::new(&settings(None, Some(40)));
        share.set_sources(50);
        share.members("a", 2);
        let held: Vec<Held> = (0..5)
            .map(|_| share.try_hold("s").expect("within the budget"))
            .collect();
        assert_eq!(share.try_hold("s").err(), Some(Refusal::Budget));
        assert!(share.try_hold("other server").is_ok());
        drop(held);
        assert!(share.try_hold("s").is_ok());
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
        // 40 connections, 2 processes: 20 each; 6 sources, a fair share of 3, 4 connections
        // each (pool 3 + LISTEN): 12 reserved, 8 left for kept poll sessions.
        let share = Share::new(&settings(None, Some(40)));
        share.set_sources(6);
        share.members("a", 2);
        assert!(
            share.try_keep("s").is_none(),
            "until it has polled every source, the process does not know the fleet's size"
        );
        join(&share, 6);
        let mut kept: Vec<Kept> = (0..8)
            .map(|_| share.try_keep("s").expect("within the room left"))
            .collect();
        assert!(share.try_keep("s").is_none());
        assert!(kept.iter_mut().all(|k| !k.excess()));
        // A third process: 13 each, a fair share of 2 (8 connections): 5 left, 3 must close.
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
        // 40 connections, one process, 4 sources (4 connections each): 16 reserved, 24 left.
        let share = Share::new(&settings(None, Some(40)));
        share.set_sources(4);
        share.members("a", 1);
        join(&share, 4);
        let mut kept: Vec<Kept> = (0..30).filter_map(|_| share.try_keep("s")).collect();
        assert_eq!(kept.len(), 24);
        let held: Vec<Held> = (0..4)
            .map(|_| share.try_hold("s").expect("its fair share"))
            .collect();
        assert_eq!(
            kept.iter_mut()
                .filter_map(|k| k.excess().then_some(()))
                .count(),
            0
        );
        // A second process: 20 each and a fair share of 2, but the 4 sources served until
        // two are given back keep their 16: 4 left, 20 must close.
        share.members("a", 2);
        assert_eq!(
            kept.iter_mut()
                .filter_map(|k| k.excess().then_some(()))
                .count(),
            20
        );
        drop(held);
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

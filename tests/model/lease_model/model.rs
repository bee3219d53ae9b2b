//! The lease protocol as a state machine: the rows of `outbox.messages` as the SQL functions
//! change them, the batches the relayers hold, and the clock. Each action is one SQL call
//! (atomic: the functions lock and re-check the rows they change, so under READ COMMITTED
//! each call acts on its rows as one step) or one step of a relayer.
//!
//! | action          | mirrors                                                            |
//! | --------------- | ------------------------------------------------------------------ |
//! | `Claim`         | `outbox.claim_outbox_batch_seq` (04_claim.sql): heads, the runs behind them, a fresh token and `lease_expires_at = now() + lease` each |
//! | `Publish`       | one call of a destination by `Lane::attempt` (src/dispatch), after the publish-window check (`Window::check`, src/destination/window.rs; the window comes from the lease book of src/relay/leases.rs) |
//! | `GiveBackRest`  | `Outcome::NotAttempted` for what is left of a part: window closed, circuit open, destination panicked |
//! | `Abandon`       | the shutdown deadline firing while a part is published: `Relay::deliver` releases the whole part |
//! | `Release`       | `outbox.release_outbox_leases` (05_completion.sql), called by `Relay::complete` for what was not attempted |
//! | `Report`        | `outbox.complete_outbox_batch` (05_completion.sql) with `apply_outcomes` and `promote_heads` |
//! | `Extend`        | `outbox.extend_outbox_leases` (05_completion.sql), sent by the lease keeper, then `LeaseBook::extended` when every lease of the part was held |
//! | `Repair`        | `outbox.repair_expired_leases` (06_repair_retention.sql) for one row: a ZOMBIE_REQUEUE attempt, dead-lettered when out of attempts |
//! | `Crash`         | a relayer (or one batch's task) dying: its batch is forgotten, its leases left to expire |
//! | `Tick`          | the clock advancing one tick, for the database and every relayer alike |
//!
//! A stalled relayer is not an action: it is every interleaving in which the clock ticks while
//! a batch takes no step; its late actions are the steps it takes afterwards.
//!
//! Time is kept relative, so the state space is finite without a bound on the clock: a lease
//! keeps the ticks it has left (`lease_expires_at - now()`, expired at 0: the fences ask for
//! `lease_expires_at > now()`), a batch the ticks left in its publish window.

use std::fmt;

use stateright::{Model, Property};

/// When the relayer checks that a batch may still be published.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowCheck {
    /// Before every call to a destination: the contract.
    PerCall,
    /// Once, before the first call of a batch. Not enough: a batch that stalls between two
    /// calls publishes after its lease was taken over.
    PerBatch,
}

/// The lease fence of completion, extension and release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    /// `claimed_by = p_worker_id AND lease_token = token AND lease_expires_at > now()`.
    Full,
    /// Without `lease_expires_at > now()` (a broken fence).
    WithoutExpiry,
    /// Without `lease_token = token`, the worker id alone (a broken fence).
    WithoutToken,
}

/// The bounds and the variant checked.
#[derive(Clone, Debug)]
pub struct LeaseModel {
    /// One entry per message, in enqueue order (`seq`): its key, `None` for an unkeyed one.
    pub keys: Vec<Option<char>>,
    /// One entry per batch slot: the worker id it claims with. Two slots of one id are one
    /// relayer with two batches in flight; a slot holds one batch at a time.
    pub workers: Vec<char>,
    /// `p_batch_size`.
    pub batch_size: usize,
    /// `p_lease_seconds`, in ticks.
    pub lease_ticks: u8,
    /// `max_attempts` of every message.
    pub max_attempts: u8,
    pub check: WindowCheck,
    pub fence: Fence,
}

impl LeaseModel {
    /// The publish window: four fifths of the lease (`Relay::publish_window`), in whole ticks.
    pub fn window_ticks(&self) -> u8 {
        self.lease_ticks * 4 / 5
    }
}

/// A row of `outbox.messages`, or where it went.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Row {
    Pending {
        attempt_count: u8,
        lease: Option<Lease>,
    },
    /// Deleted by a DISPATCHED completion.
    Delivered,
    /// Moved to `outbox.dead_letters`.
    DeadLetter,
}

/// `claimed_by`, `lease_token` and `lease_expires_at` of a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Lease {
    /// The batch slot whose claim set it: `claimed_by` is that slot's worker id.
    pub holder: usize,
    /// Tokens are random and never reused; here the smallest number no batch still holds for
    /// the message, which is the same for every comparison the fences make.
    pub token: u8,
    /// Ticks until `lease_expires_at`; expired at 0.
    pub left: u8,
}

/// What a destination call came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Acknowledged: DISPATCHED.
    Delivered,
    /// Arrived, but no answer within the deadline: RETRYABLE.
    Unanswered,
    /// Refused for now, did not arrive: RETRYABLE.
    Refused,
    /// Refused for good, did not arrive: FAILED.
    Rejected,
}

impl Outcome {
    pub const ALL: [Outcome; 4] = [
        Outcome::Delivered,
        Outcome::Unanswered,
        Outcome::Refused,
        Outcome::Rejected,
    ];

    fn arrives(self) -> bool {
        matches!(self, Outcome::Delivered | Outcome::Unanswered)
    }
}

/// Where one message of a batch is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    Waiting,
    Sent(Outcome),
    /// Not attempted; to be released.
    GivenBack,
    Released,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Entry {
    pub message: usize,
    pub token: u8,
    pub step: Step,
}

/// A claimed batch (one destination's part: every message goes to the one destination).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Batch {
    /// In enqueue order, as the claim returns them.
    pub entries: Vec<Entry>,
    /// Ticks left in the publish window (`LeaseBook::publish_before`).
    pub window_left: u8,
    /// A call was made: the once-per-batch check is behind it.
    pub started: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub rows: Vec<Row>,
    pub batches: Vec<Option<Batch>>,
    /// `outbox.attempts`: how many attempts each message has.
    pub attempts: Vec<u8>,
    /// An attempt was written under a number other than the message's next one (a gap or a
    /// repeat).
    pub attempt_misnumbered: bool,
    /// What the consumer saw: per message, whether it arrived.
    pub arrived: Vec<bool>,
    /// A message arrived for the first time after a later message of its key had.
    pub arrived_out_of_order: bool,
    /// A call published a message under a lease its batch did not hold (lost or expired).
    pub published_outside_lease: bool,
    /// A call published a message whose lease its batch had lost (taken over: repaired,
    /// claimed again, completed).
    pub published_after_takeover: bool,
    /// A completion, extension or release was applied although its caller did not hold the
    /// lease (the token it claimed with, unexpired).
    pub applied_without_lease: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Claim {
        batch: usize,
        messages: Vec<usize>,
    },
    Publish {
        batch: usize,
        message: usize,
        outcome: Outcome,
    },
    GiveBackRest {
        batch: usize,
    },
    Abandon {
        batch: usize,
    },
    Release {
        batch: usize,
    },
    Report {
        batch: usize,
    },
    Extend {
        batch: usize,
    },
    Crash {
        batch: usize,
    },
    Repair {
        message: usize,
    },
    Tick,
}

impl LeaseModel {
    /// Whether the batch in `slot`, holding `token`, passes the fence of `row` as this
    /// model's fence checks it (`claimed_by` is compared with that slot's worker id).
    fn fence(&self, row: &Row, slot: usize, token: u8) -> bool {
        match row {
            Row::Pending { lease: Some(l), .. } => {
                self.workers[l.holder] == self.workers[slot]
                    && (self.fence == Fence::WithoutToken || l.token == token)
                    && (self.fence == Fence::WithoutExpiry || l.left > 0)
            }
            _ => false,
        }
    }

    /// Whether `message` could be in one claim together with the messages of `set`: ready
    /// and unleased, and either unkeyed, its key's head (no earlier message of its key
    /// pending), or in the run behind a head of the claim (every earlier pending message of
    /// its key is in the claim).
    fn claimable(&self, s: &State, set: u32) -> bool {
        let size = set.count_ones() as usize;
        if size == 0 || size > self.batch_size {
            return false;
        }
        (0..self.keys.len())
            .filter(|m| set & (1 << m) != 0)
            .all(|m| {
                matches!(s.rows[m], Row::Pending { lease: None, .. })
                    && self.keys[m].is_none_or(|k| {
                        (0..m).all(|e| {
                            self.keys[e] != Some(k)
                                || !matches!(s.rows[e], Row::Pending { .. })
                                || set & (1 << e) != 0
                        })
                    })
            })
    }

    /// The index of the entry before entry `i` in its key, within the batch.
    fn predecessor(&self, batch: &Batch, i: usize) -> Option<usize> {
        let key = self.keys[batch.entries[i].message]?;
        (0..i)
            .rev()
            .find(|&j| self.keys[batch.entries[j].message] == Some(key))
    }

    /// Whether the window check lets `batch` call its destination now.
    fn may_call(&self, batch: &Batch) -> bool {
        match self.check {
            WindowCheck::PerCall => batch.window_left > 0,
            WindowCheck::PerBatch => batch.started || batch.window_left > 0,
        }
    }

    /// `Lane::attempt_in_runs`: what follows, in its key, a message that was not delivered is
    /// not attempted.
    fn give_back_behind_failures(&self, batch: &mut Batch) {
        for i in 0..batch.entries.len() {
            if batch.entries[i].step != Step::Waiting {
                continue;
            }
            if let Some(p) = self.predecessor(batch, i)
                && !matches!(
                    batch.entries[p].step,
                    Step::Waiting | Step::Sent(Outcome::Delivered)
                )
            {
                batch.entries[i].step = Step::GivenBack;
            }
        }
    }

    fn fresh_token(s: &State, message: usize) -> u8 {
        let held: Vec<u8> = s
            .batches
            .iter()
            .flatten()
            .flat_map(|b| &b.entries)
            .filter(|e| e.message == message)
            .map(|e| e.token)
            .collect();
        (0..).find(|t| !held.contains(t)).expect("a free token")
    }

    /// `apply_outcomes` for one row the caller has fenced: the attempt, then delete,
    /// dead-letter or requeue.
    fn apply(&self, s: &mut State, message: usize, state: AttemptState) {
        let Row::Pending { attempt_count, .. } = s.rows[message] else {
            unreachable!("only pending rows pass a fence");
        };
        let number = attempt_count + 1;
        if number != s.attempts[message] + 1 {
            s.attempt_misnumbered = true;
        }
        s.attempts[message] += 1;
        let exhausted = number >= self.max_attempts;
        s.rows[message] = match state {
            AttemptState::Dispatched => Row::Delivered,
            AttemptState::Failed => Row::DeadLetter,
            AttemptState::Retryable | AttemptState::ZombieRequeue if exhausted => Row::DeadLetter,
            AttemptState::Retryable | AttemptState::ZombieRequeue => Row::Pending {
                attempt_count: number,
                lease: None,
            },
        };
    }

    /// Runs the fence for one entry of `batch` and records whether the call was applied
    /// without the lease (which the full fence never does).
    fn fenced(&self, s: &mut State, batch: usize, message: usize, token: u8) -> bool {
        let row = &s.rows[message];
        let passes = self.fence(row, batch, token);
        if passes && !self.holds(row, batch, token) {
            s.applied_without_lease = true;
        }
        passes
    }
}

/// `outbox.attempt_state`.
#[derive(Clone, Copy)]
enum AttemptState {
    Dispatched,
    Retryable,
    Failed,
    ZombieRequeue,
}

impl LeaseModel {
    /// Whether the batch in `slot` holds the lease of `row` under `token`: claimed by its
    /// worker with that token, not expired (the full fence).
    fn holds(&self, row: &Row, slot: usize, token: u8) -> bool {
        matches!(row, Row::Pending { lease: Some(l), .. }
            if self.workers[l.holder] == self.workers[slot] && l.token == token && l.left > 0)
    }

    /// Whether the lease of `row` under `token` was taken over: the row was leased again
    /// (another token) or settled (delivered, dead-lettered). A lease repaired and not yet
    /// claimed again is lost, not taken over.
    fn taken_over(&self, row: &Row, slot: usize, token: u8) -> bool {
        match row {
            Row::Pending { lease: None, .. } => false,
            Row::Pending { .. } => self.lost(row, slot, token),
            Row::Delivered | Row::DeadLetter => true,
        }
    }

    /// Whether the lease of `row` under `token` is gone: its row no longer carries it.
    fn lost(&self, row: &Row, slot: usize, token: u8) -> bool {
        !matches!(row, Row::Pending { lease: Some(l), .. }
            if self.workers[l.holder] == self.workers[slot] && l.token == token)
    }
}

impl Model for LeaseModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        assert!(
            self.window_ticks() >= 1,
            "lease_ticks must be at least 2, so that the publish window is at least one tick"
        );
        assert!(self.keys.len() <= 8, "at most 8 messages");
        let n = self.keys.len();
        vec![State {
            rows: vec![
                Row::Pending {
                    attempt_count: 0,
                    lease: None
                };
                n
            ],
            batches: vec![None; self.workers.len()],
            attempts: vec![0; n],
            attempt_misnumbered: false,
            arrived: vec![false; n],
            arrived_out_of_order: false,
            published_outside_lease: false,
            published_after_takeover: false,
            applied_without_lease: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        for (b, batch) in s.batches.iter().enumerate() {
            let Some(batch) = batch else {
                for set in 1..(1u32 << self.keys.len()) {
                    if self.claimable(s, set) {
                        actions.push(Action::Claim {
                            batch: b,
                            messages: (0..self.keys.len())
                                .filter(|m| set & (1 << m) != 0)
                                .collect(),
                        });
                    }
                }
                continue;
            };
            let waiting = batch.entries.iter().any(|e| e.step == Step::Waiting);
            let sent = batch
                .entries
                .iter()
                .any(|e| matches!(e.step, Step::Sent(_)));
            if waiting {
                if self.may_call(batch) {
                    for (i, e) in batch.entries.iter().enumerate() {
                        let ready = self.predecessor(batch, i).is_none_or(|p| {
                            batch.entries[p].step == Step::Sent(Outcome::Delivered)
                        });
                        if e.step == Step::Waiting && ready {
                            for outcome in Outcome::ALL {
                                actions.push(Action::Publish {
                                    batch: b,
                                    message: e.message,
                                    outcome,
                                });
                            }
                        }
                    }
                }
                actions.push(Action::GiveBackRest { batch: b });
                if sent {
                    actions.push(Action::Abandon { batch: b });
                }
            } else if batch.entries.iter().any(|e| e.step == Step::GivenBack) {
                actions.push(Action::Release { batch: b });
            } else {
                actions.push(Action::Report { batch: b });
            }
            actions.push(Action::Extend { batch: b });
            actions.push(Action::Crash { batch: b });
        }
        for (m, row) in s.rows.iter().enumerate() {
            if matches!(row, Row::Pending { lease: Some(l), .. } if l.left == 0) {
                actions.push(Action::Repair { message: m });
            }
        }
        let timers = s
            .rows
            .iter()
            .any(|r| matches!(r, Row::Pending { lease: Some(l), .. } if l.left > 0))
            || s.batches.iter().flatten().any(|b| b.window_left > 0);
        if timers {
            actions.push(Action::Tick);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Claim { batch, messages } => {
                let mut entries = Vec::new();
                for m in messages {
                    let token = Self::fresh_token(&s, m);
                    let Row::Pending { lease, .. } = &mut s.rows[m] else {
                        unreachable!("claimable rows are pending");
                    };
                    *lease = Some(Lease {
                        holder: batch,
                        token,
                        left: self.lease_ticks,
                    });
                    entries.push(Entry {
                        message: m,
                        token,
                        step: Step::Waiting,
                    });
                }
                s.batches[batch] = Some(Batch {
                    entries,
                    window_left: self.window_ticks(),
                    started: false,
                });
            }
            Action::Publish {
                batch,
                message,
                outcome,
            } => {
                let b = s.batches[batch].as_mut().expect("a batch in flight");
                let entry = b
                    .entries
                    .iter_mut()
                    .find(|e| e.message == message)
                    .expect("a message of the batch");
                let row = &s.rows[message];
                if !self.holds(row, batch, entry.token) {
                    s.published_outside_lease = true;
                }
                if self.taken_over(row, batch, entry.token) {
                    s.published_after_takeover = true;
                }
                entry.step = Step::Sent(outcome);
                b.started = true;
                self.give_back_behind_failures(b);
                if outcome.arrives() && !s.arrived[message] {
                    s.arrived[message] = true;
                    let key = self.keys[message];
                    if key.is_some()
                        && (message + 1..self.keys.len())
                            .any(|later| self.keys[later] == key && s.arrived[later])
                    {
                        s.arrived_out_of_order = true;
                    }
                }
            }
            Action::GiveBackRest { batch } | Action::Abandon { batch } => {
                let all = matches!(action, Action::Abandon { .. });
                let b = s.batches[batch].as_mut().expect("a batch in flight");
                for e in &mut b.entries {
                    if e.step == Step::Waiting || (all && matches!(e.step, Step::Sent(_))) {
                        e.step = Step::GivenBack;
                    }
                }
            }
            Action::Release { batch } => {
                let mut b = s.batches[batch].take().expect("a batch in flight");
                for e in &mut b.entries {
                    if e.step != Step::GivenBack {
                        continue;
                    }
                    if self.fenced(&mut s, batch, e.message, e.token) {
                        let Row::Pending { lease, .. } = &mut s.rows[e.message] else {
                            unreachable!("only pending rows pass a fence");
                        };
                        *lease = None;
                    }
                    e.step = Step::Released;
                }
                if b.entries.iter().any(|e| matches!(e.step, Step::Sent(_))) {
                    s.batches[batch] = Some(b);
                }
            }
            Action::Report { batch } => {
                let b = s.batches[batch].take().expect("a batch in flight");
                for e in &b.entries {
                    let Step::Sent(outcome) = e.step else {
                        continue;
                    };
                    if self.fenced(&mut s, batch, e.message, e.token) {
                        let state = match outcome {
                            Outcome::Delivered => AttemptState::Dispatched,
                            Outcome::Unanswered | Outcome::Refused => AttemptState::Retryable,
                            Outcome::Rejected => AttemptState::Failed,
                        };
                        self.apply(&mut s, e.message, state);
                    }
                }
            }
            Action::Extend { batch } => {
                let entries = s.batches[batch].as_ref().expect("a batch").entries.clone();
                let mut all_held = true;
                for e in &entries {
                    if self.fenced(&mut s, batch, e.message, e.token) {
                        let Row::Pending { lease: Some(l), .. } = &mut s.rows[e.message] else {
                            unreachable!("only leased rows pass a fence");
                        };
                        l.left = self.lease_ticks;
                    } else {
                        all_held = false;
                    }
                }
                if all_held {
                    s.batches[batch].as_mut().expect("a batch").window_left = self.window_ticks();
                }
            }
            Action::Crash { batch } => s.batches[batch] = None,
            Action::Repair { message } => {
                self.apply(&mut s, message, AttemptState::ZombieRequeue);
            }
            Action::Tick => {
                for row in &mut s.rows {
                    if let Row::Pending { lease: Some(l), .. } = row {
                        l.left = l.left.saturating_sub(1);
                    }
                }
                for b in s.batches.iter_mut().flatten() {
                    b.window_left = b.window_left.saturating_sub(1);
                }
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ONE_HOLDER, |model: &LeaseModel, s: &State| {
                (0..model.keys.len()).all(|m| {
                    s.batches
                        .iter()
                        .flatten()
                        .filter(|b| {
                            model.may_call(b)
                                && b.entries
                                    .iter()
                                    .any(|e| e.message == m && e.step == Step::Waiting)
                        })
                        .count()
                        <= 1
                })
            }),
            Property::always(HOLDER_ONLY, |_: &LeaseModel, s: &State| {
                !s.applied_without_lease
            }),
            Property::always(GAPLESS, |_: &LeaseModel, s: &State| !s.attempt_misnumbered),
            Property::always(NOTHING_LOST, |_: &LeaseModel, s: &State| {
                s.rows.iter().enumerate().all(|(m, row)| match row {
                    Row::Pending { .. } => true,
                    Row::Delivered => s.arrived[m],
                    Row::DeadLetter => s.attempts[m] > 0,
                })
            }),
            Property::always(KEY_ORDER, |_: &LeaseModel, s: &State| {
                !s.arrived_out_of_order
            }),
            Property::always(NO_PUBLISH_AFTER_TAKEOVER, |_: &LeaseModel, s: &State| {
                !s.published_after_takeover
            }),
            Property::always(PUBLISH_WITHIN_LEASE, |_: &LeaseModel, s: &State| {
                !s.published_outside_lease
            }),
            Property::sometimes(ALL_DELIVERED, |_: &LeaseModel, s: &State| {
                s.rows.iter().all(|r| *r == Row::Delivered)
            }),
            Property::sometimes(SOME_DEAD_LETTER, |_: &LeaseModel, s: &State| {
                s.rows.contains(&Row::DeadLetter)
            }),
            Property::sometimes(
                STALLED_BATCH_LOST_ITS_LEASE,
                |model: &LeaseModel, s: &State| {
                    s.batches.iter().enumerate().any(|(b, batch)| {
                        batch.as_ref().is_some_and(|batch| {
                            batch.entries.iter().any(|e| {
                                e.step == Step::Waiting
                                    && model.lost(&s.rows[e.message], b, e.token)
                            })
                        })
                    })
                },
            ),
        ]
    }
}

pub const ONE_HOLDER: &str = "no two batches may publish one message at once";
pub const HOLDER_ONLY: &str =
    "a completion, extension or release is applied only for the holder within its lease";
pub const GAPLESS: &str = "attempt numbers per message are 1, 2, 3 … without a gap";
pub const NOTHING_LOST: &str =
    "every message is pending, delivered (and arrived) or dead-lettered (with an attempt)";
pub const KEY_ORDER: &str = "per key, first deliveries are in enqueue order";
pub const NO_PUBLISH_AFTER_TAKEOVER: &str = "a batch whose lease was taken over publishes nothing";
pub const PUBLISH_WITHIN_LEASE: &str = "every publish is made under a lease its batch holds";
pub const ALL_DELIVERED: &str = "every message can be delivered";
pub const SOME_DEAD_LETTER: &str = "a message can be dead-lettered";
pub const STALLED_BATCH_LOST_ITS_LEASE: &str =
    "a stalled batch can lose the lease of a message it has not published";

impl fmt::Display for State {
    /// One line: each row, then each batch.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rows: Vec<String> = self
            .rows
            .iter()
            .enumerate()
            .map(|(m, row)| match row {
                Row::Pending {
                    attempt_count,
                    lease: None,
                } => format!("m{m}:ready(a{attempt_count})"),
                Row::Pending {
                    attempt_count,
                    lease: Some(l),
                } => format!(
                    "m{m}:leased(b{}#{},{}t left,a{attempt_count})",
                    l.holder, l.token, l.left
                ),
                Row::Delivered => format!("m{m}:delivered"),
                Row::DeadLetter => format!("m{m}:dead"),
            })
            .collect();
        let batches: Vec<String> = self
            .batches
            .iter()
            .enumerate()
            .map(|(b, batch)| match batch {
                None => format!("b{b}:idle"),
                Some(batch) => {
                    let entries: Vec<String> = batch
                        .entries
                        .iter()
                        .map(|e| format!("m{}#{}:{:?}", e.message, e.token, e.step))
                        .collect();
                    format!("b{b}:[{}] window {}t", entries.join(" "), batch.window_left)
                }
            })
            .collect();
        let seen: Vec<String> = (0..self.arrived.len())
            .filter(|&m| self.arrived[m])
            .map(|m| format!("m{m}"))
            .collect();
        write!(
            f,
            "{} | {} | arrived: {}",
            rows.join(" "),
            batches.join(" "),
            seen.join(",")
        )
    }
}

//! How a batch is cut into calls of a service's size (a Pub/Sub publish request, a Kinesis
//! `PutRecords`, an SQS `SendMessageBatch`), for the destinations that send a batch as
//! such calls. It exists because those calls may carry a key's run (see
//! [`super::Destination::keeps_key_order`]), and then which call a message goes in, and
//! when that call is sent, is what keeps the key's order:
//!
//! - a key's consecutive messages bound for one target (topic, queue, stream) go in one
//!   call, in enqueue order, whenever they fit in one;
//! - a run that does not fit (more entries or bytes than a call takes), or a key whose
//!   messages go to different targets, is cut into parts that go out in successive
//!   **rounds**: a round's calls are sent together, and the next round only once they were
//!   all answered;
//! - before a round, a message whose key had a message not delivered in an earlier round
//!   is not sent: it is given back ([`Outcome::NotAttempted`]) to wait for it; so is one
//!   behind a message of its key refused before anything was sent ([`behind_refused`]).
//!
//! A batch without runs (no key twice) is one round: its calls are what a plain cut by
//! target, count and size gives, in batch order.

use std::collections::{HashMap, HashSet};
use std::future::Future;

use futures_util::StreamExt;

use crate::message::{ClaimedMessage, Outcome};

/// One message ready for a call: its place in the batch, its target, its key, its size as
/// the service counts it, and what the service's request carries for it.
pub(super) struct Entry<T> {
    pub at: usize,
    pub target: String,
    pub key: Option<String>,
    pub bytes: usize,
    pub item: T,
}

/// One call: the round it goes out in, its target and its entries, in order.
pub(super) struct Call<T> {
    pub round: usize,
    pub target: String,
    pub entries: Vec<Entry<T>>,
}

/// A stretch of a key's consecutive messages bound for one target (or one unkeyed
/// message), and its place among the key's stretches.
struct Unit<T> {
    ordinal: usize,
    first: usize,
    entries: Vec<Entry<T>>,
}

/// Cuts `entries` (in batch order) into calls of at most `max_count` entries and
/// `max_bytes` bytes, a call per target, following the rules of this module.
pub(super) fn plan<T>(entries: Vec<Entry<T>>, max_count: usize, max_bytes: usize) -> Vec<Call<T>> {
    let max_count = max_count.max(1);
    // Each key's stretches, in the key's order.
    let mut units: Vec<Unit<T>> = Vec::new();
    let mut open: HashMap<String, usize> = HashMap::new();
    for e in entries {
        let Some(key) = e.key.clone() else {
            units.push(Unit {
                ordinal: 0,
                first: e.at,
                entries: vec![e],
            });
            continue;
        };
        match open.get(&key).copied() {
            Some(u) if units[u].entries[0].target == e.target => units[u].entries.push(e),
            previous => {
                let ordinal = previous.map_or(0, |u| units[u].ordinal + 1);
                open.insert(key, units.len());
                units.push(Unit {
                    ordinal,
                    first: e.at,
                    entries: vec![e],
                });
            }
        }
    }
    // A key's earlier stretches are placed first, so that its later ones know their round.
    units.sort_by_key(|u| (u.ordinal, u.first));
    let mut calls: Vec<Call<T>> = Vec::new();
    let mut bytes: Vec<usize> = Vec::new();
    // The call still open for each (target, round).
    let mut filling: HashMap<(String, usize), usize> = HashMap::new();
    // The round after a key's last stretch.
    let mut next_round: HashMap<String, usize> = HashMap::new();
    for unit in units {
        let key = unit.entries[0].key.clone();
        let target = unit.entries[0].target.clone();
        let round = key
            .as_ref()
            .and_then(|k| next_round.get(k).copied())
            .unwrap_or(0);
        let size: usize = unit.entries.iter().map(|e| e.bytes).sum();
        let count = unit.entries.len();
        let slot = filling.get(&(target.clone(), round)).copied();
        let mut last = round;
        match slot {
            Some(c)
                if calls[c].entries.len() + count <= max_count && bytes[c] + size <= max_bytes =>
            {
                calls[c].entries.extend(unit.entries);
                bytes[c] += size;
            }
            _ if count <= max_count && size <= max_bytes => {
                filling.insert((target.clone(), round), calls.len());
                calls.push(Call {
                    round,
                    target,
                    entries: unit.entries,
                });
                bytes.push(size);
            }
            _ => {
                // Too big for one call: parts in successive rounds.
                let mut current: Option<usize> = None;
                for e in unit.entries {
                    let fits = current.is_some_and(|c| {
                        calls[c].entries.len() < max_count && bytes[c] + e.bytes <= max_bytes
                    });
                    if !fits {
                        if current.is_some() {
                            last += 1;
                        }
                        current = Some(calls.len());
                        calls.push(Call {
                            round: last,
                            target: target.clone(),
                            entries: Vec::new(),
                        });
                        bytes.push(0);
                    }
                    let c = current.expect("a call to add to");
                    bytes[c] += e.bytes;
                    calls[c].entries.push(e);
                }
            }
        }
        if let Some(k) = key {
            next_round.insert(k, last + 1);
        }
    }
    calls.sort_by_key(|c| c.round);
    calls
}

/// Sends `calls` round by round, up to `concurrency` calls at once within a round, and
/// answers `(place in the batch, outcome)` for every entry. `send` sends one call and
/// answers each of its entries. Before a round, an entry whose key had a message not
/// delivered in an earlier round is given back unsent.
pub(super) async fn in_rounds<T, F, Fut>(
    calls: Vec<Call<T>>,
    concurrency: usize,
    send: F,
) -> Vec<(usize, Outcome)>
where
    F: Fn(Call<T>) -> Fut,
    Fut: Future<Output = Vec<(usize, Outcome)>>,
{
    let keys: HashMap<usize, String> = calls
        .iter()
        .flat_map(|c| &c.entries)
        .filter_map(|e| e.key.clone().map(|k| (e.at, k)))
        .collect();
    let mut answered = Vec::new();
    let mut stopped: HashSet<String> = HashSet::new();
    let mut calls = calls.into_iter().peekable();
    while let Some(round) = calls.peek().map(|c| c.round) {
        let mut this = Vec::new();
        while let Some(mut call) = calls.next_if(|c| c.round == round) {
            call.entries.retain(|e| match &e.key {
                Some(k) if stopped.contains(k) => {
                    answered.push((e.at, Outcome::behind_undelivered(k)));
                    false
                }
                _ => true,
            });
            if !call.entries.is_empty() {
                this.push(call);
            }
        }
        let outcomes: Vec<Vec<(usize, Outcome)>> = futures_util::stream::iter(this)
            .map(&send)
            .buffer_unordered(concurrency.max(1))
            .collect()
            .await;
        for (at, outcome) in outcomes.into_iter().flatten() {
            if outcome != Outcome::Delivered
                && let Some(k) = keys.get(&at)
            {
                stopped.insert(k.clone());
            }
            answered.push((at, outcome));
        }
    }
    answered
}

/// Leaves out of `entries` the messages of `batch` behind an earlier message of their key
/// whose outcome is already known (refused before anything was sent: a message the service
/// would refuse, a target that cannot be found), and gives them back in `outcomes`.
pub(super) fn behind_refused<T>(
    batch: &[ClaimedMessage],
    outcomes: &mut [Option<Outcome>],
    entries: Vec<Entry<T>>,
) -> Vec<Entry<T>> {
    let mut first_refused: HashMap<&str, usize> = HashMap::new();
    for (at, m) in batch.iter().enumerate() {
        if let (Some(key), Some(_)) = (m.key.as_deref(), &outcomes[at]) {
            first_refused.entry(key).or_insert(at);
        }
    }
    if first_refused.is_empty() {
        return entries;
    }
    entries
        .into_iter()
        .filter(|e| {
            let behind = e
                .key
                .as_deref()
                .and_then(|k| first_refused.get(k).map(|&first| (k, first)))
                .filter(|&(_, first)| first < e.at);
            match behind {
                Some((k, _)) => {
                    outcomes[e.at] = Some(Outcome::behind_undelivered(k));
                    false
                }
                None => true,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(at: usize, target: &str, key: Option<&str>, bytes: usize) -> Entry<()> {
        Entry {
            at,
            target: target.into(),
            key: key.map(str::to_owned),
            bytes,
            item: (),
        }
    }

    fn shape(calls: &[Call<()>]) -> Vec<(usize, String, Vec<usize>)> {
        calls
            .iter()
            .map(|c| {
                (
                    c.round,
                    c.target.clone(),
                    c.entries.iter().map(|e| e.at).collect(),
                )
            })
            .collect()
    }

    #[test]
    fn without_runs_the_calls_are_a_cut_by_target_count_and_size_in_one_round() {
        let mut entries: Vec<Entry<()>> = (0..5).map(|i| entry(i, "a", None, 10)).collect();
        entries.push(entry(5, "b", Some("k"), 10));
        entries.push(entry(6, "a", Some("j"), 25));
        assert_eq!(
            shape(&plan(entries, 2, 40)),
            [
                (0, "a".into(), vec![0, 1]),
                (0, "a".into(), vec![2, 3]),
                (0, "a".into(), vec![4, 6]),
                (0, "b".into(), vec![5]),
            ]
        );
    }

    #[test]
    fn a_keys_run_goes_in_one_call_and_what_does_not_fit_in_later_rounds() {
        let entries = vec![
            entry(0, "t", Some("k"), 1),
            entry(1, "t", None, 1),
            entry(2, "t", Some("k"), 1),
            entry(3, "t", Some("big"), 1),
            entry(4, "t", Some("big"), 1),
            entry(5, "t", Some("big"), 1),
            entry(6, "t", Some("big"), 1),
            entry(7, "t", Some("k"), 1),
        ];
        assert_eq!(
            shape(&plan(entries, 3, 100)),
            [
                (0, "t".into(), vec![0, 2, 7]),
                (0, "t".into(), vec![1]),
                (0, "t".into(), vec![3, 4, 5]),
                (1, "t".into(), vec![6]),
            ]
        );
    }

    #[test]
    fn a_key_moving_between_targets_waits_for_its_earlier_stretch() {
        let entries = vec![
            entry(0, "a", Some("k"), 1),
            entry(1, "a", Some("k"), 1),
            entry(2, "b", Some("k"), 1),
            entry(3, "a", Some("k"), 1),
            entry(4, "b", None, 1),
        ];
        assert_eq!(
            shape(&plan(entries, 10, 100)),
            [
                (0, "a".into(), vec![0, 1]),
                (0, "b".into(), vec![4]),
                (1, "b".into(), vec![2]),
                (2, "a".into(), vec![3]),
            ]
        );
    }

    #[test]
    fn a_message_behind_one_refused_before_sending_is_given_back() {
        let message = |key: Option<&str>| {
            let mut m = ClaimedMessage::example(serde_json::json!({}));
            m.key = key.map(str::to_owned);
            m
        };
        let batch = vec![
            message(Some("k")),
            message(Some("k")),
            message(Some("k")),
            message(None),
            message(Some("j")),
        ];
        let refused = Outcome::Permanent {
            reason: "too big".into(),
        };
        let mut outcomes = vec![None, Some(refused.clone()), None, None, None];
        let entries = vec![
            entry(0, "t", Some("k"), 1),
            entry(2, "t", Some("k"), 1),
            entry(3, "t", None, 1),
            entry(4, "t", Some("j"), 1),
        ];
        let left: Vec<usize> = behind_refused(&batch, &mut outcomes, entries)
            .iter()
            .map(|e| e.at)
            .collect();
        assert_eq!(
            left,
            [0, 3, 4],
            "the key's message before the refused one still goes"
        );
        assert_eq!(outcomes[1], Some(refused));
        assert_eq!(outcomes[2], Some(Outcome::behind_undelivered("k")));
    }

    #[tokio::test]
    async fn a_round_leaves_out_the_keys_that_failed_before_it() {
        let entries = vec![
            entry(0, "t", Some("k"), 1),
            entry(1, "t", Some("k"), 1),
            entry(2, "t", Some("k"), 1),
            entry(3, "t", None, 1),
        ];
        let sent = std::sync::Mutex::new(Vec::new());
        let answered = in_rounds(plan(entries, 1, 100), 4, |call| {
            let at: Vec<usize> = call.entries.iter().map(|e| e.at).collect();
            sent.lock().unwrap().extend(at.clone());
            async move {
                at.into_iter()
                    .map(|at| {
                        let outcome = if at == 1 {
                            Outcome::Retryable {
                                reason: "busy".into(),
                                retry_after: None,
                            }
                        } else {
                            Outcome::Delivered
                        };
                        (at, outcome)
                    })
                    .collect()
            }
        })
        .await;
        let mut sent = sent.into_inner().unwrap();
        sent.sort_unstable();
        assert_eq!(sent, [0, 1, 3], "the message after the failure is not sent");
        let mut answered = answered;
        answered.sort_by_key(|(at, _)| *at);
        assert_eq!(answered[0].1, Outcome::Delivered);
        assert!(matches!(answered[1].1, Outcome::Retryable { .. }));
        assert_eq!(answered[2].1, Outcome::behind_undelivered("k"));
        assert_eq!(answered[3].1, Outcome::Delivered);
    }
}

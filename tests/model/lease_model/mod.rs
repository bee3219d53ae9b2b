//! The lease protocol, model-checked: every interleaving of claims, destination calls,
//! completions, extensions, releases, repairs, crashes and clock ticks of a few relayers
//! over a few messages is explored (breadth first, exhaustively, with stateright), and the
//! protocol's safety properties are checked in every state reached. The model is in
//! `model.rs`, which says which SQL function each action mirrors; what it leaves
//! out, the bounds and the figures are in docs/lease-model.md.
//!
//! The broken variants show that the properties can fail: checked once per batch instead of
//! before every call, the publish window lets a stalled relayer publish after its lease was
//! taken over (the stale-publish bug), and a fence without the expiry or the token accepts
//! a completion from a relayer that no longer holds the lease. Each prints the shortest
//! counterexample.

mod model;

use std::collections::BTreeSet;
use std::time::Instant;

use model::{Fence, LeaseModel, WindowCheck};
use stateright::{Checker, HasDiscoveries, Model};

fn model(keys: &str, workers: &str, batch_size: usize) -> LeaseModel {
    LeaseModel {
        keys: keys.chars().map(|k| (k != '-').then_some(k)).collect(),
        workers: workers.chars().collect(),
        batch_size,
        lease_ticks: 2,
        max_attempts: 2,
        check: WindowCheck::PerCall,
        fence: Fence::Full,
    }
}

/// The bounds of `model`, in words.
fn bounds(model: &LeaseModel) -> String {
    let messages: Vec<String> = model
        .keys
        .iter()
        .enumerate()
        .map(|(m, k)| match k {
            Some(k) => format!("m{m} (key {k})"),
            None => format!("m{m} (unkeyed)"),
        })
        .collect();
    let batches: Vec<String> = model
        .workers
        .iter()
        .enumerate()
        .map(|(b, w)| format!("b{b} (worker {w})"))
        .collect();
    format!(
        "messages {}; batch slots {}; batch size {}; lease {} ticks, publish window {}; max_attempts {}; window checked {:?}; fence {:?}",
        messages.join(", "),
        batches.join(", "),
        model.batch_size,
        model.lease_ticks,
        model.window_ticks(),
        model.max_attempts,
        model.check,
        model.fence
    )
}

/// Checks every state of `model` and asserts every property: no counterexample to a safety
/// property, and an example of each `sometimes` one (the scenarios it covers are reached).
fn check_all(model: LeaseModel) {
    let started = Instant::now();
    let bounds = bounds(&model);
    let checker = model.checker().spawn_bfs().join();
    println!(
        "{bounds}: {} states ({} unique), depth {}, {:.1} s",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed().as_secs_f64()
    );
    assert!(checker.is_done(), "the search stopped before the end");
    checker.assert_properties();
}

/// Searches `model` for a counterexample to `property`, prints the shortest one (each state
/// on one line, the step taken from it below it), and returns its steps.
fn counterexample(model: LeaseModel, property: &'static str) -> Vec<String> {
    let started = Instant::now();
    let holds = model
        .properties()
        .into_iter()
        .find(|p| p.name == property)
        .expect("a property of the model")
        .condition;
    let checker = model
        .clone()
        .checker()
        .finish_when(HasDiscoveries::AnyOf(BTreeSet::from([property])))
        .spawn_bfs()
        .join();
    let path = checker
        .discovery(property)
        .unwrap_or_else(|| panic!("no counterexample to {property:?}"));
    let mut steps = Vec::new();
    let mut lines = vec![format!(
        "counterexample to {property:?} ({} states searched, {:.1} s)\n{}:",
        checker.unique_state_count(),
        started.elapsed().as_secs_f64(),
        bounds(&model)
    )];
    // The path may run on past the first state that breaks the property: it ends there.
    for (state, action) in path.into_vec() {
        lines.push(format!("     {state}"));
        match action {
            Some(action) if holds(&model, &state) => {
                lines.push(format!("  -> {action:?}"));
                steps.push(format!("{action:?}"));
            }
            _ => break,
        }
    }
    println!("{}", lines.join("\n"));
    steps
}

#[test]
fn two_relayers_over_three_messages_of_one_key_keep_every_property() {
    check_all(model("aaa", "AB", 2));
}

#[test]
fn two_relayers_over_two_keys_with_one_attempt_each_keep_every_property() {
    check_all(LeaseModel {
        max_attempts: 1,
        ..model("aab", "AB", 2)
    });
}

#[test]
fn one_relayer_with_two_batches_in_flight_keeps_every_property() {
    check_all(LeaseModel {
        lease_ticks: 5,
        ..model("aa", "AA", 2)
    });
}

#[test]
fn two_relayers_with_a_window_of_four_fifths_of_a_five_tick_lease_keep_every_property() {
    check_all(LeaseModel {
        lease_ticks: 5,
        ..model("aa", "AB", 2)
    });
}

#[test]
fn checked_once_per_batch_the_window_lets_a_stalled_relayer_publish_after_a_takeover() {
    let broken = LeaseModel {
        check: WindowCheck::PerBatch,
        ..model("aa", "AB", 2)
    };
    let steps = counterexample(broken, model::NO_PUBLISH_AFTER_TAKEOVER);
    assert!(
        steps.last().is_some_and(|s| s.starts_with("Publish")),
        "the violation is a publish: {steps:?}"
    );
    assert!(
        steps.iter().filter(|s| s.starts_with("Claim")).count() >= 2,
        "another claim took the lease over before the late publish: {steps:?}"
    );
}

#[test]
fn checked_once_per_batch_the_window_lets_a_stale_message_arrive_after_a_newer_one_of_its_key() {
    let broken = LeaseModel {
        check: WindowCheck::PerBatch,
        max_attempts: 1,
        ..model("aab", "AB", 2)
    };
    let steps = counterexample(broken, model::KEY_ORDER);
    assert!(
        steps.last().is_some_and(|s| s.starts_with("Publish")),
        "the violation is a publish: {steps:?}"
    );
}

#[test]
fn a_fence_without_the_expiry_applies_a_call_after_the_lease_ran_out() {
    let broken = LeaseModel {
        fence: Fence::WithoutExpiry,
        ..model("a", "AB", 1)
    };
    assert_ends_in_a_fenced_call(&counterexample(broken, model::HOLDER_ONLY));
}

#[test]
fn a_fence_without_the_token_applies_a_call_of_a_stale_batch_of_the_same_relayer() {
    let broken = LeaseModel {
        fence: Fence::WithoutToken,
        ..model("a", "AA", 1)
    };
    assert_ends_in_a_fenced_call(&counterexample(broken, model::HOLDER_ONLY));
}

/// The last step of `steps` is a call the fence decides: a completion, an extension or a
/// release.
fn assert_ends_in_a_fenced_call(steps: &[String]) {
    assert!(
        steps.last().is_some_and(|s| {
            s.starts_with("Report") || s.starts_with("Extend") || s.starts_with("Release")
        }),
        "the violation is a fenced call: {steps:?}"
    );
}

#[test]
fn the_publish_window_is_four_fifths_of_the_lease() {
    let m = LeaseModel {
        lease_ticks: 5,
        ..model("a", "A", 1)
    };
    assert_eq!(m.window_ticks(), 4);
}

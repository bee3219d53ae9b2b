//! The fleet on a connection budget too short for its sources, under faults
//! ([`crate::fleet_turns`]): 50 databases, 3 processes, a budget of 45 (room for 12 sources
//! at once), messages arriving for 20 s, a kill, a start, a source dropped and one added.

use crate::common::TestDb;
use crate::fleet_turns::{Turns, run};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_short_budget_serves_every_source_in_turns_within_the_bound_and_never_exceeds_it() {
    let _serial = crate::SERIAL.lock().await;
    let db = TestDb::new().await;
    let figures = run(
        &db,
        Turns {
            sources: 50,
            arriving: Duration::from_secs(20),
            per_wave: 4,
            budget: 45,
        },
    )
    .await
    .unwrap_or_else(|broken| panic!("{broken}"));
    println!("fleet turns: {figures}");
    db.finish().await;
}

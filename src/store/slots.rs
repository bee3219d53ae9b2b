//! The ring of slots of `outbox.messages`: `rotate_messages` moves producers on to the next
//! empty slot once the current one has been current for its period, and truncates a slot
//! in which nothing is pending. Truncation is what gives back the space delivered messages
//! leave behind while a snapshot holds the MVCC horizon, which vacuum may not; the database
//! decides what may be truncated, under its own lock (`schema/06_repair_retention.sql`).

use super::{Result, Store};

/// Result of one `rotate_messages` call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rotation {
    /// The slot producers write to after the call.
    pub current_slot: i32,
    /// The slot the call truncated.
    pub truncated_slot: Option<i32>,
    /// A slot with nothing pending that other transactions held open: left for the next
    /// call.
    pub busy_slot: Option<i32>,
    /// How many slots other than the current one hold a pending message; `None` when
    /// another process had the turn.
    pub pinned_slots: Option<i32>,
}

impl Store {
    /// `outbox.rotate_messages`: one pass over the slots, with the database's default
    /// period.
    pub async fn rotate(&self) -> Result<Rotation> {
        let row = self
            .client()
            .await?
            .query_typed_one(&self.sql("SELECT * FROM outbox.rotate_messages()"), &[])
            .await?;
        Ok(Rotation {
            current_slot: row.get(0),
            truncated_slot: row.get(1),
            busy_slot: row.get(2),
            pinned_slots: row.get(3),
        })
    }
}

//! The `adopt` verb: relays an outbox table an application already writes (Debezium's, or
//! any table by a mapping of its columns) by installing, or removing, the trigger of
//! `outbox.adopt_table` on it; and lists the tables adopted. Its producers change nothing.

use anyhow::{Context, Result, bail};
use outbox_relay::store::Store;

#[derive(clap::Args)]
pub struct Args {
    /// The application's table (`schema.table`; unqualified: found on the search path).
    #[arg(required_unless_present = "list")]
    table: Option<String>,
    /// The mapping of columns to start from: `debezium` (topic aggregatetype, key
    /// aggregateid, id id, payload payload; type, timestamp and tracingspancontext as
    /// headers) or `none` (--mapping alone).
    #[arg(long, default_value = "debezium", value_parser = ["debezium", "none"])]
    preset: String,
    /// Mapping keys over the preset's, a JSON object, e.g.
    /// '{"topic_value":"orders","key":"order_id","payload":"body"}' (docs/from-debezium.md).
    #[arg(long, value_name = "JSON", conflicts_with_all = ["remove", "list"])]
    mapping: Option<String>,
    /// Remove the adoption: drop its triggers, leaving the table as it was.
    #[arg(long, conflicts_with = "list")]
    remove: bool,
    /// List the adopted tables and their mappings.
    #[arg(long)]
    list: bool,
}

impl Args {
    /// Whether the verb only reads (`--list`).
    pub fn list(&self) -> bool {
        self.list
    }
}

/// Adopts, unadopts or lists, as `args` ask.
pub async fn run(store: &Store, args: &Args) -> Result<()> {
    if args.list {
        for adopted in store
            .adopted_tables()
            .await
            .context("list adopted tables")?
        {
            let state = if adopted.enabled {
                ""
            } else {
                " (trigger disabled)"
            };
            outln!("{}{state}\t{}", adopted.table, adopted.mapping);
        }
        return Ok(());
    }
    let Some(table) = args.table.as_deref() else {
        bail!("give the table to adopt, or --list");
    };
    if args.remove {
        if store.unadopt_table(table).await.context("unadopt")? {
            outln!("{table} is no longer adopted");
        } else {
            outln!("{table} was not adopted; nothing changed");
        }
        return Ok(());
    }
    let mapping = args
        .mapping
        .as_deref()
        .map(serde_json::from_str::<serde_json::Value>)
        .transpose()
        .context("--mapping is not valid JSON")?;
    let preset = (args.preset != "none").then_some(args.preset.as_str());
    let resolved = store
        .adopt_table(table, preset, mapping.as_ref())
        .await
        .context("adopt")?;
    outln!("adopted {table}: {resolved}");
    Ok(())
}

//! The `outbox-relay` command line.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use outbox_relay::message::NewMessage;
use outbox_relay::store::Store;

const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

#[derive(Parser)]
#[command(
    name = "outbox-relay",
    version,
    about = "Relays a Postgres transactional outbox to a destination"
)]
struct Cli {
    /// Postgres URL of the database holding the outbox.
    #[arg(long, env = "DATABASE_URL", default_value = DEFAULT_DATABASE_URL, global = true, hide_env_values = true)]
    database_url: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Apply the embedded schema migrations (idempotent); prints what it applied.
    Migrate,
    /// Enqueue one message (for trying things by hand).
    Enqueue {
        #[arg(long)]
        topic: String,
        /// Messages with the same key are delivered one at a time, in order.
        #[arg(long)]
        key: Option<String>,
        /// The payload, a JSON document.
        #[arg(long)]
        payload: String,
    },
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let store = Store::connect(&cli.database_url, 2)?;
    match cli.command {
        Command::Migrate => {
            let applied = store.migrate().await.context("migrate")?;
            if applied.is_empty() {
                println!("schema is up to date");
            }
            for name in applied {
                println!("applied {name}");
            }
        }
        Command::Enqueue {
            topic,
            key,
            payload,
        } => {
            let payload = serde_json::from_str(&payload).context("--payload is not valid JSON")?;
            let id = store
                .enqueue(&NewMessage {
                    topic,
                    key,
                    payload,
                    ..NewMessage::default()
                })
                .await
                .context("enqueue")?;
            println!("{id}");
        }
    }
    Ok(())
}

//! Log set-up: human-readable lines by default, one JSON object per line with
//! `--log-format json`, on stderr (stdout belongs to the stdout sink). `RUST_LOG` filters
//! (default `info`). Our own events carry numbers as numbers and text as text, never a
//! `Debug` rendering; library events that would print a message's payload are off whatever
//! `RUST_LOG` says.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// How log lines are written (`--log-format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Human,
    Json,
}

/// lapin warns with an unroutable message the broker returned, in full: payload bytes
/// included. The AMQP destination reports the return itself, as the reason the message is
/// dead-lettered, so nothing is lost by silencing it.
const PAYLOAD_DUMPING: [&str; 1] = ["lapin::returned_messages=off"];

pub fn init(format: LogFormat) {
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    for directive in PAYLOAD_DUMPING {
        filter = filter.add_directive(directive.parse().expect("a valid directive"));
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal());
    // try_init: a second call (tests, bench) keeps the first subscriber.
    let _ = match format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

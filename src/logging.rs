//! Log set-up: human-readable lines by default, one JSON object per line with
//! `--log-format json`, on stderr (stdout belongs to the stdout sink). `RUST_LOG` filters
//! (default `info`). Our own events carry numbers as numbers and text as text, never a
//! `Debug` rendering; library events that would print a message's payload are off whatever
//! `RUST_LOG` says, and client libraries' chatter is quieted unless `RUST_LOG` names them.

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

/// Client libraries whose own lines an operator cannot act on, quieted unless `RUST_LOG`
/// names the crate. lapin logs the broker's frames as Rust `Debug` renderings (`Close {
/// reply_code: 403, reply_text: ShortString(…) }`), even in JSON; what they say reaches the
/// log in words anyway, as the destination's error at start and as each retry's reason.
/// async-nats logs every (re)connection at info; a lost connection shows up the same way.
/// refinery lists every migration it applies; `run --migrate` says how many, once.
const CLIENT_CHATTER: [(&str, &str); 3] = [
    ("lapin", "lapin=off"),
    ("async_nats", "async_nats=warn"),
    ("refinery", "refinery_core=warn"),
];

pub fn init(format: LogFormat) {
    let asked = std::env::var("RUST_LOG").unwrap_or_default();
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let quieted = CLIENT_CHATTER
        .iter()
        .filter(|(krate, _)| !asked.contains(krate))
        .map(|(_, directive)| *directive);
    for directive in quieted.chain(PAYLOAD_DUMPING) {
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

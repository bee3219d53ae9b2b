//! The `healthcheck` verb: asks a running relayer's probe server for `/healthz` (or
//! `/readyz`) and succeeds when it answers 200, for container HEALTHCHECKs (the image has
//! no curl).

use anyhow::{Result, bail};
use outbox_relay::probes;

/// Asks `/healthz`, or `/readyz` when `ready`, of the probe server at `addr`
/// [default: 127.0.0.1:9187]; prints the body.
pub async fn run(addr: Option<&str>, ready: bool) -> Result<()> {
    let addr = addr.unwrap_or("127.0.0.1:9187");
    let path = if ready { "/readyz" } else { "/healthz" };
    let (status, body) = probes::probe(addr, path).await?;
    out!("{body}");
    if status != 200 {
        bail!("{path} on {addr} answered HTTP {status}");
    }
    Ok(())
}

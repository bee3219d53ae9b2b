//! The `mqtt` destination's settings: what `[destinations.NAME]` may hold, checked before
//! anything connects (the broker's address, the protocol version, the topic template, the
//! client id, credentials, limits, the CloudEvents envelope and TLS), and the destination
//! they build. `build` takes them in that order, one named step each, so that the first
//! bad field is the one reported.

use std::sync::Arc;
use std::time::Duration;

use rumqttc::{TlsConfiguration, Transport};

use super::{MQTT_STRING, Mqtt, Protocol, Settings};
use crate::destination::cloudevents::{self, Envelope, Mode};
use crate::destination::{Setting, install_tls_provider};
use crate::error::ConfigError;

/// `type = "mqtt"`.
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MqttConfig {
    /// `mqtt://HOST[:PORT]` (1883) or `mqtts://HOST[:PORT]` (8883, TLS)
    /// [default: mqtt://127.0.0.1:1883].
    pub url: Option<String>,
    /// `"5"` or `"3.1.1"` [default: "5"].
    pub protocol: Option<String>,
    /// Topic template [default: `{topic}`].
    pub topic: Option<String>,
    /// Start of the client id; a random suffix makes it unique per process
    /// [default: outbox-relay].
    pub client_id: Option<String>,
    pub username: Option<String>,
    pub password: Option<String>,
    /// PEM file of the CA certificates to trust for `mqtts://` [default: the system's].
    pub ca_file: Option<std::path::PathBuf>,
    /// Keep-alive interval, 5..=3600 [default: 30].
    pub keep_alive_secs: Option<i64>,
    /// The largest publish packet sent; a larger message is permanent [default: 1048576].
    pub max_packet_bytes: Option<i64>,
    /// `"cloudevents"` to send each message as a CloudEvent [default: none].
    pub envelope: Option<String>,
    /// `"binary"` (MQTT 5 only) or `"structured"` [default: binary].
    pub cloudevents_mode: Option<String>,
    /// The CloudEvents `source` template [default: /outbox-relay].
    pub cloudevents_source: Option<String>,
    /// The CloudEvents `type` template [default: `{topic}`].
    pub cloudevents_type: Option<String>,
}

/// Where the broker is, from `url`.
struct Address<'a> {
    tls: bool,
    host: &'a str,
    port: u16,
}

impl MqttConfig {
    pub(in crate::destination) fn build(
        &self,
        at: Setting<'_>,
        deadline: Duration,
    ) -> Result<Mqtt, ConfigError> {
        let url = self.url.as_deref().unwrap_or("mqtt://127.0.0.1:1883");
        let address = address(at, url)?;
        let protocol = self.protocol(at)?;
        let topic = self.topic(at)?;
        let client_id = self.client_id(at)?;
        let credentials = self.credentials(at)?;
        let keep_alive = at.ranged("keep_alive_secs", self.keep_alive_secs, 30, 5, 3600)?;
        let max_packet = at.ranged(
            "max_packet_bytes",
            self.max_packet_bytes,
            1_048_576,
            1024,
            268_435_455,
        )?;
        let envelope = self.envelope(at, protocol)?;
        let transport = self.transport(at, address.tls)?;
        Ok(Mqtt {
            settings: Settings {
                host: address.host.to_owned(),
                port: address.port,
                protocol,
                client_id,
                credentials,
                transport,
                keep_alive: Duration::from_secs(keep_alive.unsigned_abs()),
                max_packet: usize::try_from(max_packet).unwrap_or(1_048_576),
            },
            url: url.to_owned(),
            topic: topic.to_owned(),
            timeout: deadline,
            session: tokio::sync::Mutex::new(None),
            envelope,
        })
    }

    /// The MQTT version to speak.
    fn protocol(&self, at: Setting<'_>) -> Result<Protocol, ConfigError> {
        match self.protocol.as_deref().unwrap_or("5") {
            "5" => Ok(Protocol::V5),
            "3.1.1" => Ok(Protocol::V311),
            other => Err(at.invalid(
                "protocol",
                format!("{other:?} is not an MQTT version this relayer speaks: \"5\" or \"3.1.1\""),
            )),
        }
    }

    /// The topic template, once what it adds to `{topic}` can be in a topic name.
    fn topic(&self, at: Setting<'_>) -> Result<&str, ConfigError> {
        let topic = self.topic.as_deref().unwrap_or("{topic}");
        if topic.is_empty() {
            return Err(at.invalid("topic", "must not be empty"));
        }
        if let Err(problem) = topic_problem(&topic.replace("{topic}", "")) {
            return Err(at.invalid("topic", problem));
        }
        Ok(topic)
    }

    /// The client id: the configured start and a random suffix, unique to the process.
    fn client_id(&self, at: Setting<'_>) -> Result<String, ConfigError> {
        let prefix = self.client_id.as_deref().unwrap_or("outbox-relay");
        if prefix.is_empty() || prefix.len() > 200 {
            return Err(at.invalid("client_id", "must be 1 to 200 bytes"));
        }
        Ok(format!(
            "{prefix}-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..10]
        ))
    }

    /// The user name and password, when a user name is given.
    fn credentials(&self, at: Setting<'_>) -> Result<Option<(String, String)>, ConfigError> {
        if self.password.is_some() && self.username.is_none() {
            return Err(at.invalid("password", "is sent only with a `username`"));
        }
        Ok(self
            .username
            .clone()
            .map(|u| (u, self.password.clone().unwrap_or_default())))
    }

    /// The CloudEvents envelope, if any, in a mode the protocol can carry.
    fn envelope(
        &self,
        at: Setting<'_>,
        protocol: Protocol,
    ) -> Result<Option<Envelope>, ConfigError> {
        let envelope = Envelope::from_settings(
            at,
            &cloudevents::Settings {
                envelope: self.envelope.as_deref(),
                mode: self.cloudevents_mode.as_deref(),
                source: self.cloudevents_source.as_deref(),
                kind: self.cloudevents_type.as_deref(),
            },
        )?;
        if protocol == Protocol::V311 && envelope.as_ref().is_some_and(|e| e.mode == Mode::Binary) {
            return Err(at.invalid(
                "cloudevents_mode",
                "MQTT 3.1.1 has no headers to carry binary mode's attributes: set \
                 cloudevents_mode = \"structured\" (or protocol = \"5\")",
            ));
        }
        Ok(envelope)
    }

    /// TLS for `mqtts://`, trusting `ca_file` or the system's certificates; none otherwise.
    fn transport(&self, at: Setting<'_>, tls: bool) -> Result<Option<Transport>, ConfigError> {
        if !tls {
            if self.ca_file.is_some() {
                return Err(at.invalid("ca_file", "is for mqtts:// URLs only"));
            }
            return Ok(None);
        }
        install_tls_provider();
        let mut roots = rustls::RootCertStore::empty();
        match &self.ca_file {
            Some(path) => {
                use rustls::pki_types::pem::PemObject;
                let certs = rustls::pki_types::CertificateDer::pem_file_iter(path)
                    .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| at.invalid("ca_file", format!("{}: {e}", path.display())))?;
                let (added, _) = roots.add_parsable_certificates(certs);
                if added == 0 {
                    return Err(at.invalid(
                        "ca_file",
                        format!("{}: no PEM certificate in the file", path.display()),
                    ));
                }
            }
            None => {
                roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
            }
        }
        let config = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Some(Transport::tls_with_config(TlsConfiguration::Rustls(
            Arc::new(config),
        ))))
    }
}

/// The broker's address in `url`: `mqtt://` or `mqtts://`, then HOST, HOST:PORT, [V6] or
/// [V6]:PORT, with no credentials, path or query.
fn address<'a>(at: Setting<'_>, url: &'a str) -> Result<Address<'a>, ConfigError> {
    let (tls, rest) = if let Some(rest) = url.strip_prefix("mqtt://") {
        (false, rest)
    } else if let Some(rest) = url.strip_prefix("mqtts://") {
        (true, rest)
    } else {
        return Err(at.invalid(
            "url",
            format!("{url:?} must start with mqtt:// or mqtts://"),
        ));
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains('@') {
        return Err(at.invalid(
            "url",
            "credentials go in `username` and `password`, not in the URL",
        ));
    }
    if rest.contains('/') || rest.contains('?') {
        return Err(at.invalid(
            "url",
            format!("{url:?}: an MQTT address is HOST[:PORT], with no path or query"),
        ));
    }
    let (host, port) = match rest.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((host, "")) => (host, None),
            Some((host, port)) => (host, port.strip_prefix(':')),
            None => return Err(at.invalid("url", format!("{url:?}: no ] after [IPv6"))),
        },
        None => match rest.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (rest, None),
        },
    };
    let port = match port {
        None => {
            if tls {
                8883
            } else {
                1883
            }
        }
        Some(port) => port.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| {
            at.invalid(
                "url",
                format!("{url:?}: the port {port:?} is not 1..=65535"),
            )
        })?,
    };
    if host.is_empty() {
        return Err(at.invalid("url", format!("{url:?} has no host")));
    }
    Ok(Address { tls, host, port })
}

/// Why `topic` cannot be an MQTT topic name, if it cannot.
pub(super) fn topic_problem(topic: &str) -> Result<(), String> {
    if topic.contains(['+', '#']) {
        return Err(format!(
            "{topic:?} has a wildcard (+ or #), which a topic name to publish to cannot have"
        ));
    }
    if topic.contains('\0') {
        return Err(format!("{topic:?} has a NUL character"));
    }
    if topic.len() > MQTT_STRING {
        return Err(format!(
            "the topic is {} bytes, over MQTT's {MQTT_STRING}",
            topic.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_topic_with_a_wildcard_is_refused() {
        assert!(topic_problem("a/+/b").is_err());
        assert!(topic_problem("a/#").is_err());
        assert!(topic_problem("a/b").is_ok());
    }
}

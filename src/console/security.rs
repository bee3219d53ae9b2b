//! The console's safety rules, in one place so that each can be read and tested on its
//! own: the admin token and its constant-time comparison, the refusal of unsafe methods
//! from another site (Sidekiq 8.1's rule: `Sec-Fetch-Site: same-origin`, or an `Origin`
//! naming this host), the headers every response carries (a Content-Security-Policy that
//! allows no inline script), and the refusal to listen on a non-loopback address without a
//! token unless read-only is asked for explicitly.

use std::net::SocketAddr;

use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use crate::error::ConfigError;

/// The Content-Security-Policy of every response: scripts, styles and everything else from
/// the console itself, no inline script or style, no framing, forms posting only here.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self'; \
     style-src 'self'; img-src 'self' data:; connect-src 'self'; object-src 'none'; \
     base-uri 'none'; frame-ancestors 'none'; form-action 'self'";

/// The admin token that allows the console's writes (replay). Kept as its SHA-256 digest:
/// a presented token is hashed and the digests compared in constant time, so neither the
/// comparison's duration nor its length reveals the token.
#[derive(Clone)]
pub struct AdminToken {
    digest: [u8; 32],
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(…)")
    }
}

impl AdminToken {
    /// The token `secret` (leading and trailing white space removed, as a file holding it
    /// ends with a newline); refused when shorter than 16 characters.
    pub fn new(secret: &str) -> Result<Self, ConfigError> {
        let secret = secret.trim();
        if secret.chars().count() < 16 {
            return Err(ConfigError::new(
                "console token",
                "must be at least 16 characters (OUTBOX_CONSOLE_TOKEN or --token-file)",
            ));
        }
        Ok(Self {
            digest: Sha256::digest(secret.as_bytes()).into(),
        })
    }

    /// Whether `presented` is the token, compared in constant time.
    pub fn matches(&self, presented: &str) -> bool {
        let other: [u8; 32] = Sha256::digest(presented.trim().as_bytes()).into();
        constant_time_eq(&self.digest, &other)
    }
}

/// Whether `a` and `b` are equal, looking at every byte whatever the first difference.
pub fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

/// Refuses to listen on `listen` (not a loopback address) without a token, unless
/// `read_only` was given explicitly: an address others can reach then serves a console
/// that can only look.
pub fn check_listen(
    listen: SocketAddr,
    token: Option<&AdminToken>,
    read_only: bool,
) -> Result<(), ConfigError> {
    if listen.ip().is_loopback() || token.is_some() || read_only {
        return Ok(());
    }
    Err(ConfigError::new(
        "--listen",
        format!(
            "{listen} is not a loopback address and no admin token is configured: give a \
             token (OUTBOX_CONSOLE_TOKEN or --token-file) or say --read-only, so that a \
             console others can reach is never writable by accident"
        ),
    ))
}

/// Middleware: every response gets the security headers; a request with an unsafe method
/// (anything but GET, HEAD and OPTIONS) from another site is refused with 403 before any
/// handler runs. A console that listens on a loopback address (`loopback`) answers only
/// requests whose `Host` is a loopback name: a page of another site that rebinds its own
/// name to 127.0.0.1 (DNS rebinding) would otherwise read the console as its own origin.
pub async fn guard(loopback: bool, request: Request, next: Next) -> Response {
    let safe = matches!(
        *request.method(),
        Method::GET | Method::HEAD | Method::OPTIONS
    );
    let mut response = if loopback && !loopback_host(request.headers()) {
        tracing::warn!(
            host = request
                .headers()
                .get(header::HOST)
                .and_then(|v| v.to_str().ok())
                .unwrap_or(""),
            path = %request.uri().path(),
            "console refused a request for another host name (it listens on a loopback address)"
        );
        (
            StatusCode::MISDIRECTED_REQUEST,
            "refused: this console listens on a loopback address and answers only for \
             localhost, 127.0.0.1 or [::1] (a host name that merely resolves to it is refused)\n",
        )
            .into_response()
    } else if safe || same_origin(request.headers()) {
        next.run(request).await
    } else {
        tracing::warn!(
            method = %request.method(),
            path = %request.uri().path(),
            "console refused a request from another site (Sec-Fetch-Site / Origin)"
        );
        (
            StatusCode::FORBIDDEN,
            "refused: a state-changing request must come from the console's own pages \
             (Sec-Fetch-Site: same-origin, or an Origin naming this host)\n",
        )
            .into_response()
    };
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-store"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// Whether the request's `Host` names this machine's loopback interface: `localhost`, or a
/// loopback IP address (`127.0.0.1`, `[::1]`), with or without a port.
pub fn loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split_once(']').map_or("", |(ip, _)| ip)
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
            _ => host,
        }
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether the browser says the request comes from the console's own pages:
/// `Sec-Fetch-Site: same-origin`; without that header (older browsers), an `Origin` whose
/// host and port are the request's `Host`. Neither: refused.
pub fn same_origin(headers: &HeaderMap) -> bool {
    if let Some(site) = headers.get("sec-fetch-site") {
        return site.as_bytes() == b"same-origin";
    }
    let (Some(origin), Some(host)) = (
        headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()),
        headers.get(header::HOST).and_then(|v| v.to_str().ok()),
    ) else {
        return false;
    };
    origin
        .split_once("://")
        .is_some_and(|(_, authority)| authority.eq_ignore_ascii_case(host))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_host_names_are_loopback_hosts() {
        let host = |value: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::HOST, HeaderValue::from_str(value).unwrap());
            loopback_host(&h)
        };
        for ok in [
            "localhost",
            "LOCALHOST:9188",
            "127.0.0.1",
            "127.0.0.1:9188",
            "127.1.2.3:80",
            "[::1]",
            "[::1]:9188",
        ] {
            assert!(host(ok), "{ok}");
        }
        for refused in [
            "evil.example",
            "evil.example:9188",
            "localhost.evil.example",
            "10.0.0.1:9188",
            "[::2]:9188",
            "127.0.0.1.nip.io",
        ] {
            assert!(!host(refused), "{refused}");
        }
        assert!(!loopback_host(&HeaderMap::new()), "no Host at all");
    }

    #[test]
    fn a_token_matches_itself_only() {
        let token = AdminToken::new("correct horse battery staple\n").unwrap();
        assert!(token.matches("correct horse battery staple"));
        assert!(!token.matches("correct horse battery stapl"));
        assert!(!token.matches(""));
        assert!(AdminToken::new("short").is_err());
    }

    #[test]
    fn only_a_loopback_address_goes_without_token_or_read_only() {
        let token = AdminToken::new("0123456789abcdef").unwrap();
        let lan: SocketAddr = "0.0.0.0:9188".parse().unwrap();
        assert!(check_listen("127.0.0.1:9188".parse().unwrap(), None, false).is_ok());
        assert!(check_listen("[::1]:9188".parse().unwrap(), None, false).is_ok());
        assert!(check_listen(lan, None, false).is_err());
        assert!(check_listen(lan, None, true).is_ok());
        assert!(check_listen(lan, Some(&token), false).is_ok());
    }

    #[test]
    fn same_origin_needs_the_fetch_site_or_a_matching_origin() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.insert(*k, HeaderValue::from_static(v));
            }
            h
        };
        assert!(same_origin(&headers(&[("sec-fetch-site", "same-origin")])));
        assert!(!same_origin(&headers(&[("sec-fetch-site", "cross-site")])));
        assert!(!same_origin(&headers(&[
            ("sec-fetch-site", "same-site"),
            ("origin", "http://h:1"),
            ("host", "h:1")
        ])));
        assert!(same_origin(&headers(&[
            ("origin", "http://h:1"),
            ("host", "h:1")
        ])));
        assert!(!same_origin(&headers(&[
            ("origin", "http://evil:1"),
            ("host", "h:1")
        ])));
        assert!(!same_origin(&headers(&[("host", "h:1")])));
    }
}

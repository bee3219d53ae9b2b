//! The settings of a connection string that tokio-postgres does not read: the TLS settings,
//! read the way libpq reads them (`sslmode`, `sslrootcert`, `sslcert`, `sslkey` and
//! `sslnegotiation`), and the relayer's own `outbox_schema`, from a `postgres://` URL's
//! query or from `key=value` words (quoted values, `\\` escapes), apart from the rest of the
//! string, which tokio-postgres parses.

/// The TLS settings of the connection string (and their `PG*` environment variables).
pub(super) const TLS_KEYS: [(&str, &str); 5] = [
    ("sslmode", "PGSSLMODE"),
    ("sslrootcert", "PGSSLROOTCERT"),
    ("sslcert", "PGSSLCERT"),
    ("sslkey", "PGSSLKEY"),
    ("sslnegotiation", "PGSSLNEGOTIATION"),
];

/// libpq's `sslmode`, without `allow` (plain first, TLS on refusal), which tokio-postgres
/// cannot do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    pub(super) fn parse(value: &str) -> Result<Self, String> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            "allow" => {
                return Err(
                    "sslmode \"allow\" is not supported: use prefer (TLS when the \
                            server offers it) or disable"
                        .to_owned(),
                );
            }
            other => {
                return Err(format!(
                    "invalid sslmode {other:?}: expected disable, prefer, require, verify-ca \
                     or verify-full"
                ));
            }
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// The relayer's own setting of a connection string: the schema that holds the outbox
/// (see [`crate::connection::Target::schema`]).
pub(super) const SCHEMA_KEY: &str = "outbox_schema";

/// Splits the TLS settings and `outbox_schema` from the rest of a connection string (URL or
/// key=value).
pub(super) fn split_own_settings(url: &str) -> Result<(String, Vec<(String, String)>), String> {
    let is_tls = |key: &str| key == SCHEMA_KEY || TLS_KEYS.iter().any(|(k, _)| *k == key);
    let mut tls = Vec::new();
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let Some((base, query)) = url.split_once('?') else {
            return Ok((url.to_owned(), tls));
        };
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            if is_tls(key) {
                tls.push((key.to_owned(), percent_decode(value)));
            } else {
                kept.push(pair);
            }
        }
        let rest = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        return Ok((rest, tls));
    }
    check_form(url)?;
    let mut kept = Vec::new();
    for (key, value) in key_values(url)? {
        if is_tls(&key) {
            tls.push((key, value));
        } else {
            kept.push(format!(
                "{key}='{}'",
                value.replace('\\', "\\\\").replace('\'', "\\'")
            ));
        }
    }
    Ok((kept.join(" "), tls))
}

/// Refuses, with what was probably meant, the two shapes that are neither a `postgres://`
/// URL nor libpq's `key=value` words: a URL of another scheme (`postgress://`, `mysql://`)
/// and a bare word (a database name alone).
fn check_form(url: &str) -> Result<(), String> {
    let trimmed = url.trim();
    if let Some((scheme, _)) = trimmed.split_once("://")
        && !scheme.contains(['=', ' '])
    {
        return Err(format!(
            "unknown URL scheme {:?}: a database URL starts with postgres:// or postgresql:// \
             (postgres://USER@HOST:5432/DATABASE)",
            format!("{scheme}://")
        ));
    }
    if !trimmed.is_empty() && !trimmed.contains('=') {
        let shown = if trimmed
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
        {
            format!("{trimmed:?} ")
        } else {
            String::new()
        };
        return Err(format!(
            "the database URL {shown}is neither a URL nor key=value words: give \
             postgres://USER@HOST:5432/DATABASE, or dbname=DATABASE host=HOST"
        ));
    }
    Ok(())
}

/// libpq's `key=value` words: values may be single-quoted, with `\` escaping.
fn key_values(s: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    let skip_spaces = |chars: &mut std::iter::Peekable<std::str::Chars<'_>>| {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
    };
    loop {
        skip_spaces(&mut chars);
        if chars.peek().is_none() {
            return Ok(out);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        skip_spaces(&mut chars);
        if chars.next() != Some('=') {
            return Err(format!(
                "invalid connection string: missing \"=\" after {key:?}"
            ));
        }
        skip_spaces(&mut chars);
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    Some('\\') => value.extend(chars.next()),
                    Some('\'') => break,
                    Some(c) => value.push(c),
                    None => {
                        return Err(format!(
                            "invalid connection string: unterminated quoted value of {key:?}"
                        ));
                    }
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    value.extend(chars.next());
                } else {
                    value.push(c);
                }
            }
        }
        out.push((key, value));
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                let (h, l) = (hex(h).unwrap_or(0), hex(l).unwrap_or(0));
                out.push(u8::try_from(h * 16 + l).unwrap_or(b'?'));
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

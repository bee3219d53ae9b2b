//! How the relayer reaches Postgres. libpq users set TLS with `sslmode`, `sslrootcert`,
//! `sslcert`, `sslkey` and `sslnegotiation`, in the connection string or as `PGSSLMODE`, …
//! environment variables. tokio-postgres knows only part of that (it refuses `verify-ca` and
//! `verify-full` when parsing), so this module reads those settings itself, hands the rest
//! of the string to tokio-postgres, and builds the rustls connector that enforces the mode.
//! It also turns a failed connection into a sentence that says what is wrong.
//!
//! The modes keep libpq's meanings:
//! - `disable`: plain TCP.
//! - `prefer` (the default): TLS when the server offers it, plain otherwise.
//! - `require`: TLS or nothing. Like libpq, the certificate is not checked unless a root
//!   certificate is given (`sslrootcert`, or `~/.postgresql/root.crt` exists), in which case
//!   the chain is checked as in `verify-ca`. This keeps `require` working against managed
//!   services whose CA users never installed, the way it does for psql; it stops passive
//!   eavesdropping, not an active man in the middle, and the relayer says so in its log.
//! - `verify-ca`: TLS, and the server's chain must lead to a trusted root.
//! - `verify-full`: `verify-ca`, and the certificate must name the host connected to.
//!
//! The connection string also names the schema that holds the outbox: `outbox_schema`
//! (default `outbox`), the relayer's own parameter, which is never sent to the server.
//!
//! `settings.rs` reads the TLS settings and `outbox_schema` out of the connection string and
//! the environment;
//! `tls.rs` builds the rustls configuration and the verifier each mode needs.

mod settings;
mod tls;

use std::io;
use std::path::Path;
use std::str::FromStr;

use rustls::CertificateError;
use tokio_postgres::config::{Host, SslNegotiation};
use tokio_postgres_rustls::MakeRustlsConnect;

pub use settings::SslMode;
use settings::{SCHEMA_KEY, TLS_KEYS, split_own_settings};
use tls::{client_config, client_identity, file_roots, system_roots};

/// A parsed connection string: where to connect, as whom, and how to secure it.
#[derive(Clone)]
pub struct Target {
    pub config: tokio_postgres::Config,
    pub tls: MakeRustlsConnect,
    pub mode: SslMode,
    /// What the server's certificate is checked against.
    pub verification: Verification,
    /// The schema that holds the outbox (`outbox_schema`; [`DEFAULT_SCHEMA`] when unset).
    pub schema: String,
}

/// The schema of the outbox when the connection string names none.
pub const DEFAULT_SCHEMA: &str = "outbox";

/// SQL keywords that cannot name a schema unquoted (Postgres' reserved and type or function
/// name keywords), and `plpgsql`, whose settings prefix is reserved: the outbox's
/// statements name its schema unquoted (`NAME.messages`, the setting `NAME.woken`).
const NOT_A_SCHEMA_NAME: &[&str] = &[
    "all",
    "analyse",
    "analyze",
    "and",
    "any",
    "array",
    "as",
    "asc",
    "asymmetric",
    "authorization",
    "binary",
    "both",
    "case",
    "cast",
    "check",
    "collate",
    "collation",
    "column",
    "concurrently",
    "constraint",
    "create",
    "cross",
    "current_catalog",
    "current_date",
    "current_role",
    "current_schema",
    "current_time",
    "current_timestamp",
    "current_user",
    "default",
    "deferrable",
    "desc",
    "distinct",
    "do",
    "else",
    "end",
    "except",
    "false",
    "fetch",
    "for",
    "foreign",
    "freeze",
    "from",
    "full",
    "grant",
    "group",
    "having",
    "ilike",
    "in",
    "initially",
    "inner",
    "intersect",
    "into",
    "is",
    "isnull",
    "join",
    "lateral",
    "leading",
    "left",
    "like",
    "limit",
    "localtime",
    "localtimestamp",
    "natural",
    "not",
    "notnull",
    "null",
    "offset",
    "on",
    "only",
    "or",
    "order",
    "outer",
    "overlaps",
    "placing",
    "plpgsql",
    "primary",
    "references",
    "returning",
    "right",
    "select",
    "session_user",
    "similar",
    "some",
    "symmetric",
    "system_user",
    "table",
    "tablesample",
    "then",
    "to",
    "trailing",
    "true",
    "union",
    "unique",
    "user",
    "using",
    "variadic",
    "verbose",
    "when",
    "where",
    "window",
    "with",
];

/// Checks an outbox schema name: a plain lower-case identifier (letters, digits, `_`; at
/// most 48 characters, so that its derived names (`NAME_new`, the notification channel)
/// stay within Postgres' 63) that is not one of Postgres' own schemas, `public`, or an SQL
/// keyword. Every statement may put a name that passes into its text as it is.
pub fn check_schema_name(name: &str) -> Result<(), String> {
    let plain = !name.is_empty()
        && name.len() <= 48
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !plain {
        return Err(format!(
            "invalid outbox_schema {name:?}: use a lower-case identifier of letters, digits \
             and _ that starts with a letter or _, at most 48 characters"
        ));
    }
    if NOT_A_SCHEMA_NAME.contains(&name) {
        return Err(format!(
            "invalid outbox_schema {name:?}: an SQL keyword cannot name the outbox's schema"
        ));
    }
    if name.starts_with("pg_") || name == "public" || name == "information_schema" {
        return Err(format!(
            "invalid outbox_schema {name:?}: the outbox needs a schema of its own, not one of \
             Postgres' (pg_*, information_schema) or public"
        ));
    }
    Ok(())
}

/// The outbox schema `url` names (`outbox_schema`), if it names one.
pub fn schema_of(url: &str) -> Option<String> {
    let (_, own) = split_own_settings(url).ok()?;
    own.into_iter()
        .rev()
        .find(|(k, _)| k == SCHEMA_KEY)
        .map(|(_, v)| v)
}

/// `url` (a `postgres://` URL or `key=value` words) naming `schema` as its outbox schema,
/// unless it names one already (its own wins).
pub fn with_schema(url: &str, schema: &str) -> String {
    if schema == DEFAULT_SCHEMA || schema_of(url).is_some() {
        return url.to_owned();
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}{SCHEMA_KEY}={schema}")
    } else {
        format!("{url} {SCHEMA_KEY}={schema}")
    }
}

/// How much of the server's certificate is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verification {
    /// Nothing (plain TCP, or TLS without a root certificate in prefer/require).
    None,
    /// The chain leads to a trusted root.
    Chain,
    /// The chain and the host name.
    ChainAndHost,
}

impl Target {
    /// Reads `url` (a `postgres://` URL or libpq `key=value` words), with libpq's `PG*`
    /// variables from the process environment filling what it leaves out.
    pub fn parse(url: &str) -> Result<Self, String> {
        Self::parse_with_env(url, |name| std::env::var(name).ok())
    }

    /// [`Target::parse`] with the environment given as a lookup.
    pub fn parse_with_env(url: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let (rest, mut tls) = split_own_settings(url)?;
        for (key, variable) in TLS_KEYS {
            if !tls.iter().any(|(k, _)| k == key)
                && let Some(value) = env(variable).filter(|v| !v.is_empty())
            {
                tls.push((key.to_owned(), value));
            }
        }
        let setting = |key: &str| {
            tls.iter()
                .rev()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
        };
        let mode = SslMode::parse(setting("sslmode").unwrap_or("prefer"))?;
        let schema = setting(SCHEMA_KEY).unwrap_or(DEFAULT_SCHEMA).to_owned();
        check_schema_name(&schema)?;
        let mut config = tokio_postgres::Config::from_str(&rest).map_err(|e| describe_chain(&e))?;
        if config.get_password().is_none()
            && let Some(password) = env("PGPASSWORD")
        {
            config.password(password);
        }
        config.ssl_mode(match mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        });
        match setting("sslnegotiation") {
            None | Some("postgres") => {}
            Some("direct") if matches!(mode, SslMode::Disable | SslMode::Prefer) => {
                return Err(format!(
                    "sslnegotiation=direct needs sslmode=require or stronger (it is {})",
                    mode.as_str()
                ));
            }
            Some("direct") => {
                config.ssl_negotiation(SslNegotiation::Direct);
            }
            Some(other) => {
                return Err(format!(
                    "invalid sslnegotiation {other:?}: expected postgres or direct"
                ));
            }
        }
        let home_file = |name: &str| {
            std::env::var_os("HOME")
                .map(|home| Path::new(&home).join(".postgresql").join(name))
                .filter(|path| path.exists())
        };
        let roots = match setting("sslrootcert") {
            Some("system") => Some(system_roots()?),
            Some(path) => Some(file_roots(Path::new(path))?),
            None if mode == SslMode::Disable => None,
            None => match home_file("root.crt") {
                Some(path) => Some(file_roots(&path)?),
                None if matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull) => {
                    return Err(format!(
                        "sslmode={} needs a root certificate to check the server against: set \
                         sslrootcert to a CA file, or sslrootcert=system for the platform's \
                         trusted roots",
                        mode.as_str()
                    ));
                }
                None => None,
            },
        };
        let client_auth = match (setting("sslcert"), setting("sslkey")) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some(client_identity(Path::new(cert), Path::new(key))?),
            (Some(_), None) => return Err("sslcert is set but sslkey is not".to_owned()),
            (None, Some(_)) => return Err("sslkey is set but sslcert is not".to_owned()),
        };
        let verification = match (mode, &roots) {
            (SslMode::Disable, _) | (_, None) => Verification::None,
            (SslMode::VerifyFull, Some(_)) => Verification::ChainAndHost,
            (_, Some(_)) => Verification::Chain,
        };
        let tls = MakeRustlsConnect::new(client_config(verification, roots, client_auth)?);
        Ok(Target {
            config,
            tls,
            mode,
            verification,
            schema,
        })
    }

    /// `host:port` of every host the connection may go to.
    pub fn address(&self) -> String {
        let ports = self.config.get_ports();
        self.config
            .get_hosts()
            .iter()
            .enumerate()
            .map(|(i, host)| {
                let port = ports
                    .get(i)
                    .or_else(|| ports.first())
                    .copied()
                    .unwrap_or(5432);
                match host {
                    Host::Tcp(name) => format!("{name}:{port}"),
                    Host::Unix(path) => format!("{}/.s.PGSQL.{port}", path.display()),
                }
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `127.0.0.1:5432 as "relay", database "app"` (and `, schema "NAME"` for an outbox
    /// schema other than `outbox`), for messages (never the password).
    pub fn describe(&self) -> String {
        let user = self.config.get_user().unwrap_or("(default user)");
        let database = self.config.get_dbname().unwrap_or(user);
        let schema = if self.schema == DEFAULT_SCHEMA {
            String::new()
        } else {
            format!(", schema {:?}", self.schema)
        };
        format!(
            "{} as {user:?}, database {database:?}{schema}",
            self.address()
        )
    }

    /// Why the log should warn about this connection's security, if it should.
    pub fn weakness(&self) -> Option<String> {
        match (self.mode, self.verification) {
            (SslMode::Disable, _) => {
                Some("sslmode=disable: the connection to Postgres is not encrypted".to_owned())
            }
            (mode, Verification::None) => Some(format!(
                "sslmode={}: the server's certificate is not verified, so a man in the middle \
                 goes unnoticed; use sslmode=verify-full with sslrootcert",
                mode.as_str()
            )),
            _ => None,
        }
    }

    /// One connection, its driver spawned on the runtime.
    pub async fn connect(&self) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
        let (client, connection) = self.config.connect(self.tls.clone()).await?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "database connection ended");
            }
        });
        Ok(client)
    }

    /// Why connecting failed, in words: Postgres' own message and SQLSTATE, or what
    /// happened on the network or in the TLS handshake.
    pub fn explain(&self, e: &tokio_postgres::Error) -> String {
        if let Some(db) = e.as_db_error() {
            let code = db.code().code();
            if code == "28000" && db.message().contains("no encryption") {
                return format!(
                    "the server requires TLS (it says: {} (SQLSTATE {code})); sslmode is {}: \
                     set sslmode=require or stronger",
                    db.message(),
                    self.mode.as_str()
                );
            }
            let mut text = format!("{} (SQLSTATE {code})", db.message());
            if let Some(hint) = db.hint() {
                text += &format!("; hint: {hint}");
            }
            return text;
        }
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(cause) = source {
            if let Some(io) = cause.downcast_ref::<io::Error>() {
                if io.kind() == io::ErrorKind::ConnectionRefused {
                    return format!("connection refused ({})", self.address());
                }
                if let Some(tls) = io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
                    return self.explain_tls(tls);
                }
            }
            if let Some(tls) = cause.downcast_ref::<rustls::Error>() {
                return self.explain_tls(tls);
            }
            if cause.to_string() == "server does not support TLS" {
                return format!(
                    "the server does not support TLS, and sslmode={} requires it",
                    self.mode.as_str()
                );
            }
            source = cause.source();
        }
        if self.config.get_ssl_negotiation() == SslNegotiation::Direct {
            return format!(
                "{} (sslnegotiation=direct needs Postgres 17 or later: use sslnegotiation=postgres \
                 for older servers)",
                describe_chain(e)
            );
        }
        describe_chain(e)
    }

    fn explain_tls(&self, e: &rustls::Error) -> String {
        let why = match e {
            rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer) => {
                "the server's certificate is not signed by a trusted CA (check sslrootcert)"
                    .to_owned()
            }
            rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            ) => format!(
                "the server's certificate does not name the host {} (sslmode=verify-full checks \
                 the host name: connect by a name the certificate lists)",
                self.address()
            ),
            rustls::Error::InvalidCertificate(CertificateError::Expired)
            | rustls::Error::InvalidCertificate(CertificateError::ExpiredContext { .. }) => {
                "the server's certificate has expired".to_owned()
            }
            _ => "the TLS handshake failed".to_owned(),
        };
        format!("{why} ({e})")
    }
}

/// The error and every cause under it, joined by ": " (tokio-postgres keeps the useful part
/// of an error in its causes), each only once.
pub fn describe_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text += ": ";
            text += &more;
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn the_schema_is_named_once_and_a_connection_strings_own_wins() {
        use super::{check_schema_name, schema_of, with_schema};
        assert_eq!(
            with_schema("postgres://u@h/db", "outbox"),
            "postgres://u@h/db"
        );
        assert_eq!(
            with_schema("postgres://u@h/db", "t1"),
            "postgres://u@h/db?outbox_schema=t1"
        );
        assert_eq!(
            with_schema("postgres://u@h/db?sslmode=require", "t1"),
            "postgres://u@h/db?sslmode=require&outbox_schema=t1"
        );
        assert_eq!(
            with_schema("postgres://u@h/db?outbox_schema=a", "t1"),
            "postgres://u@h/db?outbox_schema=a"
        );
        assert_eq!(
            with_schema("host=h dbname=db outbox_schema = a", "t1"),
            "host=h dbname=db outbox_schema = a"
        );
        assert_eq!(
            with_schema("host=h dbname=db", "t1"),
            "host=h dbname=db outbox_schema=t1"
        );
        assert_eq!(schema_of("host=h password='x outbox_schema=y'"), None);
        let target =
            Target::parse_with_env("postgres://u@h/db?outbox_schema=t1", |_| None).unwrap();
        assert_eq!(target.schema, "t1");
        assert_eq!(target.config.get_dbname(), Some("db"));
        for bad in [
            "user", "order", "plpgsql", "public", "pg_x", "Tenant", "1a", "",
        ] {
            assert!(check_schema_name(bad).is_err(), "{bad}");
        }
        for good in ["tenant_1", "billing", "_x"] {
            assert!(check_schema_name(good).is_ok(), "{good}");
        }
    }

    #[test]
    fn a_misspelt_scheme_and_a_bare_database_name_are_named_with_the_fix() {
        let refusal = |url: &str| match Target::parse_with_env(url, no_env) {
            Ok(_) => panic!("{url} was accepted"),
            Err(e) => e,
        };
        let err = refusal("postgress://u:secret@h/db");
        assert!(err.contains("unknown URL scheme \"postgress://\""), "{err}");
        assert!(err.contains("postgres://USER@HOST:5432/DATABASE"), "{err}");
        assert!(!err.contains("secret"), "{err}");
        let err = refusal("mysql://h/db");
        assert!(err.contains("\"mysql://\""), "{err}");
        let err = refusal("orders");
        assert!(
            err.contains("\"orders\" is neither a URL nor key=value words"),
            "{err}"
        );
        assert!(err.contains("dbname=DATABASE"), "{err}");
        // A word that is not a plain name is not echoed: it may be a secret pasted in.
        let err = refusal("pa$$w0rd!");
        assert!(!err.contains("pa$$"), "{err}");
        // What libpq accepts is still accepted.
        for good in [
            "postgres://u@h/db",
            "postgresql://u@h/db",
            "host=h dbname=db",
            "dbname = 'x y'",
        ] {
            assert!(Target::parse_with_env(good, no_env).is_ok(), "{good}");
        }
    }

    #[test]
    fn tls_settings_leave_the_url_and_the_rest_stays() {
        let (rest, tls) = split_own_settings(
            "postgres://u:p@h:5433/db?sslmode=verify-full&application_name=x&sslrootcert=%2Fca.pem",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u:p@h:5433/db?application_name=x");
        assert_eq!(
            tls,
            vec![
                ("sslmode".to_owned(), "verify-full".to_owned()),
                ("sslrootcert".to_owned(), "/ca.pem".to_owned())
            ]
        );
        let (rest, tls) =
            split_own_settings("host=h user='a b' sslmode = require password='it\\'s'").unwrap();
        assert_eq!(rest, "host='h' user='a b' password='it\\'s'");
        assert_eq!(tls, vec![("sslmode".to_owned(), "require".to_owned())]);
        let config = tokio_postgres::Config::from_str(&rest).unwrap();
        assert_eq!(config.get_password(), Some(&b"it's"[..]));
    }

    #[test]
    fn modes_parse_with_libpq_names_and_bad_ones_are_named() {
        let t = Target::parse_with_env("postgres://u@h/db", no_env).unwrap();
        assert_eq!(
            (t.mode, t.verification),
            (SslMode::Prefer, Verification::None)
        );
        let t = Target::parse_with_env("postgres://u@h/db?sslmode=require", no_env).unwrap();
        assert_eq!(
            t.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
        assert!(t.weakness().unwrap().contains("not verified"));
        let e = Target::parse_with_env("postgres://u@h/db?sslmode=strict", no_env)
            .err()
            .unwrap();
        assert!(e.contains("invalid sslmode \"strict\""), "{e}");
        let e = Target::parse_with_env("postgres://u@h/db?sslmode=verify-full", no_env)
            .err()
            .unwrap();
        // Unless ~/.postgresql/root.crt exists, verify-full has nothing to verify against.
        if std::env::var_os("HOME")
            .is_none_or(|h| !Path::new(&h).join(".postgresql/root.crt").exists())
        {
            assert!(e.contains("needs a root certificate"), "{e}");
        }
        let e = Target::parse_with_env("postgres://u@h/db?sslrootcert=/nonexistent.pem", no_env)
            .err()
            .unwrap();
        assert!(e.contains("sslrootcert /nonexistent.pem"), "{e}");
    }

    #[test]
    fn pg_environment_fills_what_the_url_leaves_out() {
        let env = |name: &str| match name {
            "PGSSLMODE" => Some("disable".to_owned()),
            "PGPASSWORD" => Some("from-env".to_owned()),
            _ => None,
        };
        let t = Target::parse_with_env("postgres://u@h/db", env).unwrap();
        assert_eq!(t.mode, SslMode::Disable);
        assert_eq!(t.config.get_password(), Some(&b"from-env"[..]));
        let t = Target::parse_with_env("postgres://u:url@h/db?sslmode=require", env).unwrap();
        assert_eq!(t.mode, SslMode::Require, "the URL wins over PGSSLMODE");
        assert_eq!(t.config.get_password(), Some(&b"url"[..]));
        assert_eq!(t.address(), "h:5432");
        assert_eq!(t.describe(), "h:5432 as \"u\", database \"db\"");
    }
}

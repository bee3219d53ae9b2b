//! The `key-order` verb: chooses the scope of a key's order per topic pattern (the whole
//! outbox, the default, or per topic), removes a choice, and lists them. A choice applies to
//! the messages enqueued after it; the messages already pending keep the order they have.

use anyhow::{Context, Result};
use outbox_relay::dispatch::TopicPattern;
use outbox_relay::store::Store;

#[derive(clap::Subcommand)]
pub enum Verb {
    /// Order the keys of the topics of PATTERN per topic (`topic`) or across the whole
    /// outbox (`global`), for the messages enqueued from now on.
    Set {
        /// Topics as a route names them: `orders.created`, `orders.*` (a prefix), `*`.
        pattern: String,
        /// `topic`: a key's messages wait only for its earlier messages on their own topic;
        /// `global`: for its earlier messages on any topic (the default of a topic no rule
        /// matches).
        #[arg(value_parser = ["topic", "global"])]
        scope: String,
    },
    /// Remove the rule of PATTERN: its topics take the next most specific rule's scope, or
    /// the whole outbox, for the messages enqueued from now on.
    Unset {
        /// The pattern as `set` was given it.
        pattern: String,
    },
    /// The rules, most specific first: pattern, scope, when and by whom set.
    List,
}

impl Verb {
    /// Whether the verb only reads (`list`).
    pub fn reads_only(&self) -> bool {
        matches!(self, Verb::List)
    }
}

/// A route's topic pattern as the SQL `LIKE` pattern the rules hold.
fn like(pattern: &str) -> Result<String> {
    if pattern.is_empty() {
        anyhow::bail!("the topic pattern must not be empty (`*` is every topic)");
    }
    Ok(TopicPattern::parse(pattern)
        .map_err(|e| anyhow::anyhow!("{}", e.problem))?
        .to_like())
}

/// A rule's `LIKE` pattern as a route names it, when it can (a rule set with SQL may use
/// `_` or a `%` inside the pattern, shown as it is); `list` and `status` show rules so.
pub fn route_pattern(like: &str) -> String {
    let (body, prefix) = match like.strip_suffix('%') {
        Some(body) if !body.ends_with('\\') || body.ends_with("\\\\") => (body, true),
        _ => (like, false),
    };
    let mut out = String::new();
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(e) => out.push(e),
                None => return like.to_owned(),
            },
            '%' | '_' => return like.to_owned(),
            c => out.push(c),
        }
    }
    if prefix { format!("{out}*") } else { out }
}

/// Sets, removes or lists, as `verb` asks.
pub async fn run(store: &Store, verb: &Verb) -> Result<()> {
    match verb {
        Verb::Set { pattern, scope } => {
            let before = store
                .set_key_order_scope(&like(pattern)?, scope)
                .await
                .context("set the key order scope")?;
            match before {
                Some(before) if before == *scope => {
                    outln!("{pattern}: keys already ordered per {scope}; nothing changed");
                }
                Some(before) => outln!(
                    "{pattern}: keys ordered per {scope} (was {before}) for messages enqueued from now on"
                ),
                None => {
                    outln!("{pattern}: keys ordered per {scope} for messages enqueued from now on")
                }
            }
        }
        Verb::Unset { pattern } => {
            if store
                .unset_key_order_scope(&like(pattern)?)
                .await
                .context("unset the key order scope")?
            {
                outln!("{pattern}: rule removed for messages enqueued from now on");
            } else {
                outln!("{pattern} had no rule; nothing changed");
            }
        }
        Verb::List => {
            for rule in store
                .key_order_scopes()
                .await
                .context("list the key order scopes")?
            {
                outln!(
                    "{}\t{}\t{}\t{}",
                    route_pattern(&rule.topic_pattern),
                    rule.scope,
                    rule.set_at
                        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    rule.set_by
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_patterns_and_like_patterns_round_trip() {
        for pattern in ["orders.*", "*", "orders.created", "a_b%c*", "x\\y"] {
            assert_eq!(route_pattern(&like(pattern).unwrap()), pattern, "{pattern}");
        }
        assert_eq!(
            route_pattern("a_%"),
            "a_%",
            "a LIKE pattern no route can name"
        );
        assert!(like("or*ders").is_err());
        assert!(like("").is_err());
    }
}

//! The outbox in a schema other than `outbox`. The SQL API, its migrations and the
//! statements of this module name every object schema-qualified as `outbox.…`; a source
//! whose connection string names another schema (`outbox_schema`, see
//! [`crate::connection`]) gets the same text with that schema's name in their place. Its
//! migrations are rewritten the same way, so each schema holds a complete, independent
//! outbox: its own tables, functions, history table (`NAME.refinery_schema_history`),
//! notification channel (`NAME_new`), advisory-lock keys and per-transaction settings
//! (`NAME.woken`). The default schema's text is used as it is.
//!
//! The rewritten text of each migration is what refinery checksums in such a schema's
//! history: a change of the rewrite that alters the text of a landed migration makes
//! `migrate` refuse every outbox already built in another schema. Change it only in ways
//! that leave the rewritten text of the landed migrations as it is.

use std::borrow::Cow;

use crate::connection::DEFAULT_SCHEMA;

/// `sql` with every schema qualifier `outbox.` (the word `outbox` followed by a dot, as in
/// `outbox.messages` and in the lock key `'outbox.migrate'`) naming `schema` instead.
pub fn in_schema<'a>(sql: &'a str, schema: &str) -> Cow<'a, str> {
    if schema == DEFAULT_SCHEMA {
        return Cow::Borrowed(sql);
    }
    Cow::Owned(replace_word(sql, schema, |after| after.starts_with('.')))
}

/// A migration's text for `schema`: [`in_schema`], plus the schema's own name where a
/// statement names the schema itself (`CREATE SCHEMA IF NOT EXISTS outbox`, `GRANT … ON
/// SCHEMA outbox`, `COMMENT ON SCHEMA outbox`) and the notification channel (`'outbox_new'`
/// becomes `'NAME_new'`).
pub fn migration_in_schema(sql: &str, schema: &str) -> String {
    if schema == DEFAULT_SCHEMA {
        return sql.to_owned();
    }
    let qualified = in_schema(sql, schema);
    let named = replace_schema_statements(&qualified, schema);
    named.replace("'outbox_new'", &format!("'{}'", notify_channel(schema)))
}

/// The channel `enqueue` notifies for the outbox in `schema`.
pub fn notify_channel(schema: &str) -> String {
    format!("{schema}_new")
}

/// Every `SCHEMA outbox` and `SCHEMA IF NOT EXISTS outbox` (the word) with `schema` in its
/// place.
fn replace_schema_statements(sql: &str, schema: &str) -> String {
    ["SCHEMA outbox", "SCHEMA IF NOT EXISTS outbox"]
        .iter()
        .fold(sql.to_owned(), |sql, pattern| {
            let mut out = String::with_capacity(sql.len());
            let mut rest = sql.as_str();
            while let Some(at) = rest.find(pattern) {
                let end = at + pattern.len();
                out.push_str(&rest[..at]);
                if rest[end..].starts_with(is_word_char) {
                    out.push_str(pattern);
                } else {
                    out.push_str(pattern.trim_end_matches("outbox"));
                    out.push_str(schema);
                }
                rest = &rest[end..];
            }
            out.push_str(rest);
            out
        })
}

/// Each whole word `outbox` for which `follows(text after it)` holds, replaced by `by`.
fn replace_word(sql: &str, by: &str, follows: impl Fn(&str) -> bool) -> String {
    let mut out = String::with_capacity(sql.len() + 64);
    let mut rest = sql;
    let mut before: Option<char> = None;
    while let Some(at) = rest.find("outbox") {
        let prev = rest[..at].chars().next_back().or(before);
        let after = &rest[at + "outbox".len()..];
        out.push_str(&rest[..at]);
        if !prev.is_some_and(is_word_char) && follows(after) {
            out.push_str(by);
        } else {
            out.push_str("outbox");
        }
        before = Some('x');
        rest = after;
    }
    out.push_str(rest);
    out
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '$'
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_schema_is_left_as_it_is() {
        let sql = "SELECT * FROM outbox.claim_outbox_batch_seq($1)";
        assert!(matches!(in_schema(sql, "outbox"), Cow::Borrowed(_)));
        assert_eq!(migration_in_schema(sql, "outbox"), sql);
    }

    #[test]
    fn qualifiers_lock_keys_and_settings_follow_the_schema() {
        assert_eq!(
            in_schema(
                "SELECT outbox.complete_outbox_batch($1::outbox.attempt_state[]), \
                 hashtext('outbox.key'), current_setting('outbox.woken', true), p_outbox_id",
                "tenant_7"
            ),
            "SELECT tenant_7.complete_outbox_batch($1::tenant_7.attempt_state[]), \
             hashtext('tenant_7.key'), current_setting('tenant_7.woken', true), p_outbox_id"
        );
        // Not a qualifier: a word that ends in outbox, an identifier that contains it, text.
        let kept = "my_outbox.x, outboxes, 'the message is already in the outbox'";
        assert_eq!(in_schema(kept, "t"), kept);
    }

    #[test]
    fn migrations_name_the_schema_and_its_channel() {
        let sql = "CREATE SCHEMA IF NOT EXISTS outbox;\n\
                   GRANT USAGE ON SCHEMA outbox TO outbox_relay;\n\
                   COMMENT ON SCHEMA outbox IS 'x';\n\
                   PERFORM pg_notify('outbox_new', '');";
        assert_eq!(
            migration_in_schema(sql, "billing"),
            "CREATE SCHEMA IF NOT EXISTS billing;\n\
             GRANT USAGE ON SCHEMA billing TO outbox_relay;\n\
             COMMENT ON SCHEMA billing IS 'x';\n\
             PERFORM pg_notify('billing_new', '');"
        );
    }

    #[test]
    fn every_embedded_migration_is_left_without_a_reference_to_schema_outbox() {
        // The word `outbox` followed by a dot (a qualifier, a lock key, a setting) anywhere;
        // the word at all outside string literals (text of messages may say "outbox").
        let words = |text: &str, dot_only: bool| {
            let mut found = false;
            let mut rest = text;
            while let Some(at) = rest.find("outbox") {
                let before = rest[..at].chars().next_back();
                let after = &rest[at + "outbox".len()..];
                let word = !before.is_some_and(is_word_char) && !after.starts_with(is_word_char);
                found |= word && (!dot_only || after.starts_with('.'));
                rest = after;
            }
            found
        };
        for m in crate::schema::runner().get_migrations() {
            let sql = migration_in_schema(m.sql().expect("embedded"), "tenant_a");
            for (i, line) in sql.lines().enumerate() {
                let code = line.split("--").next().unwrap_or("");
                let outside: String = code.split('\'').step_by(2).collect();
                assert!(
                    !words(code, true) && !words(&outside, false) && !code.contains("'outbox'"),
                    "{} line {}: {line}",
                    m.name(),
                    i + 1
                );
            }
        }
    }
}

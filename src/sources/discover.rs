//! Finding the sources: those listed in the config, every database of a server that holds
//! the outbox schema (`outbox_schema`, default `outbox`), and the rows of a catalogue query,
//! merged by name (a listed source wins over a discovered one of the same name). A source's
//! connection string names its schema when it is not `outbox` (see [`crate::connection`]),
//! so two sources may be two schemas of one database.

use std::collections::BTreeMap;

use super::settings::SourcesSettings;
use super::share::Share;
use crate::store::{Store, with_database};

/// Every source, name → connection string. An error names what could not be read (the
/// server or the catalogue); the caller keeps serving the sources it had.
pub async fn discover(settings: &SourcesSettings) -> Result<BTreeMap<String, String>, String> {
    discover_keeping(settings, &BTreeMap::new(), None).await
}

/// [`discover`], keeping a database of `known` whose probe failed this time (a server at
/// its connection limit, a network blip): a source is dropped when the server says it
/// has no outbox or is gone, not when it could not be asked. With `share`, each session
/// takes one of its server's short sessions ([`Share::short_session`]): the connection
/// budget counts discovery's sessions too.
pub async fn discover_keeping(
    settings: &SourcesSettings,
    known: &BTreeMap<String, String>,
    share: Option<&Share>,
) -> Result<BTreeMap<String, String>, String> {
    let short = async |url: &str| match share {
        Some(share) => share.short_session(&super::serve::server_of(url)).await,
        None => None,
    };
    let mut found = BTreeMap::new();
    if let Some(server) = &settings.server_url {
        let listing = short(server).await;
        let store = Store::connect_as(server, 1, "outbox-relay poll")
            .map_err(|e| format!("sources_server_url: {e}"))?;
        let databases = store
            .databases()
            .await
            .map_err(|e| format!("sources_server_url: listing the databases: {e}"))?;
        drop(store);
        drop(listing);
        for database in databases {
            let url = with_database(server, &database);
            // One short session per database: a database this login may not enter, or
            // without an outbox, is not a source.
            let _short = short(&url).await;
            let holds_outbox = match Store::connect_as(&url, 1, "outbox-relay poll") {
                Ok(probe) => probe.has_outbox().await,
                Err(e) => Err(e),
            };
            match holds_outbox {
                Ok(true) => {
                    found.insert(database, url);
                }
                Ok(false) => {}
                Err(e) => match known.get(&database) {
                    Some(url) => {
                        found.insert(database, url.clone());
                    }
                    None => tracing::debug!(database, error = %e,
                        "database skipped by discovery: cannot look into it"),
                },
            }
        }
    }
    if let Some((url, query)) = &settings.catalogue {
        let _short = short(url).await;
        let store = Store::connect_as(url, 1, "outbox-relay poll")
            .map_err(|e| format!("sources_catalogue_url: {e}"))?;
        for (name, source_url, schema) in store
            .catalogue(query)
            .await
            .map_err(|e| format!("sources_catalogue_query: {e}"))?
        {
            let source_url = crate::secret::interpolate(&source_url)
                .map_err(|e| format!("sources_catalogue_query: source {name:?}: {e}"))?;
            let schema = schema.unwrap_or_else(|| settings.schema.clone());
            crate::connection::check_schema_name(&schema)
                .map_err(|e| format!("sources_catalogue_query: source {name:?}: {e}"))?;
            let source_url = crate::connection::with_schema(&source_url, &schema);
            found.insert(name, source_url);
        }
    }
    for (name, url) in &settings.listed {
        found.insert(name.clone(), url.clone());
    }
    Ok(found)
}

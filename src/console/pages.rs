//! One handler per screen of the console. Each reads its filters and its source from the
//! query string ([`Params`]), asks the store for each panel separately (a panel whose
//! query fails or times out says so, the others still show), and renders the page with
//! [`html::page`]. The replay is the only write: it needs the admin token, a name for the
//! actor and goes through the same audited `start_replay`/`replay_step` as
//! `outbox-relay replay`.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use chrono::Utc;
use futures_util::future::join_all;
use uuid::Uuid;

use super::html::{self, Frame, esc, opt, query_failed, time_ago};
use super::params::{Params, encode, query};
use super::{Console, Sources};
use crate::store::{
    DeadLetterFilter, MessageFilter, MessageState, SEARCH_WINDOW, Store, WorkerRow, thousands,
};

type Shared = State<Arc<Console>>;

/// How many dead letters a replay preview lists by name.
const PREVIEW_ROWS: i64 = 500;

/// A page, or the refusal that replaces it (unknown source, bad filter).
type Page = Result<Html<String>, Refusal>;

/// A response other than the page asked for: its status and HTML body.
pub struct Refusal(StatusCode, String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (self.0, Html(self.1)).into_response()
    }
}

/// The selected source, or a 404 naming the known ones.
fn pick<'a>(sources: &'a Sources, params: &Params) -> Result<(&'a str, &'a Store), Refusal> {
    sources.source(params.get("source")).ok_or_else(|| {
        Refusal(
            StatusCode::NOT_FOUND,
            format!(
                "<!doctype html><html lang=\"en\"><link rel=\"icon\" href=\"data:,\"><title>unknown source</title><p>No source is named {}; the \
                 sources are: {}</p>",
                esc(params.get("source").unwrap_or("")),
                esc(&sources.names.join(", "))
            ),
        )
    })
}

/// A 400 page naming the bad parameter.
fn bad_request(problem: &str) -> Refusal {
    Refusal(
        StatusCode::BAD_REQUEST,
        format!(
            "<!doctype html><html lang=\"en\"><link rel=\"icon\" href=\"data:,\"><title>bad request</title><p>{}</p>",
            esc(problem)
        ),
    )
}

fn frame<'a>(
    console: &'a Console,
    sources: &'a Sources,
    title: &'a str,
    current: &'a str,
    source: &'a str,
    live: bool,
) -> Frame<'a> {
    let s = &console.settings;
    Frame {
        base: &s.base_path,
        title,
        current,
        sources: &sources.names,
        source,
        refresh_ms: if live { s.refresh.as_millis() } else { 0 },
        writable: s.writable(),
    }
}

fn timeout(console: &Console) -> Duration {
    console.settings.statement_timeout
}

/// Overview: every source, per topic (from the fleet's observation), delivered per minute
/// over the last hour, workers and their leases, destinations' circuits.
pub async fn overview(State(console): Shared, RawQuery(q): RawQuery) -> Page {
    let params = Params::parse(q.as_deref().unwrap_or(""));
    let sources = console.sources();
    let (selected, _) = pick(&sources, &params)?;
    let sections = join_all(
        sources
            .stores
            .iter()
            .map(|(name, store)| overview_reused(&console, name, store)),
    )
    .await;
    let body = sections.iter().map(|s| s.as_str()).collect::<String>();
    Ok(Html(html::page(
        &frame(&console, &sources, "Overview", "/", selected, true),
        &body,
    )))
}

/// A source's overview section: the one rendered less than [`OVERVIEW_REUSE`] ago, or a
/// new one. Its worker and rate panels read whole tables or an hour of attempts, which a
/// page refreshed every few seconds by several operators must not repeat each time.
async fn overview_reused(console: &Console, name: &str, store: &Store) -> Arc<String> {
    let fresh = |(at, section): &(std::time::Instant, Arc<String>)| {
        (at.elapsed() < super::OVERVIEW_REUSE).then(|| section.clone())
    };
    let kept = console
        .overviews
        .lock()
        .expect("not poisoned")
        .get(name)
        .and_then(fresh);
    if let Some(section) = kept {
        return section;
    }
    let section = Arc::new(overview_of(console, name, store).await);
    console.overviews.lock().expect("not poisoned").insert(
        name.to_owned(),
        (std::time::Instant::now(), section.clone()),
    );
    section
}

/// The observation of `store`: the stored one (one row's read), and when it is missing or
/// older than [`super::OBSERVATION_MAX_AGE`] a refresh in the background (one at a time per
/// source, under [`super::OBSERVATION_REFRESH_TIMEOUT`]). The page shows the stored
/// snapshot at once; only when none is stored yet does it wait for the refresh, no longer
/// than the statement timeout: no page is held for the computation of a large backlog.
async fn observation(
    console: &Console,
    name: &str,
    store: &Store,
) -> crate::store::Result<Option<crate::store::ObservationRow>> {
    let t = timeout(console);
    let latest = store.console_latest_observation(t).await;
    let stale = match &latest {
        Ok(Some(o)) => {
            (Utc::now() - o.observed_at).to_std().unwrap_or_default() > super::OBSERVATION_MAX_AGE
        }
        Ok(None) => true,
        Err(_) => false,
    };
    if !stale
        || !console
            .refreshing
            .lock()
            .expect("not poisoned")
            .insert(name.to_owned())
    {
        return latest;
    }
    let (store, source, refreshing) = (store.clone(), name.to_owned(), console.refreshing.clone());
    let refresh = tokio::spawn(async move {
        let refreshed = store
            .console_observe(
                super::OBSERVATION_REFRESH_TIMEOUT,
                super::OBSERVATION_MAX_AGE,
            )
            .await;
        if let Err(e) = &refreshed {
            tracing::warn!(source = %source, error = %e, "the console could not refresh the observation");
        }
        refreshing.lock().expect("not poisoned").remove(&source);
        refreshed
    });
    if !matches!(latest, Ok(None)) {
        return latest;
    }
    match tokio::time::timeout(t, refresh).await {
        Ok(Ok(Ok(Some(fresh)))) => Ok(Some(fresh)),
        _ => latest,
    }
}

async fn overview_of(console: &Console, name: &str, store: &Store) -> String {
    let t = timeout(console);
    let base = &console.settings.base_path;
    let n = encode(name);
    let (observation, rates, circuits) = tokio::join!(
        observation(console, name, store),
        store.console_rates(t),
        store.console_circuits(t),
    );
    let mut out = format!(
        "<section aria-labelledby=\"src-{id}\"><h2 id=\"src-{id}\">Source \
         <a href=\"{base}/messages?source={n}\">{name}</a></h2>\
         <p class=\"muted\">As of {}; shown again for up to {} s.</p>",
        html::time(Utc::now()),
        super::OVERVIEW_REUSE.as_secs(),
        id = esc(&n),
        name = esc(name)
    );
    let workers = observation
        .as_ref()
        .ok()
        .and_then(Option::as_ref)
        .map(|o| WorkerRow::from_snapshot(&o.snapshot));
    match observation {
        Ok(Some(o)) => {
            let _ = write!(
                out,
                "<p class=\"muted\">Backlog and workers as observed {} (the fleet's shared \
                 observation, refreshed every {} s while it is read).</p>",
                time_ago(o.observed_at),
                super::OBSERVATION_MAX_AGE.as_secs()
            );
            out += "<table><caption>Per topic</caption><thead><tr><th scope=\"col\">Topic</th>\
                    <th scope=\"col\" class=\"num\">Ready</th><th scope=\"col\" class=\"num\">Scheduled</th>\
                    <th scope=\"col\" class=\"num\">Leased</th><th scope=\"col\" class=\"num\">Expired leases</th>\
                    <th scope=\"col\" class=\"num\">Dead letters</th><th scope=\"col\" class=\"num\">Oldest ready</th>\
                    </tr></thead><tbody>";
            let topics = o.snapshot["topics"].as_array().cloned().unwrap_or_default();
            if topics.is_empty() {
                out += "<tr><td colspan=\"7\">Nothing pending, no dead letters.</td></tr>";
            }
            for t in topics {
                let topic = t["topic"].as_str().unwrap_or("");
                let num = |k: &str| thousands(t[k].as_i64().unwrap_or(0));
                let age = t["oldest_ready_age_seconds"]
                    .as_f64()
                    .map_or_else(|| "—".to_owned(), html::seconds);
                let _ = write!(
                    out,
                    "<tr><td><a href=\"{base}/messages?{q}\">{}</a></td><td class=\"num\">{}</td>\
                     <td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
                     <td class=\"num\"><a href=\"{base}/dead-letters?{q}\">{}</a></td>\
                     <td class=\"num\">{age}</td></tr>",
                    esc(topic),
                    num("ready"),
                    num("delayed"),
                    num("in_flight"),
                    num("expired_leases"),
                    num("dead_letters"),
                    q = esc(&query(&[("source", name), ("topic", topic)])),
                );
            }
            out += "</tbody></table>";
        }
        Ok(None) => {
            out += "<p>No observation yet: the console asked for one; it shows on the next \
                    refresh.</p>";
        }
        Err(e) => out += &query_failed("Backlog", &e, t),
    }
    match rates {
        Ok(rates) => {
            let now = Utc::now();
            let mut minutes: Vec<(String, i64)> = Vec::with_capacity(60);
            let mut total = 0;
            for back in (1..=60).rev() {
                let minute = now - chrono::Duration::minutes(back);
                let key = minute.format("%H:%M").to_string();
                let v = rates
                    .iter()
                    .find(|r| r.minute.format("%H:%M").to_string() == key)
                    .map_or(0, |r| r.delivered);
                total += v;
                minutes.push((key, v));
            }
            let failed: i64 = rates.iter().map(|r| r.failed).sum();
            let _ = write!(
                out,
                "<h3>Delivered per minute, last hour</h3>{}<p class=\"muted\">{} delivered, \
                 {} attempts that did not deliver, in the last hour's whole minutes (each \
                 counted once by the observation's refresh).</p>",
                html::bars(
                    &minutes,
                    &format!("Delivered per minute over the last hour of {name}")
                ),
                thousands(total),
                thousands(failed)
            );
        }
        Err(e) => out += &query_failed("Delivered per minute", &e, t),
    }
    if let Some(workers) = workers {
        out += "<h3>Workers</h3>";
        if workers.is_empty() {
            out += "<p>No worker held a lease or recorded an attempt in the minute before \
                        the observation.</p>";
        } else {
            out += "<table><thead><tr><th scope=\"col\">Worker</th><th scope=\"col\" class=\"num\">Leases held</th>\
                        <th scope=\"col\">Next lease expiry</th><th scope=\"col\" class=\"num\">Delivered (1 min)</th>\
                        <th scope=\"col\" class=\"num\">Not delivered (1 min)</th><th scope=\"col\">Last attempt (heartbeat)</th></tr></thead><tbody>";
            for w in workers {
                let _ = write!(
                    out,
                    "<tr><td class=\"mono\">{}</td><td class=\"num\">{}</td><td>{}</td>\
                         <td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
                    esc(&w.worker_id),
                    thousands(w.leases_held),
                    w.next_lease_expiry.map_or_else(|| "—".into(), time_ago),
                    thousands(w.delivered_1m),
                    thousands(w.not_delivered_1m),
                    w.last_attempt_at.map_or_else(|| "—".into(), time_ago),
                );
            }
            out += "</tbody></table>";
        }
    }
    match circuits {
        Ok(circuits) => out += &circuit_table(&circuits),
        Err(e) => out += &query_failed("Destinations", &e, t),
    }
    out += "</section>";
    out
}

fn circuit_table(circuits: &[crate::store::ReportedCircuit]) -> String {
    if circuits.is_empty() {
        return "<h3>Destinations</h3><p>No relayer has reported a destination's circuit.</p>"
            .into();
    }
    let mut out = "<h3>Destinations</h3><table><thead><tr><th scope=\"col\">Destination</th>\
                   <th scope=\"col\">Circuit</th><th scope=\"col\">Since</th><th scope=\"col\">Reported by</th>\
                   <th scope=\"col\">Reported</th></tr></thead><tbody>"
        .to_owned();
    for c in circuits {
        let state = if c.stale {
            format!("{} (stale report)", c.report.state)
        } else {
            c.report.state.clone()
        };
        let _ = write!(
            out,
            "<tr><td>{}</td><td class=\"state-{}\">{}</td><td>{}</td><td class=\"mono\">{}</td><td>{}</td></tr>",
            esc(&c.report.destination),
            esc(&c.report.state),
            esc(&state),
            time_ago(c.report.since),
            esc(&c.worker_id),
            time_ago(c.reported_at),
        );
    }
    out + "</tbody></table>"
}

/// Messages: pending messages of the selected source, filtered by id, topic, key, state
/// and age, newest first, keyset-paginated (`before=`).
pub async fn messages(State(console): Shared, RawQuery(q): RawQuery) -> Page {
    let params = Params::parse(q.as_deref().unwrap_or(""));
    let sources = console.sources();
    let (name, store) = pick(&sources, &params)?;
    let s = &console.settings;
    let uuid = |field: &str| -> Result<Option<Uuid>, Refusal> {
        params
            .get(field)
            .map(|v| {
                Uuid::parse_str(v).map_err(|_| {
                    bad_request(&format!("{field}: {v:?} is not a message id (a UUID)"))
                })
            })
            .transpose()
    };
    let state = match params.get("state") {
        None => None,
        Some(v) => Some(MessageState::parse(v).ok_or_else(|| {
            bad_request(&format!(
                "state: {v:?} is none of ready, leased, waiting, scheduled"
            ))
        })?),
    };
    let older_than = match params.get("older_than") {
        None => None,
        Some(v) => Some(humantime::parse_duration(v).map_err(|e| {
            bad_request(&format!(
                "older_than: {v:?} is not a duration such as 5m ({e})"
            ))
        })?),
    };
    let filter = MessageFilter {
        id: uuid("id")?,
        topic: params.get("topic").map(str::to_owned),
        key: params.get("key").map(str::to_owned),
        state,
        older_than,
        before: uuid("before")?,
    };
    let rows = store
        .console_messages(s.statement_timeout, &filter, s.page_size + 1)
        .await;
    let base = &s.base_path;
    let keep = [
        ("source", name),
        ("topic", params.get("topic").unwrap_or("")),
        ("key", params.get("key").unwrap_or("")),
        ("state", params.get("state").unwrap_or("")),
        ("older_than", params.get("older_than").unwrap_or("")),
        ("id", params.get("id").unwrap_or("")),
    ];
    let mut body = format!(
        "<form class=\"filters\" method=\"get\" action=\"{base}/messages\">\
         <input type=\"hidden\" name=\"source\" value=\"{}\">\
         <div><label for=\"f-topic\">Topic</label><input id=\"f-topic\" name=\"topic\" value=\"{}\"></div>\
         <div><label for=\"f-key\">Key</label><input id=\"f-key\" name=\"key\" value=\"{}\"></div>\
         <div><label for=\"f-state\">State</label><select id=\"f-state\" name=\"state\"><option value=\"\">any</option>",
        esc(name),
        esc(params.get("topic").unwrap_or("")),
        esc(params.get("key").unwrap_or("")),
    );
    for st in MessageState::ALL {
        let sel = if state == Some(st) { " selected" } else { "" };
        let label = match st {
            MessageState::Waiting => "waiting behind its key",
            other => other.as_str(),
        };
        let _ = write!(
            body,
            "<option value=\"{}\"{sel}>{label}</option>",
            st.as_str()
        );
    }
    let _ = write!(
        body,
        "</select></div>\
         <div><label for=\"f-age\">Older than</label><input id=\"f-age\" name=\"older_than\" size=\"6\" placeholder=\"5m\" value=\"{}\"></div>\
         <div><label for=\"f-id\">Id</label><input id=\"f-id\" name=\"id\" size=\"38\" value=\"{}\"></div>\
         <button type=\"submit\">Filter</button></form>",
        esc(params.get("older_than").unwrap_or("")),
        esc(params.get("id").unwrap_or("")),
    );
    match rows {
        Ok(mut rows) => {
            let more = i64::try_from(rows.len()).unwrap_or(i64::MAX) > s.page_size;
            rows.truncate(usize::try_from(s.page_size).unwrap_or(50));
            if rows.is_empty() {
                body += "<p>No pending message matches.</p>";
            } else {
                body += "<table><thead><tr><th scope=\"col\">Id</th><th scope=\"col\">Topic</th><th scope=\"col\">Key</th>\
                         <th scope=\"col\">State</th><th scope=\"col\">Created</th><th scope=\"col\" class=\"num\">Attempts</th>\
                         <th scope=\"col\">Lease holder</th><th scope=\"col\">Last error</th></tr></thead><tbody>";
                for m in &rows {
                    let _ = write!(
                        body,
                        "<tr><td class=\"mono\"><a href=\"{base}/messages/{id}?source={n}\">{id}</a></td>\
                         <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"mono\">{}</td><td>{}</td></tr>",
                        esc(&m.topic),
                        opt(m.message_key.as_deref()),
                        esc(&m.state),
                        time_ago(m.created_at),
                        m.attempt_count,
                        opt(m.claimed_by.as_deref()),
                        opt(m.last_error.as_deref().map(|e| short(e, 120)).as_deref()),
                        id = m.outbox_id,
                        n = encode(name),
                    );
                }
                body += "</tbody></table>";
            }
            if more && let Some(last) = rows.last() {
                let mut pairs = keep.to_vec();
                let cursor = last.outbox_id.to_string();
                pairs.push(("before", &cursor));
                let _ = write!(
                    body,
                    "<p><a rel=\"next\" href=\"{base}/messages?{}\">Older messages →</a></p>",
                    esc(&query(&pairs))
                );
            } else if filter.windowed() {
                // Fewer than a page matched among the window searched: say so, and offer
                // the next window.
                match store
                    .console_window_end(s.statement_timeout, filter.before)
                    .await
                {
                    Ok(Some(end)) => {
                        let mut pairs = keep.to_vec();
                        let cursor = end.to_string();
                        pairs.push(("before", &cursor));
                        let _ = write!(
                            body,
                            "<p>No more match among the {} pending messages searched. \
                             <a rel=\"next\" href=\"{base}/messages?{}\">Search the next {} \
                             older messages →</a></p>",
                            thousands(SEARCH_WINDOW),
                            esc(&query(&pairs)),
                            thousands(SEARCH_WINDOW)
                        );
                    }
                    Ok(None) => {
                        body += "<p>The search reached the oldest pending message.</p>";
                    }
                    Err(e) => body += &query_failed("Next search window", &e, s.statement_timeout),
                }
            }
        }
        Err(e) => body += &query_failed("Messages", &e, s.statement_timeout),
    }
    Ok(Html(html::page(
        &frame(&console, &sources, "Messages", "/messages", name, true),
        &body,
    )))
}

/// `text` cut to `max` characters, with an ellipsis when cut.
fn short(text: &str, max: usize) -> String {
    let mut chars = text.chars();
    let head: String = chars.by_ref().take(max).collect();
    if chars.next().is_some() {
        head + "…"
    } else {
        head
    }
}

/// Find by id: the selected source first, then every other, pending messages and dead
/// letters alike; redirects to the message's page in the source that has it.
pub async fn find(State(console): Shared, RawQuery(q): RawQuery) -> Result<Response, Refusal> {
    let params = Params::parse(q.as_deref().unwrap_or(""));
    let sources = console.sources();
    let (selected, _) = pick(&sources, &params)?;
    let Some(text) = params.get("id") else {
        return Err(bad_request("id: give a message id to find"));
    };
    let id = Uuid::parse_str(text)
        .map_err(|_| bad_request(&format!("id: {text:?} is not a message id (a UUID)")))?;
    let t = timeout(&console);
    let order = std::iter::once(selected).chain(
        sources
            .names
            .iter()
            .map(String::as_str)
            .filter(|n| *n != selected),
    );
    let base = &console.settings.base_path;
    let mut failures = String::new();
    for name in order {
        let store = &sources.stores[name];
        let found = match store.console_message(t, id, false).await {
            Ok(Some(_)) => true,
            Ok(None) => match store
                .console_dead_letter_count(
                    t,
                    &DeadLetterFilter {
                        ids: Some(vec![id]),
                        ..DeadLetterFilter::default()
                    },
                )
                .await
            {
                Ok(n) => n.count > 0,
                Err(e) => {
                    failures += &query_failed(&format!("Source {name}"), &e, t);
                    false
                }
            },
            Err(e) => {
                failures += &query_failed(&format!("Source {name}"), &e, t);
                false
            }
        };
        if found {
            return Ok(
                Redirect::to(&format!("{base}/messages/{id}?source={}", encode(name)))
                    .into_response(),
            );
        }
    }
    let body = format!(
        "<p>No source holds message <code>{id}</code> as pending or as a dead letter: it was \
         delivered (its attempts are kept until pruned: <a href=\"{base}/messages/{id}?source={}\">\
         look for them</a>), or the id is wrong.</p>{failures}",
        encode(selected)
    );
    Ok((
        StatusCode::NOT_FOUND,
        Html(html::page(
            &frame(
                &console,
                &sources,
                "Message not found",
                "/messages",
                selected,
                false,
            ),
            &body,
        )),
    )
        .into_response())
}

/// One message: where it is (pending, dead letter, neither), its payload (pretty JSON;
/// hidden with `--sensitive-payloads`), headers, its key's position, its lease, and the
/// attempt timeline.
pub async fn message(
    State(console): Shared,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> Page {
    let params = Params::parse(q.as_deref().unwrap_or(""));
    let sources = console.sources();
    let (name, store) = pick(&sources, &params)?;
    let id = Uuid::parse_str(&id)
        .map_err(|_| bad_request(&format!("{id:?} is not a message id (a UUID)")))?;
    let s = &console.settings;
    let t = s.statement_timeout;
    let base = &s.base_path;
    let n = encode(name);
    let (pending, attempts) = tokio::join!(
        store.console_message(t, id, !s.sensitive_payloads),
        store.console_attempts(t, id)
    );
    let mut body = format!("<p>Message <code>{id}</code> in source {}.</p>", esc(name));
    let mut found = false;
    match pending {
        Ok(Some(m)) => {
            found = true;
            let r = &m.row;
            let _ = write!(
                body,
                "<h2>Pending</h2><table><tbody>\
                 <tr><th scope=\"row\">State</th><td>{}</td></tr>\
                 <tr><th scope=\"row\">Topic</th><td><a href=\"{base}/messages?{tq}\">{}</a></td></tr>\
                 <tr><th scope=\"row\">Key</th><td>{}</td></tr>\
                 <tr><th scope=\"row\">Created</th><td>{}</td></tr>\
                 <tr><th scope=\"row\">Available from</th><td>{}</td></tr>\
                 <tr><th scope=\"row\">Attempts</th><td>{} (at most {} in this life)</td></tr>\
                 <tr><th scope=\"row\">Lease holder</th><td class=\"mono\">{}</td></tr>\
                 <tr><th scope=\"row\">Lease expires</th><td>{}</td></tr>\
                 <tr><th scope=\"row\">Last error</th><td>{}</td></tr>",
                esc(&r.state),
                esc(&r.topic),
                opt(r.message_key.as_deref()),
                time_ago(r.created_at),
                time_ago(r.available_at),
                r.attempt_count,
                m.max_attempts,
                opt(r.claimed_by.as_deref()),
                r.lease_expires_at.map_or_else(|| "—".into(), time_ago),
                opt(r.last_error.as_deref()),
                tq = esc(&query(&[("source", name), ("topic", &r.topic)])),
            );
            if let Some(key) = &r.message_key {
                let position = match (&m.ahead, &m.key_head) {
                    (Some(ahead), Some(head)) if ahead.count > 0 => format!(
                        "{ahead} message(s) of key {k} before it; the head of the key is \
                         <a class=\"mono\" href=\"{base}/messages/{head}?source={n}\">{head}</a> \
                         (<a href=\"{base}/messages?{kq}\">all of the key</a>)",
                        k = esc(key),
                        kq = esc(&query(&[("source", name), ("key", key)])),
                    ),
                    _ => format!("the head of key {}: delivered next for it", esc(key)),
                };
                let _ = write!(
                    body,
                    "<tr><th scope=\"row\">Key position</th><td>{position}</td></tr>"
                );
            }
            body += "</tbody></table>";
            body += &contents(
                &m.content_type,
                &m.headers,
                m.payload.as_deref(),
                m.payload_bytes,
            );
        }
        Ok(None) => {}
        Err(e) => body += &query_failed("Pending message", &e, t),
    }
    if !found {
        match store
            .console_dead_letter(t, id, !s.sensitive_payloads)
            .await
        {
            Ok(Some(d)) => {
                found = true;
                let _ = write!(
                    body,
                    "<h2>Dead letter</h2><table><tbody>\
                     <tr><th scope=\"row\">Topic</th><td>{}</td></tr>\
                     <tr><th scope=\"row\">Key</th><td>{}</td></tr>\
                     <tr><th scope=\"row\">Created</th><td>{}</td></tr>\
                     <tr><th scope=\"row\">Dead-lettered</th><td>{}</td></tr>\
                     <tr><th scope=\"row\">Attempts</th><td>{} (at most {} per life)</td></tr>\
                     <tr><th scope=\"row\">Last error</th><td>{}</td></tr></tbody></table>\
                     <p><a href=\"{base}/dead-letters/replay?{rq}\">Replay this dead letter…</a></p>",
                    esc(&d.topic),
                    opt(d.message_key.as_deref()),
                    time_ago(d.created_at),
                    time_ago(d.dead_lettered_at),
                    d.attempt_count,
                    d.max_attempts,
                    opt(d.last_error.as_deref()),
                    rq = esc(&query(&[("source", name), ("id", &id.to_string())])),
                );
                body += &contents(
                    &d.content_type,
                    &d.headers,
                    d.payload.as_deref(),
                    d.payload_bytes,
                );
            }
            Ok(None) => {}
            Err(e) => body += &query_failed("Dead letter", &e, t),
        }
    }
    if !found {
        body += "<p class=\"notice\">Neither pending nor a dead letter here: delivered (its \
                 attempts below, while retention keeps them), in another source, or an id \
                 never enqueued.</p>";
    }
    body += "<h2>Attempts</h2>";
    match attempts {
        Ok(attempts) if attempts.is_empty() => body += "<p>No attempt recorded.</p>",
        Ok(attempts) => {
            body += "<table><thead><tr><th scope=\"col\" class=\"num\">#</th><th scope=\"col\">At</th>\
                     <th scope=\"col\">Outcome</th><th scope=\"col\">Worker</th><th scope=\"col\">Since the previous</th>\
                     <th scope=\"col\">Error</th></tr></thead><tbody>";
            let mut previous = None;
            for a in &attempts {
                let gap = previous.map_or_else(
                    || "—".to_owned(),
                    |p: chrono::DateTime<Utc>| {
                        html::seconds((a.created_at - p).num_milliseconds() as f64 / 1000.0)
                    },
                );
                let _ = write!(
                    body,
                    "<tr><td class=\"num\">{}</td><td>{}</td><td>{}</td><td class=\"mono\">{}</td><td>{gap}</td><td>{}</td></tr>",
                    a.attempt_no,
                    time_ago(a.created_at),
                    esc(&a.state),
                    esc(&a.worker_id),
                    opt(a.error.as_deref()),
                );
                previous = Some(a.created_at);
            }
            body += "</tbody></table>";
        }
        Err(e) => body += &query_failed("Attempts", &e, t),
    }
    Ok(Html(html::page(
        &frame(&console, &sources, "Message", "/messages", name, true),
        &body,
    )))
}

/// The headers and payload of a message: pretty JSON when it parses, text when it is
/// UTF-8, a size otherwise; a notice with its size when the payload was not read (the
/// console runs with `--sensitive-payloads`, and asks the database for none).
fn contents(
    content_type: &str,
    headers: &serde_json::Value,
    payload: Option<&[u8]>,
    payload_bytes: i64,
) -> String {
    // The creation context's trace, to look the producer's request up in a trace viewer.
    let trace = headers
        .get("traceparent")
        .and_then(serde_json::Value::as_str)
        .and_then(|tp| crate::message::TraceContext::parse(tp, None))
        .map(|t| {
            format!(
                "<p>Trace <code class=\"trace-id\">{}</code>, created by span <code>{}</code> \
                 (its creation context, docs/tracing.md).</p>",
                esc(t.trace_id()),
                esc(t.parent_id())
            )
        })
        .unwrap_or_default();
    let headers = serde_json::to_string_pretty(headers).unwrap_or_default();
    let shown = if let Some(payload) = payload {
        shown_payload(payload)
    } else {
        format!(
            "<p class=\"notice\">Payload hidden ({payload_bytes} bytes): the console runs \
             with --sensitive-payloads.</p>"
        )
    };
    format!(
        "{trace}<h2>Headers</h2><pre>{}</pre><h2>Payload <span class=\"muted\">({})</span></h2>{shown}",
        esc(&headers),
        esc(content_type)
    )
}

/// A payload read: pretty JSON when it parses, text when it is UTF-8, a size otherwise.
fn shown_payload(payload: &[u8]) -> String {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(payload) {
        format!(
            "<pre id=\"payload\">{}</pre>",
            esc(&serde_json::to_string_pretty(&v).unwrap_or_default())
        )
    } else if let Ok(text) = std::str::from_utf8(payload) {
        format!("<pre id=\"payload\">{}</pre>", esc(text))
    } else {
        format!("<p>{} bytes of binary payload.</p>", payload.len())
    }
}

/// The dead-letter filter of a page's parameters (`id` repeated, `topic`, `since` as an
/// age such as `1h` or an RFC 3339 time, `error`), or a 400 naming the bad one. The replay
/// preview hands `since` on as the time it stood for, so that the replay moves exactly the
/// dead letters the preview listed.
fn dead_letter_filter(params: &Params) -> Result<DeadLetterFilter, Refusal> {
    let ids = params
        .all("id")
        .into_iter()
        .map(|v| {
            Uuid::parse_str(v)
                .map_err(|_| bad_request(&format!("id: {v:?} is not a message id (a UUID)")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let since = match params.get("since") {
        None => None,
        Some(v) => match chrono::DateTime::parse_from_rfc3339(v) {
            Ok(at) => Some(at.with_timezone(&Utc)),
            Err(_) => {
                let d = humantime::parse_duration(v).map_err(|e| {
                    bad_request(&format!(
                        "since: {v:?} is neither a duration such as 1h ({e}) nor an RFC 3339 time"
                    ))
                })?;
                Some(
                    Utc::now()
                        - chrono::Duration::from_std(d)
                            .map_err(|_| bad_request("since: too long"))?,
                )
            }
        },
    };
    Ok(DeadLetterFilter {
        ids: (!ids.is_empty()).then_some(ids),
        topic: params.get("topic").map(str::to_owned),
        since,
        error_contains: params.get("error").map(str::to_owned),
    })
}

/// Dead letters: filters, a capped count, multi-select, and the way to the replay preview.
pub async fn dead_letters(State(console): Shared, RawQuery(q): RawQuery) -> Page {
    let params = Params::parse(q.as_deref().unwrap_or(""));
    let sources = console.sources();
    let (name, store) = pick(&sources, &params)?;
    let filter = dead_letter_filter(&params)?;
    let before = match params.get("before") {
        None => None,
        Some(v) => Some(Uuid::parse_str(v).map_err(|_| bad_request("before: not a UUID"))?),
    };
    let s = &console.settings;
    let t = s.statement_timeout;
    let base = &s.base_path;
    let (count, rows) = tokio::join!(
        store.console_dead_letter_count(t, &filter),
        store.console_dead_letters(t, &filter, before, s.page_size + 1)
    );
    let mut body = format!(
        "<form class=\"filters\" method=\"get\" action=\"{base}/dead-letters\">\
         <input type=\"hidden\" name=\"source\" value=\"{}\">\
         <div><label for=\"f-topic\">Topic</label><input id=\"f-topic\" name=\"topic\" value=\"{}\"></div>\
         <div><label for=\"f-since\">Dead-lettered within</label><input id=\"f-since\" name=\"since\" size=\"6\" placeholder=\"1h\" value=\"{}\"></div>\
         <div><label for=\"f-error\">Error contains</label><input id=\"f-error\" name=\"error\" value=\"{}\"></div>\
         <button type=\"submit\">Filter</button></form>",
        esc(name),
        esc(params.get("topic").unwrap_or("")),
        esc(params.get("since").unwrap_or("")),
        esc(params.get("error").unwrap_or("")),
    );
    match count {
        Ok(c) => {
            let _ = write!(
                body,
                "<p id=\"dead-letter-count\">{c} dead letter(s) match.</p>"
            );
        }
        Err(e) => body += &query_failed("Count", &e, t),
    }
    match rows {
        Ok(mut rows) => {
            let more = i64::try_from(rows.len()).unwrap_or(i64::MAX) > s.page_size;
            rows.truncate(usize::try_from(s.page_size).unwrap_or(50));
            if rows.is_empty() {
                body += "<p>No dead letter matches.</p>";
            } else {
                let _ = write!(
                    body,
                    "<form method=\"get\" action=\"{base}/dead-letters/replay\">\
                     <input type=\"hidden\" name=\"source\" value=\"{}\">\
                     <table><thead><tr><th scope=\"col\"><input type=\"checkbox\" data-select-all \
                     id=\"select-all\" aria-label=\"Select every dead letter shown\"></th>\
                     <th scope=\"col\">Id</th><th scope=\"col\">Topic</th><th scope=\"col\">Key</th>\
                     <th scope=\"col\">Dead-lettered</th><th scope=\"col\" class=\"num\">Attempts</th>\
                     <th scope=\"col\">Last error</th></tr></thead><tbody>",
                    esc(name)
                );
                for d in &rows {
                    let _ = write!(
                        body,
                        "<tr><td><input type=\"checkbox\" name=\"id\" value=\"{id}\" aria-label=\"Select {id}\"></td>\
                         <td class=\"mono\"><a href=\"{base}/messages/{id}?source={n}\">{id}</a></td>\
                         <td>{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
                        esc(&d.topic),
                        opt(d.message_key.as_deref()),
                        time_ago(d.dead_lettered_at),
                        d.attempt_count,
                        opt(d.last_error.as_deref().map(|e| short(e, 120)).as_deref()),
                        id = d.outbox_id,
                        n = encode(name),
                    );
                }
                body += "</tbody></table><button type=\"submit\">Preview the replay of the selected…</button></form>";
                let filtered = filter.topic.is_some()
                    || filter.since.is_some()
                    || filter.error_contains.is_some();
                if filtered {
                    let _ = write!(
                        body,
                        "<p><a href=\"{base}/dead-letters/replay?{}\">Preview the replay of every dead letter this filter matches…</a></p>",
                        esc(&query(&[
                            ("source", name),
                            ("topic", params.get("topic").unwrap_or("")),
                            ("since", params.get("since").unwrap_or("")),
                            ("error", params.get("error").unwrap_or("")),
                        ]))
                    );
                }
            }
            if more && let Some(last) = rows.last() {
                let cursor = last.outbox_id.to_string();
                let _ = write!(
                    body,
                    "<p><a rel=\"next\" href=\"{base}/dead-letters?{}\">Older dead letters →</a></p>",
                    esc(&query(&[
                        ("source", name),
                        ("topic", params.get("topic").unwrap_or("")),
                        ("since", params.get("since").unwrap_or("")),
                        ("error", params.get("error").unwrap_or("")),
                        ("before", &cursor),
                    ]))
                );
            }
        }
        Err(e) => body += &query_failed("Dead letters", &e, t),
    }
    match store.console_replays(t, 10).await {
        Ok(replays) if !replays.is_empty() => {
            body += "<h2>Latest replays</h2><table><thead><tr><th scope=\"col\" class=\"num\">Replay</th>\
                     <th scope=\"col\">Started</th><th scope=\"col\">By (login)</th><th scope=\"col\">Reason</th>\
                     <th scope=\"col\" class=\"num\">Replayed</th></tr></thead><tbody>";
            for r in replays {
                let _ = write!(
                    body,
                    "<tr><td class=\"num\">{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td></tr>",
                    r.replay_id,
                    time_ago(r.started_at),
                    esc(&r.replayed_by),
                    opt(r.reason.as_deref()),
                    thousands(r.replayed)
                );
            }
            body += "</tbody></table>";
        }
        Ok(_) => {}
        Err(e) => body += &query_failed("Latest replays", &e, t),
    }
    Ok(Html(html::page(
        &frame(
            &console,
            &sources,
            "Dead letters",
            "/dead-letters",
            name,
            true,
        ),
        &body,
    )))
}

/// The replay's dry run: exactly which dead letters the replay would move (by id when
/// some were ticked, else every one the filter matches, listed up to [`PREVIEW_ROWS`]),
/// and the form that asks for it with the admin token.
pub async fn replay_preview(State(console): Shared, RawQuery(q): RawQuery) -> Page {
    let params = Params::parse(q.as_deref().unwrap_or(""));
    let sources = console.sources();
    let (name, store) = pick(&sources, &params)?;
    let filter = dead_letter_filter(&params)?;
    if filter.ids.is_none()
        && filter.topic.is_none()
        && filter.since.is_none()
        && filter.error_contains.is_none()
    {
        return Err(bad_request(
            "a replay needs dead letters ticked (id) or a filter (topic, since, error)",
        ));
    }
    let s = &console.settings;
    let t = s.statement_timeout;
    let base = &s.base_path;
    let (count, rows) = tokio::join!(
        store.console_dead_letter_count(t, &filter),
        store.console_dead_letters(t, &filter, None, PREVIEW_ROWS)
    );
    let mut body = "<p>Dry run: nothing has moved yet.</p>".to_owned();
    let rows = match (count, rows) {
        (Ok(c), Ok(rows)) => {
            let _ = write!(
                body,
                "<p id=\"replay-count\">The replay would move <strong>{c}</strong> dead letter(s) \
                 back into the outbox with a fresh attempt budget{}:</p>",
                if c.more || c.count > PREVIEW_ROWS {
                    format!(" (the first {PREVIEW_ROWS} listed)")
                } else {
                    String::new()
                }
            );
            rows
        }
        (Err(e), _) | (_, Err(e)) => {
            body += &query_failed("Dry run", &e, t);
            return Ok(Html(html::page(
                &frame(
                    &console,
                    &sources,
                    "Replay dead letters",
                    "/dead-letters",
                    name,
                    false,
                ),
                &body,
            )));
        }
    };
    body += "<table><thead><tr><th scope=\"col\">Id</th><th scope=\"col\">Topic</th>\
             <th scope=\"col\">Dead-lettered</th><th scope=\"col\">Last error</th></tr></thead><tbody>";
    for d in &rows {
        let _ = write!(
            body,
            "<tr><td class=\"mono\">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            d.outbox_id,
            esc(&d.topic),
            time_ago(d.dead_lettered_at),
            opt(d.last_error.as_deref().map(|e| short(e, 120)).as_deref())
        );
    }
    body += "</tbody></table>";
    if !s.writable() {
        body += "<p class=\"notice\">This console is read-only (no admin token is configured, \
                 or it runs with --read-only): replay from the command line with \
                 <code>outbox-relay replay</code>.</p>";
    } else if rows.is_empty() {
        body += "<p>Nothing to replay.</p>";
    } else {
        let mut hidden = format!(
            "<input type=\"hidden\" name=\"source\" value=\"{}\">",
            esc(name)
        );
        for id in filter.ids.iter().flatten() {
            let _ = write!(hidden, "<input type=\"hidden\" name=\"id\" value=\"{id}\">");
        }
        for field in ["topic", "error"] {
            if let Some(v) = params.get(field) {
                let _ = write!(
                    hidden,
                    "<input type=\"hidden\" name=\"{field}\" value=\"{}\">",
                    esc(v)
                );
            }
        }
        if let Some(since) = filter.since {
            let _ = write!(
                hidden,
                "<input type=\"hidden\" name=\"since\" value=\"{}\">",
                esc(&since.to_rfc3339())
            );
        }
        let _ = write!(
            body,
            "<form class=\"replay\" method=\"post\" action=\"{base}/dead-letters/replay\">{hidden}\
             <div><label for=\"r-actor\">Your name (recorded with the replay)</label>\
             <input id=\"r-actor\" name=\"actor\" required maxlength=\"100\" autocomplete=\"username\"></div>\
             <div><label for=\"r-reason\">Reason</label><input id=\"r-reason\" name=\"reason\" required maxlength=\"500\"></div>\
             <div><label for=\"r-token\">Admin token</label><input id=\"r-token\" name=\"token\" type=\"password\" required autocomplete=\"current-password\"></div>\
             <button type=\"submit\">Replay these dead letters</button></form>"
        );
    }
    Ok(Html(html::page(
        &frame(
            &console,
            &sources,
            "Replay dead letters",
            "/dead-letters",
            name,
            false,
        ),
        &body,
    )))
}

/// The replay: refused (403) without a configured token, with a wrong one, or read-only;
/// otherwise the audited replay of what the preview listed, its actor and reason recorded
/// in `outbox.replay_log` and in the console's log.
pub async fn replay(
    State(console): Shared,
    headers: HeaderMap,
    form: String,
) -> Result<Response, Refusal> {
    let params = Params::parse(&form);
    let sources = console.sources();
    let (name, store) = pick(&sources, &params)?;
    let s = &console.settings;
    let refuse = |why: &str| {
        tracing::warn!(source = name, reason = why, "console refused a replay");
        Refusal(
            StatusCode::FORBIDDEN,
            format!(
                "<!doctype html><html lang=\"en\"><link rel=\"icon\" href=\"data:,\"><title>refused</title><p>Replay refused: \
                 {}</p></html>",
                esc(why)
            ),
        )
    };
    let Some(token) = s.token.as_ref().filter(|_| !s.read_only) else {
        return Err(refuse(
            "the console is read-only (no admin token configured, or --read-only)",
        ));
    };
    let presented = params.get("token").map(str::to_owned).or_else(|| {
        headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::to_owned)
    });
    if !presented.is_some_and(|p| token.matches(&p)) {
        return Err(refuse("the admin token is missing or wrong"));
    }
    let Some(actor) = params.get("actor").map(|a| short(a, 100)) else {
        return Err(bad_request("actor: say who replays (your name)"));
    };
    let reason = params
        .get("reason")
        .map(|r| short(r, 500))
        .unwrap_or_default();
    let filter = dead_letter_filter(&params)?;
    if filter.ids.is_none()
        && filter.topic.is_none()
        && filter.since.is_none()
        && filter.error_contains.is_none()
    {
        return Err(bad_request(
            "a replay needs dead letters ticked (id) or a filter (topic, since, error)",
        ));
    }
    let audit = format!("console, by {actor}: {reason}");
    let base = &s.base_path;
    match store
        .console_replay(s.statement_timeout, &filter, &audit)
        .await
    {
        Ok((replay_id, moved)) => {
            tracing::info!(source = name, actor = %actor, reason = %reason, replay_id, replayed = moved,
                "console replayed dead letters");
            let body = format!(
                "<p class=\"notice\" id=\"replay-done\" role=\"status\">Replayed {moved} dead letter(s) \
                 (replay {replay_id}, recorded in {schema}.replay_log as “{}”).</p>\
                 <p><a href=\"{base}/dead-letters?source={n}\">Back to the dead letters</a></p>",
                esc(&audit),
                schema = esc(store.schema()),
                n = encode(name)
            );
            Ok(Html(html::page(
                &frame(&console, &sources, "Replayed", "/dead-letters", name, false),
                &body,
            ))
            .into_response())
        }
        Err(e) => {
            tracing::warn!(source = name, actor = %actor, error = %e, "console replay failed");
            let body = query_failed("Replay", &e, s.statement_timeout);
            Err(Refusal(
                StatusCode::INTERNAL_SERVER_ERROR,
                html::page(
                    &frame(
                        &console,
                        &sources,
                        "Replay failed",
                        "/dead-letters",
                        name,
                        false,
                    ),
                    &body,
                ),
            ))
        }
    }
}

/// Sources: each source's state (reachable, schema version), who serves it (its slots'
/// holders) and what is wrong. Never a connection string: the address, login and database.
pub async fn sources(State(console): Shared, RawQuery(q): RawQuery) -> Page {
    let params = Params::parse(q.as_deref().unwrap_or(""));
    let sources = console.sources();
    let (selected, _) = pick(&sources, &params)?;
    let t = timeout(&console);
    let base = &console.settings.base_path;
    let rows = join_all(sources.stores.iter().map(|(name, store)| async move {
        let (version, holders) = tokio::join!(store.check_schema(), store.console_holders(t));
        let (health, cause) = match &version {
            Ok(v) => (format!("ok, schema version {v}"), String::new()),
            Err(e) => ("unhealthy".to_owned(), e.to_string()),
        };
        let served = match holders {
            Ok(h) if h.is_empty() => "no relayer holds a slot".to_owned(),
            Ok(h) => h
                .iter()
                .map(|h| format!("slot {}: <span class=\"mono\">{}</span> until {}", h.slot, esc(&h.worker_id), time_ago(h.expires_at)))
                .collect::<Vec<_>>()
                .join("<br>"),
            Err(e) if version.is_ok() => query_failed("Holders", &e, t),
            Err(_) => "—".to_owned(),
        };
        format!(
            "<tr><td><a href=\"{base}/?source={n}\">{}</a></td><td>{}</td><td class=\"{}\">{}</td><td>{served}</td><td>{}</td></tr>",
            esc(name),
            esc(&store.target().describe()),
            if version.is_ok() { "" } else { "bad" },
            esc(&health),
            esc(&cause),
            n = encode(name),
        )
    }))
    .await;
    let body = format!(
        "<p>{} source(s); the console keeps at most {} connection(s) to each, opened when a \
         page needs them and closed after a minute unused.</p>\
         <table><thead><tr><th scope=\"col\">Source</th><th scope=\"col\">Where</th><th scope=\"col\">Health</th>\
         <th scope=\"col\">Served by</th><th scope=\"col\">Cause</th></tr></thead><tbody>{}</tbody></table>",
        sources.stores.len(),
        console.settings.connections_per_source,
        rows.concat()
    );
    Ok(Html(html::page(
        &frame(&console, &sources, "Sources", "/sources", selected, true),
        &body,
    )))
}

/// Destinations: each destination's circuit as each relayer reports it, the error rate per
/// worker in the minute before the observation, and the latest errors.
pub async fn destinations(State(console): Shared, RawQuery(q): RawQuery) -> Page {
    let params = Params::parse(q.as_deref().unwrap_or(""));
    let sources = console.sources();
    let (name, store) = pick(&sources, &params)?;
    let t = timeout(&console);
    let base = &console.settings.base_path;
    let (circuits, observation, failures) = tokio::join!(
        store.console_circuits(t),
        observation(&console, name, store),
        store.console_failures(t)
    );
    let mut body = match circuits {
        Ok(c) => circuit_table(&c),
        Err(e) => query_failed("Circuits", &e, t),
    };
    match observation {
        Ok(Some(o)) => {
            let _ = write!(
                body,
                "<h3>Error rate, the minute before the observation</h3><p class=\"muted\">As \
                 observed {}.</p><table><thead><tr><th scope=\"col\">Worker</th>\
                 <th scope=\"col\" class=\"num\">Delivered</th><th scope=\"col\" class=\"num\">Not delivered</th>\
                 <th scope=\"col\" class=\"num\">Error rate</th></tr></thead><tbody>",
                time_ago(o.observed_at)
            );
            for w in WorkerRow::from_snapshot(&o.snapshot) {
                let total = w.delivered_1m + w.not_delivered_1m;
                let rate = if total == 0 {
                    "—".to_owned()
                } else {
                    format!("{:.1} %", w.not_delivered_1m as f64 * 100.0 / total as f64)
                };
                let _ = write!(
                    body,
                    "<tr><td class=\"mono\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{rate}</td></tr>",
                    esc(&w.worker_id),
                    thousands(w.delivered_1m),
                    thousands(w.not_delivered_1m)
                );
            }
            body += "</tbody></table>";
        }
        Ok(None) => {
            body += "<h3>Error rate</h3><p>No observation yet: the console asked for one; it \
                     shows on the next refresh.</p>";
        }
        Err(e) => body += &query_failed("Error rate", &e, t),
    }
    match failures {
        Ok(f) => {
            body += "<h3>Recent errors</h3>";
            if f.is_empty() {
                body += "<p>No failed attempt recorded recently.</p>";
            } else {
                body += "<table><thead><tr><th scope=\"col\">At</th><th scope=\"col\">Message</th><th scope=\"col\">Topic</th>\
                         <th scope=\"col\">Outcome</th><th scope=\"col\">Worker</th><th scope=\"col\">Error</th><th scope=\"col\">Now</th></tr></thead><tbody>";
                for f in f.iter().take(50) {
                    let _ = write!(
                        body,
                        "<tr><td>{}</td><td class=\"mono\"><a href=\"{base}/messages/{id}?source={n}\">{id}</a> #{}</td><td>{}</td><td>{}</td><td class=\"mono\">{}</td><td>{}</td><td>{}</td></tr>",
                        time_ago(f.created_at),
                        f.attempt_no,
                        opt(f.topic.as_deref()),
                        esc(&f.state),
                        esc(&f.worker_id),
                        opt(f.error.as_deref().map(|e| short(e, 160)).as_deref()),
                        esc(&f.now_in),
                        id = f.outbox_id,
                        n = encode(name)
                    );
                }
                body += "</tbody></table>";
            }
        }
        Err(e) => body += &query_failed("Recent errors", &e, t),
    }
    Ok(Html(html::page(
        &frame(
            &console,
            &sources,
            "Destinations",
            "/destinations",
            name,
            true,
        ),
        &body,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_is_an_age_or_the_time_the_preview_handed_on() {
        let at = "2026-11-28T20:00:00.500+00:00";
        let filter =
            dead_letter_filter(&Params::parse(&format!("since={}", at.replace('+', "%2B"))))
                .unwrap_or_else(|_| panic!("{at} is a time"));
        assert_eq!(filter.since.unwrap().to_rfc3339(), at);
        let filter = dead_letter_filter(&Params::parse("since=1h")).unwrap_or_else(|_| panic!());
        let age = Utc::now() - filter.since.unwrap();
        assert!((3599..=3601).contains(&age.num_seconds()), "{age}");
        assert!(dead_letter_filter(&Params::parse("since=yesterday")).is_err());
    }

    #[test]
    fn a_message_with_a_creation_context_shows_its_trace_id() {
        let headers = serde_json::json!({
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        });
        let page = contents("application/json", &headers, None, 2);
        assert!(
            page.contains("<code class=\"trace-id\">4bf92f3577b34da6a3ce929d0e0e4736</code>"),
            "{page}"
        );
        let page = contents("application/json", &serde_json::json!({}), None, 2);
        assert!(!page.contains("trace-id"), "{page}");
    }
}

//! The mixed keyed/unkeyed drain each destination that takes a key's run in one call
//! (Pub/Sub, Kinesis, SQS FIFO) is tried with: 10 % of the messages keyed, ten keys, read
//! back by the harness's independent client, and the requests the relayer made as its
//! proxy saw them.

use std::collections::HashMap;

use tokio_postgres::Client;

/// Messages of the drain.
pub const MESSAGES: i64 = 2_000;
/// Keys among them: every tenth message is keyed, with one of these.
pub const KEYS: i64 = 10;
/// Messages of each key.
pub const PER_KEY: i64 = MESSAGES / 10 / KEYS;

/// Enqueues the drain's messages on `topic`: payload `{"seq": s}`, message `s` keyed with
/// `key-{s / 10 % 10}` when `s` is a multiple of ten.
pub async fn enqueue(c: &Client, topic: &str) {
    c.execute(
        "SELECT outbox.enqueue($1, jsonb_build_object('seq', s), \
                CASE WHEN s % 10 = 0 THEN 'key-' || (s / 10 % $2::bigint) END, '{}'::jsonb) \
         FROM generate_series(0, $3::bigint - 1) AS s",
        &[&topic, &KEYS, &MESSAGES],
    )
    .await
    .unwrap();
}

/// What arrived, as `(key, seq)` in the order the service hands a key's messages out:
/// every message is there, and each key's in enqueue order (a message sent again may
/// appear twice, never after its successor).
pub fn assert_arrived_in_key_order(arrived: &[(Option<String>, i64)]) {
    let mut last: HashMap<&str, i64> = HashMap::new();
    let mut seen = std::collections::BTreeSet::new();
    for (key, seq) in arrived {
        seen.insert(*seq);
        if let Some(key) = key {
            let previous = last.insert(key, *seq).unwrap_or(-1);
            assert!(*seq >= previous, "{key}: seq {seq} after {previous}");
        }
    }
    assert_eq!(
        seen.len(),
        usize::try_from(MESSAGES).unwrap(),
        "every message arrived"
    );
    assert_eq!(last.len(), usize::try_from(KEYS).unwrap());
}

/// The JSON request bodies among `bodies` that hold an array `list`, each as the drain's
/// keys of its entries: the string field `key` of an entry when it is one of
/// [`enqueue`]'s `key-…`, `None` otherwise (an unkeyed message, whose partition key or
/// message group is its own). Other bodies (a call without `list`) are left out.
pub fn requests_by_key(bodies: &[Vec<u8>], list: &str, key: &str) -> Vec<Vec<Option<String>>> {
    bodies
        .iter()
        .filter_map(|body| {
            let body: serde_json::Value = serde_json::from_slice(body).ok()?;
            let entries = body[list].as_array()?;
            Some(
                entries
                    .iter()
                    .map(|e| {
                        e[key]
                            .as_str()
                            .filter(|k| k.starts_with("key-"))
                            .map(str::to_owned)
                    })
                    .collect(),
            )
        })
        .collect()
}

/// The requests the relayer made, each as the keys of its messages (`None`: unkeyed), in
/// the order they were sent: they carried every message, and a key's run went in one
/// request (some request carries several messages of one key). Where a request takes
/// `max_per_request` messages or more than all the keyed ones, fewer requests carried keyed
/// messages than a key has messages (one message of a key per request would need at least
/// [`PER_KEY`] of them). Prints the sizes.
pub fn assert_runs_share_requests(
    what: &str,
    requests: &[Vec<Option<String>>],
    max_per_request: usize,
) {
    let sizes: Vec<usize> = requests.iter().map(Vec::len).collect();
    let keyed: Vec<usize> = requests
        .iter()
        .map(|r| r.iter().filter(|k| k.is_some()).count())
        .filter(|&n| n > 0)
        .collect();
    let longest_run = requests
        .iter()
        .flat_map(|r| {
            let mut per_key: HashMap<&str, usize> = HashMap::new();
            for k in r.iter().flatten() {
                *per_key.entry(k).or_default() += 1;
            }
            per_key.into_values()
        })
        .max()
        .unwrap_or(0);
    let mut by_size = std::collections::BTreeMap::<usize, usize>::new();
    for s in &sizes {
        *by_size.entry(*s).or_default() += 1;
    }
    eprintln!(
        "{what}: {} requests (messages in a request: count {by_size:?}); {} of them with \
         keyed messages; longest run of a key in one request {longest_run}",
        requests.len(),
        keyed.len()
    );
    assert!(
        sizes.iter().sum::<usize>() >= usize::try_from(MESSAGES).unwrap(),
        "the requests carried every message: {sizes:?}"
    );
    assert!(
        longest_run > 1,
        "a key's run goes in one request: {keyed:?}"
    );
    assert!(
        max_per_request < usize::try_from(KEYS * PER_KEY).unwrap()
            || keyed.len() < usize::try_from(PER_KEY).unwrap(),
        "{} requests carried keyed messages, one message of a key per request would need {PER_KEY}",
        keyed.len()
    );
}

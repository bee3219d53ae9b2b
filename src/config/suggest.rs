//! "Did you mean": the nearest known name for an unknown key or value of the TOML file.
//! serde words an unknown key as ``unknown field `x`, expected one of `a`, `b`, …`` (and an
//! unknown variant the same way); this reads the candidates out of that message and, when
//! one is close to what was written, puts it first so that a typo names its own fix
//! instead of a list of fifty keys.

/// `message` with a "did you mean" put in when it reports an unknown field or variant and
/// a known name is close to the one given; otherwise `message` unchanged.
pub(super) fn did_you_mean(message: &str) -> String {
    for kind in ["unknown field `", "unknown variant `"] {
        let Some(start) = message.find(kind) else {
            continue;
        };
        let after = &message[start + kind.len()..];
        let Some(end) = after.find('`') else {
            continue;
        };
        let given = &after[..end];
        let rest = &after[end + 1..];
        // The candidates end where serde's sentence does: at the first line break.
        let list_end = rest.find('\n').unwrap_or(rest.len());
        let candidates: Vec<&str> = rest[..list_end].split('`').skip(1).step_by(2).collect();
        if let Some(best) = nearest(given, &candidates) {
            let head = &message[..start + kind.len() + end + 1];
            let tail = &rest[list_end..];
            return format!("{head}: did you mean `{best}`?{tail}");
        }
    }
    message.to_owned()
}

/// The candidate closest to `given` when it is close enough to be the one meant: the same
/// name but for case, `-` and `_`, or within a third of its length in edits (at least 1).
fn nearest<'a>(given: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let fold = |s: &str| -> String {
        s.chars()
            .filter(|c| *c != '_' && *c != '-')
            .flat_map(char::to_lowercase)
            .collect()
    };
    let given_folded = fold(given);
    let limit = (given.chars().count() / 3).max(1);
    candidates
        .iter()
        .map(|c| {
            let distance = if fold(c) == given_folded {
                0
            } else {
                edits(given, c)
            };
            (distance, *c)
        })
        .filter(|(distance, _)| *distance <= limit)
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, c)| c)
}

/// Insertions, deletions, substitutions and swaps of neighbours turning `a` into `b`.
fn edits(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut rows = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in rows.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in rows[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (rows[i - 1][j] + 1)
                .min(rows[i][j - 1] + 1)
                .min(rows[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(rows[i - 2][j - 2] + 1);
            }
            rows[i][j] = best;
        }
    }
    rows[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_typo_of_a_key_names_the_key_meant() {
        let long = "unknown field `batchsize`, expected one of `database_url`, `batch_size`, \
                    `max_batch_bytes`";
        assert_eq!(
            did_you_mean(long),
            "unknown field `batchsize`: did you mean `batch_size`?"
        );
        let nested = "unknown field `paht`, expected `path` or `fsync`\nin `destinations.d`\n";
        assert_eq!(
            did_you_mean(nested),
            "unknown field `paht`: did you mean `path`?\nin `destinations.d`\n"
        );
        assert_eq!(
            did_you_mean("unknown field `lease-secs`, expected one of `lease_secs`, `sink`"),
            "unknown field `lease-secs`: did you mean `lease_secs`?"
        );
        assert_eq!(
            did_you_mean("unknown variant `jsn`, expected `text` or `json`"),
            "unknown variant `jsn`: did you mean `json`?"
        );
    }

    #[test]
    fn a_key_close_to_nothing_keeps_the_whole_list() {
        let message = "unknown field `colour`, expected one of `sink`, `topics`";
        assert_eq!(did_you_mean(message), message);
        let message = "unknown field `x`, there are no fields";
        assert_eq!(did_you_mean(message), message);
        assert_eq!(did_you_mean("missing field `path`"), "missing field `path`");
    }
}

//! The query strings and form bodies of the console's pages: every filter of a page, and
//! the source, lives in its URL (a link to a filtered list can be shared), so they are read
//! here from `application/x-www-form-urlencoded` text, repeated names (`id=…&id=…`, the
//! dead letters ticked for a replay) included, and written back into links the same way.

/// The name-value pairs of a query string or form body, in order, percent-decoded.
#[derive(Clone, Debug, Default)]
pub struct Params(Vec<(String, String)>);

impl Params {
    pub fn parse(text: &str) -> Self {
        Params(
            text.split('&')
                .filter(|pair| !pair.is_empty())
                .map(|pair| {
                    let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
                    (decode(name), decode(value))
                })
                .collect(),
        )
    }

    /// The first value of `name`, unless empty (an empty filter field is no filter).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, v)| n == name && !v.trim().is_empty())
            .map(|(_, v)| v.trim())
    }

    /// Every non-empty value of `name`.
    pub fn all(&self, name: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(n, v)| n == name && !v.trim().is_empty())
            .map(|(_, v)| v.trim())
            .collect()
    }
}

/// `pairs` as a query string (without the `?`), empty values left out.
pub fn query(pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(n, v)| format!("{}={}", encode(n), encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// Percent-encodes everything but the unreserved characters of RFC 3986.
pub fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Percent- and `+`-decoding; a malformed escape is kept as it is written, and invalid
/// UTF-8 is replaced.
pub fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(high), Some(low)) => {
                    out.push(high << 4 | low);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The value of one hexadecimal digit.
fn hex(b: u8) -> Option<u8> {
    char::from(b)
        .to_digit(16)
        .and_then(|d| u8::try_from(d).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_names_and_escapes_are_read() {
        let p = Params::parse("source=a%20b&id=1&id=2&topic=&key=x+y&bad=%zz&end=%4");
        assert_eq!(p.get("source"), Some("a b"));
        assert_eq!(p.all("id"), vec!["1", "2"]);
        assert_eq!(p.get("topic"), None);
        assert_eq!(p.get("key"), Some("x y"));
        assert_eq!(p.get("bad"), Some("%zz"));
        assert_eq!(p.get("end"), Some("%4"));
    }

    #[test]
    fn a_query_round_trips() {
        let q = query(&[
            ("topic", "orders/eu & more"),
            ("key", ""),
            ("state", "ready"),
        ]);
        assert_eq!(q, "topic=orders%2Feu%20%26%20more&state=ready");
        let p = Params::parse(&q);
        assert_eq!(p.get("topic"), Some("orders/eu & more"));
        assert_eq!(p.get("key"), None);
    }
}

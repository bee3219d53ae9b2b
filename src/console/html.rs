//! How the console writes HTML: escaping (every value from the database or the request
//! goes through [`esc`]), the page frame (navigation, source picker, find-by-id box,
//! live-update switch), times and ages in words, the small SVG chart of the overview, and
//! the panel that says a query failed (a statement timeout in so many words).

use chrono::{DateTime, Utc};

use crate::store::StoreError;

/// `text` safe inside HTML text and attribute values.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// What the frame of a page needs to know.
pub struct Frame<'a> {
    /// The path prefix (`--base-path`), "" or `/x`.
    pub base: &'a str,
    pub title: &'a str,
    /// Which navigation entry is current (its path after the base: "/", "/messages", …).
    pub current: &'a str,
    /// Every source's name, and the selected one.
    pub sources: &'a [String],
    pub source: &'a str,
    /// Milliseconds between live updates; 0: the page is not updated.
    pub refresh_ms: u128,
    /// The console allows writes (a token is configured and it is not read-only).
    pub writable: bool,
}

const NAV: [(&str, &str); 5] = [
    ("/", "Overview"),
    ("/messages", "Messages"),
    ("/dead-letters", "Dead letters"),
    ("/sources", "Sources"),
    ("/destinations", "Destinations"),
];

/// A whole page: the frame around `body` (which goes inside the live region).
pub fn page(frame: &Frame<'_>, body: &str) -> String {
    let base = frame.base;
    let source_q = super::params::encode(frame.source);
    let mut nav = String::new();
    for (path, label) in NAV {
        let current = if path == frame.current {
            " aria-current=\"page\""
        } else {
            ""
        };
        nav += &format!("<li><a href=\"{base}{path}?source={source_q}\"{current}>{label}</a></li>");
    }
    let mut options = String::new();
    for name in frame.sources {
        let selected = if name == frame.source {
            " selected"
        } else {
            ""
        };
        options += &format!(
            "<option value=\"{v}\"{selected}>{v}</option>",
            v = esc(name)
        );
    }
    let current_path = if frame.current == "/" {
        "/".to_owned()
    } else {
        frame.current.to_owned()
    };
    let mode = if frame.writable {
        "<span class=\"badge warn\">writes allowed with the admin token</span>"
    } else {
        "<span class=\"badge\">read-only</span>"
    };
    let live = if frame.refresh_ms > 0 {
        "<button type=\"button\" id=\"pause\" aria-pressed=\"false\">Pause live updates</button>\
         <span id=\"live-state\" role=\"status\">live</span>"
    } else {
        ""
    };
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{title} · outbox-relay console</title><link rel=\"icon\" href=\"data:,\">\
         <link rel=\"stylesheet\" href=\"{base}/assets/console.css\">\
         <script src=\"{base}/assets/console.js\" defer></script></head>\
         <body data-refresh=\"{refresh}\">\
         <header><a class=\"brand\" href=\"{base}/?source={source_q}\">outbox-relay</a>\
         <nav aria-label=\"Screens\"><ul>{nav}</ul></nav>\
         <form class=\"picker\" method=\"get\" action=\"{base}{current_path}\">\
         <label for=\"source-pick\">Source</label>\
         <select id=\"source-pick\" name=\"source\">{options}</select>\
         <button type=\"submit\">Show</button></form>\
         <form class=\"find\" role=\"search\" method=\"get\" action=\"{base}/find\">\
         <input type=\"hidden\" name=\"source\" value=\"{source}\">\
         <label for=\"find-id\">Message id</label>\
         <input id=\"find-id\" name=\"id\" placeholder=\"0190…\" size=\"38\" required>\
         <button type=\"submit\">Find</button></form>{mode}{live}</header>\
         <main><h1>{title}</h1><div id=\"live\">{body}</div></main></body></html>\n",
        title = esc(frame.title),
        refresh = frame.refresh_ms,
        source = esc(frame.source),
    )
}

/// The panel that replaces a query's result when it failed: a statement timeout says the
/// query was cancelled and after how long; a refused right names the role it needs.
pub fn query_failed(what: &str, e: &StoreError, timeout: std::time::Duration) -> String {
    let detail = if e.is_statement_timeout() {
        format!(
            "cancelled: the query ran longer than the console's statement timeout ({} ms). \
             Narrow the filters, or raise --statement-timeout.",
            timeout.as_millis()
        )
    } else if e.is_permission_denied() {
        format!(
            "this login may not read it ({e}): see docs/console.md, “Roles”, for the rights \
             the console needs"
        )
    } else {
        e.to_string()
    };
    format!(
        "<div class=\"error\" role=\"alert\"><strong>{}</strong>: {}</div>",
        esc(what),
        esc(&detail)
    )
}

/// `t` as `2026-11-28 18:48:15Z`.
pub fn time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%SZ").to_string()
}

/// `t` with its age: `<time datetime=…>2026-… (3 min ago)</time>`.
pub fn time_ago(t: DateTime<Utc>) -> String {
    let secs = (Utc::now() - t).num_milliseconds() as f64 / 1000.0;
    let words = if secs >= 0.0 {
        format!("{} ago", seconds(secs))
    } else {
        format!("in {}", seconds(-secs))
    };
    format!(
        "<time datetime=\"{}\">{} ({words})</time>",
        t.to_rfc3339(),
        time(t)
    )
}

/// A duration in seconds, in the largest unit that keeps it readable.
pub fn seconds(secs: f64) -> String {
    if secs < 1.0 {
        format!("{:.0} ms", secs * 1000.0)
    } else if secs < 120.0 {
        format!("{secs:.1} s")
    } else if secs < 7200.0 {
        format!("{:.1} min", secs / 60.0)
    } else if secs < 172_800.0 {
        format!("{:.1} h", secs / 3600.0)
    } else {
        format!("{:.1} days", secs / 86400.0)
    }
}

/// An optional text, "—" when absent.
pub fn opt(text: Option<&str>) -> String {
    text.map_or_else(|| "—".to_owned(), esc)
}

/// A bar chart of `values` (one per minute, oldest first), `label` naming it for screen
/// readers; drawn with SVG attributes only (the CSP allows no inline style).
pub fn bars(values: &[(String, i64)], label: &str) -> String {
    const W: usize = 600;
    const H: i64 = 60;
    let max = values.iter().map(|(_, v)| *v).max().unwrap_or(0).max(1);
    let step = W / values.len().max(1);
    let mut out = format!(
        "<svg class=\"chart\" viewBox=\"0 0 {W} {}\" width=\"{W}\" height=\"{}\" \
         role=\"img\" aria-label=\"{}\"><title>{}</title>",
        H + 2,
        H + 2,
        esc(label),
        esc(label)
    );
    for (i, (minute, v)) in values.iter().enumerate() {
        let h = (v * H / max).max(i64::from(*v > 0));
        out += &format!(
            "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{h}\" fill=\"#2f6fb0\">\
             <title>{}: {v}</title></rect>",
            i * step,
            H + 1 - h,
            step.saturating_sub(1).max(1),
            esc(minute)
        );
    }
    out += &format!(
        "<line x1=\"0\" y1=\"{y}\" x2=\"{W}\" y2=\"{y}\" stroke=\"#888\"/></svg>",
        y = H + 1
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markup_in_values_is_escaped() {
        assert_eq!(
            esc("<script>alert('x')</script> & \"y\""),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;y&quot;"
        );
    }

    #[test]
    fn a_page_has_no_inline_script() {
        let sources = vec!["a".to_owned()];
        let html = page(
            &Frame {
                base: "/console",
                title: "T",
                current: "/",
                sources: &sources,
                source: "a",
                refresh_ms: 5000,
                writable: false,
            },
            "<p>x</p>",
        );
        assert!(html.contains("<script src=\"/console/assets/console.js\" defer></script>"));
        assert_eq!(html.matches("<script").count(), 1);
        assert!(!html.contains(" on"), "no event handler attributes");
        assert!(!html.contains("style="));
    }
}

//! Which destination each topic goes to, and the claim filters that follow from it. Routes
//! are tried in order and the first whose pattern matches the topic wins. This is the only
//! place that writes SQL `LIKE` patterns: the claim takes only the topics the routes cover,
//! and leaves unclaimed the topics of a destination that admits no work now.

use crate::error::ConfigError;

/// One `[[routes]]` entry: `topic` is an exact topic, `prefix.*`, or `*` (everything).
#[derive(Clone, Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub topic: String,
    pub destination: String,
}

/// Which topics a route takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TopicPattern {
    Exact(String),
    /// `orders.*`: every topic starting with `orders.`.
    Prefix(String),
    /// `*`: every topic (a default route).
    Any,
}

fn invalid(problem: String) -> ConfigError {
    ConfigError {
        setting: "routes".into(),
        problem,
    }
}

impl TopicPattern {
    pub fn parse(pattern: &str) -> Result<Self, ConfigError> {
        let only_trailing = || {
            invalid(format!(
                "topic pattern {pattern:?}: only a trailing * is supported"
            ))
        };
        match pattern {
            "" => Err(invalid("a route's topic must not be empty".into())),
            "*" => Ok(TopicPattern::Any),
            p if p.ends_with('*') => {
                let prefix = &p[..p.len() - 1];
                if prefix.contains('*') {
                    return Err(only_trailing());
                }
                Ok(TopicPattern::Prefix(prefix.to_owned()))
            }
            p if p.contains('*') => Err(only_trailing()),
            p => Ok(TopicPattern::Exact(p.to_owned())),
        }
    }

    pub fn matches(&self, topic: &str) -> bool {
        match self {
            TopicPattern::Exact(t) => t == topic,
            TopicPattern::Prefix(p) => topic.starts_with(p.as_str()),
            TopicPattern::Any => true,
        }
    }

    /// The same pattern for SQL `LIKE` (with `\` escaping `%`, `_` and `\`).
    pub fn to_like(&self) -> String {
        let escape = |s: &str| {
            s.replace('\\', "\\\\")
                .replace('%', "\\%")
                .replace('_', "\\_")
        };
        match self {
            TopicPattern::Exact(t) => escape(t),
            TopicPattern::Prefix(p) => format!("{}%", escape(p)),
            TopicPattern::Any => "%".to_owned(),
        }
    }
}

/// Routes, first match wins; each names a destination by its index.
#[derive(Clone, Debug, PartialEq)]
pub struct Routes(pub Vec<(TopicPattern, usize)>);

impl Routes {
    /// Resolves `[[routes]]` against the destinations' names.
    pub fn parse(routes: &[RouteConfig], names: &[&str]) -> Result<Self, ConfigError> {
        if routes.is_empty() {
            return Err(invalid(
                "at least one [[routes]] entry (topic, destination) is needed".into(),
            ));
        }
        routes
            .iter()
            .map(|r| {
                let index = names
                    .iter()
                    .position(|n| *n == r.destination)
                    .ok_or_else(|| {
                        invalid(format!(
                            "route {:?} points at unknown destination {:?}",
                            r.topic, r.destination
                        ))
                    })?;
                Ok((TopicPattern::parse(&r.topic)?, index))
            })
            .collect::<Result<_, _>>()
            .map(Routes)
    }

    /// The destination of `topic`, if a route takes it.
    pub fn route(&self, topic: &str) -> Option<usize> {
        self.0
            .iter()
            .find(|(p, _)| p.matches(topic))
            .map(|(_, d)| *d)
    }

    /// The topics these routes cover, as SQL `LIKE` patterns for the claim's
    /// `p_include_topics`: `None` when a `*` route covers every topic. A relayer claims only
    /// these, so that it never takes a message it has no destination for.
    pub fn covered(&self) -> Option<Vec<String>> {
        if self.0.iter().any(|(p, _)| *p == TopicPattern::Any) {
            return None;
        }
        Some(self.0.iter().map(|(p, _)| p.to_like()).collect())
    }

    /// Each route's topic as a SQL `LIKE` pattern with the index of its destination, in the
    /// configuration's order (a `*` route as `%`).
    pub fn like_patterns(&self) -> Vec<(String, usize)> {
        self.0.iter().map(|(p, d)| (p.to_like(), *d)).collect()
    }

    /// The routes' topic patterns as written in the config (`orders.*`, `emails`), for
    /// the start-up line that says what this relayer leaves to others.
    pub fn described(&self) -> Vec<String> {
        self.0
            .iter()
            .map(|(p, _)| match p {
                TopicPattern::Exact(t) => t.clone(),
                TopicPattern::Prefix(t) => format!("{t}*"),
                TopicPattern::Any => "*".to_owned(),
            })
            .collect()
    }

    /// Which topics to claim, given which destinations admit work now. A pattern of a
    /// later route may also hold back topics an earlier route sends elsewhere: they wait,
    /// they are not lost.
    pub fn claim_filter(&self, admits: impl Fn(usize) -> bool) -> ClaimFilter {
        let held: Vec<&TopicPattern> = self
            .0
            .iter()
            .filter(|(_, d)| !admits(*d))
            .map(|(p, _)| p)
            .collect();
        if held.is_empty() {
            ClaimFilter::Everything
        } else if held.contains(&&TopicPattern::Any) {
            ClaimFilter::Nothing
        } else {
            ClaimFilter::Except(held.iter().map(|p| p.to_like()).collect())
        }
    }
}

/// What the next claim may take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimFilter {
    Everything,
    /// Every topic but those matching these SQL `LIKE` patterns.
    Except(Vec<String>),
    /// Nothing: no claim is worth its round trip.
    Nothing,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_match_wins_and_like_patterns_are_escaped() {
        let routes = Routes::parse(
            &[
                RouteConfig {
                    topic: "a_b.*".into(),
                    destination: "x".into(),
                },
                RouteConfig {
                    topic: "*".into(),
                    destination: "y".into(),
                },
            ],
            &["x", "y"],
        )
        .unwrap();
        assert_eq!(routes.route("a_b.c"), Some(0));
        assert_eq!(routes.route("a_bc"), Some(1));
        assert_eq!(
            routes.claim_filter(|d| d == 1),
            ClaimFilter::Except(vec!["a\\_b.%".to_owned()])
        );
        assert_eq!(routes.claim_filter(|_| true), ClaimFilter::Everything);
        assert_eq!(routes.claim_filter(|d| d == 0), ClaimFilter::Nothing);
        assert_eq!(routes.covered(), None, "a * route covers every topic");
        let narrow = Routes::parse(
            &[
                RouteConfig {
                    topic: "u.*".into(),
                    destination: "x".into(),
                },
                RouteConfig {
                    topic: "50%_off".into(),
                    destination: "x".into(),
                },
            ],
            &["x"],
        )
        .unwrap();
        assert_eq!(
            narrow.covered(),
            Some(vec!["u.%".to_owned(), "50\\%\\_off".to_owned()])
        );
        assert_eq!(narrow.described(), ["u.*", "50%_off"]);
        assert!(Routes::parse(&[], &["x"]).is_err());
        assert!(TopicPattern::parse("a*b").is_err());
    }
}

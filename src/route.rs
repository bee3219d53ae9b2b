//! Which destination each message goes to. Routes are tried in order and the first whose
//! pattern matches the topic wins; a message no route takes is dead-lettered with a reason
//! saying so (never retried forever, never dropped). The router is the relay's one sink: it
//! splits a batch by destination, publishes the parts concurrently and puts the outcomes
//! back in batch order. It also knows which topics to stop claiming while a destination's
//! circuit is open, and gives back (without an attempt) what an open circuit holds back.

use std::sync::Arc;

use futures_util::future::{BoxFuture, join_all};

use crate::circuit::{Breaker, State};
use crate::config::{CircuitSettings, DestinationSettings, TopicPattern};
use crate::message::{ClaimedMessage, Outcome};
use crate::sink::{self, Sink, SinkError};

struct Destination {
    name: String,
    sink: Arc<dyn Sink>,
    breaker: Breaker,
}

pub struct Router {
    destinations: Vec<Destination>,
    routes: Vec<(TopicPattern, usize)>,
}

impl Router {
    /// Builds every destination's sink.
    pub fn new(
        destinations: &[DestinationSettings],
        routes: Vec<(TopicPattern, usize)>,
        circuit: CircuitSettings,
    ) -> Result<Self, SinkError> {
        let destinations = destinations
            .iter()
            .map(|d| {
                Ok(Destination {
                    name: d.name.clone(),
                    sink: sink::from_settings(&d.sink)?,
                    breaker: Breaker::new(&d.name, circuit),
                })
            })
            .collect::<Result<Vec<_>, SinkError>>()?;
        Ok(Self {
            destinations,
            routes,
        })
    }

    /// One sink taking every topic (for tools and benchmarks).
    pub fn single(name: &str, sink: Arc<dyn Sink>, circuit: CircuitSettings) -> Self {
        Self {
            destinations: vec![Destination {
                name: name.to_owned(),
                sink,
                breaker: Breaker::new(name, circuit),
            }],
            routes: vec![(TopicPattern::Any, 0)],
        }
    }

    fn route(&self, topic: &str) -> Option<usize> {
        self.routes
            .iter()
            .find(|(p, _)| p.matches(topic))
            .map(|(_, d)| *d)
    }

    /// LIKE patterns of the topics whose destination does not admit work now (open
    /// circuit); `None` when every destination does. A pattern of a later route may also
    /// hold back topics an earlier route sends elsewhere: they wait, they are not lost.
    pub fn paused_topics(&self) -> Option<Vec<String>> {
        let paused: Vec<String> = self
            .routes
            .iter()
            .filter(|(_, d)| !self.destinations[*d].breaker.admits())
            .map(|(p, _)| p.to_like())
            .collect();
        (!paused.is_empty()).then_some(paused)
    }

    /// Each destination's name, circuit state and readiness (for /readyz). A destination
    /// whose circuit is not closed is not ready, whatever its connection says.
    pub async fn readiness(&self) -> Vec<(String, State, Result<(), String>)> {
        join_all(self.destinations.iter().map(|d| async move {
            let state = d.breaker.state();
            let ready = match (state, d.sink.ready().await) {
                (_, Err(e)) => Err(e),
                (State::Closed, Ok(())) => Ok(()),
                (_, Ok(())) => Err(
                    "down: its circuit opened after repeated failures; a probe is sent after each cool-down"
                        .to_owned(),
                ),
            };
            (d.name.clone(), state, ready)
        }))
        .await
    }
}

impl Router {
    /// Publishes to destination `d` through its circuit breaker: nothing while it is open,
    /// one message when it probes.
    async fn publish_to(&self, d: usize, messages: &[ClaimedMessage]) -> Vec<Outcome> {
        let destination = &self.destinations[d];
        let held_back = |n: usize| {
            vec![
                Outcome::NotAttempted {
                    reason: format!("the circuit of destination {} is open", destination.name),
                };
                n
            ]
        };
        let Some(ticket) = destination.breaker.start() else {
            return held_back(messages.len());
        };
        let now = if ticket.probe {
            &messages[..messages.len().min(1)]
        } else {
            messages
        };
        let mut outcomes = destination.sink.publish(now).await;
        destination.breaker.record(ticket, &mut outcomes);
        outcomes.extend(held_back(messages.len() - now.len()));
        outcomes
    }
}

impl Sink for Router {
    fn name(&self) -> &'static str {
        "router"
    }

    fn publish<'a>(&'a self, batch: &'a [ClaimedMessage]) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(async move {
            let routes: Vec<Option<usize>> = batch.iter().map(|m| self.route(&m.topic)).collect();
            // The usual case, one destination for the whole batch: hand it the batch as is.
            if let Some(Some(d)) = routes.first()
                && routes.iter().all(|r| *r == Some(*d))
            {
                return self.publish_to(*d, batch).await;
            }
            let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
            let mut parts: Vec<(Vec<usize>, Vec<ClaimedMessage>)> =
                vec![(Vec::new(), Vec::new()); self.destinations.len()];
            for (i, (m, route)) in batch.iter().zip(&routes).enumerate() {
                match route {
                    Some(d) => {
                        parts[*d].0.push(i);
                        parts[*d].1.push(m.clone());
                    }
                    None => {
                        outcomes[i] = Some(Outcome::Permanent {
                            reason: format!(
                                "no route for topic {:?}: add a [[routes]] entry (or a \"*\" default route)",
                                m.topic
                            ),
                        });
                    }
                }
            }
            let published = join_all(
                parts
                    .iter()
                    .enumerate()
                    .filter(|(_, (idx, _))| !idx.is_empty())
                    .map(|(d, (idx, messages))| async move {
                        (idx, self.publish_to(d, messages).await)
                    }),
            )
            .await;
            for (idx, result) in published {
                for (i, outcome) in idx.iter().zip(result) {
                    outcomes[*i] = Some(outcome);
                }
            }
            outcomes
                .into_iter()
                .map(|o| {
                    o.unwrap_or_else(|| Outcome::Retryable {
                        reason: "destination returned too few outcomes".into(),
                        retry_after: None,
                    })
                })
                .collect()
        })
    }

    fn ready(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let problems: Vec<String> = self
                .readiness()
                .await
                .into_iter()
                .filter_map(|(name, _, r)| r.err().map(|e| format!("{name}: {e}")))
                .collect();
            if problems.is_empty() {
                Ok(())
            } else {
                Err(problems.join("; "))
            }
        })
    }
}

//! When to try a message again: exponential backoff with full jitter (a random delay
//! between zero and `base × multiplier^(attempt − 1)`, capped), so a destination coming
//! back is not hit by every failed message at the same instant. A destination's own hint
//! (`Retry-After`) is honoured as a lower bound.

use std::time::Duration;

/// Exponential backoff with full jitter.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetrySettings {
    pub base: Duration,
    pub cap: Duration,
    pub multiplier: f64,
}

/// The delay before attempt `attempt_no + 1`, after attempt `attempt_no` failed.
pub fn delay(settings: &RetrySettings, attempt_no: i32, hint: Option<Duration>) -> Duration {
    let exponent = attempt_no.saturating_sub(1).clamp(0, 64);
    let ceiling = settings.base.as_secs_f64() * settings.multiplier.powi(exponent);
    let ceiling = ceiling.min(settings.cap.as_secs_f64());
    let jittered = Duration::from_secs_f64(rand::random_range(0.0..=ceiling));
    hint.map_or(jittered, |h| h.max(jittered))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SETTINGS: RetrySettings = RetrySettings {
        base: Duration::from_millis(100),
        cap: Duration::from_secs(2),
        multiplier: 2.0,
    };

    #[test]
    fn delays_grow_exponentially_within_the_cap() {
        for attempt in 1..=10 {
            let ceiling =
                Duration::from_millis(100 * 2u64.pow(u32::try_from(attempt - 1).unwrap()))
                    .min(SETTINGS.cap);
            let delays: Vec<Duration> = (0..200).map(|_| delay(&SETTINGS, attempt, None)).collect();
            assert!(delays.iter().all(|d| *d <= ceiling), "attempt {attempt}");
            assert!(
                delays.iter().any(|d| *d > ceiling / 2),
                "full jitter spans the range (attempt {attempt})"
            );
        }
    }

    #[test]
    fn a_destination_hint_is_a_lower_bound() {
        let d = delay(&SETTINGS, 1, Some(Duration::from_secs(30)));
        assert_eq!(d, Duration::from_secs(30));
    }
}

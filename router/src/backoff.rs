//! When a failed attempt is retried: exponential backoff with jitter, and only while nothing of the
//! response has reached the client.

use std::time::Duration;

#[derive(Clone, Copy, Debug)]
pub struct RetryConfig {
    /// Attempts after the first.
    pub max_retries: u32,
    /// The first retry's delay; each next one doubles.
    pub base: Duration,
}

impl RetryConfig {
    /// The delay before retry number `retry` (1, 2, ...), scaled by `jitter` in [0, 1): between half
    /// and one and a half times base x 2^(retry-1), so that clients retrying together spread out.
    pub fn delay(&self, retry: u32, jitter: f64) -> Duration {
        assert!(retry >= 1 && (0.0..1.0).contains(&jitter));
        let exponential = self.base.saturating_mul(1u32 << (retry - 1).min(16));
        exponential.mul_f64(0.5 + jitter)
    }

    /// Whether a failed attempt may be retried: never once a byte went to the client.
    pub fn may_retry(&self, retries_done: u32, client_saw_bytes: bool) -> bool {
        !client_saw_bytes && retries_done < self.max_retries
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: RetryConfig = RetryConfig {
        max_retries: 2,
        base: Duration::from_millis(25),
    };

    #[test]
    fn delays_double_around_the_base() {
        assert_eq!(CONFIG.delay(1, 0.5), Duration::from_millis(25));
        assert_eq!(CONFIG.delay(2, 0.5), Duration::from_millis(50));
        assert_eq!(CONFIG.delay(3, 0.5), Duration::from_millis(100));
        assert_eq!(CONFIG.delay(1, 0.0), Duration::from_micros(12_500));
        assert!(CONFIG.delay(1, 0.999) < Duration::from_micros(37_500));
    }

    #[test]
    fn retries_stop_at_the_limit_and_after_the_first_byte() {
        assert!(CONFIG.may_retry(0, false));
        assert!(CONFIG.may_retry(1, false));
        assert!(!CONFIG.may_retry(2, false));
        assert!(!CONFIG.may_retry(0, true));
    }
}

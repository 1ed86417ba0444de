//! A circuit breaker per replica: consecutive request failures open it (the replica takes no
//! requests); after a cooldown it lets one trial request through (half-open), whose outcome closes
//! or reopens it.

use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker.
    pub failures_to_open: u32,
    pub cooldown: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    Closed { failures: u32 },
    Open { until: Instant },
    HalfOpen { trial_in_flight: bool },
}

#[derive(Debug)]
pub struct Breaker {
    config: BreakerConfig,
    state: BreakerState,
}

impl Breaker {
    pub fn new(config: BreakerConfig) -> Self {
        assert!(config.failures_to_open > 0);
        Breaker {
            config,
            state: BreakerState::Closed { failures: 0 },
        }
    }

    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// Whether a request may be sent now; an open breaker past its cooldown turns half-open.
    pub fn admits(&mut self, now: Instant) -> bool {
        match self.state {
            BreakerState::Closed { .. } => true,
            BreakerState::Open { until } if now >= until => {
                self.state = BreakerState::HalfOpen {
                    trial_in_flight: false,
                };
                true
            }
            BreakerState::Open { .. } => false,
            BreakerState::HalfOpen { trial_in_flight } => !trial_in_flight,
        }
    }

    /// A request is being sent: in half-open, it is the one trial.
    pub fn on_attempt(&mut self) {
        if let BreakerState::HalfOpen { .. } = self.state {
            self.state = BreakerState::HalfOpen {
                trial_in_flight: true,
            };
        }
    }

    /// A request ended without an outcome (the client left before the answer): a half-open
    /// breaker's trial slot is free again.
    pub fn on_abandoned(&mut self) {
        if let BreakerState::HalfOpen { .. } = self.state {
            self.state = BreakerState::HalfOpen {
                trial_in_flight: false,
            };
        }
    }

    pub fn on_success(&mut self) {
        self.state = BreakerState::Closed { failures: 0 };
    }

    /// Returns true when this failure opened the breaker.
    pub fn on_failure(&mut self, now: Instant) -> bool {
        let open = BreakerState::Open {
            until: now + self.config.cooldown,
        };
        match self.state {
            BreakerState::Closed { failures } if failures + 1 >= self.config.failures_to_open => {
                self.state = open;
                true
            }
            BreakerState::Closed { failures } => {
                self.state = BreakerState::Closed {
                    failures: failures + 1,
                };
                false
            }
            BreakerState::HalfOpen { .. } => {
                self.state = open;
                true
            }
            // A request sent before the breaker opened failed late: it stays open as it is.
            BreakerState::Open { .. } => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> Breaker {
        Breaker::new(BreakerConfig {
            failures_to_open: 3,
            cooldown: Duration::from_secs(5),
        })
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let now = Instant::now();
        let mut b = breaker();
        assert!(!b.on_failure(now));
        assert!(!b.on_failure(now));
        b.on_success();
        assert!(!b.on_failure(now));
        assert!(!b.on_failure(now));
        assert!(b.admits(now));
        assert!(b.on_failure(now));
        assert!(!b.admits(now));
        assert!(!b.admits(now + Duration::from_secs(4)));
    }

    #[test]
    fn half_open_lets_one_trial_through_and_its_outcome_decides() {
        let now = Instant::now();
        let mut b = breaker();
        for _ in 0..3 {
            b.on_failure(now);
        }
        let later = now + Duration::from_secs(5);
        assert!(b.admits(later));
        b.on_attempt();
        assert_eq!(
            b.state(),
            BreakerState::HalfOpen {
                trial_in_flight: true
            }
        );
        assert!(!b.admits(later), "a second request waits for the trial");
        assert!(b.on_failure(later), "a failed trial reopens it");
        assert!(!b.admits(later + Duration::from_secs(1)));

        let again = later + Duration::from_secs(5);
        assert!(b.admits(again));
        b.on_attempt();
        b.on_success();
        assert_eq!(b.state(), BreakerState::Closed { failures: 0 });
        assert!(b.admits(again));
    }

    #[test]
    fn a_late_failure_does_not_extend_an_open_breaker() {
        let now = Instant::now();
        let mut b = breaker();
        for _ in 0..3 {
            b.on_failure(now);
        }
        assert!(!b.on_failure(now + Duration::from_secs(4)));
        assert!(b.admits(now + Duration::from_secs(5)));
    }
}

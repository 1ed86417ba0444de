//! Active health checks: each replica's `/health` every interval; K consecutive failures eject it,
//! M consecutive successes readmit it.

use std::sync::Arc;
use std::time::Duration;

use crate::replicas::Replica;
use crate::state::AppState;

#[derive(Clone, Copy, Debug)]
pub struct HealthConfig {
    pub interval: Duration,
    pub failures_to_eject: u32,
    pub successes_to_readmit: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HealthChange {
    Ejected,
    Readmitted,
}

/// One replica's standing with the health checker. A replica starts admitted: the first checks
/// run at once, and a replica that is down is ejected after K of them.
#[derive(Debug)]
pub struct HealthRecord {
    admitted: bool,
    failures: u32,
    successes: u32,
}

impl Default for HealthRecord {
    fn default() -> Self {
        HealthRecord {
            admitted: true,
            failures: 0,
            successes: 0,
        }
    }
}

impl HealthRecord {
    pub fn admitted(&self) -> bool {
        self.admitted
    }

    pub fn on_check(&mut self, healthy: bool, config: &HealthConfig) -> Option<HealthChange> {
        if healthy {
            self.failures = 0;
            self.successes += 1;
            if !self.admitted && self.successes >= config.successes_to_readmit {
                self.admitted = true;
                return Some(HealthChange::Readmitted);
            }
        } else {
            self.successes = 0;
            self.failures += 1;
            if self.admitted && self.failures >= config.failures_to_eject {
                self.admitted = false;
                return Some(HealthChange::Ejected);
            }
        }
        None
    }
}

/// Checks every replica each interval, for as long as the router runs.
pub async fn run_health_checks(state: Arc<AppState>) {
    let interval = state.settings.health.interval;
    loop {
        let replicas = state.replicas.all();
        let checks = replicas.iter().map(|replica| check_once(&state, replica));
        futures::future::join_all(checks).await;
        tokio::time::sleep(interval).await;
    }
}

async fn check_once(state: &AppState, replica: &Arc<Replica>) {
    // A check slower than the interval counts as failed, so that a hung replica is ejected too.
    let timeout = state
        .settings
        .health
        .interval
        .max(Duration::from_millis(500));
    let healthy = state.upstream.health(&replica.id, timeout).await;
    if let Some(change) = replica.on_health_check(healthy, &state.settings.health) {
        match change {
            HealthChange::Ejected => {
                state.metrics.ejection(&replica.id);
                eprintln!(
                    "sluice-router: ejected {} (failed health checks)",
                    replica.id
                );
            }
            HealthChange::Readmitted => {
                eprintln!("sluice-router: readmitted {} (healthy again)", replica.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: HealthConfig = HealthConfig {
        interval: Duration::from_secs(2),
        failures_to_eject: 3,
        successes_to_readmit: 2,
    };

    #[test]
    fn ejected_after_k_consecutive_failures_and_readmitted_after_m_successes() {
        let mut record = HealthRecord::default();
        assert!(record.admitted());
        assert_eq!(record.on_check(false, &CONFIG), None);
        assert_eq!(record.on_check(false, &CONFIG), None);
        assert_eq!(
            record.on_check(true, &CONFIG),
            None,
            "a success resets the count"
        );
        assert_eq!(record.on_check(false, &CONFIG), None);
        assert_eq!(record.on_check(false, &CONFIG), None);
        assert_eq!(record.on_check(false, &CONFIG), Some(HealthChange::Ejected));
        assert!(!record.admitted());
        assert_eq!(record.on_check(false, &CONFIG), None);
        assert_eq!(record.on_check(true, &CONFIG), None);
        assert_eq!(record.on_check(false, &CONFIG), None);
        assert_eq!(record.on_check(true, &CONFIG), None);
        assert!(!record.admitted());
        assert_eq!(
            record.on_check(true, &CONFIG),
            Some(HealthChange::Readmitted)
        );
        assert!(record.admitted());
        assert_eq!(record.on_check(true, &CONFIG), None);
    }
}

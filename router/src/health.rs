//! A replica's standing with the active health checks (`health_checker`): K consecutive failures eject
//! it, M consecutive successes readmit it.

use std::time::Duration;

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

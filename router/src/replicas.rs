//! The replicas the router knows, each with its load, health record and circuit breaker.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use crate::breaker::{Breaker, BreakerConfig};
use crate::health::{HealthChange, HealthConfig, HealthRecord};
use crate::policies::{Candidate, ReplicaId};

pub struct Replica {
    pub id: ReplicaId,
    outstanding: AtomicUsize,
    standing: Mutex<Standing>,
}

struct Standing {
    health: HealthRecord,
    breaker: Breaker,
}

impl Replica {
    fn new(id: ReplicaId, breaker: BreakerConfig) -> Self {
        Replica {
            id,
            outstanding: AtomicUsize::new(0),
            standing: Mutex::new(Standing {
                health: HealthRecord::default(),
                breaker: Breaker::new(breaker),
            }),
        }
    }

    fn standing(&self) -> std::sync::MutexGuard<'_, Standing> {
        self.standing.lock().expect("replica standing lock")
    }

    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Admitted by the health checker and let through by its breaker.
    pub fn routable(&self, now: Instant) -> bool {
        let mut standing = self.standing();
        standing.health.admitted() && standing.breaker.admits(now)
    }

    pub fn on_health_check(&self, healthy: bool, config: &HealthConfig) -> Option<HealthChange> {
        self.standing().health.on_check(healthy, config)
    }

    /// A request is sent to it; the guard counts it as outstanding until dropped.
    pub fn begin_request(self: &Arc<Self>) -> Outstanding {
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        self.standing().breaker.on_attempt();
        Outstanding {
            replica: self.clone(),
            outcome_known: false,
        }
    }
}

/// One request in flight on a replica. Its outcome feeds the breaker; a request dropped before
/// its outcome was known (the client left) releases a half-open breaker's trial slot.
pub struct Outstanding {
    replica: Arc<Replica>,
    outcome_known: bool,
}

impl Outstanding {
    pub fn replica(&self) -> &Arc<Replica> {
        &self.replica
    }

    pub fn succeeded(&mut self) {
        self.outcome_known = true;
        self.replica.standing().breaker.on_success();
    }

    /// Returns true when this failure opened the replica's breaker.
    pub fn failed(&mut self) -> bool {
        self.outcome_known = true;
        self.replica.standing().breaker.on_failure(Instant::now())
    }
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        let before = self.replica.outstanding.fetch_sub(1, Ordering::Relaxed);
        assert!(
            before > 0,
            "outstanding count of {} underflowed",
            self.replica.id
        );
        if !self.outcome_known {
            self.replica.standing().breaker.on_abandoned();
        }
    }
}

pub struct ReplicaSet {
    replicas: RwLock<Arc<[Arc<Replica>]>>,
    breaker: BreakerConfig,
}

impl ReplicaSet {
    pub fn new(breaker: BreakerConfig) -> Self {
        ReplicaSet {
            replicas: RwLock::new(Arc::from(Vec::new())),
            breaker,
        }
    }

    pub fn all(&self) -> Arc<[Arc<Replica>]> {
        self.replicas.read().expect("replica list lock").clone()
    }

    /// Sets the list (sorted, deduplicated), keeping the state of replicas already known. Returns
    /// whether it changed.
    pub fn replace(&self, mut ids: Vec<ReplicaId>) -> bool {
        ids.sort();
        ids.dedup();
        let mut replicas = self.replicas.write().expect("replica list lock");
        if replicas.iter().map(|r| &r.id).eq(ids.iter()) {
            return false;
        }
        let next: Vec<Arc<Replica>> = ids
            .into_iter()
            .map(|id| {
                replicas
                    .iter()
                    .find(|r| r.id == id)
                    .cloned()
                    .unwrap_or_else(|| Arc::new(Replica::new(id, self.breaker)))
            })
            .collect();
        *replicas = Arc::from(next);
        true
    }

    /// The routable replicas not in `tried`, as a policy sees them.
    pub fn candidates(&self, tried: &[ReplicaId]) -> Vec<Candidate> {
        let now = Instant::now();
        self.all()
            .iter()
            .filter(|r| !tried.contains(&r.id) && r.routable(now))
            .map(|r| Candidate {
                id: r.id.clone(),
                outstanding: r.outstanding(),
            })
            .collect()
    }

    pub fn get(&self, id: &ReplicaId) -> Option<Arc<Replica>> {
        self.all().iter().find(|r| r.id == *id).cloned()
    }

    pub fn any_routable(&self) -> bool {
        let now = Instant::now();
        self.all().iter().any(|r| r.routable(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn id(n: u8) -> ReplicaId {
        ReplicaId(format!("http://10.0.0.{n}:8000").into())
    }

    fn set() -> ReplicaSet {
        ReplicaSet::new(BreakerConfig {
            failures_to_open: 2,
            cooldown: Duration::from_secs(60),
        })
    }

    #[test]
    fn replacing_the_list_keeps_known_replicas_state() {
        let replicas = set();
        assert!(replicas.replace(vec![id(2), id(1), id(1)]));
        let kept = replicas.get(&id(1)).unwrap();
        let _busy = kept.begin_request();
        assert!(!replicas.replace(vec![id(1), id(2)]));
        assert!(replicas.replace(vec![id(1), id(3)]));
        assert!(Arc::ptr_eq(&kept, &replicas.get(&id(1)).unwrap()));
        assert!(replicas.get(&id(2)).is_none());
        let outstanding: Vec<_> = replicas
            .candidates(&[])
            .iter()
            .map(|c| (c.id.clone(), c.outstanding))
            .collect();
        assert_eq!(outstanding, vec![(id(1), 1), (id(3), 0)]);
    }

    #[test]
    fn an_open_breaker_or_a_try_removes_a_candidate() {
        let replicas = set();
        replicas.replace(vec![id(1), id(2)]);
        let broken = replicas.get(&id(1)).unwrap();
        for _ in 0..2 {
            broken.begin_request().failed();
        }
        let ids: Vec<_> = replicas.candidates(&[]).into_iter().map(|c| c.id).collect();
        assert_eq!(ids, vec![id(2)]);
        assert!(replicas.candidates(&[id(2)]).is_empty());
        assert!(replicas.any_routable());
    }

    #[test]
    fn outstanding_counts_requests_until_their_guard_drops() {
        let replicas = set();
        replicas.replace(vec![id(1)]);
        let replica = replicas.get(&id(1)).unwrap();
        let first = replica.begin_request();
        let second = replica.begin_request();
        assert_eq!(replica.outstanding(), 2);
        drop(first);
        drop(second);
        assert_eq!(replica.outstanding(), 0);
    }
}

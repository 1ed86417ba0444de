use std::sync::atomic::{AtomicUsize, Ordering};

use crate::policies::{Candidate, Decision, Policy, RouteReason, RouteRequest};

/// Each candidate in turn.
#[derive(Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn pick(&self, _request: &RouteRequest<'_>, candidates: &[Candidate]) -> Decision {
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        Decision {
            replica: candidates[turn % candidates.len()].id.clone(),
            reason: RouteReason::RoundRobin,
            prefix_match_tokens: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::test_support::candidates;

    #[test]
    fn takes_each_replica_in_turn() {
        let policy = RoundRobin::default();
        let body = serde_json::json!({});
        let request = RouteRequest {
            path: "/v1/completions",
            body: &body,
            session_key: None,
        };
        let replicas = candidates(&[5, 0, 0]);
        let picked: Vec<_> = (0..6)
            .map(|_| policy.pick(&request, &replicas).replica)
            .collect();
        let ids: Vec<_> = replicas.iter().map(|c| c.id.clone()).collect();
        assert_eq!(picked, [&ids[..], &ids[..]].concat());
    }
}

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::policies::{Candidate, Decision, Policy, RouteReason, RouteRequest};

/// The candidate with the fewest requests in flight; ties rotate, so an idle fleet is shared.
#[derive(Default)]
pub struct LeastOutstanding {
    tie_break: AtomicUsize,
}

impl LeastOutstanding {
    pub fn choose<'a>(&self, candidates: &'a [Candidate]) -> &'a Candidate {
        let least = candidates
            .iter()
            .map(|c| c.outstanding)
            .min()
            .expect("pick is never called without candidates");
        let tied: Vec<&Candidate> = candidates
            .iter()
            .filter(|c| c.outstanding == least)
            .collect();
        tied[self.tie_break.fetch_add(1, Ordering::Relaxed) % tied.len()]
    }
}

impl Policy for LeastOutstanding {
    fn pick(&self, _request: &RouteRequest<'_>, candidates: &[Candidate]) -> Decision {
        Decision {
            replica: self.choose(candidates).id.clone(),
            reason: RouteReason::LeastOutstanding,
            prefix_match_tokens: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::test_support::candidates;

    #[test]
    fn picks_the_least_loaded_and_rotates_among_ties() {
        let policy = LeastOutstanding::default();
        let body = serde_json::json!({});
        let request = RouteRequest {
            path: "/v1/completions",
            body: &body,
            session_key: None,
        };
        let replicas = candidates(&[3, 1, 2]);
        for _ in 0..4 {
            assert_eq!(policy.pick(&request, &replicas).replica, replicas[1].id);
        }
        let idle = candidates(&[0, 4, 0]);
        let first = policy.pick(&request, &idle).replica;
        let second = policy.pick(&request, &idle).replica;
        assert_ne!(first, second);
        assert!([&first, &second]
            .iter()
            .all(|id| **id == idle[0].id || **id == idle[2].id));
    }
}

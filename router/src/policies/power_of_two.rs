use rand::Rng;

use crate::policies::{Candidate, Decision, Policy, RouteReason, RouteRequest};

/// Two distinct candidates at random; the less loaded of the two.
pub struct PowerOfTwo;

impl PowerOfTwo {
    fn choose<'a, R: Rng>(candidates: &'a [Candidate], rng: &mut R) -> &'a Candidate {
        if candidates.len() == 1 {
            return &candidates[0];
        }
        let first = rng.random_range(0..candidates.len());
        let mut second = rng.random_range(0..candidates.len() - 1);
        if second >= first {
            second += 1;
        }
        let (a, b) = (&candidates[first], &candidates[second]);
        if b.outstanding < a.outstanding {
            b
        } else {
            a
        }
    }
}

impl Policy for PowerOfTwo {
    fn pick(&self, _request: &RouteRequest<'_>, candidates: &[Candidate]) -> Decision {
        Decision {
            replica: Self::choose(candidates, &mut rand::rng()).id.clone(),
            reason: RouteReason::PowerOfTwo,
            prefix_match_tokens: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::test_support::candidates;
    use rand::SeedableRng;

    #[test]
    fn never_picks_the_most_loaded_of_three_and_spreads_over_the_others() {
        let replicas = candidates(&[2, 9, 2]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut counts = [0usize; 3];
        for _ in 0..3000 {
            let picked = PowerOfTwo::choose(&replicas, &mut rng);
            counts[replicas.iter().position(|c| c.id == picked.id).unwrap()] += 1;
        }
        assert_eq!(counts[1], 0, "{counts:?}");
        // Each light replica wins against the heavy one and as the first drawn of a tie.
        assert!(counts[0] > 1200 && counts[2] > 1200, "{counts:?}");
    }

    #[test]
    fn two_replicas_with_one_loaded_always_go_to_the_other() {
        let replicas = candidates(&[1, 0]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for _ in 0..100 {
            assert_eq!(PowerOfTwo::choose(&replicas, &mut rng).id, replicas[1].id);
        }
    }

    #[test]
    fn a_single_candidate_is_taken() {
        let replicas = candidates(&[4]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        assert_eq!(PowerOfTwo::choose(&replicas, &mut rng).id, replicas[0].id);
    }
}

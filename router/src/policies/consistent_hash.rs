use std::collections::HashSet;
use std::sync::RwLock;

use super::LeastOutstanding;
use crate::policies::{Candidate, Decision, Policy, ReplicaId, RouteReason, RouteRequest};

/// Points each replica takes on the ring: enough that keys split evenly and a removed replica's keys
/// spread over all the others.
const POINTS_PER_REPLICA: usize = 160;

/// A hash ring over the replicas, keyed by the session key: a session stays on its replica while
/// that replica is a candidate, and losing one replica moves only its own sessions.
#[derive(Default)]
pub struct ConsistentHash {
    ring: RwLock<Ring>,
    fallback: LeastOutstanding,
}

/// FNV-1a then a splitmix64 finaliser: stable across processes and Rust versions (the ring must
/// agree between router restarts and replicas of the router), and well spread.
fn stable_hash(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash = (hash ^ (hash >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash = (hash ^ (hash >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ (hash >> 31)
}

#[derive(Default)]
struct Ring {
    /// (point, replica), sorted by point.
    points: Vec<(u64, ReplicaId)>,
    members: HashSet<ReplicaId>,
}

fn ring_of<'a>(replicas: impl Iterator<Item = &'a ReplicaId> + Clone) -> Ring {
    let mut points: Vec<(u64, ReplicaId)> = replicas
        .clone()
        .flat_map(|id| {
            (0..POINTS_PER_REPLICA)
                .map(move |point| (stable_hash(format!("{id}#{point}").as_bytes()), id.clone()))
        })
        .collect();
    points.sort();
    Ring {
        points,
        members: replicas.cloned().collect(),
    }
}

impl ConsistentHash {
    /// The first replica clockwise from the key's point that is a candidate.
    fn owner(&self, key: &str, candidates: &[Candidate]) -> Option<ReplicaId> {
        let allowed: HashSet<&ReplicaId> = candidates.iter().map(|c| &c.id).collect();
        let ring = self.ring.read().expect("ring lock");
        if allowed.iter().all(|id| ring.members.contains(*id)) {
            return Self::walk(&ring, key, &allowed);
        }
        // A candidate the ring has not heard of (replicas_changed not called yet): ring the
        // candidates themselves.
        Self::walk(&ring_of(candidates.iter().map(|c| &c.id)), key, &allowed)
    }

    fn walk(ring: &Ring, key: &str, allowed: &HashSet<&ReplicaId>) -> Option<ReplicaId> {
        let points = &ring.points;
        let point = stable_hash(key.as_bytes());
        let start = points.partition_point(|(p, _)| *p < point);
        (0..points.len())
            .map(|offset| &points[(start + offset) % points.len()].1)
            .find(|id| allowed.contains(id))
            .cloned()
    }
}

impl Policy for ConsistentHash {
    fn pick(&self, request: &RouteRequest<'_>, candidates: &[Candidate]) -> Decision {
        if let Some(replica) = request
            .session_key
            .and_then(|key| self.owner(key, candidates))
        {
            return Decision {
                replica,
                reason: RouteReason::ConsistentHash,
                prefix_match_tokens: None,
            };
        }
        Decision {
            replica: self.fallback.choose(candidates).id.clone(),
            reason: RouteReason::NoSessionKey,
            prefix_match_tokens: None,
        }
    }

    fn replicas_changed(&self, replicas: &[ReplicaId]) {
        *self.ring.write().expect("ring lock") = ring_of(replicas.iter());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::test_support::candidates;
    use std::collections::HashMap;

    fn pick(policy: &ConsistentHash, key: Option<&str>, replicas: &[Candidate]) -> Decision {
        let body = serde_json::json!({});
        let request = RouteRequest {
            path: "/v1/chat/completions",
            body: &body,
            session_key: key,
        };
        policy.pick(&request, replicas)
    }

    fn ids(replicas: &[Candidate]) -> Vec<ReplicaId> {
        replicas.iter().map(|c| c.id.clone()).collect()
    }

    #[test]
    fn the_hash_is_pinned() {
        // FNV-1a of "" is the offset basis; the finaliser is splitmix64's.
        assert_eq!(stable_hash(b""), 0xf52a_15e9_a9b5_e89b);
        assert_eq!(stable_hash(b"session-1"), 0x8f9d_4a83_e238_4785);
        assert_ne!(stable_hash(b"a"), stable_hash(b"b"));
    }

    #[test]
    fn a_session_always_lands_on_the_same_replica_and_sessions_spread() {
        let replicas = candidates(&[0, 0, 0]);
        let policy = ConsistentHash::default();
        policy.replicas_changed(&ids(&replicas));
        let mut per_replica: HashMap<ReplicaId, usize> = HashMap::new();
        for session in 0..600 {
            let key = format!("session-{session}");
            let first = pick(&policy, Some(&key), &replicas);
            assert_eq!(first.reason, RouteReason::ConsistentHash);
            for _ in 0..3 {
                assert_eq!(pick(&policy, Some(&key), &replicas).replica, first.replica);
            }
            *per_replica.entry(first.replica).or_default() += 1;
        }
        assert_eq!(per_replica.len(), 3);
        assert!(per_replica.values().all(|&n| n > 120), "{per_replica:?}");
    }

    #[test]
    fn losing_a_replica_moves_only_its_sessions() {
        let replicas = candidates(&[0, 0, 0]);
        let policy = ConsistentHash::default();
        policy.replicas_changed(&ids(&replicas));
        let keys: Vec<String> = (0..300).map(|s| format!("user-{s}")).collect();
        let before: Vec<ReplicaId> = keys
            .iter()
            .map(|k| pick(&policy, Some(k), &replicas).replica)
            .collect();
        // Replica 1 is unhealthy: no longer a candidate, still on the ring.
        let remaining = [replicas[0].clone(), replicas[2].clone()];
        let mut moved = 0;
        for (key, old) in keys.iter().zip(&before) {
            let new = pick(&policy, Some(key), &remaining).replica;
            if *old == replicas[1].id {
                moved += 1;
                assert_ne!(new, replicas[1].id);
            } else {
                assert_eq!(&new, old, "{key} moved although its replica is healthy");
            }
        }
        assert!(moved > 0);
        // And the same holds when the list itself shrinks.
        policy.replicas_changed(&ids(&remaining));
        for (key, old) in keys.iter().zip(&before) {
            if *old != replicas[1].id {
                assert_eq!(&pick(&policy, Some(key), &remaining).replica, old);
            }
        }
    }

    #[test]
    fn no_session_key_falls_back_to_least_outstanding() {
        let replicas = candidates(&[4, 1, 3]);
        let policy = ConsistentHash::default();
        policy.replicas_changed(&ids(&replicas));
        let decision = pick(&policy, None, &replicas);
        assert_eq!(decision.reason, RouteReason::NoSessionKey);
        assert_eq!(decision.replica, replicas[1].id);
    }

    #[test]
    fn candidates_the_ring_has_not_seen_are_still_routed() {
        let replicas = candidates(&[0, 0]);
        let policy = ConsistentHash::default();
        let decision = pick(&policy, Some("s"), &replicas);
        assert_eq!(decision.reason, RouteReason::ConsistentHash);
        assert_eq!(
            pick(&policy, Some("s"), &replicas).replica,
            decision.replica
        );
    }
}

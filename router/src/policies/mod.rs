//! The routing policies behind `--policy`, and their seam with the proxy: what a policy sees of a
//! request and of the replicas, and what it decides ([`Policy`]).

mod cache_aware;
mod consistent_hash;
mod least_outstanding;
mod named;
mod power_of_two;
mod round_robin;

pub use cache_aware::{CacheAwareConfig, CacheAwarePolicy};
pub use consistent_hash::ConsistentHash;
pub use least_outstanding::LeastOutstanding;
pub use named::{build_policy, PolicyName};
pub use power_of_two::PowerOfTwo;
pub use round_robin::RoundRobin;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// A replica, named by its base URL (`http://host:port`): stable across DNS re-resolution, so a
/// policy's per-replica state (a hash ring, a KV index) survives the list being refreshed.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplicaId(pub Arc<str>);

impl fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a policy may read of one request. The body is the parsed JSON of an OpenAI request.
pub struct RouteRequest<'a> {
    /// `/v1/chat/completions` or `/v1/completions`.
    pub path: &'a str,
    pub body: &'a serde_json::Value,
    /// The session header's value, else the body's `user` field: what consistent-hash keys on.
    pub session_key: Option<&'a str>,
}

/// A replica that may take the request: healthy, its breaker closed, not already tried for it.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub id: ReplicaId,
    /// Requests sent to it by this router that have not finished.
    pub outstanding: usize,
}

/// Why a policy picked a replica: a label of the router's `routing decisions` metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RouteReason {
    RoundRobin,
    LeastOutstanding,
    PowerOfTwo,
    ConsistentHash,
    /// consistent-hash with no session key: fell back to least-outstanding.
    NoSessionKey,
    /// cache-aware: the replica holding the longest prefix (exact KV index or approximate tree).
    PrefixMatch,
    /// cache-aware: no replica holds any of the prefix, so the least loaded one.
    NoPrefixMatch,
    /// cache-aware: the longest match was too loaded, so the least loaded one.
    LoadBound,
}

impl RouteReason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            RouteReason::RoundRobin => "round_robin",
            RouteReason::LeastOutstanding => "least_outstanding",
            RouteReason::PowerOfTwo => "power_of_two",
            RouteReason::ConsistentHash => "consistent_hash",
            RouteReason::NoSessionKey => "no_session_key",
            RouteReason::PrefixMatch => "prefix_match",
            RouteReason::NoPrefixMatch => "no_prefix_match",
            RouteReason::LoadBound => "load_bound",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Decision {
    pub replica: ReplicaId,
    pub reason: RouteReason,
    /// cache-aware only: how many prompt tokens the chosen replica is believed to hold.
    pub prefix_match_tokens: Option<usize>,
}

/// A routing policy. `pick` is called once per attempt (a retry offers the candidates not yet
/// tried) and never with an empty slice.
pub trait Policy: Send + Sync {
    fn pick(&self, request: &RouteRequest<'_>, candidates: &[Candidate]) -> Decision;

    /// The replica list changed (startup, DNS refresh): per-replica state for the others can go.
    fn replicas_changed(&self, _replicas: &[ReplicaId]) {}

    /// The block hashes each replica is believed to hold (lower-case hex, sorted), for a policy
    /// that follows KV events: what `GET /sluice/kv_index` serves; None for the others.
    fn kv_index(&self) -> Option<BTreeMap<String, Vec<String>>> {
        None
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::{Candidate, ReplicaId};

    pub fn candidates(outstanding: &[usize]) -> Vec<Candidate> {
        outstanding
            .iter()
            .enumerate()
            .map(|(i, &outstanding)| Candidate {
                id: ReplicaId(format!("http://10.0.0.{i}:8000").into()),
                outstanding,
            })
            .collect()
    }
}

//! The routing policies behind `--policy`, each implementing [`Policy`].

mod consistent_hash;
mod least_outstanding;
mod power_of_two;
mod round_robin;

use std::sync::Arc;

pub use consistent_hash::ConsistentHash;
pub use least_outstanding::LeastOutstanding;
pub use power_of_two::PowerOfTwo;
pub use round_robin::RoundRobin;

use crate::cache_aware::{CacheAwareConfig, CacheAwarePolicy};
use crate::policy::Policy;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PolicyName {
    RoundRobin,
    LeastOutstanding,
    PowerOfTwo,
    ConsistentHash,
    CacheAware,
}

pub fn build_policy(
    name: PolicyName,
    cache_aware: &CacheAwareConfig,
) -> Result<Arc<dyn Policy>, String> {
    Ok(match name {
        PolicyName::RoundRobin => Arc::new(RoundRobin::default()),
        PolicyName::LeastOutstanding => Arc::new(LeastOutstanding::default()),
        PolicyName::PowerOfTwo => Arc::new(PowerOfTwo),
        PolicyName::ConsistentHash => Arc::new(ConsistentHash::default()),
        PolicyName::CacheAware => Arc::new(CacheAwarePolicy::new(cache_aware.clone())?),
    })
}

#[cfg(test)]
pub(crate) mod test_support {
    use crate::policy::{Candidate, ReplicaId};

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

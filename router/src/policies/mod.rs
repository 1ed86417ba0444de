//! The routing policies behind `--policy`, each implementing [`Policy`].

mod consistent_hash;
mod least_outstanding;
mod power_of_two;
mod round_robin;

use std::path::PathBuf;
use std::sync::Arc;

pub use consistent_hash::ConsistentHash;
pub use least_outstanding::LeastOutstanding;
pub use power_of_two::PowerOfTwo;
pub use round_robin::RoundRobin;

use crate::policy::Policy;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PolicyName {
    RoundRobin,
    LeastOutstanding,
    PowerOfTwo,
    ConsistentHash,
    CacheAware,
}

/// What `--policy cache-aware` is built from.
#[derive(Clone, Debug)]
pub struct CacheAwareSettings {
    /// `--model`: tokenizer and chat template for exact KV matching.
    pub model_dir: Option<PathBuf>,
    pub balance_abs: usize,
    pub balance_rel: f64,
}

pub fn build_policy(
    name: PolicyName,
    cache_aware: &CacheAwareSettings,
) -> Result<Arc<dyn Policy>, String> {
    Ok(match name {
        PolicyName::RoundRobin => Arc::new(RoundRobin::default()),
        PolicyName::LeastOutstanding => Arc::new(LeastOutstanding::default()),
        PolicyName::PowerOfTwo => Arc::new(PowerOfTwo),
        PolicyName::ConsistentHash => Arc::new(ConsistentHash::default()),
        PolicyName::CacheAware => cache_aware_policy(cache_aware)?,
    })
}

/// The one place the cache-aware policy (crate::cache_aware) is built. That module has no policy
/// type on this branch, so least-outstanding stands in for it here.
fn cache_aware_policy(_settings: &CacheAwareSettings) -> Result<Arc<dyn Policy>, String> {
    Ok(Arc::new(LeastOutstanding::default()))
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

//! `--policy`'s names and the policy each builds.

use std::sync::Arc;

use super::{
    CacheAwareConfig, CacheAwarePolicy, ConsistentHash, LeastOutstanding, Policy, PowerOfTwo,
    RoundRobin,
};

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

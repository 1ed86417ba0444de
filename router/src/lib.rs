//! The router in front of Sluice replicas: it shares nothing with them but HTTP (and, for
//! cache-aware routing, the engine cores' KV-cache events).

pub mod cache_aware;
pub mod policy;

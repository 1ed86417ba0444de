//! The router in front of Sluice replicas: it shares nothing with them but HTTP (and, for
//! cache-aware routing, the engine cores' KV-cache events).

pub mod affinity;
pub mod api_error;
pub mod backoff;
pub mod breaker;
pub mod cache_aware;
pub mod cli;
pub mod discovery;
pub mod health;
pub mod health_checker;
pub mod metrics;
pub mod models;
pub mod policies;
pub mod proxy;
pub mod replica_url;
pub mod replicas;
pub mod server;
pub mod state;
pub mod upstream;

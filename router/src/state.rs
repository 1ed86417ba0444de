//! What every handler and background task shares.

use std::sync::Arc;
use std::time::Duration;

use crate::backoff::RetryConfig;
use crate::health::HealthConfig;
use crate::metrics::Metrics;
use crate::policies::{Policy, ReplicaId};
use crate::replicas::ReplicaSet;
use crate::upstream::Upstream;
use sluice_common::cors::CorsLayer;

pub struct Settings {
    pub api_key: Option<String>,
    /// Serve /metrics without the API key.
    pub metrics_without_auth: bool,
    /// consistent-hash's key: this header's value, else the body's `user`.
    pub session_header: String,
    pub health: HealthConfig,
    pub retry: RetryConfig,
    pub max_body_bytes: usize,
    /// How long a client may take to send a request's body.
    pub body_read_timeout: Duration,
    /// How long `/v1/models` waits for each replica.
    pub models_timeout: Duration,
    /// The origins whose pages may call the router from a browser, if any (`--allowed-origins`).
    pub cors: Option<CorsLayer>,
}

pub struct AppState {
    pub settings: Settings,
    pub replicas: ReplicaSet,
    pub policy: Arc<dyn Policy>,
    pub metrics: Arc<Metrics>,
    pub upstream: Upstream,
}

impl AppState {
    /// Sets the replica list and tells the policy when it changed.
    pub fn set_replicas(&self, ids: Vec<ReplicaId>) {
        if self.replicas.replace(ids) {
            let ids: Vec<ReplicaId> = self.replicas.all().iter().map(|r| r.id.clone()).collect();
            self.policy.replicas_changed(&ids);
            let names: Vec<String> = ids.iter().map(ToString::to_string).collect();
            eprintln!("sluice-router: replicas: [{}]", names.join(", "));
        }
    }
}

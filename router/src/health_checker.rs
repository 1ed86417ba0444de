//! Active health checks: each replica's `/health` every interval, its standing kept by its
//! `HealthRecord` (`health`).

use std::sync::Arc;
use std::time::Duration;

use crate::health::HealthChange;
use crate::replicas::Replica;
use crate::state::AppState;

/// Checks every replica each interval, for as long as the router runs.
pub async fn run_health_checks(state: Arc<AppState>) {
    let interval = state.settings.health.interval;
    loop {
        let replicas = state.replicas.all();
        let checks = replicas.iter().map(|replica| check_once(&state, replica));
        futures::future::join_all(checks).await;
        tokio::time::sleep(interval).await;
    }
}

async fn check_once(state: &AppState, replica: &Arc<Replica>) {
    // A check slower than the interval counts as failed, so that a hung replica is ejected too.
    let timeout = state
        .settings
        .health
        .interval
        .max(Duration::from_millis(500));
    let healthy = state.upstream.health(&replica.id, timeout).await;
    if let Some(change) = replica.on_health_check(healthy, &state.settings.health) {
        match change {
            HealthChange::Ejected => {
                state.metrics.ejection(&replica.id);
                eprintln!(
                    "sluice-router: ejected {} (failed health checks)",
                    replica.id
                );
            }
            HealthChange::Readmitted => {
                eprintln!("sluice-router: readmitted {} (healthy again)", replica.id);
            }
        }
    }
}

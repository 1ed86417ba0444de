//! Replicas from DNS: every address a name resolves to (a Kubernetes headless Service's pods),
//! resolved again every interval.

use std::sync::Arc;
use std::time::Duration;

use crate::policies::ReplicaId;
use crate::replica_url::replica_id_of;
use crate::state::AppState;

pub async fn resolve(name: &str, port: u16) -> std::io::Result<Vec<ReplicaId>> {
    let addresses = tokio::net::lookup_host((name, port)).await?;
    Ok(addresses.map(replica_id_of).collect())
}

/// Refreshes the list every `interval`; a failed lookup keeps the last list, since a DNS hiccup
/// is not every replica going away.
pub async fn run_discovery(state: Arc<AppState>, name: String, port: u16, interval: Duration) {
    loop {
        match resolve(&name, port).await {
            Ok(ids) => state.set_replicas(ids),
            Err(error) => eprintln!("sluice-router: cannot resolve {name}:{port}: {error}"),
        }
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn localhost_resolves_to_loopback_replicas() {
        let ids = resolve("localhost", 8123).await.unwrap();
        assert!(!ids.is_empty());
        assert!(ids
            .iter()
            .all(|id| id.0.as_ref() == "http://127.0.0.1:8123"
                || id.0.as_ref() == "http://[::1]:8123"));
    }
}

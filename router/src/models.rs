//! `GET /v1/models`: the union, by id, of what the routable replicas serve.

use std::collections::BTreeMap;

use axum::http::{HeaderMap, Method};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::{json, Value};

use crate::api_error::RouterError;
use crate::policies::ReplicaId;
use crate::state::AppState;

pub async fn aggregated_models(state: &AppState) -> Response {
    let now = std::time::Instant::now();
    let replicas: Vec<ReplicaId> = state
        .replicas
        .all()
        .iter()
        .filter(|r| r.routable(now))
        .map(|r| r.id.clone())
        .collect();
    let lists = futures::future::join_all(replicas.iter().map(|id| models_of(state, id))).await;
    let answered: Vec<Vec<Value>> = lists.into_iter().flatten().collect();
    if answered.is_empty() {
        return RouterError::NoReplica {
            reason: "no replica answered /v1/models".into(),
            retry_after: state.settings.health.interval,
        }
        .into_response();
    }
    Json(json!({"object": "list", "data": union_by_id(answered)})).into_response()
}

async fn models_of(state: &AppState, replica: &ReplicaId) -> Option<Vec<Value>> {
    let no_headers = HeaderMap::new();
    let request = state.upstream.send(
        replica,
        Method::GET,
        "/v1/models",
        &no_headers,
        Bytes::new(),
    );
    let response = tokio::time::timeout(state.settings.models_timeout, request)
        .await
        .ok()?
        .ok()?;
    if !response.status().is_success() {
        return None;
    }
    let body = response.into_body().collect().await.ok()?.to_bytes();
    let mut list: Value = serde_json::from_slice(&body).ok()?;
    match list.get_mut("data")?.take() {
        Value::Array(models) => Some(models),
        _ => None,
    }
}

/// Each model once, the first replica's entry for it kept, sorted by id.
fn union_by_id(lists: Vec<Vec<Value>>) -> Vec<Value> {
    let mut by_id: BTreeMap<String, Value> = BTreeMap::new();
    for model in lists.into_iter().flatten() {
        if let Some(id) = model.get("id").and_then(Value::as_str) {
            by_id.entry(id.to_string()).or_insert(model);
        }
    }
    by_id.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_are_united_by_id() {
        let a = vec![json!({"id": "m1", "owned_by": "a"}), json!({"id": "m2"})];
        let b = vec![json!({"id": "m1", "owned_by": "b"}), json!({"no_id": true})];
        let united = union_by_id(vec![a, b]);
        assert_eq!(
            united,
            vec![json!({"id": "m1", "owned_by": "a"}), json!({"id": "m2"})]
        );
    }
}

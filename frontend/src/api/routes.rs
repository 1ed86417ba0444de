//! The axum router: which handler serves which route, the API-key layer, and the small
//! endpoints (models, health, kv_cache, version, metrics). Handlers are thin: parse, call one
//! function, map the result.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::api::error::ApiError;
use crate::api::openai::{ModelCard, ModelList};
use crate::api::{chat, completions, openapi, tokenize};
use crate::engine::protocol::{BlockPoolAudit, KvCacheSnapshot, UtilityMethod, UtilityValue};
use crate::state::{unix_time, AppState};

pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(completions::create))
        .route("/v1/chat/completions", post(chat::create))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    Router::new()
        .merge(v1)
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/health", get(health))
        .route("/sluice/kv_cache", get(kv_cache))
        .route("/sluice/block_pool_audit", get(block_pool_audit))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi::serve))
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .with_state(state)
}

async fn require_api_key(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    match check_api_key(state.config.api_key.as_deref(), &request) {
        Ok(()) => next.run(request).await,
        Err(error) => error.into_response(),
    }
}

fn check_api_key(expected: Option<&str>, request: &Request) -> Result<(), ApiError> {
    let Some(expected) = expected else {
        return Ok(());
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "));
    match given {
        Some(given) if given.trim() == expected => Ok(()),
        _ => Err(ApiError::InvalidApiKey),
    }
}

async fn models(State(state): State<Arc<AppState>>) -> Result<Json<ModelList>, ApiError> {
    Ok(Json(model_list(&state)?))
}

fn model_list(state: &AppState) -> Result<ModelList, ApiError> {
    Ok(ModelList {
        object: "list".into(),
        data: vec![ModelCard {
            id: state.config.served_model_name.clone(),
            object: "model".into(),
            created: unix_time(),
            owned_by: "sluice".into(),
            max_model_len: state.max_model_len()?,
        }],
    })
}

async fn health(State(state): State<Arc<AppState>>) -> StatusCode {
    if state.is_healthy() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// The engine core's prefix cache, for a cache-aware router's index (and the tests that check it).
async fn kv_cache(State(state): State<Arc<AppState>>) -> Result<Json<KvCacheSnapshot>, ApiError> {
    match state.engine()?.utility(UtilityMethod::KvCache).await {
        Ok(Some(UtilityValue::KvCache(snapshot))) => Ok(Json(snapshot)),
        Ok(other) => Err(ApiError::Internal(format!(
            "the engine core answered kv_cache with {other:?}"
        ))),
        Err(error) => Err(error.into()),
    }
}

/// The engine core's audit of its KV block pool: no block held by a request that is gone.
async fn block_pool_audit(
    State(state): State<Arc<AppState>>,
) -> Result<Json<BlockPoolAudit>, ApiError> {
    match state.engine()?.utility(UtilityMethod::BlockPoolAudit).await {
        Ok(Some(UtilityValue::BlockPoolAudit(audit))) => Ok(Json(audit)),
        Ok(other) => Err(ApiError::Internal(format!(
            "the engine core answered block_pool_audit with {other:?}"
        ))),
        Err(error) => Err(error.into()),
    }
}

async fn version() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "version": env!("CARGO_PKG_VERSION") }))
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let stats = state.latest_stats().unwrap_or_default();
    let mut response = state
        .metrics
        .render(&stats, state.engine_restarts())
        .into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;

    fn request(authorization: Option<&str>) -> Request {
        let mut builder = Request::builder().uri("/v1/models");
        if let Some(value) = authorization {
            builder = builder.header(header::AUTHORIZATION, value);
        }
        builder.body(Body::empty()).unwrap()
    }

    #[test]
    fn api_key_is_checked_only_when_set() {
        assert_eq!(check_api_key(None, &request(None)), Ok(()));
        assert_eq!(check_api_key(Some("k"), &request(Some("Bearer k"))), Ok(()));
        for bad in [None, Some("Bearer x"), Some("k"), Some("Basic k")] {
            assert_eq!(
                check_api_key(Some("k"), &request(bad)),
                Err(ApiError::InvalidApiKey),
                "{bad:?}"
            );
        }
    }
}

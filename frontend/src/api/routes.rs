//! The axum router: which handler serves which route, its layers (the API key, the request
//! body's limits), OpenAI-shaped 404 and 405, the small endpoints (models, health,
//! kv_cache, block_pool_audit, version, metrics) and the playground's page. Handlers are thin: parse, call one
//! function, map the result.

use std::sync::Arc;

use axum::extract::Request;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::api::chat::Chat;
use crate::api::completions::Completions;
use crate::api::error::ApiError;
use crate::api::messages::Messages;
use crate::api::request_body::{self, BodyLimits};
use crate::api::responses::Responses;
use crate::api::{
    auth, embeddings, generation, input_items, messages, openapi, prepare, responses, score,
    tokenize,
};
use crate::engine::protocol::{BlockPoolAudit, KvCacheSnapshot, UtilityMethod, UtilityValue};
use crate::state::{unix_time, AppState};
use sluice_common::schema::openai::{ModelCard, ModelList};
use sluice_common::{connections, error_dialect, playground};

pub fn router(state: Arc<AppState>) -> Router {
    let body_limits = Arc::new(BodyLimits::new(
        state.config.max_body_bytes,
        state.config.body_read_timeout,
        state.config.max_body_bytes_in_flight,
    ));
    let cors = state.config.cors.clone();
    let app = Router::new()
        .route("/v1/completions", post(generation::create::<Completions>))
        .route("/v1/chat/completions", post(generation::create::<Chat>))
        .route("/v1/messages", post(generation::create::<Messages>))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/responses", post(generation::create::<Responses>))
        .route("/v1/embeddings", post(embeddings::create))
        .route("/score", post(score::score))
        .route("/rerank", post(score::rerank))
        .route("/v1/rerank", post(score::rerank))
        .route("/v2/rerank", post(score::rerank))
        .route(
            "/v1/responses/{id}",
            get(responses::retrieve).delete(responses::delete),
        )
        .route("/v1/responses/{id}/input_items", get(input_items::list))
        .route("/v1/models", get(models))
        .route("/v1/models/{model}", get(model))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/health", get(health))
        .route("/sluice/kv_cache", get(kv_cache))
        .route("/sluice/block_pool_audit", get(block_pool_audit))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi::serve))
        .merge(playground::routes())
        .fallback(no_such_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .layer(middleware::from_fn_with_state(
            body_limits,
            request_body::read_body,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_api_key,
        ))
        .layer(middleware::from_fn(bounded_head))
        .layer(middleware::from_fn(error_dialect::anthropic_errors))
        .with_state(state);
    // Outermost: a browser's preflight is answered before the API key is checked.
    match cors {
        Some(cors) => app.layer(cors),
        None => app,
    }
}

/// A head over the served bounds is a 431 before anything else reads it.
async fn bounded_head(request: Request, next: Next) -> Response {
    match connections::head_too_large(request.headers()) {
        Some(why) => ApiError::HeadTooLarge(why).into_response(),
        None => next.run(request).await,
    }
}

async fn no_such_route(method: Method, uri: Uri) -> ApiError {
    ApiError::NoSuchRoute(format!("{method} {}", uri.path()))
}

async fn method_not_allowed(method: Method) -> ApiError {
    ApiError::MethodNotAllowed(method.to_string())
}

async fn models(State(state): State<Arc<AppState>>) -> Result<Json<ModelList>, ApiError> {
    Ok(Json(ModelList {
        object: "list".into(),
        data: vec![model_card(&state)?],
    }))
}

/// `GET /v1/models/{model}`: the served model's card, or a 404 in OpenAI's shape.
async fn model(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    prepare::check_model(&state, &model)?;
    Ok(Json(model_card(&state)?))
}

fn model_card(state: &AppState) -> Result<ModelCard, ApiError> {
    Ok(ModelCard {
        id: state.config.served_model_name.clone(),
        object: "model".into(),
        created: unix_time(),
        owned_by: "sluice".into(),
        max_model_len: state.max_model_len()?,
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

async fn version(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "cpu_kernels": state.config.cpu_kernels,
    }))
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let stats = state.latest_stats().unwrap_or_default();
    let mut text = state.metrics.render(&stats, state.engine_restarts());
    text.push_str(&state.metrics.render_store(&state.responses.stats()));
    let mut response = text.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

//! The router's HTTP surface: which path goes to which handler. Handlers parse, call one function
//! and return its answer.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use bytes::Bytes;
use serde_json::Value;
use sluice_common::auth::{authorize, AuthFailure};
use sluice_common::playground;
use sluice_common::{connections, error_dialect};

use crate::affinity::home_of;
use crate::api_error::RouterError;
use crate::policies::{ReplicaId, RouteRequest};
use crate::proxy::{forward, Expect, Forward};
use crate::state::AppState;

pub fn router(state: Arc<AppState>) -> axum::Router {
    let cors = state.settings.cors.clone();
    let app = axum::Router::new()
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(completion))
        .route("/v1/completions", post(completion))
        .route("/v1/responses", post(responses))
        .route(
            "/v1/responses/{id}",
            get(stored_response).delete(stored_response),
        )
        .route("/v1/responses/{id}/input_items", get(stored_response))
        .route("/v1/{*rest}", any(pass_through))
        // A pooling replica's routes outside /v1 (vLLM's paths).
        .route("/score", post(pass_through))
        .route("/rerank", post(pass_through))
        .route("/v2/rerank", post(pass_through))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/sluice/kv_index", get(kv_index))
        // The replicas' playground page, served here too, so that it talks to the router's API.
        .merge(playground::routes())
        .fallback(no_such_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
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

/// A head over the served bounds (the frontend's) is a 431 before anything else reads it.
async fn bounded_head(request: Request, next: Next) -> Response {
    match connections::head_too_large(request.headers()) {
        Some(why) => RouterError::HeadTooLarge(why).into_response(),
        None => next.run(request).await,
    }
}

/// Before anything else, when the router has a key: exactly one `Authorization: Bearer KEY` (or
/// `x-api-key: KEY`) on
/// every route but /health, the playground's static page (see sluice_common's playground.rs) and
/// /metrics with --metrics-without-auth, checked as the frontend does.
async fn require_api_key(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(key) = &state.settings.api_key else {
        return next.run(request).await;
    };
    let path = request.uri().path();
    if path == "/health"
        || playground::is_playground_path(path)
        || (path == "/metrics" && state.settings.metrics_without_auth)
    {
        return next.run(request).await;
    }
    match authorize(key, request.headers()) {
        Ok(()) => next.run(request).await,
        Err(AuthFailure::Wrong) => RouterError::InvalidApiKey.into_response(),
        Err(AuthFailure::Duplicate) => RouterError::DuplicateAuthorization.into_response(),
    }
}

async fn no_such_route(method: Method, uri: Uri) -> RouterError {
    RouterError::NoSuchRoute(format!("{method} {}", uri.path()))
}

async fn method_not_allowed(method: Method) -> RouterError {
    RouterError::MethodNotAllowed(method.to_string())
}

async fn health(State(state): State<Arc<AppState>>) -> StatusCode {
    if state.replicas.any_routable() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let text = state.metrics.render(&state.replicas.all());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// What the cache-aware policy believes each replica holds, to compare with the engines' own
/// `/sluice/kv_cache`.
async fn kv_index(State(state): State<Arc<AppState>>) -> Response {
    match state.policy.kv_index() {
        Some(index) => axum::Json(index).into_response(),
        None => RouterError::NoKvIndex.into_response(),
    }
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    crate::models::aggregated_models(&state).await
}

/// The whole body, within the size cap (413) and the read timeout (408).
async fn body_bytes(state: &AppState, body: Body) -> Result<Bytes, RouterError> {
    let timeout = state.settings.body_read_timeout;
    let read = axum::body::to_bytes(body, state.settings.max_body_bytes);
    match tokio::time::timeout(timeout, read).await {
        Ok(read) => read.map_err(|_| RouterError::PayloadTooLarge),
        Err(_) => Err(RouterError::BodyReadTimeout(timeout)),
    }
}

/// The session key consistent-hash routes on: the session header, else the body's `user`.
fn session_key<'a>(state: &AppState, headers: &'a HeaderMap, body: &'a Value) -> Option<&'a str> {
    headers
        .get(state.settings.session_header.as_str())
        .and_then(|value| value.to_str().ok())
        .or_else(|| body.get("user").and_then(Value::as_str))
}

async fn completion(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let (parts, bytes, json, expect) = match generation_request(&state, request).await {
        Ok(read) => read,
        Err(error) => return error.into_response(),
    };
    forward_read(&state, &parts, bytes, &json, expect, None).await
}

/// A generation request read whole: its head, body, body as JSON (an object) and what its answer
/// looks like.
async fn generation_request(
    state: &AppState,
    request: Request,
) -> Result<(Parts, Bytes, Value, Expect), RouterError> {
    let (parts, body) = request.into_parts();
    let bytes = body_bytes(state, body).await?;
    let json: Value = match serde_json::from_slice(&bytes) {
        Ok(json @ Value::Object(_)) => json,
        Ok(_) => return Err(RouterError::InvalidJson("expected a JSON object".into())),
        Err(error) => return Err(RouterError::InvalidJson(error.to_string())),
    };
    let expect = if json.get("stream").and_then(Value::as_bool) == Some(true) {
        Expect::EventStream
    } else {
        Expect::Json
    };
    Ok((parts, bytes, json, expect))
}

/// `POST /v1/responses`: a follow-up goes to the replica that stored the response it continues.
async fn responses(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let (parts, bytes, json, expect) = match generation_request(&state, request).await {
        Ok(read) => read,
        Err(error) => return error.into_response(),
    };
    let previous = json.get("previous_response_id").and_then(Value::as_str);
    let pin = match previous.map(|id| home(&state, id, Some("previous_response_id"))) {
        Some(Ok(pin)) => pin,
        Some(Err(gone)) => return gone.into_response(),
        None => None,
    };
    forward_read(&state, &parts, bytes, &json, expect, pin).await
}

/// `GET` and `DELETE /v1/responses/{id}`, and `GET /v1/responses/{id}/input_items`: sent to the
/// replica that stored it.
async fn stored_response(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    request: Request,
) -> Response {
    let pin = match home(&state, &id, None) {
        Ok(pin) => pin,
        Err(gone) => return gone.into_response(),
    };
    let (parts, body) = request.into_parts();
    let bytes = match body_bytes(&state, body).await {
        Ok(bytes) => bytes,
        Err(error) => return error.into_response(),
    };
    forward_read(&state, &parts, bytes, &Value::Null, Expect::Json, pin).await
}

/// The replica that stored response `id`, if its id names one; a 404 naming the id when that
/// replica is gone.
fn home(
    state: &AppState,
    id: &str,
    param: Option<&'static str>,
) -> Result<Option<ReplicaId>, RouterError> {
    home_of(&state.replicas, id).map_err(|tag| RouterError::ResponseGone {
        id: id.to_owned(),
        tag,
        param,
    })
}

async fn pass_through(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let bytes = match body_bytes(&state, body).await {
        Ok(bytes) => bytes,
        Err(error) => return error.into_response(),
    };
    forward_read(&state, &parts, bytes, &Value::Null, Expect::Anything, None).await
}

/// Forwards a request whose body is read: `json` is that body parsed, or Null where it is passed
/// through unread (then only the session header can key it).
async fn forward_read(
    state: &AppState,
    parts: &Parts,
    bytes: Bytes,
    json: &Value,
    expect: Expect,
    pin: Option<ReplicaId>,
) -> Response {
    let request = Forward {
        method: parts.method.clone(),
        path_and_query: parts.uri.path_and_query().map_or("/", |p| p.as_str()),
        headers: &parts.headers,
        body: bytes,
        route: RouteRequest {
            path: parts.uri.path(),
            body: json,
            session_key: session_key(state, &parts.headers, json),
        },
        expect,
        pin,
    };
    forward(state, &request).await
}

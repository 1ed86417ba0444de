//! The API key middleware: every protected route runs the check of `sluice_common::auth` (the router
//! runs the same check).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use sluice_common::auth::{authorize, AuthFailure};
use sluice_common::playground;

use crate::api::error::ApiError;
use crate::state::AppState;

/// Routes a load balancer or orchestrator probes without credentials.
const OPEN_PATHS: &[&str] = &["/health"];

/// Middleware on the whole app: with a key set, every route but /health, the playground's page
/// (static, no data: see sluice_common's playground.rs) and /metrics with `--metrics-without-auth` needs it;
/// unknown routes too, so they cannot be told apart unseen.
pub async fn require_api_key(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(expected) = state.config.api_key.as_deref() else {
        return next.run(request).await;
    };
    let path = request.uri().path();
    let open = OPEN_PATHS.contains(&path)
        || playground::is_playground_path(path)
        || (path == "/metrics" && state.config.metrics_without_auth);
    if open {
        return next.run(request).await;
    }
    match authorize(expected, request.headers()) {
        Ok(()) => next.run(request).await,
        Err(failure) => api_error(failure).into_response(),
    }
}

fn api_error(failure: AuthFailure) -> ApiError {
    match failure {
        AuthFailure::Wrong => ApiError::InvalidApiKey,
        AuthFailure::Duplicate => ApiError::InvalidRequest(
            "send exactly one Authorization header (or one x-api-key header)".into(),
        ),
    }
}

//! Request bodies, read before any handler runs: within a size cap (413), within a time bound
//! (408, so a client that sends half a body cannot hold a connection), and within a budget of
//! body bytes in flight across all requests, so that a burst of large requests (and the
//! tokenization each one brings) waits its turn instead of growing memory without bound. After a
//! large request the allocator is asked to hand its freed pages back to the system.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, HttpBody};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::sync::Semaphore;

use crate::api::error::ApiError;
use sluice_common::allocator::release_free_memory;

/// The budget's unit, so that a budget of gigabytes fits a semaphore's u32 acquire.
const BUDGET_UNIT_BYTES: usize = 1024;
/// Bodies at least this large trim the allocator when done.
const TRIM_AFTER_BYTES: usize = 1 << 20;

pub struct BodyLimits {
    pub max_bytes: usize,
    pub read_timeout: Duration,
    /// Body bytes (in BUDGET_UNIT_BYTES) that requests being read or handled may hold together.
    in_flight: Arc<Semaphore>,
    budget_units: usize,
}

impl BodyLimits {
    /// `budget_bytes` is raised to `max_bytes` if smaller, so that one largest body always fits.
    pub fn new(max_bytes: usize, read_timeout: Duration, budget_bytes: usize) -> Self {
        let budget_units = units(budget_bytes.max(max_bytes)).max(1);
        BodyLimits {
            max_bytes,
            read_timeout,
            in_flight: Arc::new(Semaphore::new(budget_units)),
            budget_units,
        }
    }
}

fn units(bytes: usize) -> usize {
    bytes.div_ceil(BUDGET_UNIT_BYTES)
}

/// Middleware: reads the whole body under the limits and hands the handler a buffered one.
pub async fn read_body(
    State(limits): State<Arc<BodyLimits>>,
    request: Request,
    next: Next,
) -> Response {
    let (parts, body) = request.into_parts();
    // The declared length (Content-Length, or 0 for no body); None for a chunked body.
    let declared = body
        .size_hint()
        .exact()
        .and_then(|n| usize::try_from(n).ok());
    if declared.is_some_and(|n| n > limits.max_bytes) {
        return ApiError::PayloadTooLarge.into_response();
    }
    let reserved = units(declared.unwrap_or(limits.max_bytes)).min(limits.budget_units);
    let budget = u32::try_from(reserved).expect("the budget fits a u32 of KiB");
    let permit = match tokio::time::timeout(
        limits.read_timeout,
        limits.in_flight.clone().acquire_many_owned(budget),
    )
    .await
    {
        Ok(Ok(permit)) => permit,
        _ => return ApiError::BodiesInFlight.into_response(),
    };
    let read = axum::body::to_bytes(body, limits.max_bytes);
    let bytes = match tokio::time::timeout(limits.read_timeout, read).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(error)) => return body_error(&error).into_response(),
        Err(_) => return ApiError::BodyReadTimeout(limits.read_timeout).into_response(),
    };
    let size = bytes.len();
    let response = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    drop(permit);
    if size >= TRIM_AFTER_BYTES {
        tokio::task::spawn_blocking(release_free_memory);
    }
    response
}

/// `to_bytes` fails when the body grows past the cap or the connection breaks mid-body.
fn body_error(error: &axum::Error) -> ApiError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(cause) = source {
        if cause.is::<http_body_util::LengthLimitError>() {
            return ApiError::PayloadTooLarge;
        }
        source = cause.source();
    }
    ApiError::InvalidRequest(format!("cannot read the request body: {error}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::post;
    use axum::Router;
    use futures::StreamExt;
    use tower::ServiceExt;

    fn app(max_bytes: usize) -> Router {
        let limits = Arc::new(BodyLimits::new(max_bytes, Duration::from_secs(5), 0));
        Router::new()
            .route(
                "/",
                post(|body: String| async move { body.len().to_string() }),
            )
            .layer(axum::middleware::from_fn_with_state(limits, read_body))
    }

    async fn status_of(app: Router, body: Body) -> u16 {
        let request = Request::builder()
            .method("POST")
            .uri("/")
            .body(body)
            .unwrap();
        app.oneshot(request).await.unwrap().status().as_u16()
    }

    #[tokio::test]
    async fn a_body_over_the_cap_is_413_declared_or_streamed() {
        assert_eq!(status_of(app(10), Body::from("0123456789")).await, 200);
        assert_eq!(status_of(app(10), Body::from("0123456789x")).await, 413);
        let chunks = futures::stream::iter(["012345", "6789x"].map(Ok::<_, std::io::Error>));
        assert_eq!(status_of(app(10), Body::from_stream(chunks)).await, 413);
    }

    #[tokio::test]
    async fn a_body_that_stops_arriving_is_408() {
        let limits = Arc::new(BodyLimits::new(100, Duration::from_millis(100), 0));
        let app = Router::new()
            .route("/", post(|body: String| async move { body }))
            .layer(axum::middleware::from_fn_with_state(limits, read_body));
        let stalled = futures::stream::once(async { Ok::<_, std::io::Error>("half") })
            .chain(futures::stream::pending());
        assert_eq!(status_of(app, Body::from_stream(stalled)).await, 408);
    }
}

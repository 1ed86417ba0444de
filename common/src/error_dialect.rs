//! Error bodies in the shape that a route's clients parse. Every error response of the frontend and
//! of the router carries its message as an [`ErrorMessage`] extension beside OpenAI's body; on
//! Anthropic's routes (`/v1/messages...`) one middleware, [`anthropic_errors`], renders the same
//! status and message in Anthropic's shape. So a refused key, a body over its limit, an unknown
//! route and a handler's own error all reach the `anthropic` client as errors it can read.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;

use crate::schema::anthropic::ErrorResponse;

/// An error response's message, whatever shape its body has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorMessage(pub String);

/// Whether `path` is one of Anthropic's routes, whose errors are Anthropic's shape.
pub fn is_anthropic_path(path: &str) -> bool {
    path == "/v1/messages" || path.starts_with("/v1/messages/")
}

/// Middleware: an error response to one of Anthropic's routes is re-rendered in Anthropic's shape.
pub async fn anthropic_errors(request: Request, next: Next) -> Response {
    let anthropic = is_anthropic_path(request.uri().path());
    let response = next.run(request).await;
    if !anthropic {
        return response;
    }
    let Some(ErrorMessage(message)) = response.extensions().get::<ErrorMessage>().cloned() else {
        return response;
    };
    let (mut parts, _) = response.into_parts();
    let body = serde_json::to_vec(&ErrorResponse::new(parts.status, message))
        .expect("an error body always serializes");
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, Body::from(body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use axum::response::IntoResponse;
    use axum::routing::post;
    use axum::Router;
    use serde_json::{json, Value};
    use tower::ServiceExt;

    async fn refused() -> Response {
        let mut response = (StatusCode::TOO_MANY_REQUESTS, "{\"error\": {}}").into_response();
        response
            .extensions_mut()
            .insert(ErrorMessage("queue full".into()));
        response
    }

    async fn body_of(app: Router, path: &str) -> (StatusCode, String) {
        let request = Request::post(path).body(Body::empty()).unwrap();
        let response = app.oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, String::from_utf8(bytes.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn only_anthropics_routes_get_anthropics_shape() {
        let app = Router::new()
            .route("/v1/messages", post(refused))
            .route("/v1/messages/count_tokens", post(refused))
            .route("/v1/chat/completions", post(refused))
            .layer(axum::middleware::from_fn(anthropic_errors));
        for path in ["/v1/messages", "/v1/messages/count_tokens"] {
            let (status, body) = body_of(app.clone(), path).await;
            assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
            assert_eq!(
                serde_json::from_str::<Value>(&body).unwrap(),
                json!({"type": "error", "error": {"type": "rate_limit_error", "message": "queue full"}})
            );
        }
        let (_, body) = body_of(app, "/v1/chat/completions").await;
        assert_eq!(body, "{\"error\": {}}");
        assert!(!is_anthropic_path("/v1/messagesx"));
    }
}

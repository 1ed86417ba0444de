//! Every error the HTTP layer answers with, and the one place that maps each
//! to its status and OpenAI's error body.

use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use thiserror::Error;

use crate::engine::error::EngineError;
use crate::state::EngineNotReady;
use crate::text::tokenizer_pool::TokenizerPoolError;
use sluice_common::error_dialect::ErrorMessage;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ApiError {
    /// Malformed JSON, wrong types, missing fields.
    #[error("{0}")]
    InvalidRequest(String),
    /// A parameter outside its range, named in `param`.
    #[error("{message}")]
    InvalidParameter {
        param: &'static str,
        message: String,
    },
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// The prompt is over max_model_len, or max_tokens cannot fit after it.
    #[error("{message}")]
    ContextLengthExceeded {
        param: &'static str,
        message: String,
    },
    /// A stored response that is not (or no longer) here; `param` is `previous_response_id` when the
    /// id came from that field.
    #[error(
        "no response with id '{id}' is stored here: it was never stored (store: false), was \
         deleted, or has expired or been evicted"
    )]
    ResponseNotFound {
        id: String,
        param: Option<&'static str>,
    },
    #[error("messages must not be empty")]
    EmptyMessages,
    #[error("request body is too large")]
    PayloadTooLarge,
    #[error("the request body did not arrive within {0:?}")]
    BodyReadTimeout(std::time::Duration),
    #[error("too many large request bodies are in flight, retry later")]
    BodiesInFlight,
    /// Too many headers, or too many header bytes.
    #[error("{0}")]
    HeadTooLarge(String),
    #[error("no route {0}")]
    NoSuchRoute(String),
    #[error("method {0} is not allowed on this route")]
    MethodNotAllowed(String),
    #[error("missing or incorrect API key")]
    InvalidApiKey,
    #[error("the waiting queue is full, retry later")]
    QueueFull,
    #[error("the engine is not available: {0}")]
    EngineUnavailable(String),
    #[error("internal error: {0}")]
    Internal(String),
}

/// OpenAI's error JSON: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ErrorResponse {
    pub error: ErrorBody,
}

#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    #[schema(required = true)]
    pub param: Option<&'static str>,
    #[schema(required = true)]
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest(_)
            | ApiError::InvalidParameter { .. }
            | ApiError::ContextLengthExceeded { .. }
            | ApiError::EmptyMessages => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound(_) | ApiError::ResponseNotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BodyReadTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::BodiesInFlight => StatusCode::TOO_MANY_REQUESTS,
            ApiError::HeadTooLarge(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ApiError::NoSuchRoute(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::InvalidApiKey => StatusCode::UNAUTHORIZED,
            ApiError::QueueFull => StatusCode::TOO_MANY_REQUESTS,
            ApiError::EngineUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `type`.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::QueueFull | ApiError::BodiesInFlight => "rate_limit_error",
            ApiError::EngineUnavailable(_) | ApiError::Internal(_) => "server_error",
            _ => "invalid_request_error",
        }
    }

    pub fn param(&self) -> Option<&'static str> {
        match self {
            ApiError::InvalidParameter { param, .. }
            | ApiError::ContextLengthExceeded { param, .. } => Some(param),
            ApiError::EmptyMessages => Some("messages"),
            ApiError::ModelNotFound(_) => Some("model"),
            ApiError::ResponseNotFound { param, .. } => *param,
            _ => None,
        }
    }

    /// OpenAI's machine-readable `code`, where OpenAI has one.
    pub fn code(&self) -> Option<&'static str> {
        match self {
            ApiError::ModelNotFound(_) => Some("model_not_found"),
            ApiError::ResponseNotFound { param: Some(_), .. } => {
                Some("previous_response_not_found")
            }
            ApiError::ResponseNotFound { param: None, .. } => Some("response_not_found"),
            ApiError::ContextLengthExceeded { .. } => Some("context_length_exceeded"),
            ApiError::InvalidApiKey => Some("invalid_api_key"),
            ApiError::QueueFull | ApiError::BodiesInFlight => Some("rate_limit_exceeded"),
            ApiError::PayloadTooLarge => Some("request_too_large"),
            ApiError::HeadTooLarge(_) => Some("request_header_fields_too_large"),
            ApiError::EngineUnavailable(_) => Some("engine_unavailable"),
            _ => None,
        }
    }

    pub fn body(&self) -> ErrorResponse {
        ErrorResponse {
            error: ErrorBody {
                message: self.to_string(),
                kind: self.kind(),
                param: self.param(),
                code: self.code(),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut response = (status, Json(self.body())).into_response();
        // For the routes whose clients read another error shape (`error_dialect`).
        response
            .extensions_mut()
            .insert(ErrorMessage(self.to_string()));
        // A client that backs off on 429 and 503 needs to be told when to come back.
        if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static(RETRY_AFTER_SECONDS),
            );
        }
        response
    }
}

/// What a 429 or 503 asks a client to wait: admission frees within a step or two.
const RETRY_AFTER_SECONDS: &str = "1";

/// Lets a handler take `Result<Json<T>, JsonRejection>` and answer with `?`,
/// keeping axum's own plain-text rejections out of the API.
impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge
        } else {
            ApiError::InvalidRequest(rejection.body_text())
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(error: EngineError) -> Self {
        ApiError::EngineUnavailable(error.to_string())
    }
}

impl From<TokenizerPoolError> for ApiError {
    fn from(error: TokenizerPoolError) -> Self {
        ApiError::Internal(error.to_string())
    }
}

impl From<EngineNotReady> for ApiError {
    fn from(not_ready: EngineNotReady) -> Self {
        ApiError::EngineUnavailable(not_ready.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    async fn response_parts(error: ApiError) -> (StatusCode, Option<String>, Value) {
        let response = error.into_response();
        let status = response.status();
        let content_type = response
            .headers()
            .get(axum::http::header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned());
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        (
            status,
            content_type,
            serde_json::from_slice(&bytes).unwrap(),
        )
    }

    async fn check(error: ApiError, status: u16, expected: Value) {
        let (got_status, content_type, body) = response_parts(error).await;
        assert_eq!(got_status.as_u16(), status);
        assert_eq!(content_type.as_deref(), Some("application/json"));
        assert_eq!(body, json!({ "error": expected }));
    }

    #[tokio::test]
    async fn invalid_request_is_400_without_param() {
        check(
            ApiError::InvalidRequest("expected value at line 1 column 1".into()),
            400,
            json!({"message": "expected value at line 1 column 1",
                   "type": "invalid_request_error", "param": null, "code": null}),
        )
        .await;
    }

    #[tokio::test]
    async fn parameter_out_of_range_is_400_naming_the_param() {
        check(
            ApiError::InvalidParameter {
                param: "temperature",
                message: "temperature must be in [0, 2], got 3".into(),
            },
            400,
            json!({"message": "temperature must be in [0, 2], got 3",
                   "type": "invalid_request_error", "param": "temperature", "code": null}),
        )
        .await;
    }

    #[tokio::test]
    async fn unknown_model_is_404_model_not_found() {
        check(
            ApiError::ModelNotFound("gpt-9".into()),
            404,
            json!({"message": "The model `gpt-9` does not exist.",
                   "type": "invalid_request_error", "param": "model", "code": "model_not_found"}),
        )
        .await;
    }

    #[tokio::test]
    async fn prompt_too_long_is_400_context_length_exceeded() {
        check(
            ApiError::ContextLengthExceeded {
                param: "max_tokens",
                message: "prompt (10 tokens) + max_tokens (100) exceeds 64".into(),
            },
            400,
            json!({"message": "prompt (10 tokens) + max_tokens (100) exceeds 64",
                   "type": "invalid_request_error", "param": "max_tokens",
                   "code": "context_length_exceeded"}),
        )
        .await;
    }

    #[tokio::test]
    async fn empty_messages_is_400_on_messages() {
        check(
            ApiError::EmptyMessages,
            400,
            json!({"message": "messages must not be empty",
                   "type": "invalid_request_error", "param": "messages", "code": null}),
        )
        .await;
    }

    #[tokio::test]
    async fn body_too_large_is_413() {
        check(
            ApiError::PayloadTooLarge,
            413,
            json!({"message": "request body is too large",
                   "type": "invalid_request_error", "param": null, "code": "request_too_large"}),
        )
        .await;
    }

    #[tokio::test]
    async fn bad_api_key_is_401_invalid_api_key() {
        check(
            ApiError::InvalidApiKey,
            401,
            json!({"message": "missing or incorrect API key",
                   "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}),
        )
        .await;
    }

    #[tokio::test]
    async fn full_queue_is_429() {
        check(
            ApiError::QueueFull,
            429,
            json!({"message": "the waiting queue is full, retry later",
                   "type": "rate_limit_error", "param": null, "code": "rate_limit_exceeded"}),
        )
        .await;
    }

    #[test]
    fn only_429_and_503_tell_the_client_when_to_retry() {
        let retry_after = |error: ApiError| {
            error
                .into_response()
                .headers()
                .get(axum::http::header::RETRY_AFTER)
                .map(|value| value.to_str().unwrap().to_owned())
        };
        assert_eq!(retry_after(ApiError::QueueFull).as_deref(), Some("1"));
        assert_eq!(
            retry_after(ApiError::EngineUnavailable("restarting".into())).as_deref(),
            Some("1")
        );
        assert_eq!(retry_after(ApiError::Internal("x".into())), None);
        assert_eq!(retry_after(ApiError::InvalidApiKey), None);
    }

    #[tokio::test]
    async fn dead_engine_is_503() {
        check(
            ApiError::EngineUnavailable("engine core disconnected".into()),
            503,
            json!({"message": "the engine is not available: engine core disconnected",
                   "type": "server_error", "param": null, "code": "engine_unavailable"}),
        )
        .await;
    }

    #[tokio::test]
    async fn internal_is_500() {
        check(
            ApiError::Internal("tokenizer pool closed".into()),
            500,
            json!({"message": "internal error: tokenizer pool closed",
                   "type": "server_error", "param": null, "code": null}),
        )
        .await;
    }

    #[tokio::test]
    async fn json_rejections_become_openai_errors() {
        use axum::body::Body;
        use axum::extract::FromRequest;
        use axum::http::Request;

        let request = Request::builder()
            .method("POST")
            .header("content-type", "application/json")
            .body(Body::from("{\"model\": 3"))
            .unwrap();
        let rejection = Json::<Value>::from_request(request, &()).await.unwrap_err();
        let error = ApiError::from(rejection);
        assert_eq!(error.status(), StatusCode::BAD_REQUEST);
        assert_eq!(error.kind(), "invalid_request_error");
    }
}

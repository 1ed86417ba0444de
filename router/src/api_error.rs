//! Every error the router answers with itself, and the one place that maps each to its status and
//! OpenAI's error body.

use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use sluice_common::error_dialect::ErrorMessage;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum RouterError {
    #[error("missing or incorrect API key")]
    InvalidApiKey,
    #[error("send exactly one Authorization header (or one x-api-key header)")]
    DuplicateAuthorization,
    #[error("no route {0}")]
    NoSuchRoute(String),
    #[error("method {0} is not allowed on this route")]
    MethodNotAllowed(String),
    #[error("the request body is not valid JSON: {0}")]
    InvalidJson(String),
    #[error("request body is too large")]
    PayloadTooLarge,
    /// Too many headers, or too many header bytes.
    #[error("{0}")]
    HeadTooLarge(String),
    #[error("the request body did not arrive within {}s", .0.as_secs_f64())]
    BodyReadTimeout(Duration),
    #[error("this router keeps no KV index: only --policy cache-aware follows KV events")]
    NoKvIndex,
    /// A stored response whose replica (by the tag in its id) is no longer one of the router's.
    #[error(
        "no response with id '{id}' can be reached: the replica that stored it (tag {tag}) is no \
         longer serving, and its conversations are gone with it"
    )]
    ResponseGone {
        id: String,
        tag: String,
        param: Option<&'static str>,
    },
    /// No replica is healthy, or every attempt failed before the first byte.
    #[error("no replica is available: {reason}")]
    NoReplica {
        reason: String,
        retry_after: Duration,
    },
}

impl RouterError {
    pub fn status(&self) -> StatusCode {
        match self {
            RouterError::InvalidApiKey => StatusCode::UNAUTHORIZED,
            RouterError::DuplicateAuthorization => StatusCode::BAD_REQUEST,
            RouterError::NoSuchRoute(_) => StatusCode::NOT_FOUND,
            RouterError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            RouterError::InvalidJson(_) => StatusCode::BAD_REQUEST,
            RouterError::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            RouterError::HeadTooLarge(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            RouterError::BodyReadTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            RouterError::NoKvIndex | RouterError::ResponseGone { .. } => StatusCode::NOT_FOUND,
            RouterError::NoReplica { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    fn kind_and_code(&self) -> (&'static str, &'static str) {
        match self {
            RouterError::InvalidApiKey => ("invalid_request_error", "invalid_api_key"),
            RouterError::DuplicateAuthorization => {
                ("invalid_request_error", "duplicate_authorization")
            }
            RouterError::NoSuchRoute(_) => ("invalid_request_error", "not_found"),
            RouterError::MethodNotAllowed(_) => ("invalid_request_error", "method_not_allowed"),
            RouterError::InvalidJson(_) => ("invalid_request_error", "invalid_json"),
            RouterError::PayloadTooLarge => ("invalid_request_error", "payload_too_large"),
            RouterError::HeadTooLarge(_) => {
                ("invalid_request_error", "request_header_fields_too_large")
            }
            RouterError::BodyReadTimeout(_) => ("invalid_request_error", "request_timeout"),
            RouterError::NoKvIndex => ("invalid_request_error", "no_kv_index"),
            RouterError::ResponseGone { param: Some(_), .. } => {
                ("invalid_request_error", "previous_response_not_found")
            }
            RouterError::ResponseGone { param: None, .. } => {
                ("invalid_request_error", "response_not_found")
            }
            RouterError::NoReplica { .. } => ("server_error", "no_replica_available"),
        }
    }

    /// OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`.
    pub fn body(&self) -> serde_json::Value {
        let (kind, code) = self.kind_and_code();
        let param = match self {
            RouterError::ResponseGone { param, .. } => *param,
            _ => None,
        };
        json!({"error": {"message": self.to_string(), "type": kind, "param": param, "code": code}})
    }
}

impl IntoResponse for RouterError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), Json(self.body())).into_response();
        // For the routes whose clients read another error shape (`error_dialect`).
        response
            .extensions_mut()
            .insert(ErrorMessage(self.to_string()));
        if let RouterError::NoReplica { retry_after, .. } = &self {
            let seconds = retry_after.as_secs_f64().ceil().max(1.0) as u64;
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from_str(&seconds.to_string()).expect("digits are a header value"),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_replica_is_a_503_with_retry_after_in_openai_shape() {
        let error = RouterError::NoReplica {
            reason: "all replicas are ejected".into(),
            retry_after: Duration::from_millis(1500),
        };
        assert_eq!(
            error.body(),
            json!({"error": {"message": "no replica is available: all replicas are ejected",
                "type": "server_error", "param": null, "code": "no_replica_available"}})
        );
        let response = error.into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
    }
}

//! Sending one client request to a replica: pick, send, check the answer, retry elsewhere while
//! nothing has reached the client, then pass the answer through.
//!
//! Nothing goes to the client until the replica's answer is known to be sound: a complete JSON body
//! for a plain request, or a first SSE event for a stream. Until then a failure (connection
//! refused or reset, a 5xx, garbage) is retried on a replica not yet tried; after it, never.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::api_error::RouterError;
use crate::metrics::Metrics;
use crate::policies::{Candidate, ReplicaId, RouteRequest};
use crate::replicas::Outstanding;
use crate::state::AppState;

/// What a sound answer looks like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// A plain completion: one JSON document.
    Json,
    /// `"stream": true`: Server-Sent Events.
    EventStream,
    /// A pass-through path the router knows nothing about.
    Anything,
}

/// One client request, as it goes to whichever replica takes it.
pub struct Forward<'a> {
    pub method: Method,
    pub path_and_query: &'a str,
    pub headers: &'a HeaderMap,
    pub body: Bytes,
    pub route: RouteRequest<'a>,
    pub expect: Expect,
    /// The one replica that may take it: the one that stored the response it is about.
    pub pin: Option<ReplicaId>,
}

pub async fn forward(state: &AppState, request: &Forward<'_>) -> Response {
    let mut tried: Vec<ReplicaId> = Vec::new();
    let mut last_failure: Option<String> = None;
    for attempt in 0u32.. {
        if attempt > 0 {
            let retry = &state.settings.retry;
            if !retry.may_retry(attempt - 1, false) || candidates(state, request, &tried).is_empty()
            {
                break;
            }
            state
                .metrics
                .retry(tried.last().expect("an attempt was made"));
            tokio::time::sleep(retry.delay(attempt, rand::random_range(0.0..1.0))).await;
        }
        let candidates = candidates(state, request, &tried);
        if candidates.is_empty() {
            break;
        }
        let decision = state.policy.pick(&request.route, &candidates);
        assert!(
            candidates.iter().any(|c| c.id == decision.replica),
            "the policy picked {}, which is not a candidate",
            decision.replica
        );
        let Some(replica) = state.replicas.get(&decision.replica) else {
            // The list was refreshed between listing candidates and picking: list them again.
            continue;
        };
        state
            .metrics
            .decision(&replica.id, decision.reason, decision.prefix_match_tokens);
        state.metrics.request(&replica.id);
        tried.push(replica.id.clone());
        let mut outstanding = replica.begin_request();
        match attempt_on(state, request, &mut outstanding).await {
            Ok(answer) => return answer.into_response(state, outstanding),
            Err(failure) => {
                let failure = format!("{}: {failure}", replica.id);
                eprintln!("sluice-router: attempt failed before the first byte: {failure}");
                state.metrics.error(&replica.id);
                if outstanding.failed() {
                    state.metrics.ejection(&replica.id);
                    eprintln!("sluice-router: circuit breaker opened for {}", replica.id);
                }
                last_failure = Some(failure);
            }
        }
    }
    let none_healthy = match &request.pin {
        Some(pin) => {
            format!("{pin}, which holds the conversation this request continues, is not healthy")
        }
        None => "no replica is healthy".to_string(),
    };
    RouterError::NoReplica {
        reason: last_failure.unwrap_or(none_healthy),
        retry_after: state.settings.health.interval,
    }
    .into_response()
}

/// The replicas that may take `request` now: routable, not tried yet, and the pinned one if it is
/// pinned.
fn candidates(state: &AppState, request: &Forward<'_>, tried: &[ReplicaId]) -> Vec<Candidate> {
    let mut candidates = state.replicas.candidates(tried);
    if let Some(pin) = &request.pin {
        candidates.retain(|candidate| candidate.id == *pin);
    }
    candidates
}

/// A replica's answer that was found sound, not yet sent.
enum Answer {
    Complete {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    },
    Streaming {
        status: StatusCode,
        headers: HeaderMap,
        first: Option<Bytes>,
        rest: Incoming,
        sse: bool,
    },
}

impl Answer {
    fn into_response(self, state: &AppState, mut outstanding: Outstanding) -> Response {
        outstanding.succeeded();
        let (status, headers, body) = match self {
            Answer::Complete {
                status,
                headers,
                body,
            } => (status, headers, Body::from(body)),
            Answer::Streaming {
                status,
                headers,
                first,
                rest,
                sse,
            } => {
                let relay = Relay {
                    pending: first,
                    upstream: rest,
                    sse,
                    tail: [0, 0],
                    finished: false,
                    outstanding,
                    metrics: state.metrics.clone(),
                };
                (status, headers, relay.into_body())
            }
        };
        let mut response = Response::new(body);
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        response
    }
}

async fn attempt_on(
    state: &AppState,
    request: &Forward<'_>,
    outstanding: &mut Outstanding,
) -> Result<Answer, String> {
    let replica = &outstanding.replica().id;
    let answer = state
        .upstream
        .send(
            replica,
            request.method.clone(),
            request.path_and_query,
            request.headers,
            request.body.clone(),
        )
        .await?;
    let status = answer.status();
    if status.is_server_error() {
        return Err(format!("answered {status}"));
    }
    let (parts, body) = answer.into_parts();
    let headers = crate::upstream::response_headers(&parts.headers);
    let expect = if status.is_success() {
        request.expect
    } else {
        // A client error (4xx) is the replica's sound answer about the request: passed through.
        Expect::Anything
    };
    match expect {
        Expect::Json => {
            let body = body
                .collect()
                .await
                .map_err(|error| format!("broke while answering: {error}"))?
                .to_bytes();
            serde_json::from_slice::<serde::de::IgnoredAny>(&body)
                .map_err(|_| "answered garbage: the body is not JSON".to_string())?;
            Ok(Answer::Complete {
                status,
                headers,
                body,
            })
        }
        Expect::EventStream => {
            let is_sse = parts
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|value| value.to_str().ok())
                .is_some_and(|value| value.starts_with("text/event-stream"));
            if !is_sse {
                return Err("answered garbage: a stream that is not text/event-stream".into());
            }
            let mut rest = body;
            let first = first_data(&mut rest).await?;
            if !starts_like_sse(&first) {
                return Err("answered garbage: the stream does not start with an SSE field".into());
            }
            Ok(Answer::Streaming {
                status,
                headers,
                first: Some(first),
                rest,
                sse: true,
            })
        }
        Expect::Anything => Ok(Answer::Streaming {
            status,
            headers,
            first: None,
            rest: body,
            sse: false,
        }),
    }
}

/// The stream's first bytes: an empty stream or a broken one is a failure, still retryable.
async fn first_data(body: &mut Incoming) -> Result<Bytes, String> {
    loop {
        match body.frame().await {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) if !data.is_empty() => return Ok(data),
                _ => continue,
            },
            Some(Err(error)) => return Err(format!("broke before its first event: {error}")),
            None => return Err("answered garbage: an empty stream".into()),
        }
    }
}

/// An SSE stream opens with a field (`data:`, `event:`, `id:`, `retry:`) or a comment (`:`).
fn starts_like_sse(first: &[u8]) -> bool {
    let line = first.split(|&b| b == b'\n').next().unwrap_or_default();
    line.starts_with(b":")
        || [&b"data:"[..], b"event:", b"id:", b"retry:"]
            .iter()
            .any(|field| line.starts_with(field))
}

/// Passes a replica's body through chunk by chunk, pulling the next chunk only when the client
/// takes the last (backpressure). Dropping it (the client left) drops the upstream connection,
/// which is how the replica learns to abort. A stream that breaks ends with an SSE error event,
/// as the frontend's own streams do; any other body is cut, so the client sees it incomplete.
struct Relay {
    pending: Option<Bytes>,
    upstream: Incoming,
    sse: bool,
    /// The last two bytes sent: an error event must start at an event boundary.
    tail: [u8; 2],
    finished: bool,
    outstanding: Outstanding,
    metrics: Arc<Metrics>,
}

impl Relay {
    fn into_body(self) -> Body {
        Body::from_stream(futures::stream::unfold(self, |mut relay| async move {
            let chunk = relay.next_chunk().await?;
            Some((chunk, relay))
        }))
    }

    async fn next_chunk(&mut self) -> Option<Result<Bytes, std::io::Error>> {
        if let Some(first) = self.pending.take() {
            self.remember_tail(&first);
            return Some(Ok(first));
        }
        while !self.finished {
            match self.upstream.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        if !data.is_empty() {
                            self.remember_tail(&data);
                            return Some(Ok(data));
                        }
                    }
                }
                Some(Err(error)) => {
                    self.finished = true;
                    return Some(self.broke(&error.to_string()));
                }
                None => self.finished = true,
            }
        }
        None
    }

    fn remember_tail(&mut self, data: &[u8]) {
        match data {
            [.., a, b] => self.tail = [*a, *b],
            [b] => self.tail = [self.tail[1], *b],
            [] => {}
        }
    }

    fn broke(&mut self, error: &str) -> Result<Bytes, std::io::Error> {
        let replica = self.outstanding.replica().id.clone();
        eprintln!("sluice-router: {replica} broke mid-stream: {error}");
        self.metrics.error(&replica);
        if self.outstanding.failed() {
            self.metrics.ejection(&replica);
        }
        if !self.sse {
            return Err(std::io::Error::other(format!("{replica} broke mid-answer")));
        }
        Ok(stream_error_event(&replica, error, self.tail != *b"\n\n"))
    }
}

/// OpenAI's error object as the stream's last event; the status line has already gone out.
fn stream_error_event(replica: &ReplicaId, error: &str, close_open_event: bool) -> Bytes {
    let body = serde_json::json!({"error": {
        "message": format!("the replica {replica} failed mid-stream: {error}"),
        "type": "server_error",
        "param": null,
        "code": "replica_failed",
    }});
    let separator = if close_open_event { "\n\n" } else { "" };
    Bytes::from(format!("{separator}data: {body}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_starts_are_recognised_and_garbage_is_not() {
        assert!(starts_like_sse(b"data: {\"id\":1}\n\n"));
        assert!(starts_like_sse(b": keep-alive\n\n"));
        assert!(starts_like_sse(b"event: error\ndata: {}\n\n"));
        assert!(!starts_like_sse(b"<html>oops</html>"));
        assert!(!starts_like_sse(b"{\"id\": 1}"));
        assert!(!starts_like_sse(b"dat"));
    }

    #[test]
    fn a_mid_stream_error_is_one_openai_error_event_at_an_event_boundary() {
        let replica = ReplicaId("http://a:1".into());
        let event = stream_error_event(&replica, "connection reset", false);
        let text = std::str::from_utf8(&event).unwrap();
        let json = text
            .strip_prefix("data: ")
            .and_then(|rest| rest.strip_suffix("\n\n"))
            .unwrap();
        let value: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(value["error"]["type"], "server_error");
        assert_eq!(value["error"]["code"], "replica_failed");
        assert!(value["error"]["message"]
            .as_str()
            .unwrap()
            .contains("connection reset"));
        let closing = stream_error_event(&replica, "x", true);
        assert!(closing.starts_with(b"\n\ndata: "));
    }
}

//! Server-Sent Events framing and sequencing of streams: the opening events, one event per update,
//! then the closing events; or an error event for a stream that fails after its first byte. OpenAI's
//! streams are `data: <json>\n\n` events that end with `data: [DONE]\n\n`; Anthropic's name each
//! event and end with their own `message_stop` ([`StreamDialect`]).

use std::collections::HashMap;

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::{BufMut, Bytes, BytesMut};
use futures::stream::{self, BoxStream};
use futures::{Stream, StreamExt};
use serde::Serialize;

use crate::api::error::ApiError;
use crate::api::fan_out::{cached_prompt_tokens, Choices};
use crate::text::choice_stream::ChoiceUpdate;
use sluice_common::schema::openai::Usage;

pub const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";

/// One event carrying `value` as compact JSON. serde_json's compact output
/// escapes every control character inside strings, so the data line never
/// contains a raw newline that would split the event.
pub fn data_event<T: Serialize + ?Sized>(value: &T) -> Result<Bytes, serde_json::Error> {
    let mut buf = BytesMut::with_capacity(256).writer();
    std::io::Write::write_all(&mut buf, b"data: ").expect("writing to memory");
    serde_json::to_writer(&mut buf, value)?;
    let mut buf = buf.into_inner();
    buf.put_slice(b"\n\n");
    Ok(buf.freeze())
}

/// A data event for a chunk that always serializes.
pub fn chunk_event<T: Serialize>(chunk: &T) -> Bytes {
    data_event(chunk).expect("response chunks always serialize")
}

pub fn done_event() -> Bytes {
    Bytes::from_static(DONE_EVENT)
}

/// The event that ends a stream which fails mid-way: OpenAI's error object,
/// `data: {"error": {...}}`, since the status line has already gone out.
pub fn error_event(error: &ApiError) -> Bytes {
    data_event(&error.body()).expect("an error body always serializes")
}

/// How a stream of one API fails and ends.
#[derive(Debug, Clone, Copy)]
pub struct StreamDialect {
    /// The event that reports a failure mid-stream.
    pub error_event: fn(&ApiError) -> Bytes,
    /// The event after everything else, success or failure, if the API has one.
    pub last_event: Option<&'static [u8]>,
}

/// OpenAI's: an error object as data, then `[DONE]` in every case.
pub const OPENAI_STREAM: StreamDialect = StreamDialect {
    error_event,
    last_event: Some(DONE_EVENT),
};

/// A 200 response streaming already-framed events.
pub fn event_stream_response<S>(events: S) -> Response
where
    S: Stream<Item = Bytes> + Send + 'static,
{
    let body = Body::from_stream(events.map(Ok::<_, std::convert::Infallible>));
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::OK;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// Each choice's counts at its latest update, by choice index: what a stream's closing usage is
/// made of.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ChoiceTotals {
    pub completion_tokens: HashMap<u32, u32>,
    /// Only with a reasoning parser.
    pub reasoning_tokens: HashMap<u32, u32>,
    pub cached_tokens: HashMap<u32, u32>,
}

impl ChoiceTotals {
    /// The usage of the whole stream, for `n` choices per prompt.
    pub fn usage(self, prompt_tokens: u32, n: u32) -> Usage {
        let completion_tokens = self.completion_tokens.values().sum();
        let cached = cached_prompt_tokens(self.cached_tokens, n);
        let reasoning_tokens =
            (!self.reasoning_tokens.is_empty()).then(|| self.reasoning_tokens.values().sum());
        Usage::new(prompt_tokens, completion_tokens)
            .with_cached_tokens(cached)
            .with_reasoning_tokens(reasoning_tokens)
    }
}

/// The SSE events of a streamed response: `opening` first, one event per update (framed by
/// `frame`), then on success `closing` (given each choice's totals; the usage chunk), or on failure
/// the dialect's error event; then the dialect's last event (`[DONE]`). Dropping the stream (a
/// client that went away) drops the updates and so aborts their engine requests.
pub fn sse_events<F, C>(
    dialect: StreamDialect,
    opening: Vec<Bytes>,
    updates: BoxStream<'static, Result<ChoiceUpdate, ApiError>>,
    frame: F,
    closing: C,
) -> impl Stream<Item = Bytes> + Send + 'static
where
    F: FnMut(ChoiceUpdate) -> Bytes + Send + 'static,
    C: FnOnce(ChoiceTotals) -> Option<Bytes> + Send + 'static,
{
    struct Events<F, C> {
        updates: BoxStream<'static, Result<ChoiceUpdate, ApiError>>,
        frame: F,
        closing: Option<C>,
        totals: ChoiceTotals,
    }
    let events = Events {
        updates,
        frame,
        closing: Some(closing),
        totals: ChoiceTotals::default(),
    };
    let body = stream::unfold(events, move |mut events| async move {
        let closing = events.closing.take()?;
        let last = dialect.last_event.map(Bytes::from_static);
        let batch = match events.updates.next().await {
            Some(Ok(update)) => {
                let totals = &mut events.totals;
                totals
                    .completion_tokens
                    .insert(update.index, update.completion_tokens);
                if let Some(reasoning_tokens) = update.reasoning_tokens {
                    totals
                        .reasoning_tokens
                        .insert(update.index, reasoning_tokens);
                }
                totals
                    .cached_tokens
                    .insert(update.index, update.num_cached_tokens);
                events.closing = Some(closing);
                vec![(events.frame)(update)]
            }
            Some(Err(error)) => std::iter::once((dialect.error_event)(&error))
                .chain(last)
                .collect(),
            None => closing(std::mem::take(&mut events.totals))
                .into_iter()
                .chain(last)
                .collect(),
        };
        Some((stream::iter(batch), events))
    })
    .flatten();
    stream::iter(opening).chain(body)
}

/// The response of a stream whose last update's frame ends it (Anthropic's `message_stop`, the
/// Responses API's `response.completed`): nothing is sent after the updates but on failure.
pub async fn self_closing_stream<F>(
    dialect: StreamDialect,
    opening: Vec<Bytes>,
    choices: Choices,
    frame: F,
) -> Result<Response, ApiError>
where
    F: FnMut(ChoiceUpdate) -> Bytes + Send + 'static,
{
    let updates = choices.stream_updates().await?;
    let closing = |_: ChoiceTotals| None;
    Ok(event_stream_response(sse_events(
        dialect, opening, updates, frame, closing,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn data_event_is_one_compact_json_line() {
        #[derive(Serialize)]
        struct Chunk {
            id: &'static str,
            choices: Vec<serde_json::Value>,
        }
        let chunk = Chunk {
            id: "cmpl-1",
            choices: vec![json!({"text": "hi"})],
        };
        assert_eq!(
            &data_event(&chunk).unwrap()[..],
            b"data: {\"id\":\"cmpl-1\",\"choices\":[{\"text\":\"hi\"}]}\n\n"
        );
    }

    #[test]
    fn newlines_in_text_are_escaped_not_raw() {
        let event = data_event(&json!({"text": "a\nb\r\nc\u{2028}"})).unwrap();
        assert_eq!(
            &event[..],
            "data: {\"text\":\"a\\nb\\r\\nc\u{2028}\"}\n\n".as_bytes()
        );
        let body = &event[..event.len() - 2];
        assert!(!body.contains(&b'\n') && !body.contains(&b'\r'));
    }

    #[test]
    fn done_is_the_literal_marker() {
        assert_eq!(&done_event()[..], b"data: [DONE]\n\n");
    }

    #[test]
    fn error_event_carries_openai_error_object() {
        let event = error_event(&ApiError::EngineUnavailable("engine core died".into()));
        assert_eq!(
            &event[..],
            b"data: {\"error\":{\"message\":\"the engine is not available: engine core died\",\
\"type\":\"server_error\",\"param\":null,\"code\":\"engine_unavailable\"}}\n\n"
        );
    }

    #[tokio::test]
    async fn response_streams_events_as_event_stream() {
        let events = futures::stream::iter([data_event(&json!({"n": 1})).unwrap(), done_event()]);
        let response = event_stream_response(events);
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "text/event-stream"
        );
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        assert_eq!(&body[..], b"data: {\"n\":1}\n\ndata: [DONE]\n\n");
    }

    fn update(index: u32, text: &str, completion_tokens: u32) -> Result<ChoiceUpdate, ApiError> {
        Ok(ChoiceUpdate {
            index,
            text: text.into(),
            logprobs: Vec::new(),
            finish_reason: None,
            completion_tokens,
            reasoning_tokens: None,
            cumulative_logprob: 0.0,
            prefix_chars: 0,
            prompt_logprobs: None,
            token_ids: Vec::new(),
            num_cached_tokens: index * 16,
            stop_string: None,
            embedding: None,
        })
    }

    async fn events_of(updates: Vec<Result<ChoiceUpdate, ApiError>>) -> Vec<Bytes> {
        let events = sse_events(
            OPENAI_STREAM,
            vec![Bytes::from_static(b"open")],
            futures::stream::iter(updates).boxed(),
            |update| Bytes::from(update.text),
            |totals: ChoiceTotals| {
                let total: u32 = totals.completion_tokens.values().sum();
                let cached: u32 = totals.cached_tokens.values().sum();
                Some(Bytes::from(format!("usage {total} cached {cached}")))
            },
        );
        events.collect().await
    }

    #[tokio::test]
    async fn events_open_then_frame_each_update_then_close_with_the_token_total() {
        let events = events_of(vec![
            update(0, "a", 1),
            update(1, "b", 2),
            update(0, "c", 3),
        ])
        .await;
        // Choice 0's latest count (3) and choice 1's (2); cached: 0 and 16, one per choice.
        let expected: Vec<Bytes> = ["open", "a", "b", "c", "usage 5 cached 16"]
            .into_iter()
            .map(Bytes::from)
            .chain([done_event()])
            .collect();
        assert_eq!(events, expected);
    }

    #[tokio::test]
    async fn a_failed_stream_ends_with_its_error_event_then_done() {
        let error = ApiError::EngineUnavailable("gone".into());
        let events = events_of(vec![
            update(0, "a", 1),
            Err(error.clone()),
            update(0, "b", 2),
        ])
        .await;
        assert_eq!(
            events,
            [
                Bytes::from("open"),
                Bytes::from("a"),
                error_event(&error),
                done_event()
            ]
        );
    }
}

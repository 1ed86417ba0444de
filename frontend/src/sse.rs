//! Server-Sent Events framing of OpenAI streams: one `data: <json>\n\n` event
//! per chunk, a final `data: [DONE]\n\n`, and an error event for a stream
//! that fails after its first byte.

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::{BufMut, Bytes, BytesMut};
use futures::Stream;
use serde::Serialize;

use crate::api_error::ApiError;

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

pub fn done_event() -> Bytes {
    Bytes::from_static(DONE_EVENT)
}

/// The event that ends a stream which fails mid-way: OpenAI's error object,
/// `data: {"error": {...}}`, since the status line has already gone out.
pub fn error_event(error: &ApiError) -> Bytes {
    data_event(&error.body()).expect("an error body always serializes")
}

/// A 200 response streaming already-framed events.
pub fn event_stream_response<S>(events: S) -> Response
where
    S: Stream<Item = Bytes> + Send + 'static,
{
    use futures::StreamExt;
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
}

//! Anthropic's `POST /v1/messages` and `POST /v1/messages/count_tokens`. A Messages request is
//! translated into a chat request (`messages_request`) and served by chat's pipeline: its one
//! prepare, the fan-out, the tool-call parsers. The answer is Anthropic's message, or its stream of
//! named events (`message_start`, content blocks, `message_delta`, `message_stop`). Errors take
//! Anthropic's shape in `sluice_common::error_dialect`.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::{BufMut, Bytes, BytesMut};
use serde_json::Value;

use crate::api::error::ApiError;
use crate::api::fan_out::{ChoiceResult, Choices, ResponseHeader};
use crate::api::generation::GenerationEndpoint;
use crate::api::messages_request::{chat_conversation, chat_request, Ignored, Translated};
use crate::api::prepare;
use crate::api::request_fields::with_ignored_fields;
use crate::api::sse::{self_closing_stream, StreamDialect};
use crate::api::valid_request::ValidRequest;
use crate::state::AppState;
use crate::text::answer_parts::{AnswerPart, AnswerStream, WholeAnswer};
use crate::text::choice_stream::ChoiceUpdate;
use sluice_common::schema::anthropic::{
    BlockDelta, CountTokensRequest, CountTokensResponse, ErrorDetail, MessageDelta,
    MessagesRequest, MessagesResponse, ResponseBlock, StreamEvent, Usage as AnthropicUsage,
};
use sluice_common::schema::openai::Usage;

/// The endpoint for `generation::create`.
pub struct Messages;

impl GenerationEndpoint for Messages {
    type Request = MessagesRequest;
    type Answer = MessagesResponse;
    type Context = ();
    const ID_PREFIX: &'static str = "msg";

    async fn prepare(
        state: &AppState,
        request: MessagesRequest,
        _headers: &HeaderMap,
    ) -> Result<(ValidRequest, ()), ApiError> {
        let Translated {
            chat,
            ignored_fields,
        } = chat_request(request, state.config.reasoning_parser.is_some())?;
        let mut valid = prepare::chat(state, chat).await?;
        valid.ignored_fields.extend(ignored_fields);
        Ok((valid, ()))
    }

    fn whole(
        header: ResponseHeader,
        results: Vec<ChoiceResult>,
        usage: Usage,
        request: &ValidRequest,
        _context: (),
    ) -> MessagesResponse {
        assert_eq!(results.len(), 1, "a Messages request has one choice");
        let result = results.into_iter().next().expect("one choice");
        let WholeAnswer {
            thinking,
            text,
            calls,
        } = request.answer_of(result.text);
        let thinking = thinking.map(|thinking| ResponseBlock::Thinking {
            thinking,
            signature: String::new(),
        });
        let text = text
            .filter(|text| !text.is_empty())
            .map(|text| ResponseBlock::Text { text });
        let mut content: Vec<ResponseBlock> = thinking.into_iter().chain(text).collect();
        let made_calls = !calls.is_empty();
        content.extend(calls.into_iter().map(|call| ResponseBlock::ToolUse {
            id: call.id,
            name: call.function.name,
            input: tool_input(&call.function.arguments),
        }));
        let cached = usage.prompt_tokens_details.map_or(0, |d| d.cached_tokens);
        MessagesResponse {
            content,
            stop_reason: Some(stop_reason(
                result.finish_reason,
                result.stop_string.is_some(),
                made_calls,
            )),
            stop_sequence: result.stop_string,
            usage: AnthropicUsage::new(usage.prompt_tokens, cached, usage.completion_tokens),
            ..message(header, 0)
        }
    }

    async fn stream(
        choices: Choices,
        prompt_tokens: u32,
        request: &ValidRequest,
        _context: (),
    ) -> Result<Response, ApiError> {
        let opening = vec![
            event(&StreamEvent::MessageStart {
                message: message(choices.header.clone(), prompt_tokens),
            }),
            event(&StreamEvent::Ping),
        ];
        let mut answer = AnswerStream::new(
            request.reasoning_starts_thinking,
            request.tool_calls.clone(),
        );
        let mut blocks = BlockStream::default();
        let frame = move |update: ChoiceUpdate| {
            let finished = update.finish_reason.is_some();
            let mut events = Vec::new();
            for part in answer.push(&update.text, finished) {
                blocks.part(part, &mut events);
            }
            let made_calls = answer.made_calls();
            if let Some(reason) = update.finish_reason {
                blocks.close(&mut events);
                events.push(StreamEvent::MessageDelta {
                    delta: MessageDelta {
                        stop_reason: stop_reason(reason, update.stop_string.is_some(), made_calls),
                        stop_sequence: update.stop_string,
                    },
                    usage: AnthropicUsage::new(
                        prompt_tokens,
                        update.num_cached_tokens,
                        update.completion_tokens,
                    ),
                });
                events.push(StreamEvent::MessageStop);
            }
            let frames: Vec<Bytes> = events.iter().map(event).collect();
            Bytes::from(frames.concat())
        };
        self_closing_stream(ANTHROPIC_STREAM, opening, choices, frame).await
    }
}

/// `POST /v1/messages/count_tokens`: the prompt tokens of the Messages request with this
/// conversation, counted by the same translation and rendering.
pub async fn count_tokens(
    State(state): State<Arc<AppState>>,
    body: Result<Json<CountTokensRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(request) = body?;
    let mut ignored = Ignored::default();
    let mut chat = chat_conversation(
        request.model,
        request.conversation,
        state.config.reasoning_parser.is_some(),
        &mut ignored,
    )?;
    chat.other_fields = request.other_fields;
    let mut valid = prepare::chat(&state, chat).await?;
    valid.ignored_fields.extend(ignored.into_names());
    let counted = CountTokensResponse {
        input_tokens: valid.prompt_tokens(),
    };
    Ok(with_ignored_fields(
        Json(counted).into_response(),
        &valid.ignored_fields,
    ))
}

/// Anthropic's streams: a named `error` event on failure, and nothing after `message_stop`.
const ANTHROPIC_STREAM: StreamDialect = StreamDialect {
    error_event: |error| {
        event(&StreamEvent::Error {
            error: ErrorDetail::new(error.status(), error.to_string()),
        })
    },
    last_event: None,
};

/// One SSE event: `event: <type>` and the event as compact JSON (which escapes every newline).
fn event(event: &StreamEvent) -> Bytes {
    let mut buf = BytesMut::with_capacity(128);
    buf.put_slice(b"event: ");
    buf.put_slice(event.name().as_bytes());
    buf.put_slice(b"\ndata: ");
    let mut writer = buf.writer();
    serde_json::to_writer(&mut writer, event).expect("stream events always serialize");
    let mut buf = writer.into_inner();
    buf.put_slice(b"\n\n");
    buf.freeze()
}

/// A message with no content yet, as `message_start` carries it.
fn message(header: ResponseHeader, prompt_tokens: u32) -> MessagesResponse {
    MessagesResponse {
        id: header.id,
        kind: "message",
        role: "assistant",
        model: header.model,
        content: Vec::new(),
        stop_reason: None,
        stop_sequence: None,
        usage: AnthropicUsage::new(prompt_tokens, 0, 0),
    }
}

/// Anthropic's `stop_reason` for the engine's finish reason.
fn stop_reason(finish_reason: &str, by_stop_string: bool, made_calls: bool) -> &'static str {
    match finish_reason {
        "length" => "max_tokens",
        _ if made_calls => "tool_use",
        _ if by_stop_string => "stop_sequence",
        _ => "end_turn",
    }
}

/// A call's arguments as the `input` object; arguments that are not JSON (a model that wrote a
/// string) are passed on as that string rather than lost.
fn tool_input(arguments: &str) -> Value {
    serde_json::from_str(arguments).unwrap_or_else(|_| Value::String(arguments.to_owned()))
}

/// The content blocks of a streamed message: numbered in order, one open at a time (thinking,
/// text, or one tool call whose arguments arrive as JSON pieces).
#[derive(Default)]
struct BlockStream {
    opened: u32,
    open: Option<(u32, BlockKind)>,
    /// Each call's block, by the call's index.
    call_blocks: HashMap<u32, u32>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum BlockKind {
    Thinking,
    Text,
    Call,
}

impl BlockStream {
    fn start(&mut self, content_block: ResponseBlock, events: &mut Vec<StreamEvent>) -> u32 {
        self.close(events);
        let index = self.opened;
        self.opened += 1;
        let kind = match content_block {
            ResponseBlock::Thinking { .. } => BlockKind::Thinking,
            ResponseBlock::Text { .. } => BlockKind::Text,
            ResponseBlock::ToolUse { .. } => BlockKind::Call,
        };
        self.open = Some((index, kind));
        events.push(StreamEvent::ContentBlockStart {
            index,
            content_block,
        });
        index
    }

    fn close(&mut self, events: &mut Vec<StreamEvent>) {
        if let Some((index, _)) = self.open.take() {
            events.push(StreamEvent::ContentBlockStop { index });
        }
    }

    /// One part of the answer: more thinking or text (in the open block of its kind, or a new
    /// one), a call's block, or more of its arguments.
    fn part(&mut self, part: AnswerPart, events: &mut Vec<StreamEvent>) {
        match part {
            AnswerPart::Thinking(thinking) => self.prose(BlockKind::Thinking, thinking, events),
            AnswerPart::Text(text) => self.prose(BlockKind::Text, text, events),
            AnswerPart::CallOpened { call, id, name } => self.open_call(call, id, name, events),
            AnswerPart::CallArguments { call, json } => self.call_arguments(call, json, events),
        }
    }

    fn prose(&mut self, kind: BlockKind, piece: String, events: &mut Vec<StreamEvent>) {
        if piece.is_empty() {
            return;
        }
        let (empty, delta) = match kind {
            BlockKind::Thinking => (
                ResponseBlock::Thinking {
                    thinking: String::new(),
                    signature: String::new(),
                },
                BlockDelta::ThinkingDelta { thinking: piece },
            ),
            BlockKind::Text => (
                ResponseBlock::Text {
                    text: String::new(),
                },
                BlockDelta::TextDelta { text: piece },
            ),
            BlockKind::Call => unreachable!("a call grows by its arguments"),
        };
        let index = match self.open {
            Some((index, open)) if open == kind => index,
            _ => self.start(empty, events),
        };
        events.push(StreamEvent::ContentBlockDelta { index, delta });
    }

    fn open_call(&mut self, call: u32, id: String, name: String, events: &mut Vec<StreamEvent>) {
        let input = Value::Object(Default::default());
        let index = self.start(ResponseBlock::ToolUse { id, name, input }, events);
        self.call_blocks.insert(call, index);
    }

    fn call_arguments(&mut self, call: u32, json: String, events: &mut Vec<StreamEvent>) {
        if json.is_empty() {
            return;
        }
        let index = self.call_blocks[&call];
        // The parsers finish a call's arguments before they name the next call.
        assert!(
            self.open == Some((index, BlockKind::Call)),
            "arguments for a closed call"
        );
        events.push(StreamEvent::ContentBlockDelta {
            index,
            delta: BlockDelta::InputJsonDelta { partial_json: json },
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::answer_parts::sample_parts;
    use serde_json::json;

    fn json_of(events: &[StreamEvent]) -> Vec<Value> {
        events
            .iter()
            .map(|event| serde_json::to_value(event).unwrap())
            .collect()
    }

    #[test]
    fn blocks_open_in_order_and_each_closes_before_the_next() {
        let mut blocks = BlockStream::default();
        let mut events = Vec::new();
        let second_call = AnswerPart::CallOpened {
            call: 1,
            id: "call_2".into(),
            name: "g".into(),
        };
        for part in sample_parts().into_iter().chain([second_call]) {
            blocks.part(part, &mut events);
        }
        blocks.close(&mut events);
        blocks.close(&mut events);
        assert_eq!(
            json_of(&events),
            [
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
                json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Hmm."}}),
                json!({"type": "content_block_stop", "index": 0}),
                json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
                json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Let me "}}),
                json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "check."}}),
                json!({"type": "content_block_stop", "index": 1}),
                json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "call_1", "name": "f", "input": {}}}),
                json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"a\":"}}),
                json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "1}"}}),
                json!({"type": "content_block_stop", "index": 2}),
                json!({"type": "content_block_start", "index": 3, "content_block": {"type": "tool_use", "id": "call_2", "name": "g", "input": {}}}),
                json!({"type": "content_block_stop", "index": 3}),
            ]
        );
    }

    #[test]
    fn an_event_names_its_type_and_carries_one_json_line() {
        let bytes = event(&StreamEvent::ContentBlockDelta {
            index: 0,
            delta: BlockDelta::TextDelta {
                text: "a\nb".into(),
            },
        });
        assert_eq!(
            &bytes[..],
            b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\
\"delta\":{\"type\":\"text_delta\",\"text\":\"a\\nb\"}}\n\n"
        );
        let error = (ANTHROPIC_STREAM.error_event)(&ApiError::Internal("boom".into()));
        assert_eq!(
            &error[..],
            b"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\",\
\"message\":\"internal error: boom\"}}\n\n"
        );
    }

    #[test]
    fn stop_reasons_follow_anthropics_names() {
        assert_eq!(stop_reason("length", false, true), "max_tokens");
        assert_eq!(stop_reason("stop", true, true), "tool_use");
        assert_eq!(stop_reason("stop", true, false), "stop_sequence");
        assert_eq!(stop_reason("stop", false, false), "end_turn");
        assert_eq!(tool_input("{\"a\": 1}"), json!({"a": 1}));
        assert_eq!(tool_input("not json"), json!("not json"));
    }
}

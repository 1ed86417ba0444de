//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): its request,
//! response, stream event and error bodies. The frontend serves them by translating a request to a
//! chat request (`frontend/src/api/messages.rs`); the router passes them through.
//!
//! As the OpenAI types, requests are strict about types and keep unknown fields for the handler to
//! refuse or report.

use std::collections::BTreeMap;

use axum::http::StatusCode;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::schema::whole_number;

/// What a Messages request and a count_tokens request both carry: the conversation and its tools.
#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
pub struct Conversation {
    /// `{"role": "user" | "assistant", "content": string | blocks}`; blocks of type text,
    /// tool_use (assistant) and tool_result (user).
    #[schema(value_type = Vec<Object>, min_items = 1)]
    pub messages: Vec<Message>,
    /// A string, or text blocks.
    #[schema(value_type = Option<Object>)]
    pub system: Option<System>,
    /// Client tools: `{"name", "description", "input_schema"}`.
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<ToolDefinition>>,
    /// `{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}`.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<ToolChoice>,
    /// Thinking: `enabled` with `budget_tokens` (under `--reasoning-parser`: the thinking is cut
    /// at the budget), `disabled` and `adaptive` (the model decides); see the handler.
    #[schema(value_type = Option<Object>)]
    pub thinking: Option<Value>,
}

/// `POST /v1/messages`.
#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
pub struct MessagesRequest {
    pub model: String,
    #[serde(flatten)]
    pub conversation: Conversation,
    /// Required by Anthropic's API; the handler says so when it is missing.
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub max_tokens: Option<u32>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f64>,
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub top_k: Option<i64>,
    pub top_p: Option<f64>,
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Metadata>,
    pub stream: Option<bool>,
    /// `auto` or `standard_only`: there is one tier here, so either is served as asked.
    pub service_tier: Option<String>,
    /// `standard` or `fast`: there is one speed here, the fastest this server has.
    pub speed: Option<String>,
    /// The output's JSON schema (structured output) and the effort asked for.
    #[schema(value_type = Option<Object>)]
    pub output_config: Option<OutputConfig>,
    /// Asks Anthropic to cache the prompt up to its last block: here every prefix is cached
    /// without being asked (prefix caching), so it is served as it is.
    #[schema(value_type = Option<Object>)]
    pub cache_control: Option<Value>,
    /// A code-execution container: refused unless null.
    #[schema(value_type = Option<Object>)]
    pub container: Option<Value>,
    #[serde(flatten)]
    #[schema(ignore)]
    pub other_fields: BTreeMap<String, Value>,
}

/// `POST /v1/messages/count_tokens`.
#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
pub struct CountTokensRequest {
    pub model: String,
    #[serde(flatten)]
    pub conversation: Conversation,
    #[serde(flatten)]
    #[schema(ignore)]
    pub other_fields: BTreeMap<String, Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CountTokensResponse {
    pub input_tokens: u32,
}

/// `output_config`: `{"format": {"type": "json_schema", "schema": {...}}, "effort": "..."}`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct OutputConfig {
    pub format: Option<OutputFormat>,
    /// low, medium, high, xhigh or max: passed to the chat template as `reasoning_effort`.
    pub effort: Option<String>,
    #[serde(flatten)]
    pub other_fields: BTreeMap<String, Value>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct OutputFormat {
    /// Only `json_schema`.
    #[serde(rename = "type")]
    pub kind: String,
    pub schema: Option<Value>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Metadata {
    /// An opaque id of the end user: passed on as chat's `user`.
    pub user_id: Option<String>,
    #[serde(flatten)]
    pub other_fields: BTreeMap<String, Value>,
}

/// `system`: a string, or text blocks.
#[derive(Debug, Clone, PartialEq)]
pub enum System {
    Text(String),
    Blocks(Vec<ContentBlock>),
}

impl<'de> Deserialize<'de> for System {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        text_or_blocks(deserializer, System::Text, System::Blocks)
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Message {
    /// `user` or `assistant`.
    pub role: String,
    pub content: Content,
}

/// A message's content: a string, or content blocks.
#[derive(Debug, Clone, PartialEq)]
pub enum Content {
    Text(String),
    Blocks(Vec<ContentBlock>),
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        text_or_blocks(deserializer, Content::Text, Content::Blocks)
    }
}

/// A string or an array of blocks, with the blocks' own error (an untagged enum would say only
/// that nothing matched).
fn text_or_blocks<'de, D, T>(
    deserializer: D,
    text: fn(String) -> T,
    blocks: fn(Vec<ContentBlock>) -> T,
) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
{
    match Value::deserialize(deserializer)? {
        Value::String(value) => Ok(text(value)),
        value @ Value::Array(_) => serde_json::from_value(value)
            .map(blocks)
            .map_err(D::Error::custom),
        other => Err(D::Error::custom(format!(
            "expected a string or an array of content blocks, got {other}"
        ))),
    }
}

/// One content block of a request. Blocks of kinds this server cannot take are read so that the
/// handler can refuse them by name.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlock {
    Text {
        text: String,
        /// `cache_control` (a caching hint) and `citations`: see the handler.
        #[serde(flatten)]
        other_fields: BTreeMap<String, Value>,
    },
    ToolUse {
        id: String,
        name: String,
        input: Value,
        #[serde(flatten)]
        other_fields: BTreeMap<String, Value>,
    },
    ToolResult {
        tool_use_id: String,
        content: Option<ToolResultContent>,
        is_error: Option<bool>,
        #[serde(flatten)]
        other_fields: BTreeMap<String, Value>,
    },
    Image(Value),
    Document(Value),
    Thinking(Value),
    RedactedThinking(Value),
}

impl ContentBlock {
    /// The block's `type`, as the request wrote it.
    pub fn kind(&self) -> &'static str {
        match self {
            ContentBlock::Text { .. } => "text",
            ContentBlock::ToolUse { .. } => "tool_use",
            ContentBlock::ToolResult { .. } => "tool_result",
            ContentBlock::Image(_) => "image",
            ContentBlock::Document(_) => "document",
            ContentBlock::Thinking(_) => "thinking",
            ContentBlock::RedactedThinking(_) => "redacted_thinking",
        }
    }
}

/// A tool result's content: a string, or blocks (of which text is served).
#[derive(Debug, Clone, PartialEq)]
pub enum ToolResultContent {
    Text(String),
    Blocks(Vec<ContentBlock>),
}

impl<'de> Deserialize<'de> for ToolResultContent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        text_or_blocks(
            deserializer,
            ToolResultContent::Text,
            ToolResultContent::Blocks,
        )
    }
}

/// One entry of `tools`: a client tool (no `type`, or `custom`) with its input's JSON schema.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ToolDefinition {
    /// Anthropic's server tools (`web_search_...`, `bash_...`) have a dated type: refused.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub name: String,
    pub description: Option<String>,
    pub input_schema: Option<Value>,
    #[serde(flatten)]
    pub other_fields: BTreeMap<String, Value>,
}

/// `tool_choice`: `{"type": "auto" | "any" | "tool" | "none"}`, `name` with `tool`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ToolChoice {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: Option<String>,
    pub disable_parallel_tool_use: Option<bool>,
}

/// The answer of `POST /v1/messages`, and the message of a stream's `message_start`.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct MessagesResponse {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub role: &'static str,
    pub model: String,
    pub content: Vec<ResponseBlock>,
    pub stop_reason: Option<&'static str>,
    pub stop_sequence: Option<String>,
    pub usage: Usage,
}

#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseBlock {
    /// With `--reasoning-parser`: the model's thinking. No signature is made here (it is empty):
    /// a thinking block sent back in a later request's assistant message is accepted and left out
    /// of the prompt, as Anthropic leaves earlier turns' thinking out.
    Thinking {
        thinking: String,
        signature: String,
    },
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        #[schema(value_type = Object)]
        input: Value,
    },
}

/// Anthropic's counts: `input_tokens` are the prompt tokens the prefix cache did not serve, and
/// `cache_read_input_tokens` those it did. Nothing is written to a cache on request here, so
/// `cache_creation_input_tokens` is 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[schema(as = AnthropicUsage)]
pub struct Usage {
    pub input_tokens: u32,
    pub output_tokens: u32,
    pub cache_read_input_tokens: u32,
    pub cache_creation_input_tokens: u32,
}

impl Usage {
    pub fn new(prompt_tokens: u32, cached_tokens: u32, output_tokens: u32) -> Self {
        Usage {
            input_tokens: prompt_tokens.saturating_sub(cached_tokens),
            output_tokens,
            cache_read_input_tokens: cached_tokens,
            cache_creation_input_tokens: 0,
        }
    }
}

/// A stream's events, each sent as `event: <type>` with its JSON as data.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    MessageStart {
        message: MessagesResponse,
    },
    Ping,
    ContentBlockStart {
        index: u32,
        content_block: ResponseBlock,
    },
    ContentBlockDelta {
        index: u32,
        delta: BlockDelta,
    },
    ContentBlockStop {
        index: u32,
    },
    MessageDelta {
        delta: MessageDelta,
        usage: Usage,
    },
    MessageStop,
    Error {
        error: ErrorDetail,
    },
}

impl StreamEvent {
    /// The event's `type`, which its SSE `event:` line names too.
    pub fn name(&self) -> &'static str {
        match self {
            StreamEvent::MessageStart { .. } => "message_start",
            StreamEvent::Ping => "ping",
            StreamEvent::ContentBlockStart { .. } => "content_block_start",
            StreamEvent::ContentBlockDelta { .. } => "content_block_delta",
            StreamEvent::ContentBlockStop { .. } => "content_block_stop",
            StreamEvent::MessageDelta { .. } => "message_delta",
            StreamEvent::MessageStop => "message_stop",
            StreamEvent::Error { .. } => "error",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BlockDelta {
    ThinkingDelta { thinking: String },
    TextDelta { text: String },
    InputJsonDelta { partial_json: String },
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MessageDelta {
    pub stop_reason: &'static str,
    pub stop_sequence: Option<String>,
}

/// Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
#[schema(as = AnthropicErrorResponse)]
pub struct ErrorResponse {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
#[schema(as = AnthropicErrorDetail)]
pub struct ErrorDetail {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub message: String,
}

impl ErrorDetail {
    /// Anthropic's error type for an HTTP status.
    pub fn new(status: StatusCode, message: String) -> Self {
        let kind = match status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            500..=599 => "api_error",
            _ => "invalid_request_error",
        };
        ErrorDetail { kind, message }
    }
}

impl ErrorResponse {
    pub fn new(status: StatusCode, message: String) -> Self {
        ErrorResponse {
            kind: "error",
            error: ErrorDetail::new(status, message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_request_reads_strings_and_blocks_and_keeps_unknown_fields() {
        let request: MessagesRequest = serde_json::from_value(json!({
            "model": "m", "max_tokens": 16, "system": [{"type": "text", "text": "be brief",
            "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                 "input": {"a": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                 "content": "42"}]}
            ],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "auto"},
            "frobnicate": true
        }))
        .unwrap();
        assert_eq!(request.max_tokens, Some(16));
        let conversation = &request.conversation;
        assert_eq!(conversation.messages[0].content, Content::Text("hi".into()));
        let Some(System::Blocks(system)) = &conversation.system else {
            panic!("{:?}", conversation.system)
        };
        assert!(
            matches!(&system[0], ContentBlock::Text { text, other_fields }
            if text == "be brief" && other_fields.contains_key("cache_control"))
        );
        assert!(matches!(
            &conversation.messages[2].content,
            Content::Blocks(blocks) if matches!(&blocks[0], ContentBlock::ToolResult {
                content: Some(ToolResultContent::Text(text)), .. } if text == "42")
        ));
        assert_eq!(
            request.other_fields.keys().collect::<Vec<_>>(),
            ["frobnicate"]
        );
    }

    #[test]
    fn a_block_of_an_unknown_type_is_an_error_that_names_it() {
        let error = serde_json::from_value::<Message>(json!({
            "role": "user", "content": [{"type": "video", "url": "x"}]
        }))
        .unwrap_err()
        .to_string();
        assert!(error.contains("unknown variant `video`"), "{error}");
        let image: Message = serde_json::from_value(json!({
            "role": "user", "content": [{"type": "image", "source": {}}]
        }))
        .unwrap();
        let Content::Blocks(blocks) = image.content else {
            panic!()
        };
        assert_eq!(blocks[0].kind(), "image");
        assert!(serde_json::from_value::<Message>(json!({"role": "user", "content": 3})).is_err());
    }

    #[test]
    fn events_and_errors_serialize_in_anthropics_shape() {
        let event = StreamEvent::ContentBlockDelta {
            index: 1,
            delta: BlockDelta::InputJsonDelta {
                partial_json: "{\"a\"".into(),
            },
        };
        assert_eq!(event.name(), "content_block_delta");
        assert_eq!(
            serde_json::to_value(&event).unwrap(),
            json!({"type": "content_block_delta", "index": 1,
                   "delta": {"type": "input_json_delta", "partial_json": "{\"a\""}})
        );
        assert_eq!(
            serde_json::to_value(StreamEvent::MessageStop).unwrap(),
            json!({"type": "message_stop"})
        );
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (404, "not_found_error"),
            (413, "request_too_large"),
            (429, "rate_limit_error"),
            (500, "api_error"),
            (503, "overloaded_error"),
        ] {
            let body = ErrorResponse::new(StatusCode::from_u16(status).unwrap(), "why".into());
            assert_eq!(
                serde_json::to_value(body).unwrap(),
                json!({"type": "error", "error": {"type": kind, "message": "why"}})
            );
        }
        assert_eq!(
            Usage::new(100, 64, 7),
            Usage {
                input_tokens: 36,
                output_tokens: 7,
                cache_read_input_tokens: 64,
                cache_creation_input_tokens: 0
            }
        );
    }
}

//! OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`, `GET
//! /v1/responses/{id}/input_items`): its request, the response object, its input and output items
//! and its stream events. The frontend serves a
//! request by translating it to a chat request (`frontend/src/api/responses_request.rs`); the router
//! routes a follow-up to the replica that stored its conversation.
//!
//! As the other request types, the request is strict about types and keeps unknown fields for the
//! handler to refuse or report. Input items stay JSON values: the handler reads each by its `type`
//! and names the item and field it refuses.

use std::collections::BTreeMap;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::schema::whole_number;

/// The prefix of a response id; a replica behind the router adds its tag after it
/// (`resp_<tag>-...`, see [`replica_tag_of`]).
pub const RESPONSE_ID_PREFIX: &str = "resp";

/// The header in which the router tells a replica its tag, which the replica writes into the ids
/// of the responses it stores, so that a follow-up finds its way back.
pub const REPLICA_TAG_HEADER: &str = "x-sluice-replica-tag";

/// The replica tag inside a response id made behind the router (`resp_<tag>-<rest>`), if any.
pub fn replica_tag_of(response_id: &str) -> Option<&str> {
    let rest = response_id
        .strip_prefix(RESPONSE_ID_PREFIX)?
        .strip_prefix('_')?;
    let (tag, _) = rest.split_once('-')?;
    (!tag.is_empty()).then_some(tag)
}

/// `POST /v1/responses`.
#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
pub struct ResponsesRequest {
    pub model: String,
    /// A string (one user message), or a list of items: messages (`role` and `content`),
    /// `function_call`s and `function_call_output`s.
    #[schema(value_type = Option<Value>)]
    pub input: Option<Input>,
    /// A system message for this turn only: it is not carried into follow-ups.
    pub instructions: Option<String>,
    /// Continue the stored conversation that ended with this response.
    pub previous_response_id: Option<String>,
    /// Function tools: `{"type": "function", "name", "description", "parameters", "strict"}`.
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Vec<Value>>,
    /// `auto`, `none`, `required`, or `{"type": "function", "name"}`.
    #[schema(value_type = Option<Value>)]
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}}`.
    #[schema(value_type = Option<Object>)]
    pub text: Option<TextConfig>,
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub max_output_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// `{"effort": ...}`: passed to the chat template as `reasoning_effort`.
    #[schema(value_type = Option<Object>)]
    pub reasoning: Option<ReasoningConfig>,
    /// Up to 16 string pairs, stored and answered with the response.
    pub metadata: Option<BTreeMap<String, String>>,
    /// Keep the response for `previous_response_id` and `GET` (default true, as OpenAI's).
    pub store: Option<bool>,
    pub stream: Option<bool>,
    /// `{"include_obfuscation": bool}`: accepted, changes nothing (events are not padded).
    #[schema(value_type = Option<Object>)]
    pub stream_options: Option<Value>,
    pub user: Option<String>,
    pub safety_identifier: Option<String>,
    pub prompt_cache_key: Option<String>,
    pub service_tier: Option<String>,
    /// `disabled` only: a conversation longer than the context is refused, never cut.
    pub truncation: Option<String>,
    /// Extra output data to include; none is served.
    pub include: Option<Vec<String>>,
    /// Refused when true: every response is answered in the request.
    pub background: Option<bool>,
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub top_logprobs: Option<u32>,
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub max_tool_calls: Option<u32>,
    /// OpenAI's Conversations API: refused (stored responses chain by `previous_response_id`).
    #[schema(value_type = Option<Value>)]
    pub conversation: Option<Value>,
    /// A stored prompt template: refused.
    #[schema(value_type = Option<Object>)]
    pub prompt: Option<Value>,
    #[serde(flatten)]
    #[schema(ignore)]
    pub other_fields: BTreeMap<String, Value>,
}

/// `input`: one user message as a string, or a list of items.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    Text(String),
    Items(Vec<Value>),
}

impl<'de> Deserialize<'de> for Input {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match Value::deserialize(deserializer)? {
            Value::String(text) => Ok(Input::Text(text)),
            Value::Array(items) => Ok(Input::Items(items)),
            other => Err(D::Error::custom(format!(
                "input must be a string or an array of items, got {other}"
            ))),
        }
    }
}

/// `text`: the output's format.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TextConfig {
    pub format: Option<Value>,
    #[serde(flatten)]
    pub other_fields: BTreeMap<String, Value>,
}

/// `reasoning`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ReasoningConfig {
    pub effort: Option<String>,
    #[serde(flatten)]
    pub other_fields: BTreeMap<String, Value>,
}

/// The response object: what `POST` answers (whole, or in `response.completed`) and `GET` reads
/// back. The request's settings are echoed as OpenAI echoes them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ResponseObject {
    pub id: String,
    /// Always `response`.
    pub object: String,
    pub created_at: u64,
    /// `in_progress`, `completed`, `incomplete` or `failed`.
    pub status: String,
    #[schema(value_type = Option<Object>)]
    pub error: Option<Value>,
    pub incomplete_details: Option<IncompleteDetails>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    pub model: String,
    #[schema(value_type = Vec<Object>)]
    pub output: Vec<OutputItem>,
    pub parallel_tool_calls: bool,
    pub previous_response_id: Option<String>,
    #[schema(value_type = Object)]
    pub reasoning: Value,
    pub store: bool,
    pub temperature: f64,
    #[schema(value_type = Object)]
    pub text: Value,
    /// `auto`, `none`, `required`, or the function object, as the request gave it.
    #[schema(value_type = Value)]
    pub tool_choice: Value,
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<Value>,
    pub top_p: f64,
    pub truncation: String,
    pub usage: Option<ResponseUsage>,
    pub user: Option<String>,
    pub metadata: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct IncompleteDetails {
    /// `max_output_tokens`.
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ResponseUsage {
    pub input_tokens: u32,
    pub input_tokens_details: InputTokensDetails,
    pub output_tokens: u32,
    pub output_tokens_details: OutputTokensDetails,
    pub total_tokens: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct InputTokensDetails {
    /// Prompt tokens the prefix cache served: a follow-up's earlier turns.
    pub cached_tokens: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OutputTokensDetails {
    /// Output tokens up to and including the end of thinking (`--reasoning-parser`; 0 without one).
    pub reasoning_tokens: u32,
}

impl ResponseUsage {
    pub fn new(input: u32, cached: u32, output: u32, reasoning: u32) -> Self {
        ResponseUsage {
            input_tokens: input,
            input_tokens_details: InputTokensDetails {
                cached_tokens: cached,
            },
            output_tokens: output,
            output_tokens_details: OutputTokensDetails {
                reasoning_tokens: reasoning,
            },
            total_tokens: input + output,
        }
    }
}

/// One item of a response's `output`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    /// The thinking of a reasoning model (`--reasoning-parser`).
    Reasoning {
        id: String,
        summary: Vec<Value>,
        content: Vec<ReasoningText>,
        status: String,
    },
    Message {
        id: String,
        status: String,
        role: String,
        content: Vec<OutputText>,
    },
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
        status: String,
    },
}

/// A message's text part.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename = "output_text")]
pub struct OutputText {
    pub text: String,
    pub annotations: Vec<Value>,
    pub logprobs: Vec<Value>,
}

/// A reasoning item's text part.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename = "reasoning_text")]
pub struct ReasoningText {
    pub text: String,
}

/// A content part as `response.content_part.added` and `.done` carry it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum ContentPart {
    OutputText(OutputText),
    ReasoningText(ReasoningText),
}

/// One event of a streamed response, in OpenAI's names. Each goes out with its
/// `sequence_number` ([`SequencedEvent`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type")]
pub enum StreamEvent {
    #[serde(rename = "response.created")]
    Created { response: Box<ResponseObject> },
    #[serde(rename = "response.in_progress")]
    InProgress { response: Box<ResponseObject> },
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded { output_index: u32, item: OutputItem },
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded {
        item_id: String,
        output_index: u32,
        content_index: u32,
        part: ContentPart,
    },
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta {
        item_id: String,
        output_index: u32,
        content_index: u32,
        delta: String,
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.output_text.done")]
    OutputTextDone {
        item_id: String,
        output_index: u32,
        content_index: u32,
        text: String,
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.reasoning_text.delta")]
    ReasoningTextDelta {
        item_id: String,
        output_index: u32,
        content_index: u32,
        delta: String,
    },
    #[serde(rename = "response.reasoning_text.done")]
    ReasoningTextDone {
        item_id: String,
        output_index: u32,
        content_index: u32,
        text: String,
    },
    #[serde(rename = "response.content_part.done")]
    ContentPartDone {
        item_id: String,
        output_index: u32,
        content_index: u32,
        part: ContentPart,
    },
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta {
        item_id: String,
        output_index: u32,
        delta: String,
    },
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone {
        item_id: String,
        output_index: u32,
        name: String,
        arguments: String,
    },
    #[serde(rename = "response.output_item.done")]
    OutputItemDone { output_index: u32, item: OutputItem },
    #[serde(rename = "response.completed")]
    Completed { response: Box<ResponseObject> },
    #[serde(rename = "response.incomplete")]
    Incomplete { response: Box<ResponseObject> },
    /// A failure after the stream began.
    #[serde(rename = "error")]
    Error {
        code: String,
        message: String,
        param: Option<String>,
    },
}

impl StreamEvent {
    /// The SSE event name: the event's `type`.
    pub fn name(&self) -> &'static str {
        match self {
            StreamEvent::Created { .. } => "response.created",
            StreamEvent::InProgress { .. } => "response.in_progress",
            StreamEvent::OutputItemAdded { .. } => "response.output_item.added",
            StreamEvent::ContentPartAdded { .. } => "response.content_part.added",
            StreamEvent::OutputTextDelta { .. } => "response.output_text.delta",
            StreamEvent::OutputTextDone { .. } => "response.output_text.done",
            StreamEvent::ReasoningTextDelta { .. } => "response.reasoning_text.delta",
            StreamEvent::ReasoningTextDone { .. } => "response.reasoning_text.done",
            StreamEvent::ContentPartDone { .. } => "response.content_part.done",
            StreamEvent::FunctionCallArgumentsDelta { .. } => {
                "response.function_call_arguments.delta"
            }
            StreamEvent::FunctionCallArgumentsDone { .. } => {
                "response.function_call_arguments.done"
            }
            StreamEvent::OutputItemDone { .. } => "response.output_item.done",
            StreamEvent::Completed { .. } => "response.completed",
            StreamEvent::Incomplete { .. } => "response.incomplete",
            StreamEvent::Error { .. } => "error",
        }
    }
}

/// An event with its place in the stream, as it is sent.
#[derive(Debug, Serialize)]
pub struct SequencedEvent<'a> {
    #[serde(flatten)]
    pub event: &'a StreamEvent,
    pub sequence_number: u64,
}

/// One item of a request's `input`, as `GET /v1/responses/{id}/input_items` lists it: its id (the
/// client's, or one made from the response's) and the item.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ListedItem {
    pub id: String,
    #[serde(flatten)]
    pub item: InputItem,
}

/// An input item as OpenAI lists it; a message's parts are `input_text`, or `output_text` in an
/// assistant's message.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum InputItem {
    Message {
        role: String,
        content: Vec<InputContent>,
        status: String,
    },
    FunctionCall {
        call_id: String,
        name: String,
        arguments: String,
        status: String,
    },
    FunctionCallOutput {
        call_id: String,
        output: String,
        status: String,
    },
    Reasoning {
        summary: Vec<Value>,
        #[serde(skip_serializing_if = "Option::is_none")]
        content: Option<Vec<Value>>,
    },
}

/// A part of an input message.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum InputContent {
    Input(InputText),
    Output(OutputText),
}

/// A user's, system's or developer's text part.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename = "input_text")]
pub struct InputText {
    pub text: String,
}

/// `GET /v1/responses/{id}/input_items`' answer: one page of the items, in the order asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct InputItemList {
    /// Always `list`.
    pub object: String,
    /// Messages (`input_text` parts, `output_text` in an assistant's), `function_call`s,
    /// `function_call_output`s and `reasoning` items, each with its `id`.
    #[schema(value_type = Vec<Object>)]
    pub data: Vec<Value>,
    pub first_id: Option<String>,
    pub last_id: Option<String>,
    pub has_more: bool,
}

/// `DELETE /v1/responses/{id}`'s answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DeletedResponse {
    pub id: String,
    /// `response.deleted`.
    pub object: String,
    pub deleted: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_replica_tag_is_read_from_ids_made_behind_the_router_only() {
        assert_eq!(replica_tag_of("resp_a1b2c3-18f-7"), Some("a1b2c3"));
        assert_eq!(replica_tag_of("resp-18f-7"), None);
        assert_eq!(replica_tag_of("resp_-18f"), None);
        assert_eq!(replica_tag_of("msg_a1-2"), None);
        assert_eq!(replica_tag_of("resp_nodash"), None);
    }

    #[test]
    fn input_is_a_string_or_items_and_anything_else_is_named() {
        let text: ResponsesRequest =
            serde_json::from_value(json!({"model": "m", "input": "hi"})).unwrap();
        assert_eq!(text.input, Some(Input::Text("hi".into())));
        let items: ResponsesRequest =
            serde_json::from_value(json!({"model": "m", "input": [{"role": "user"}]})).unwrap();
        assert_eq!(
            items.input,
            Some(Input::Items(vec![json!({"role": "user"})]))
        );
        let error = serde_json::from_value::<ResponsesRequest>(json!({"model": "m", "input": 3}))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("input must be a string or an array"),
            "{error}"
        );
    }

    #[test]
    fn events_carry_their_type_and_sequence_number() {
        let event = StreamEvent::OutputTextDelta {
            item_id: "msg_1".into(),
            output_index: 0,
            content_index: 0,
            delta: "Hi".into(),
            logprobs: vec![],
        };
        let sent = SequencedEvent {
            event: &event,
            sequence_number: 4,
        };
        assert_eq!(
            serde_json::to_value(&sent).unwrap(),
            json!({"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
                   "content_index": 0, "delta": "Hi", "logprobs": [], "sequence_number": 4})
        );
        assert_eq!(event.name(), "response.output_text.delta");
        let item = OutputItem::Message {
            id: "msg_1".into(),
            status: "completed".into(),
            role: "assistant".into(),
            content: vec![OutputText {
                text: "Hi".into(),
                annotations: vec![],
                logprobs: vec![],
            }],
        };
        assert_eq!(
            serde_json::to_value(&item).unwrap(),
            json!({"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                   "content": [{"type": "output_text", "text": "Hi", "annotations": [], "logprobs": []}]})
        );
    }
}

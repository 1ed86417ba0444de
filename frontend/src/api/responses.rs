//! OpenAI's Responses API: `POST /v1/responses`, `GET /v1/responses/{id}` and `DELETE` (its
//! `/input_items` are `input_items`'). A request
//! is translated into a chat request (`responses_request`), after the stored conversation of its
//! `previous_response_id`, and served by chat's pipeline. The answer is a response object whose
//! output items are the thinking (`reasoning`), the text (`message`) and the tool calls
//! (`function_call`); streamed, it is OpenAI's typed events from `response.created` to
//! `response.completed` (or `response.incomplete` when `max_output_tokens` cut it).
//!
//! A stored response keeps its object and the conversation it ended (`response_store`); its id
//! carries the tag of the replica that stored it when the router sent the request, so that the
//! router brings follow-ups back to that replica.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::{BufMut, Bytes, BytesMut};

use crate::api::error::ApiError;
use crate::api::fan_out::{ChoiceResult, Choices, ResponseHeader};
use crate::api::generation::GenerationEndpoint;
use crate::api::prepare;
use crate::api::responses_request::{answer_message, chat_request, listed_items, Translated, Turn};
use crate::api::sse::{self_closing_stream, StreamDialect};
use crate::api::valid_request::ValidRequest;
use crate::response_store::{ResponseStore, StoredResponse};
use crate::state::{unix_time, AppState};
use crate::text::answer_parts::{AnswerPart, AnswerStream};
use crate::text::choice_stream::ChoiceUpdate;
use sluice_common::schema::openai::{ChatMessage, Usage};
use sluice_common::schema::openai_tools::{FunctionCall, ToolCall};
use sluice_common::schema::responses::{
    ContentPart, DeletedResponse, IncompleteDetails, OutputItem, OutputText, ReasoningText,
    ResponseObject, ResponseUsage, ResponsesRequest, SequencedEvent, StreamEvent,
    REPLICA_TAG_HEADER, RESPONSE_ID_PREFIX,
};

/// The endpoint for `generation::create`.
pub struct Responses;

/// A turn on its way: the conversation and echo (`Turn`), where it is stored, and the first part of
/// its id.
pub struct TurnContext {
    turn: Turn,
    store: Arc<ResponseStore>,
    id_kind: String,
}

impl GenerationEndpoint for Responses {
    type Request = ResponsesRequest;
    type Answer = ResponseObject;
    type Context = TurnContext;
    const ID_PREFIX: &'static str = RESPONSE_ID_PREFIX;

    async fn prepare(
        state: &AppState,
        request: ResponsesRequest,
        headers: &HeaderMap,
    ) -> Result<(ValidRequest, TurnContext), ApiError> {
        let earlier = match &request.previous_response_id {
            Some(id) => stored_conversation(&state.responses, id)?,
            None => Vec::new(),
        };
        let Translated {
            chat,
            ignored_fields,
            turn,
        } = chat_request(request, earlier)?;
        let mut valid = prepare::chat(state, chat).await?;
        valid.ignored_fields.extend(ignored_fields);
        let id_kind = match replica_tag(headers) {
            Some(tag) => format!("{RESPONSE_ID_PREFIX}_{tag}"),
            None => RESPONSE_ID_PREFIX.to_owned(),
        };
        Ok((
            valid,
            TurnContext {
                turn,
                store: state.responses.clone(),
                id_kind,
            },
        ))
    }

    fn id_kind(context: &TurnContext) -> String {
        context.id_kind.clone()
    }

    fn whole(
        header: ResponseHeader,
        results: Vec<ChoiceResult>,
        usage: Usage,
        request: &ValidRequest,
        context: TurnContext,
    ) -> ResponseObject {
        assert_eq!(results.len(), 1, "a Responses request has one choice");
        let result = results.into_iter().next().expect("one choice");
        // The items a stream of the whole output would build, so that whole and streamed answers
        // cannot differ; the events are not sent.
        let mut answer = AnswerStream::new(
            request.reasoning_starts_thinking,
            request.tool_calls.clone(),
        );
        let mut items = ItemStream::new(header.id.clone());
        let mut unsent = Vec::new();
        for part in answer.push(&result.text, true) {
            items.part(part, &mut unsent);
        }
        let output = items.finish(result.finish_reason == LENGTH, &mut unsent);
        let cached = usage.prompt_tokens_details.map_or(0, |d| d.cached_tokens);
        let reasoning = usage
            .completion_tokens_details
            .map_or(0, |d| d.reasoning_tokens);
        let usage = ResponseUsage::new(
            usage.prompt_tokens,
            cached,
            usage.completion_tokens,
            reasoning,
        );
        context.finish(&header, result.finish_reason, output, usage)
    }

    async fn stream(
        choices: Choices,
        prompt_tokens: u32,
        request: &ValidRequest,
        context: TurnContext,
    ) -> Result<Response, ApiError> {
        let header = choices.header.clone();
        let started = Box::new(context.object(&header, "in_progress"));
        let mut sequence = 0u64;
        let opening = [
            StreamEvent::Created {
                response: started.clone(),
            },
            StreamEvent::InProgress { response: started },
        ]
        .iter()
        .map(|one| event(one, &mut sequence))
        .collect();
        let mut answer = AnswerStream::new(
            request.reasoning_starts_thinking,
            request.tool_calls.clone(),
        );
        let mut items = ItemStream::new(header.id.clone());
        let mut context = Some(context);
        let frame = move |update: ChoiceUpdate| {
            let finished = update.finish_reason.is_some();
            let mut events = Vec::new();
            for part in answer.push(&update.text, finished) {
                items.part(part, &mut events);
            }
            if let Some(reason) = update.finish_reason {
                let output = items.finish(reason == LENGTH, &mut events);
                let usage = ResponseUsage::new(
                    prompt_tokens,
                    update.num_cached_tokens,
                    update.completion_tokens,
                    update.reasoning_tokens.unwrap_or(0),
                );
                let context = context.take().expect("a choice finishes once");
                let response = Box::new(context.finish(&header, reason, output, usage));
                events.push(if response.status == "incomplete" {
                    StreamEvent::Incomplete { response }
                } else {
                    StreamEvent::Completed { response }
                });
            }
            let frames: Vec<Bytes> = events.iter().map(|one| event(one, &mut sequence)).collect();
            Bytes::from(frames.concat())
        };
        self_closing_stream(RESPONSES_STREAM, opening, choices, frame).await
    }
}

impl TurnContext {
    /// The response object, with no output yet.
    fn object(&self, header: &ResponseHeader, status: &str) -> ResponseObject {
        ResponseObject {
            id: header.id.clone(),
            created_at: header.created,
            status: status.into(),
            model: header.model.clone(),
            ..self.turn.echo.clone()
        }
    }

    /// The answered response, stored with its conversation when the request asked for that. A
    /// store that fails is logged and the response says it was not stored: the answer is never
    /// lost for it.
    fn finish(
        self,
        header: &ResponseHeader,
        finish_reason: &str,
        output: Vec<OutputItem>,
        usage: ResponseUsage,
    ) -> ResponseObject {
        let cut = finish_reason == LENGTH;
        let mut response = ResponseObject {
            output,
            usage: Some(usage),
            incomplete_details: cut.then(|| IncompleteDetails {
                reason: "max_output_tokens".into(),
            }),
            ..self.object(header, if cut { "incomplete" } else { "completed" })
        };
        if self.turn.store {
            let mut history = self.turn.history;
            history.push(answer_of(&response.output));
            let input_items = listed_items(self.turn.input, &response.id);
            let stored = self.store.put(
                &response.id,
                response.created_at,
                &StoredResponse {
                    response: serde_json::to_string(&response).expect("a response serializes"),
                    history: serde_json::to_string(&history).expect("messages serialize"),
                    input_items: serde_json::to_string(&input_items).expect("items serialize"),
                },
            );
            if let Err(error) = stored {
                eprintln!("sluice-frontend: {error}; {} was not stored", response.id);
                response.store = false;
            }
        }
        response
    }
}

/// The engine's finish reason when `max_output_tokens` cut the answer.
const LENGTH: &str = "length";

fn status_mut(item: &mut OutputItem) -> &mut String {
    let (OutputItem::Reasoning { status, .. }
    | OutputItem::Message { status, .. }
    | OutputItem::FunctionCall { status, .. }) = item;
    status
}

/// The status of an item that `max_output_tokens` cut: the last one, as OpenAI marks it.
fn mark_cut(output: &mut [OutputItem]) {
    if let Some(last) = output.last_mut() {
        *status_mut(last) = "incomplete".into();
    }
}

/// The stored response `id`, or a 404 naming it (and `param`, the field it came from).
pub fn stored_response(
    store: &ResponseStore,
    id: &str,
    param: Option<&'static str>,
) -> Result<StoredResponse, ApiError> {
    store
        .get(id, unix_time())
        .map_err(|error| ApiError::Internal(error.to_string()))?
        .ok_or_else(|| ApiError::ResponseNotFound {
            id: id.to_owned(),
            param,
        })
}

/// The conversation that the stored response `id` ended, or a 404 naming it.
fn stored_conversation(store: &ResponseStore, id: &str) -> Result<Vec<ChatMessage>, ApiError> {
    let stored = stored_response(store, id, Some("previous_response_id"))?;
    serde_json::from_str(&stored.history).map_err(|error| {
        ApiError::Internal(format!(
            "the stored conversation of {id} does not read back: {error}"
        ))
    })
}

/// The router's tag for this replica, when it is one a response id can carry.
fn replica_tag(headers: &HeaderMap) -> Option<&str> {
    let tag = headers.get(REPLICA_TAG_HEADER)?.to_str().ok()?;
    let fits = !tag.is_empty() && tag.len() <= 32 && tag.bytes().all(|b| b.is_ascii_alphanumeric());
    fits.then_some(tag)
}

/// An output item's id: its kind, the response and its place.
fn item_id(kind: &str, response_id: &str, index: usize) -> String {
    format!("{kind}_{index}_{response_id}")
}

fn output_text(text: String) -> OutputText {
    OutputText {
        text,
        annotations: Vec::new(),
        logprobs: Vec::new(),
    }
}

/// The assistant message that a response's output adds to its conversation: its text and calls
/// (the thinking is left out, as chat templates leave earlier turns' thinking out).
fn answer_of(output: &[OutputItem]) -> ChatMessage {
    let mut text: Option<String> = None;
    let mut calls = Vec::new();
    for item in output {
        match item {
            OutputItem::Message { content, .. } => {
                let all = text.get_or_insert_with(String::new);
                content.iter().for_each(|part| all.push_str(&part.text));
            }
            OutputItem::FunctionCall {
                call_id,
                name,
                arguments,
                ..
            } => calls.push(ToolCall {
                id: call_id.clone(),
                kind: "function".into(),
                function: FunctionCall {
                    name: name.clone(),
                    arguments: arguments.clone(),
                },
            }),
            OutputItem::Reasoning { .. } => {}
        }
    }
    answer_message(text, calls)
}

/// The Responses API's streams: a named `error` event on failure, nothing after it.
const RESPONSES_STREAM: StreamDialect = StreamDialect {
    error_event: |error| {
        let mut unnumbered = 0;
        event(
            &StreamEvent::Error {
                code: error.code().unwrap_or(error.kind()).to_owned(),
                message: error.to_string(),
                param: error.param().map(str::to_owned),
            },
            &mut unnumbered,
        )
    },
    last_event: None,
};

/// One SSE event: `event: <type>` and the event with its sequence number as compact JSON.
fn event(event: &StreamEvent, sequence: &mut u64) -> Bytes {
    let mut buf = BytesMut::with_capacity(256);
    buf.put_slice(b"event: ");
    buf.put_slice(event.name().as_bytes());
    buf.put_slice(b"\ndata: ");
    let mut writer = buf.writer();
    let sequenced = SequencedEvent {
        event,
        sequence_number: *sequence,
    };
    serde_json::to_writer(&mut writer, &sequenced).expect("stream events always serialize");
    *sequence += 1;
    let mut buf = writer.into_inner();
    buf.put_slice(b"\n\n");
    buf.freeze()
}

/// A streamed response's output items: numbered in order, one open at a time (reasoning, a
/// message, or one function call), each added, grown and done as OpenAI's events say.
struct ItemStream {
    response_id: String,
    output: Vec<OutputItem>,
    /// Whether the last item is still open.
    open: bool,
    /// Each call's item, by the call's index in the answer.
    call_items: HashMap<u32, usize>,
    /// The answer was cut by `max_output_tokens`: the last item closes incomplete.
    cut: bool,
}

impl ItemStream {
    fn new(response_id: String) -> Self {
        ItemStream {
            response_id,
            output: Vec::new(),
            open: false,
            call_items: HashMap::new(),
            cut: false,
        }
    }

    fn part(&mut self, part: AnswerPart, events: &mut Vec<StreamEvent>) {
        match part {
            AnswerPart::Thinking(piece) => {
                let index = self.prose_item(true, events);
                let OutputItem::Reasoning { id, content, .. } = &mut self.output[index] else {
                    unreachable!("prose_item opened a reasoning item");
                };
                content[0].text.push_str(&piece);
                events.push(StreamEvent::ReasoningTextDelta {
                    item_id: id.clone(),
                    output_index: index as u32,
                    content_index: 0,
                    delta: piece,
                });
            }
            AnswerPart::Text(piece) => {
                let index = self.prose_item(false, events);
                let OutputItem::Message { id, content, .. } = &mut self.output[index] else {
                    unreachable!("prose_item opened a message");
                };
                content[0].text.push_str(&piece);
                events.push(StreamEvent::OutputTextDelta {
                    item_id: id.clone(),
                    output_index: index as u32,
                    content_index: 0,
                    delta: piece,
                    logprobs: Vec::new(),
                });
            }
            AnswerPart::CallOpened { call, id, name } => {
                let item = OutputItem::FunctionCall {
                    id: item_id("fc", &self.response_id, self.output.len()),
                    call_id: id,
                    name,
                    arguments: String::new(),
                    status: "in_progress".into(),
                };
                let index = self.add(item, events);
                self.call_items.insert(call, index);
            }
            AnswerPart::CallArguments { call, json } => {
                let index = self.call_items[&call];
                // The parsers finish a call's arguments before they open the next call.
                assert!(
                    self.open && index + 1 == self.output.len(),
                    "arguments for a closed call"
                );
                let OutputItem::FunctionCall { id, arguments, .. } = &mut self.output[index] else {
                    unreachable!("call_items holds calls");
                };
                arguments.push_str(&json);
                events.push(StreamEvent::FunctionCallArgumentsDelta {
                    item_id: id.clone(),
                    output_index: index as u32,
                    delta: json,
                });
            }
        }
    }

    /// The open reasoning item (`thinking`) or message, or a new one with its one content part.
    fn prose_item(&mut self, thinking: bool, events: &mut Vec<StreamEvent>) -> usize {
        let open_kind = self.open.then(|| self.output.last()).flatten();
        match open_kind {
            Some(OutputItem::Reasoning { .. }) if thinking => return self.output.len() - 1,
            Some(OutputItem::Message { .. }) if !thinking => return self.output.len() - 1,
            _ => {}
        }
        let index = self.output.len();
        let (item, part) = if thinking {
            let id = item_id("rs", &self.response_id, index);
            let item = OutputItem::Reasoning {
                id,
                summary: Vec::new(),
                content: Vec::new(),
                status: "in_progress".into(),
            };
            (
                item,
                ContentPart::ReasoningText(ReasoningText {
                    text: String::new(),
                }),
            )
        } else {
            let id = item_id("msg", &self.response_id, index);
            let item = OutputItem::Message {
                id,
                status: "in_progress".into(),
                role: "assistant".into(),
                content: Vec::new(),
            };
            (item, ContentPart::OutputText(output_text(String::new())))
        };
        let index = self.add(item, events);
        let item_id = match &mut self.output[index] {
            OutputItem::Reasoning { id, content, .. } => {
                content.push(ReasoningText {
                    text: String::new(),
                });
                id.clone()
            }
            OutputItem::Message { id, content, .. } => {
                content.push(output_text(String::new()));
                id.clone()
            }
            OutputItem::FunctionCall { .. } => unreachable!("a prose item"),
        };
        events.push(StreamEvent::ContentPartAdded {
            item_id,
            output_index: index as u32,
            content_index: 0,
            part,
        });
        index
    }

    /// Closes the open item and adds `item`, open.
    fn add(&mut self, item: OutputItem, events: &mut Vec<StreamEvent>) -> usize {
        self.close(events);
        let index = self.output.len();
        events.push(StreamEvent::OutputItemAdded {
            output_index: index as u32,
            item: item.clone(),
        });
        self.output.push(item);
        self.open = true;
        index
    }

    /// The open item's done events, if one is open.
    fn close(&mut self, events: &mut Vec<StreamEvent>) {
        if !std::mem::take(&mut self.open) {
            return;
        }
        let index = self.output.len() - 1;
        let output_index = index as u32;
        *status_mut(&mut self.output[index]) = "completed".into();
        match &mut self.output[index] {
            OutputItem::Reasoning { id, content, .. } => {
                let text = content[0].text.clone();
                events.push(StreamEvent::ReasoningTextDone {
                    item_id: id.clone(),
                    output_index,
                    content_index: 0,
                    text: text.clone(),
                });
                events.push(StreamEvent::ContentPartDone {
                    item_id: id.clone(),
                    output_index,
                    content_index: 0,
                    part: ContentPart::ReasoningText(ReasoningText { text }),
                });
            }
            OutputItem::Message { id, content, .. } => {
                let text = content[0].text.clone();
                events.push(StreamEvent::OutputTextDone {
                    item_id: id.clone(),
                    output_index,
                    content_index: 0,
                    text: text.clone(),
                    logprobs: Vec::new(),
                });
                events.push(StreamEvent::ContentPartDone {
                    item_id: id.clone(),
                    output_index,
                    content_index: 0,
                    part: ContentPart::OutputText(output_text(text)),
                });
            }
            OutputItem::FunctionCall {
                id,
                name,
                arguments,
                ..
            } => {
                events.push(StreamEvent::FunctionCallArgumentsDone {
                    item_id: id.clone(),
                    output_index,
                    name: name.clone(),
                    arguments: arguments.clone(),
                });
            }
        }
        if self.cut {
            mark_cut(&mut self.output);
        }
        events.push(StreamEvent::OutputItemDone {
            output_index,
            item: self.output[index].clone(),
        });
    }

    /// Closes the last item (`cut`: `max_output_tokens` cut it) and gives the output; an answer
    /// with no item at all is one empty message, as a whole response has.
    fn finish(&mut self, cut: bool, events: &mut Vec<StreamEvent>) -> Vec<OutputItem> {
        if self.output.is_empty() {
            self.prose_item(false, events);
        }
        self.cut = cut;
        self.close(events);
        std::mem::take(&mut self.output)
    }
}

/// Query parameters of `GET /v1/responses/{id}` that OpenAI defines and this server does not serve.
fn check_no_query(query: &BTreeMap<String, String>) -> Result<(), ApiError> {
    match query.keys().next() {
        Some(name) => Err(ApiError::InvalidRequest(format!(
            "the query parameter {name:?} is not served here: a stored response is read back \
             whole, as it was answered"
        ))),
        None => Ok(()),
    }
}

/// `GET /v1/responses/{id}`: the stored response, as it was answered.
pub async fn retrieve(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Result<Response, ApiError> {
    check_no_query(&query)?;
    let stored = stored_response(&state.responses, &id, None)?;
    let mut response = stored.response.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(response)
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<DeletedResponse>, ApiError> {
    let deleted = state
        .responses
        .delete(&id, unix_time())
        .map_err(|error| ApiError::Internal(error.to_string()))?;
    if !deleted {
        return Err(ApiError::ResponseNotFound { id, param: None });
    }
    Ok(Json(DeletedResponse {
        id,
        object: "response.deleted".into(),
        deleted: true,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::answer_parts::sample_parts;
    use serde_json::{json, Value};

    fn names(events: &[StreamEvent]) -> Vec<&'static str> {
        events.iter().map(StreamEvent::name).collect()
    }

    #[test]
    fn items_open_in_order_and_each_is_done_before_the_next() {
        let mut items = ItemStream::new("resp-1".into());
        let mut events = Vec::new();
        for part in sample_parts() {
            items.part(part, &mut events);
        }
        let output = items.finish(false, &mut events);
        assert_eq!(
            names(&events),
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
        );
        // Added items are empty and in progress; done items are whole and completed.
        let added = serde_json::to_value(&events[6]).unwrap();
        assert_eq!(
            added,
            json!({"type": "response.output_item.added", "output_index": 1, "item": {
                "type": "message", "id": "msg_1_resp-1", "status": "in_progress",
                "role": "assistant", "content": []}})
        );
        let done: Value = serde_json::to_value(&events[17]).unwrap();
        assert_eq!(
            done["item"],
            json!({"type": "function_call", "id": "fc_2_resp-1", "call_id": "call_1",
                   "name": "f", "arguments": "{\"a\":1}", "status": "completed"})
        );
        assert_eq!(output.len(), 3);
        assert_eq!(
            answer_of(&output),
            answer_message(
                Some("Let me check.".into()),
                vec![ToolCall {
                    id: "call_1".into(),
                    kind: "function".into(),
                    function: FunctionCall {
                        name: "f".into(),
                        arguments: "{\"a\":1}".into()
                    }
                }]
            )
        );
    }

    #[test]
    fn an_answer_with_nothing_in_it_is_one_empty_message() {
        let mut events = Vec::new();
        let output = ItemStream::new("resp-2".into()).finish(true, &mut events);
        assert_eq!(
            names(&events),
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
            ]
        );
        assert_eq!(answer_of(&output), ChatMessage::text("assistant", ""));
        // Cut by max_output_tokens: the last item is incomplete, in its done event too.
        let OutputItem::Message { status, .. } = &output[0] else {
            panic!("a message")
        };
        assert_eq!(status, "incomplete");
        let done = serde_json::to_value(events.last().unwrap()).unwrap();
        assert_eq!(done["item"]["status"], "incomplete");
    }

    #[test]
    fn events_are_named_and_numbered() {
        let mut sequence = 7;
        let bytes = event(
            &StreamEvent::OutputTextDelta {
                item_id: "msg_0_r".into(),
                output_index: 0,
                content_index: 0,
                delta: "a\nb".into(),
                logprobs: Vec::new(),
            },
            &mut sequence,
        );
        assert_eq!(sequence, 8);
        assert_eq!(
            &bytes[..],
            b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\
\"item_id\":\"msg_0_r\",\"output_index\":0,\"content_index\":0,\"delta\":\"a\\nb\",\
\"logprobs\":[],\"sequence_number\":7}\n\n"
        );
        let error = (RESPONSES_STREAM.error_event)(&ApiError::EngineUnavailable("gone".into()));
        assert!(error.starts_with(
            b"event: error\ndata: {\"type\":\"error\",\"code\":\"engine_unavailable\""
        ));
    }

    #[test]
    fn only_tags_an_id_can_carry_are_read() {
        let mut headers = HeaderMap::new();
        assert_eq!(replica_tag(&headers), None);
        headers.insert(REPLICA_TAG_HEADER, HeaderValue::from_static("a1b2"));
        assert_eq!(replica_tag(&headers), Some("a1b2"));
        headers.insert(REPLICA_TAG_HEADER, HeaderValue::from_static("a-b"));
        assert_eq!(replica_tag(&headers), None);
    }
}

//! A Responses request translated into the chat request it means, so that chat's one `prepare`
//! validates and renders it: `instructions` become this turn's system message, the stored
//! conversation of `previous_response_id` comes next, then `input`'s items (messages, function
//! calls as an assistant's tool calls, their outputs as tool messages), each also kept as the item
//! `GET /v1/responses/{id}/input_items` lists; `tools`, `tool_choice`,
//! `text.format` and `reasoning.effort` become chat's. What the Responses API defines and this
//! server cannot serve (images and files, built-in tools, background runs, automatic truncation) is
//! a 400 naming it; a field neither API knows is reported, as chat's are.
//!
//! Because the stored conversation is the chat messages the earlier turn rendered, a follow-up's
//! prompt starts with the earlier prompt and answer, and the prefix cache serves them.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::api::error::ApiError;
use crate::api::messages_request::Ignored;
use crate::api::validate::out_of_range;
use sluice_common::schema::openai::{
    ChatCompletionRequest, ChatMessage, MessageContent, SamplingFields,
};
use sluice_common::schema::openai_tools::{
    FunctionCall, FunctionDefinition, FunctionName, NamedToolChoice, Tool, ToolCall, ToolChoice,
};
use sluice_common::schema::responses::{
    Input, InputContent, InputItem, InputText, ListedItem, OutputText, ResponseObject,
    ResponsesRequest, TextConfig,
};

/// OpenAI's bound on `metadata`.
const MAX_METADATA_PAIRS: usize = 16;

/// The chat request, the conversation it continues and what the response object echoes.
pub struct Translated {
    pub chat: ChatCompletionRequest,
    pub ignored_fields: Vec<String>,
    pub turn: Turn,
}

/// What a response is made of besides its output: the conversation so far (without this turn's
/// instructions, which are not carried on), this turn's input items, whether to store it, and the
/// object that echoes the request's settings (its id, time, status, output and usage are filled in
/// when it is answered).
#[derive(Debug, Clone)]
pub struct Turn {
    pub history: Vec<ChatMessage>,
    pub input: Vec<GivenItem>,
    pub store: bool,
    pub echo: ResponseObject,
}

/// An input item, with the id the client gave it.
#[derive(Debug, Clone, PartialEq)]
pub struct GivenItem {
    pub id: Option<String>,
    pub item: InputItem,
}

/// The turn's input items as they are listed: an item the client gave no id gets one made of its
/// kind, its place in the input and the response's id.
pub fn listed_items(input: Vec<GivenItem>, response_id: &str) -> Vec<ListedItem> {
    input
        .into_iter()
        .enumerate()
        .map(|(at, GivenItem { id, item })| {
            let kind = match &item {
                InputItem::Message { .. } => "msg",
                InputItem::FunctionCall { .. } => "fc",
                InputItem::FunctionCallOutput { .. } => "fco",
                InputItem::Reasoning { .. } => "rs",
            };
            ListedItem {
                id: id.unwrap_or_else(|| format!("{kind}_in{at}_{response_id}")),
                item,
            }
        })
        .collect()
}

/// `POST /v1/responses`'s request as a chat request; `earlier` is the stored conversation of its
/// `previous_response_id` (empty without one).
pub fn chat_request(
    request: ResponsesRequest,
    earlier: Vec<ChatMessage>,
) -> Result<Translated, ApiError> {
    refuse_unserved(&request)?;
    let mut ignored = Ignored::default();
    let mut history = earlier;
    let mut input = Vec::new();
    match request.input {
        Some(Input::Text(text)) => {
            input.push(GivenItem {
                id: None,
                item: message_item("user", vec![text.clone()]),
            });
            history.push(ChatMessage::text("user", text));
        }
        Some(Input::Items(items)) => {
            for (at, item) in items.into_iter().enumerate() {
                push_item(at, item, &mut history, &mut input, &mut ignored)?;
            }
        }
        None => {}
    }
    if history.is_empty() {
        return Err(out_of_range(
            "input",
            "input is required: a string, or a list of items (or a previous_response_id to continue)"
                .into(),
        ));
    }
    if let Some(metadata) = &request.metadata {
        if metadata.len() > MAX_METADATA_PAIRS {
            return Err(out_of_range(
                "metadata",
                format!(
                    "metadata holds at most {MAX_METADATA_PAIRS} pairs, got {}",
                    metadata.len()
                ),
            ));
        }
    }
    let tools = request
        .tools
        .clone()
        .map(|tools| {
            tools
                .into_iter()
                .enumerate()
                .map(|(at, tool)| function_tool(at, tool, &mut ignored))
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    let tool_choice = request
        .tool_choice
        .clone()
        .map(chat_tool_choice)
        .transpose()?;
    let (response_format, format) = match request.text.clone() {
        Some(TextConfig {
            format,
            other_fields,
        }) => {
            ignored.fields("text", other_fields.keys());
            match format {
                Some(format) => (response_format(&format)?, format),
                None => (None, json!({"type": "text"})),
            }
        }
        None => (None, json!({"type": "text"})),
    };
    match &request.stream_options {
        None | Some(Value::Null) => {}
        // OpenAI pads events against length side channels; these are not padded.
        Some(Value::Object(options)) => ignored.fields(
            "stream_options",
            options.keys().filter(|key| *key != "include_obfuscation"),
        ),
        Some(other) => {
            return Err(out_of_range(
                "stream_options",
                format!("stream_options must be an object, got {other}"),
            ))
        }
    }
    let effort = request.reasoning.as_ref().and_then(|reasoning| {
        ignored.fields("reasoning", reasoning.other_fields.keys());
        reasoning.effort.clone()
    });
    let mut messages = Vec::with_capacity(history.len() + 1);
    if let Some(instructions) = &request.instructions {
        messages.push(ChatMessage::text("system", instructions.clone()));
    }
    messages.extend(history.iter().cloned());
    let chat = ChatCompletionRequest {
        model: request.model.clone(),
        messages,
        sampling: SamplingFields {
            max_tokens: request.max_output_tokens,
            temperature: request.temperature,
            top_p: request.top_p,
            stream: request.stream,
            user: request.user.clone(),
            safety_identifier: request.safety_identifier.clone(),
            prompt_cache_key: request.prompt_cache_key.clone(),
            service_tier: request.service_tier.clone(),
            response_format,
            ..SamplingFields::default()
        },
        reasoning_effort: effort.clone(),
        tools,
        tool_choice,
        parallel_tool_calls: request.parallel_tool_calls,
        other_fields: request.other_fields,
        ..ChatCompletionRequest::default()
    };
    let store = request.store.unwrap_or(true);
    let echo = ResponseObject {
        id: String::new(),
        object: "response".into(),
        created_at: 0,
        status: "in_progress".into(),
        error: None,
        incomplete_details: None,
        instructions: request.instructions,
        max_output_tokens: request.max_output_tokens,
        model: request.model,
        output: Vec::new(),
        parallel_tool_calls: request.parallel_tool_calls.unwrap_or(true),
        previous_response_id: request.previous_response_id,
        reasoning: json!({"effort": effort, "summary": null}),
        store,
        temperature: request.temperature.unwrap_or(1.0),
        text: json!({ "format": format }),
        tool_choice: request.tool_choice.unwrap_or_else(|| json!("auto")),
        tools: request.tools.unwrap_or_default(),
        top_p: request.top_p.unwrap_or(1.0),
        truncation: "disabled".into(),
        usage: None,
        user: request.user,
        metadata: request.metadata.unwrap_or_default(),
    };
    Ok(Translated {
        chat,
        ignored_fields: ignored.into_names(),
        turn: Turn {
            history,
            input,
            store,
            echo,
        },
    })
}

/// The fields whose meaning this server does not serve: each a 400 naming it.
fn refuse_unserved(request: &ResponsesRequest) -> Result<(), ApiError> {
    let refuse = |param: &'static str, why: &str| Err(out_of_range(param, why.to_owned()));
    if request.background == Some(true) {
        return refuse(
            "background",
            "background responses are not served: every response is answered in its request",
        );
    }
    if !matches!(request.truncation.as_deref(), None | Some("disabled")) {
        return refuse(
            "truncation",
            "truncation must be \"disabled\": a conversation longer than the context is refused, \
             never cut",
        );
    }
    if request
        .include
        .as_ref()
        .is_some_and(|include| !include.is_empty())
    {
        return refuse(
            "include",
            "include is not served: no extra output data (logprobs, encrypted reasoning) is kept",
        );
    }
    if request.top_logprobs.is_some_and(|n| n > 0) {
        return refuse(
            "top_logprobs",
            "top_logprobs is not served on /v1/responses",
        );
    }
    if request.max_tool_calls.is_some() {
        return refuse(
            "max_tool_calls",
            "max_tool_calls is not served: a turn's calls are the model's, bounded by \
             parallel_tool_calls",
        );
    }
    if request.conversation.as_ref().is_some_and(|c| !c.is_null()) {
        return refuse(
            "conversation",
            "the Conversations API is not served: chain turns with previous_response_id",
        );
    }
    if request.prompt.as_ref().is_some_and(|p| !p.is_null()) {
        return refuse("prompt", "stored prompt templates are not served");
    }
    Ok(())
}

/// One input item appended to the conversation and to the turn's items: a message, a function call
/// (an assistant's tool call, joined to the assistant message before it), a function call's output
/// (a tool message), or a reasoning item (left out of the conversation: chat templates leave
/// earlier turns' thinking out of the prompt).
fn push_item(
    at: usize,
    item: Value,
    history: &mut Vec<ChatMessage>,
    input: &mut Vec<GivenItem>,
    ignored: &mut Ignored,
) -> Result<(), ApiError> {
    let bad = |message: String| out_of_range("input", format!("input[{at}]: {message}"));
    let Value::Object(mut fields) = item else {
        return Err(bad(format!("an item is an object, got {item}")));
    };
    let kind = match fields.remove("type") {
        None => "message".to_owned(),
        Some(Value::String(kind)) => kind,
        Some(other) => return Err(bad(format!("type must be a string, got {other}"))),
    };
    let id = match fields.remove("id") {
        Some(Value::String(id)) => Some(id),
        _ => None,
    };
    // An item's status describes it and changes nothing here.
    fields.remove("status");
    let text_field =
        |fields: &mut serde_json::Map<String, Value>, name: &str| match fields.remove(name) {
            Some(Value::String(text)) => Ok(text),
            Some(other) => Err(bad(format!("{name} must be a string, got {other}"))),
            None => Err(bad(format!("a {kind} item needs its {name}"))),
        };
    let item = match kind.as_str() {
        "message" => {
            let role = text_field(&mut fields, "role")?;
            let chat_role = match role.as_str() {
                "user" | "assistant" | "system" => role.as_str(),
                // Chat templates know no developer role; OpenAI ranks it as the system's.
                "developer" => "system",
                _ => {
                    return Err(bad(format!(
                        "role is {role:?}; it must be user, assistant, system or developer"
                    )))
                }
            };
            let parts = content_parts(fields.remove("content")).map_err(bad)?;
            ignored.fields(&format!("input[{at}]"), fields.keys());
            history.push(ChatMessage::text(chat_role, parts.concat()));
            message_item(&role, parts)
        }
        "function_call" => {
            let call = ToolCall {
                id: text_field(&mut fields, "call_id")?,
                kind: "function".into(),
                function: FunctionCall {
                    name: text_field(&mut fields, "name")?,
                    arguments: text_field(&mut fields, "arguments")?,
                },
            };
            ignored.fields(&format!("input[{at}]"), fields.keys());
            let item = InputItem::FunctionCall {
                call_id: call.id.clone(),
                name: call.function.name.clone(),
                arguments: call.function.arguments.clone(),
                status: COMPLETED.into(),
            };
            match history.last_mut() {
                Some(last) if last.role == "assistant" => {
                    last.tool_calls.get_or_insert_with(Vec::new).push(call)
                }
                _ => {
                    let mut message = ChatMessage::new("assistant", None);
                    message.tool_calls = Some(vec![call]);
                    history.push(message);
                }
            }
            item
        }
        "function_call_output" => {
            let call_id = text_field(&mut fields, "call_id")?;
            let output = content_parts(fields.remove("output"))
                .map_err(bad)?
                .concat();
            ignored.fields(&format!("input[{at}]"), fields.keys());
            let mut message = ChatMessage::text("tool", output.clone());
            message.tool_call_id = Some(call_id.clone());
            history.push(message);
            InputItem::FunctionCallOutput {
                call_id,
                output,
                status: COMPLETED.into(),
            }
        }
        "reasoning" => {
            let list = |value: Option<Value>| match value {
                Some(Value::Array(values)) => Some(values),
                _ => None,
            };
            InputItem::Reasoning {
                summary: list(fields.remove("summary")).unwrap_or_default(),
                content: list(fields.remove("content")),
            }
        }
        other => {
            return Err(bad(format!(
                "items of type {other:?} are not served; the types are message, function_call, \
                 function_call_output and reasoning"
            )))
        }
    };
    input.push(GivenItem { id, item });
    Ok(())
}

/// The status of every listed input item: it was given whole.
const COMPLETED: &str = "completed";

/// A message item of `role` with one text part per piece: an assistant's parts are `output_text`.
fn message_item(role: &str, parts: Vec<String>) -> InputItem {
    let content = parts
        .into_iter()
        .map(|text| match role {
            "assistant" => InputContent::Output(OutputText {
                text,
                annotations: Vec::new(),
                logprobs: Vec::new(),
            }),
            _ => InputContent::Input(InputText { text }),
        })
        .collect();
    InputItem::Message {
        role: role.to_owned(),
        content,
        status: COMPLETED.into(),
    }
}

/// A message's (or a call output's) content as the text of its parts: a string is one part.
fn content_parts(content: Option<Value>) -> Result<Vec<String>, String> {
    match content {
        Some(Value::String(text)) => Ok(vec![text]),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (index, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                match (kind, part.get("text").and_then(Value::as_str)) {
                    ("input_text" | "output_text" | "text", Some(piece)) => {
                        texts.push(piece.to_owned())
                    }
                    ("refusal", _) => texts.push(
                        part.get("refusal")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_owned(),
                    ),
                    ("input_image" | "input_file" | "input_audio", _) => {
                        return Err(format!(
                            "content[{index}] is {kind}: this server reads text only"
                        ))
                    }
                    _ => {
                        return Err(format!(
                            "content[{index}] must be a text part ({{\"type\": \"input_text\", \
                             \"text\": ...}}), got {part}"
                        ))
                    }
                }
            }
            Ok(texts)
        }
        Some(other) => Err(format!(
            "content must be a string or a list of parts, got {other}"
        )),
        None => Err("the item needs its content".into()),
    }
}

/// A Responses function tool as chat's tool; any other tool type is refused by name.
fn function_tool(at: usize, tool: Value, ignored: &mut Ignored) -> Result<Tool, ApiError> {
    let bad = |message: String| out_of_range("tools", format!("tools[{at}]: {message}"));
    let Value::Object(mut fields) = tool else {
        return Err(bad(format!("a tool is an object, got {tool}")));
    };
    match fields.remove("type") {
        Some(Value::String(kind)) if kind == "function" => {}
        Some(Value::String(kind)) => {
            return Err(bad(format!(
                "tools of type {kind:?} are not served; only \"function\" tools are"
            )))
        }
        _ => return Err(bad("a tool needs \"type\": \"function\"".into())),
    }
    let name = match fields.remove("name") {
        Some(Value::String(name)) => name,
        _ => return Err(bad("a function tool needs its name".into())),
    };
    let description = match fields.remove("description") {
        Some(Value::String(text)) => Some(text),
        None | Some(Value::Null) => None,
        Some(other) => return Err(bad(format!("description must be a string, got {other}"))),
    };
    let strict = match fields.remove("strict") {
        Some(Value::Bool(strict)) => Some(strict),
        None | Some(Value::Null) => None,
        Some(other) => return Err(bad(format!("strict must be a boolean, got {other}"))),
    };
    let parameters = fields.remove("parameters").filter(|p| !p.is_null());
    ignored.fields(&format!("tools[{at}]"), fields.keys());
    Ok(Tool {
        kind: "function".into(),
        function: FunctionDefinition {
            name,
            description,
            parameters,
            strict,
        },
    })
}

/// `tool_choice` as chat's.
fn chat_tool_choice(choice: Value) -> Result<ToolChoice, ApiError> {
    let bad = |message: String| out_of_range("tool_choice", message);
    match &choice {
        Value::String(mode) if ["auto", "none", "required"].contains(&mode.as_str()) => {
            Ok(ToolChoice::Mode(mode.clone()))
        }
        Value::Object(fields) => match (
            fields.get("type").and_then(Value::as_str),
            fields.get("name").and_then(Value::as_str),
        ) {
            (Some("function"), Some(name)) => Ok(ToolChoice::Named(NamedToolChoice {
                kind: "function".into(),
                function: FunctionName { name: name.into() },
            })),
            (Some("function"), None) => Err(bad(
                "a function tool_choice needs the function's name".into(),
            )),
            _ => Err(bad(format!(
                "tool_choice {choice} is not served: use auto, none, required or \
                 {{\"type\": \"function\", \"name\": ...}}"
            ))),
        },
        _ => Err(bad(format!(
            "tool_choice must be auto, none, required or {{\"type\": \"function\", \"name\": ...}}, \
             got {choice}"
        ))),
    }
}

/// `text.format` as chat's `response_format` (None for plain text).
fn response_format(format: &Value) -> Result<Option<Value>, ApiError> {
    let bad = |message: String| out_of_range("text", message);
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let schema = format
                .get("schema")
                .ok_or_else(|| bad("text.format of type json_schema needs its schema".into()))?;
            let mut json_schema: BTreeMap<&str, Value> = BTreeMap::new();
            json_schema.insert(
                "name",
                format
                    .get("name")
                    .cloned()
                    .unwrap_or_else(|| json!("output")),
            );
            json_schema.insert("schema", schema.clone());
            if let Some(strict) = format.get("strict") {
                json_schema.insert("strict", strict.clone());
            }
            Ok(Some(
                json!({"type": "json_schema", "json_schema": json_schema}),
            ))
        }
        _ => Err(bad(format!(
            "text.format.type must be text, json_object or json_schema, got {format}"
        ))),
    }
}

/// The message that carries a turn's answer into the stored conversation: its text and calls.
pub fn answer_message(text: Option<String>, calls: Vec<ToolCall>) -> ChatMessage {
    let mut message = ChatMessage::new("assistant", text.map(MessageContent::Text));
    message.tool_calls = (!calls.is_empty()).then_some(calls);
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: Value) -> ResponsesRequest {
        serde_json::from_value(body).unwrap()
    }

    fn translate(body: Value) -> Result<Translated, ApiError> {
        chat_request(request(body), Vec::new())
    }

    fn refusal(body: Value) -> (Option<&'static str>, String) {
        match translate(body) {
            Err(error) => (error.param(), error.to_string()),
            Ok(_) => panic!("expected a refusal"),
        }
    }

    #[test]
    fn a_string_input_is_one_user_message_after_the_instructions() {
        let translated = translate(json!({
            "model": "m", "input": "Hi", "instructions": "Be brief.",
            "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9, "user": "u",
        }))
        .unwrap();
        let chat = translated.chat;
        assert_eq!(
            chat.messages,
            [
                ChatMessage::text("system", "Be brief."),
                ChatMessage::text("user", "Hi")
            ]
        );
        assert_eq!(chat.sampling.max_tokens, Some(7));
        assert_eq!(chat.sampling.temperature, Some(0.5));
        assert_eq!(chat.sampling.user.as_deref(), Some("u"));
        // The instructions are not carried into the stored conversation.
        assert_eq!(translated.turn.history, [ChatMessage::text("user", "Hi")]);
        assert!(translated.turn.store);
        assert_eq!(
            translated.turn.echo.instructions.as_deref(),
            Some("Be brief.")
        );
        assert_eq!(translated.turn.echo.tool_choice, json!("auto"));
    }

    #[test]
    fn items_become_messages_calls_and_tool_answers_after_the_earlier_conversation() {
        let earlier = vec![ChatMessage::text("user", "Before")];
        let translated = chat_request(
            request(json!({"model": "m", "input": [
                {"role": "developer", "content": "Rules."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is "}, {"type": "input_text", "text": "the weather?"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}], "id": "msg_1", "status": "completed"},
                {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{\"city\":\"Oslo\"}"},
                {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "Rain."},
                {"type": "reasoning", "id": "rs_1", "summary": []},
            ]})),
            earlier,
        )
        .unwrap();
        let history = translated.turn.history;
        assert_eq!(history.len(), 5);
        assert_eq!(history[0], ChatMessage::text("user", "Before"));
        assert_eq!(history[1], ChatMessage::text("system", "Rules."));
        assert_eq!(
            history[2],
            ChatMessage::text("user", "What is the weather?")
        );
        assert_eq!(history[3].role, "assistant");
        let calls = history[3].tool_calls.as_ref().unwrap();
        assert_eq!(
            calls.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(),
            ["call_1", "call_2"]
        );
        assert_eq!(calls[0].function.arguments, "{\"city\":\"Oslo\"}");
        assert_eq!(history[4].role, "tool");
        assert_eq!(history[4].tool_call_id.as_deref(), Some("call_1"));
        assert!(translated.ignored_fields.is_empty());
    }

    #[test]
    fn each_input_item_is_listed_with_the_id_it_was_given_or_one_of_its_own() {
        let translated = translate(json!({"model": "m", "instructions": "Not an item.", "input": [
            {"role": "developer", "content": "Rules."},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}], "id": "msg_1", "status": "completed"},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}", "id": "fc_9"},
            {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "Rain."}]},
            {"type": "reasoning", "summary": []},
        ]}))
        .unwrap();
        let listed = serde_json::to_value(listed_items(translated.turn.input, "resp_7")).unwrap();
        assert_eq!(
            listed,
            json!([
                {"id": "msg_in0_resp_7", "type": "message", "role": "developer",
                 "content": [{"type": "input_text", "text": "Rules."}], "status": "completed"},
                {"id": "msg_1", "type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}],
                 "status": "completed"},
                {"id": "fc_9", "type": "function_call", "call_id": "call_1", "name": "weather",
                 "arguments": "{}", "status": "completed"},
                {"id": "fco_in3_resp_7", "type": "function_call_output", "call_id": "call_1",
                 "output": "Rain.", "status": "completed"},
                {"id": "rs_in4_resp_7", "type": "reasoning", "summary": []},
            ])
        );
        let text = translate(json!({"model": "m", "input": "Hi"})).unwrap();
        assert_eq!(
            serde_json::to_value(listed_items(text.turn.input, "r")).unwrap(),
            json!([{"id": "msg_in0_r", "type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": "Hi"}], "status": "completed"}])
        );
    }

    #[test]
    fn tools_choice_and_formats_become_chats() {
        let translated = translate(json!({
            "model": "m", "input": "x",
            "tools": [{"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": true, "extra": 1}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": true}, "verbosity": "low"},
            "reasoning": {"effort": "low", "summary": "auto"},
            "stream_options": {"include_obfuscation": false, "include_usage": true},
            "unknown_field": 1,
        }))
        .unwrap();
        let chat = &translated.chat;
        let tool = &chat.tools.as_ref().unwrap()[0];
        assert_eq!(tool.function.name, "f");
        assert_eq!(tool.function.parameters, Some(json!({"type": "object"})));
        assert_eq!(
            chat.tool_choice,
            Some(ToolChoice::Named(NamedToolChoice {
                kind: "function".into(),
                function: FunctionName { name: "f".into() }
            }))
        );
        assert_eq!(
            chat.sampling.response_format,
            Some(
                json!({"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": true}})
            )
        );
        assert_eq!(chat.reasoning_effort.as_deref(), Some("low"));
        assert!(chat.other_fields.contains_key("unknown_field"));
        assert_eq!(
            translated.ignored_fields,
            [
                "reasoning.summary",
                "stream_options.include_usage",
                "text.verbosity",
                "tools[0].extra"
            ]
        );
        assert_eq!(
            translated.turn.echo.text,
            json!({"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": true}})
        );
    }

    #[test]
    fn what_is_not_served_is_refused_by_name() {
        for (body, param, says) in [
            (json!({"model": "m"}), "input", "input is required"),
            (
                json!({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
                "input",
                "input[0]: content[0] is input_image",
            ),
            (
                json!({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}),
                "input",
                "\"item_reference\" are not served",
            ),
            (
                json!({"model": "m", "input": [{"role": "tool", "content": "x"}]}),
                "input",
                "role is \"tool\"",
            ),
            (
                json!({"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
                "input",
                "needs its call_id",
            ),
            (
                json!({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}),
                "tools",
                "\"web_search\" are not served",
            ),
            (
                json!({"model": "m", "input": "x", "tool_choice": {"type": "allowed_tools"}}),
                "tool_choice",
                "is not served",
            ),
            (
                json!({"model": "m", "input": "x", "text": {"format": {"type": "xml"}}}),
                "text",
                "text.format.type",
            ),
            (
                json!({"model": "m", "input": "x", "background": true}),
                "background",
                "background",
            ),
            (
                json!({"model": "m", "input": "x", "truncation": "auto"}),
                "truncation",
                "disabled",
            ),
            (
                json!({"model": "m", "input": "x", "include": ["message.output_text.logprobs"]}),
                "include",
                "include",
            ),
            (
                json!({"model": "m", "input": "x", "conversation": "conv_1"}),
                "conversation",
                "previous_response_id",
            ),
            (
                json!({"model": "m", "input": "x", "max_tool_calls": 2}),
                "max_tool_calls",
                "max_tool_calls",
            ),
        ] {
            let (got_param, message) = refusal(body.clone());
            assert_eq!(got_param, Some(param), "{body}: {message}");
            assert!(message.contains(says), "{body}: {message}");
        }
        let metadata: serde_json::Map<String, Value> =
            (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
        let (param, _) = refusal(json!({"model": "m", "input": "x", "metadata": metadata}));
        assert_eq!(param, Some("metadata"));
    }

    #[test]
    fn the_answer_message_carries_text_and_calls() {
        let call = ToolCall {
            id: "call_1".into(),
            kind: "function".into(),
            function: FunctionCall {
                name: "f".into(),
                arguments: "{}".into(),
            },
        };
        let message = answer_message(None, vec![call.clone()]);
        assert_eq!(message.role, "assistant");
        assert_eq!(message.content, None);
        assert_eq!(message.tool_calls, Some(vec![call]));
        assert_eq!(
            answer_message(Some("Hi".into()), vec![]),
            ChatMessage::text("assistant", "Hi")
        );
    }
}

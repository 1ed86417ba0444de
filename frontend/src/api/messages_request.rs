//! An Anthropic Messages request translated into the chat request it means, so that chat's one
//! `prepare` validates and renders it: `system` becomes a system message, `tool_use` blocks an
//! assistant's calls, `tool_result` blocks tool messages, `tools` functions, `stop_sequences` stop
//! strings, `output_config.format` a response format, a final assistant message a prefill that the
//! answer continues, `thinking` the template's `enable_thinking` and chat's
//! `thinking_token_budget`. What Anthropic defines and this server cannot serve (images,
//! documents, extended thinking without a reasoning parser, server tools, containers) is a 400
//! naming it; a field neither API knows is reported, as chat's are.

use std::collections::BTreeSet;

use serde_json::Value;

use crate::api::error::ApiError;
use crate::api::validate::out_of_range;
use sluice_common::schema::anthropic::{
    Content, ContentBlock, Conversation, MessagesRequest, OutputFormat, System,
    ToolChoice as AnthropicChoice, ToolDefinition, ToolResultContent,
};
use sluice_common::schema::openai::{
    ChatCompletionRequest, ChatMessage, SamplingFields, StopSequences,
};
use sluice_common::schema::openai_tools::{
    FunctionCall, FunctionDefinition, FunctionName, NamedToolChoice, Tool, ToolCall, ToolChoice,
};

/// A block field that changes nothing here and is not reported: prefix caching is automatic, so
/// every prompt prefix is cached without being asked.
const CACHE_CONTROL: &str = "cache_control";

/// The chat request, and the names of the fields inside blocks, tools and metadata that were
/// ignored (the top level's unknown fields travel in the chat request's `other_fields`).
pub struct Translated {
    pub chat: ChatCompletionRequest,
    pub ignored_fields: Vec<String>,
}

const SERVICE_TIERS: &[&str] = &["auto", "standard_only"];
/// One speed is served: the fastest this server has.
const SPEEDS: &[&str] = &["standard", "fast"];
const EFFORTS: &[&str] = &["low", "medium", "high", "xhigh", "max"];

/// A field that takes one of a few values, when given.
fn one_of(param: &'static str, value: Option<&str>, allowed: &[&str]) -> Result<(), ApiError> {
    match value {
        Some(value) if !allowed.contains(&value) => Err(out_of_range(
            param,
            format!("{param} must be one of {allowed:?}, got {value:?}"),
        )),
        _ => Ok(()),
    }
}

/// `output_config.format` as chat's `response_format` (structured output).
fn response_format(format: OutputFormat) -> Result<Value, ApiError> {
    match (format.kind.as_str(), format.schema) {
        ("json_schema", Some(schema)) => Ok(serde_json::json!({
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema, "strict": true},
        })),
        ("json_schema", None) => Err(out_of_range(
            "output_config",
            "output_config.format of type \"json_schema\" needs its `schema`".into(),
        )),
        (kind, _) => Err(out_of_range(
            "output_config",
            format!("output_config.format.type is {kind:?}; the only type is \"json_schema\""),
        )),
    }
}

/// `POST /v1/messages`'s request as a chat request; `splits_thinking` when the server runs a
/// reasoning parser (`--reasoning-parser`), which extended thinking needs.
pub fn chat_request(
    request: MessagesRequest,
    splits_thinking: bool,
) -> Result<Translated, ApiError> {
    let max_tokens = request.max_tokens.ok_or_else(|| {
        out_of_range(
            "max_tokens",
            "max_tokens is required: the most tokens to generate".into(),
        )
    })?;
    if let Some(temperature) = request.temperature {
        if !(0.0..=1.0).contains(&temperature) {
            return Err(out_of_range(
                "temperature",
                format!("temperature must be in [0, 1], got {temperature}"),
            ));
        }
    }
    one_of(
        "service_tier",
        request.service_tier.as_deref(),
        SERVICE_TIERS,
    )?;
    one_of("speed", request.speed.as_deref(), SPEEDS)?;
    if request.container.as_ref().is_some_and(|c| !c.is_null()) {
        return Err(out_of_range(
            "container",
            "code-execution containers are not served here: leave `container` out".into(),
        ));
    }
    let mut ignored = Ignored::default();
    let (response_format, effort) = match request.output_config {
        Some(config) => {
            ignored.fields("output_config", config.other_fields.keys());
            one_of("output_config.effort", config.effort.as_deref(), EFFORTS)?;
            (
                config.format.map(response_format).transpose()?,
                config.effort,
            )
        }
        None => (None, None),
    };
    let user = request.metadata.and_then(|metadata| {
        ignored.fields("metadata", metadata.other_fields.keys());
        metadata.user_id
    });
    let mut chat = chat_conversation(
        request.model,
        request.conversation,
        splits_thinking,
        &mut ignored,
    )?;
    if let Some(budget) = chat.thinking_token_budget.filter(|&b| b >= max_tokens) {
        // Anthropic's rule: the budget is part of max_tokens, and the answer needs room after it.
        return Err(out_of_range(
            "thinking",
            format!(
                "thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})"
            ),
        ));
    }
    chat.sampling = SamplingFields {
        max_tokens: Some(max_tokens),
        temperature: request.temperature,
        top_p: request.top_p,
        top_k: request.top_k,
        stop: request.stop_sequences.map(StopSequences::Many),
        stream: request.stream,
        user,
        response_format,
        ..SamplingFields::default()
    };
    // As chat passes `reasoning_effort`: a variable for the templates that read it.
    if let Some(effort) = effort {
        chat.chat_template_kwargs
            .get_or_insert_with(Default::default)
            .insert("reasoning_effort".to_owned(), Value::String(effort));
    }
    chat.other_fields = request.other_fields;
    Ok(Translated {
        chat,
        ignored_fields: ignored.into_names(),
    })
}

/// The conversation part of a request (what count_tokens takes too) as a chat request with no
/// sampling fields.
pub fn chat_conversation(
    model: String,
    conversation: Conversation,
    splits_thinking: bool,
    ignored: &mut Ignored,
) -> Result<ChatCompletionRequest, ApiError> {
    let thinking = thinking_mode(conversation.thinking.as_ref(), splits_thinking, ignored)?;
    let mut messages = Vec::new();
    if let Some(system) = conversation.system {
        let text = match system {
            System::Text(text) => text,
            System::Blocks(blocks) => block_texts("system", blocks, ignored)?,
        };
        messages.push(ChatMessage::text("system", text));
    }
    for (at, message) in conversation.messages.into_iter().enumerate() {
        let blocks = match message.content {
            Content::Text(text) => vec![ContentBlock::Text {
                text,
                other_fields: Default::default(),
            }],
            Content::Blocks(blocks) => blocks,
        };
        match message.role.as_str() {
            "user" => user_messages(at, blocks, ignored, &mut messages)?,
            "assistant" => messages.push(assistant_message(at, blocks, ignored)?),
            role => {
                return Err(out_of_range(
                    "messages",
                    format!(
                        "messages[{at}].role is {role:?}; it must be \"user\" or \"assistant\" \
                         (the system prompt is the top-level `system`)"
                    ),
                ))
            }
        }
    }
    let tools = conversation
        .tools
        .map(|tools| {
            tools
                .into_iter()
                .enumerate()
                .map(|(at, tool)| function_tool(at, tool, ignored))
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    let (tool_choice, parallel_tool_calls) = match conversation.tool_choice {
        Some(choice) => {
            let parallel = choice.disable_parallel_tool_use.map(|disable| !disable);
            (Some(chat_tool_choice(choice)?), parallel)
        }
        None => (None, None),
    };
    // A final assistant message is a prefill: the answer goes on from it.
    let prefill = messages.last().is_some_and(|last| last.role == "assistant");
    Ok(ChatCompletionRequest {
        model,
        messages,
        continue_final_message: prefill.then_some(true),
        tools,
        tool_choice,
        parallel_tool_calls,
        // Qwen3's templates read `enable_thinking`; a template that does not, ignores it.
        chat_template_kwargs: thinking.enable_thinking.map(|enable| {
            [("enable_thinking".to_owned(), Value::Bool(enable))]
                .into_iter()
                .collect()
        }),
        thinking_token_budget: thinking.budget_tokens,
        ..ChatCompletionRequest::default()
    })
}

/// Names of ignored fields, each once, as `<where>.<name>`.
#[derive(Debug, Default)]
pub struct Ignored {
    names: BTreeSet<String>,
}

impl Ignored {
    pub fn fields<'a>(&mut self, place: &str, names: impl IntoIterator<Item = &'a String>) {
        for name in names {
            if name != CACHE_CONTROL {
                self.names.insert(format!("{place}.{name}"));
            }
        }
    }

    pub fn into_names(self) -> Vec<String> {
        self.names.into_iter().collect()
    }
}

/// What `thinking` asks of the model: whether its template turns thinking on or off, and the
/// thinking's budget.
#[derive(Debug, Default)]
struct ThinkingMode {
    enable_thinking: Option<bool>,
    budget_tokens: Option<u32>,
}

/// `thinking`: `enabled` (with `budget_tokens`) needs a reasoning model whose thinking is split
/// out into thinking blocks (`splits_thinking`); its budget is enforced (the end of thinking is
/// forced there). `disabled` turns a reasoning model's thinking off; `adaptive` leaves it to the
/// model. Anthropic's 1,024-token minimum is not kept: a smaller budget is served as asked.
fn thinking_mode(
    thinking: Option<&Value>,
    splits_thinking: bool,
    ignored: &mut Ignored,
) -> Result<ThinkingMode, ApiError> {
    let Some(Value::Object(fields)) = thinking else {
        return match thinking {
            None | Some(Value::Null) => Ok(ThinkingMode::default()),
            Some(other) => Err(out_of_range(
                "thinking",
                format!(
                    "thinking must be an object such as {{\"type\": \"disabled\"}}, got {other}"
                ),
            )),
        };
    };
    let kind = fields.get("type").and_then(Value::as_str);
    let known: &[&str] = match kind {
        Some("enabled") => &["type", "budget_tokens"],
        _ => &["type"],
    };
    ignored.fields(
        "thinking",
        fields.keys().filter(|name| !known.contains(&name.as_str())),
    );
    match kind {
        Some("disabled") => Ok(ThinkingMode {
            enable_thinking: splits_thinking.then_some(false),
            budget_tokens: None,
        }),
        Some("adaptive") => Ok(ThinkingMode::default()),
        Some("enabled") if !splits_thinking => Err(out_of_range(
            "thinking",
            "extended thinking needs a reasoning model whose thinking is split out: this server \
             was started without --reasoning-parser; leave `thinking` out or give \
             {\"type\": \"disabled\"} or {\"type\": \"adaptive\"}"
                .into(),
        )),
        Some("enabled") => {
            let budget = fields.get("budget_tokens");
            match budget.and_then(Value::as_u64).filter(|&b| b >= 1) {
                Some(budget) => Ok(ThinkingMode {
                    enable_thinking: Some(true),
                    budget_tokens: Some(u32::try_from(budget).unwrap_or(u32::MAX)),
                }),
                None => Err(out_of_range(
                    "thinking",
                    format!(
                        "thinking of type \"enabled\" needs `budget_tokens`, a whole number of \
                         at least 1, got {}",
                        budget.map_or("none".to_owned(), Value::to_string)
                    ),
                )),
            }
        }
        _ => Err(out_of_range(
            "thinking",
            format!(
                "thinking.type must be \"enabled\", \"disabled\" or \"adaptive\", got {}",
                fields
                    .get("type")
                    .map_or("none".to_owned(), Value::to_string)
            ),
        )),
    }
}

/// The refusal of a block this server cannot take.
fn unsupported_block(place: &str, block: &ContentBlock) -> ApiError {
    let why = match block {
        ContentBlock::Image(_) | ContentBlock::Document(_) => "this model takes text only",
        ContentBlock::Thinking(_) | ContentBlock::RedactedThinking(_) => {
            "only an assistant's message holds thinking blocks"
        }
        ContentBlock::ToolUse { .. } => "only an assistant's message holds tool_use blocks",
        ContentBlock::ToolResult { .. } => "only a user's message holds tool_result blocks",
        ContentBlock::Text { .. } => unreachable!("text blocks are served everywhere"),
    };
    out_of_range(
        "messages",
        format!(
            "{place}: {} blocks are not supported here: {why}",
            block.kind()
        ),
    )
}

/// Text blocks joined as chat joins a message's text parts; any other block is refused.
fn block_texts(
    place: &str,
    blocks: Vec<ContentBlock>,
    ignored: &mut Ignored,
) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(blocks.len());
    for block in blocks {
        match block {
            ContentBlock::Text { text, other_fields } => {
                ignored.fields(&format!("{place}.content"), other_fields.keys());
                texts.push(text);
            }
            other => return Err(unsupported_block(place, &other)),
        }
    }
    Ok(texts.join("\n"))
}

/// A user message's blocks, in order: runs of text as user messages, each tool_result as a tool
/// message answering its call.
fn user_messages(
    at: usize,
    blocks: Vec<ContentBlock>,
    ignored: &mut Ignored,
    messages: &mut Vec<ChatMessage>,
) -> Result<(), ApiError> {
    let place = format!("messages[{at}]");
    let mut texts: Vec<String> = Vec::new();
    for block in blocks {
        match block {
            ContentBlock::Text { text, other_fields } => {
                ignored.fields("messages.content", other_fields.keys());
                texts.push(text);
            }
            ContentBlock::ToolResult {
                tool_use_id,
                content,
                is_error,
                other_fields,
            } => {
                ignored.fields("messages.content", other_fields.keys());
                if !texts.is_empty() {
                    messages.push(ChatMessage::text("user", texts.join("\n")));
                    texts.clear();
                }
                let text = match content {
                    None => String::new(),
                    Some(ToolResultContent::Text(text)) => text,
                    Some(ToolResultContent::Blocks(blocks)) => {
                        block_texts(&format!("{place}.tool_result"), blocks, ignored)?
                    }
                };
                // The model must be told that the call failed: the template has no other place.
                let text = if is_error == Some(true) {
                    format!("Error: {text}")
                } else {
                    text
                };
                let mut message = ChatMessage::text("tool", text);
                message.tool_call_id = Some(tool_use_id);
                messages.push(message);
            }
            other => return Err(unsupported_block(&place, &other)),
        }
    }
    if !texts.is_empty() {
        messages.push(ChatMessage::text("user", texts.join("\n")));
    }
    Ok(())
}

/// An assistant message's text and tool_use blocks as one assistant message with calls; its thinking
/// blocks are left out.
fn assistant_message(
    at: usize,
    blocks: Vec<ContentBlock>,
    ignored: &mut Ignored,
) -> Result<ChatMessage, ApiError> {
    let place = format!("messages[{at}]");
    let mut texts = Vec::new();
    let mut calls = Vec::new();
    for block in blocks {
        match block {
            ContentBlock::Text { text, other_fields } => {
                ignored.fields("messages.content", other_fields.keys());
                texts.push(text);
            }
            ContentBlock::ToolUse {
                id,
                name,
                input,
                other_fields,
            } => {
                ignored.fields("messages.content", other_fields.keys());
                calls.push(ToolCall {
                    id,
                    kind: "function".into(),
                    function: FunctionCall {
                        name,
                        arguments: input.to_string(),
                    },
                });
            }
            // An earlier turn's thinking, sent back as clients do (this server's own, with its empty
            // signature, among them): Anthropic's API leaves earlier turns' thinking out of the
            // prompt, and so does this one, as the reasoning models' chat templates do.
            ContentBlock::Thinking(_) | ContentBlock::RedactedThinking(_) => {}
            other => return Err(unsupported_block(&place, &other)),
        }
    }
    let mut message = if texts.is_empty() {
        ChatMessage::new("assistant", None)
    } else {
        ChatMessage::text("assistant", texts.join("\n"))
    };
    message.tool_calls = (!calls.is_empty()).then_some(calls);
    Ok(message)
}

/// A client tool as a function; Anthropic's server tools are refused.
fn function_tool(at: usize, tool: ToolDefinition, ignored: &mut Ignored) -> Result<Tool, ApiError> {
    if let Some(kind) = tool.kind.as_deref().filter(|kind| *kind != "custom") {
        return Err(out_of_range(
            "tools",
            format!(
                "tools[{at}] has type {kind:?}: Anthropic's server tools are not served here; give \
                 client tools (name, description, input_schema)"
            ),
        ));
    }
    let parameters = tool.input_schema.ok_or_else(|| {
        out_of_range(
            "tools",
            format!("tools[{at}].input_schema is required: the JSON schema of the tool's input"),
        )
    })?;
    ignored.fields("tools", tool.other_fields.keys());
    Ok(Tool {
        kind: "function".into(),
        function: FunctionDefinition {
            name: tool.name,
            description: tool.description,
            parameters: Some(parameters),
            strict: None,
        },
    })
}

/// Anthropic's `auto`, `any`, `tool` and `none` as chat's `auto`, `required`, a named function
/// and `none`.
fn chat_tool_choice(choice: AnthropicChoice) -> Result<ToolChoice, ApiError> {
    let mode = |mode: &str| Ok(ToolChoice::Mode(mode.into()));
    match (choice.kind.as_str(), choice.name) {
        ("auto", None) => mode("auto"),
        ("any", None) => mode("required"),
        ("none", None) => mode("none"),
        ("tool", Some(name)) => Ok(ToolChoice::Named(NamedToolChoice {
            kind: "function".into(),
            function: FunctionName { name },
        })),
        ("tool", None) => Err(out_of_range(
            "tool_choice",
            "tool_choice of type \"tool\" needs the tool's `name`".into(),
        )),
        (kind @ ("auto" | "any" | "none"), Some(_)) => Err(out_of_range(
            "tool_choice",
            format!("tool_choice of type {kind:?} takes no `name`"),
        )),
        (kind, _) => Err(out_of_range(
            "tool_choice",
            format!("tool_choice.type is {kind:?}; it must be one of auto, any, tool, none"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use sluice_common::schema::openai::MessageContent;

    fn translate(body: Value) -> Result<Translated, ApiError> {
        chat_request(serde_json::from_value(body).unwrap(), false)
    }

    /// As a server with a reasoning parser translates it.
    fn translate_splitting_thinking(body: Value) -> Result<Translated, ApiError> {
        chat_request(serde_json::from_value(body).unwrap(), true)
    }

    fn text_of(message: &ChatMessage) -> &str {
        match &message.content {
            Some(MessageContent::Text(text)) => text,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_tool_conversation_becomes_chats_messages_calls_and_tools() {
        let translated = translate(json!({
            "model": "m", "max_tokens": 32, "temperature": 0.5, "top_k": 5,
            "stop_sequences": ["END"], "metadata": {"user_id": "u1"},
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": true},
                    {"type": "text", "text": "Thanks", "citations": []}
                ]}
            ],
            "tools": [{"name": "weather", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true}
        }))
        .unwrap();
        let chat = &translated.chat;
        let roles: Vec<&str> = chat.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(
            roles,
            ["system", "user", "assistant", "tool", "tool", "user"]
        );
        assert_eq!(text_of(&chat.messages[0]), "Be brief.");
        let call = &chat.messages[2].tool_calls.as_ref().unwrap()[0];
        assert_eq!(
            (call.id.as_str(), call.function.name.as_str()),
            ("toolu_1", "weather")
        );
        assert_eq!(
            serde_json::from_str::<Value>(&call.function.arguments).unwrap(),
            json!({"city": "Paris"})
        );
        assert_eq!(chat.messages[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(text_of(&chat.messages[3]), "18C");
        assert_eq!(text_of(&chat.messages[4]), "Error: down");
        assert_eq!(text_of(&chat.messages[5]), "Thanks");
        assert_eq!(chat.tool_choice, Some(ToolChoice::Mode("required".into())));
        assert_eq!(chat.parallel_tool_calls, Some(false));
        let tool = &chat.tools.as_ref().unwrap()[0].function;
        assert_eq!(tool.parameters, Some(json!({"type": "object"})));
        assert_eq!(chat.sampling.max_tokens, Some(32));
        assert_eq!(chat.sampling.top_k, Some(5));
        assert_eq!(chat.sampling.user.as_deref(), Some("u1"));
        assert_eq!(
            chat.sampling.stop,
            Some(StopSequences::Many(vec!["END".into()]))
        );
        // cache_control is served (prefix caching is automatic); citations are not.
        assert_eq!(translated.ignored_fields, ["messages.content.citations"]);
    }

    #[test]
    fn output_config_is_a_response_format_and_a_final_assistant_message_a_prefill() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let translated = translate(json!({
            "model": "m", "max_tokens": 8,
            "messages": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1, 2,"}],
            "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "max"}
        }))
        .unwrap();
        let chat = translated.chat;
        assert_eq!(chat.continue_final_message, Some(true));
        let format = chat.sampling.response_format.unwrap();
        assert_eq!(format["type"], "json_schema");
        assert_eq!(format["json_schema"]["schema"], schema);
        let kwargs = chat.chat_template_kwargs.unwrap();
        assert_eq!(kwargs["reasoning_effort"], "max");
        let plain = translate(json!({"model": "m", "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}]}))
        .unwrap();
        assert_eq!(plain.chat.continue_final_message, None);
    }

    #[test]
    fn what_cannot_be_served_is_a_400_naming_it() {
        let base = || json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
        let with = |field: &str, value: Value| {
            let mut body = base();
            body[field] = value;
            body
        };
        let cases = [
            (
                json!({"model": "m", "messages": []}),
                "max_tokens",
                "required",
            ),
            (with("temperature", json!(1.5)), "temperature", "[0, 1]"),
            (
                with(
                    "thinking",
                    json!({"type": "enabled", "budget_tokens": 1024}),
                ),
                "thinking",
                "started without --reasoning-parser",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]),
                ),
                "messages",
                "messages[0]: image blocks are not supported here: this model takes text only",
            ),
            (
                with("messages", json!([{"role": "system", "content": "x"}])),
                "messages",
                "top-level `system`",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}]),
                ),
                "messages",
                "messages[0]: thinking blocks are not supported here: only an assistant's message",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]),
                ),
                "messages",
                "only an assistant's message",
            ),
            (
                with(
                    "tools",
                    json!([{"type": "web_search_20250305", "name": "web_search"}]),
                ),
                "tools",
                "server tools",
            ),
            (
                with("tools", json!([{"name": "f"}])),
                "tools",
                "input_schema is required",
            ),
            (
                with("tool_choice", json!({"type": "tool"})),
                "tool_choice",
                "needs the tool's `name`",
            ),
            (
                with("tool_choice", json!({"type": "sometimes"})),
                "tool_choice",
                "auto, any, tool, none",
            ),
            (
                with("service_tier", json!("priority")),
                "service_tier",
                "standard_only",
            ),
        ];
        for (body, param, words) in cases {
            match translate(body.clone()) {
                Err(ApiError::InvalidParameter {
                    param: got,
                    message,
                }) => {
                    assert_eq!(got, param, "{body}");
                    assert!(message.contains(words), "{message}");
                }
                Err(other) => panic!("{body}: {other:?}"),
                Ok(_) => panic!("{body} was accepted"),
            }
        }
        for thinking in ["disabled", "adaptive"] {
            assert!(translate(with("thinking", json!({"type": thinking}))).is_ok());
        }
    }

    #[test]
    fn thinking_turns_the_templates_thinking_on_or_off_and_carries_its_budget() {
        let with = |thinking: Value| {
            json!({"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}],
                   "thinking": thinking, "output_config": {"effort": "low"}})
        };
        let enabled = translate_splitting_thinking(with(
            json!({"type": "enabled", "budget_tokens": 40, "display": "omitted"}),
        ))
        .unwrap();
        assert_eq!(enabled.chat.thinking_token_budget, Some(40));
        let kwargs = enabled.chat.chat_template_kwargs.unwrap();
        assert_eq!(kwargs["enable_thinking"], true);
        assert_eq!(kwargs["reasoning_effort"], "low");
        assert_eq!(enabled.ignored_fields, ["thinking.display"]);

        let disabled = translate_splitting_thinking(with(json!({"type": "disabled"}))).unwrap();
        assert_eq!(disabled.chat.thinking_token_budget, None);
        assert_eq!(
            disabled.chat.chat_template_kwargs.unwrap()["enable_thinking"],
            false
        );
        // Without a reasoning parser the model does not think: nothing to turn off.
        let plain = translate(with(json!({"type": "disabled"}))).unwrap();
        assert!(!plain
            .chat
            .chat_template_kwargs
            .unwrap()
            .contains_key("enable_thinking"));
        let adaptive = translate_splitting_thinking(with(json!({"type": "adaptive"}))).unwrap();
        assert_eq!(adaptive.chat.thinking_token_budget, None);

        for (thinking, words) in [
            (
                json!({"type": "enabled", "budget_tokens": 64}),
                "less than max_tokens (64)",
            ),
            (json!({"type": "enabled"}), "needs `budget_tokens`"),
            (
                json!({"type": "enabled", "budget_tokens": 0}),
                "at least 1, got 0",
            ),
            (
                json!({"type": "sometimes"}),
                "\"enabled\", \"disabled\" or \"adaptive\"",
            ),
            (json!("enabled"), "must be an object"),
        ] {
            match translate_splitting_thinking(with(thinking.clone())) {
                Err(ApiError::InvalidParameter { param, message }) => {
                    assert_eq!(param, "thinking");
                    assert!(message.contains(words), "{thinking}: {message}");
                }
                Err(other) => panic!("{thinking}: {other:?}"),
                Ok(_) => panic!("{thinking} was accepted"),
            }
        }
    }

    #[test]
    fn an_earlier_turns_thinking_is_left_out_of_the_prompt() {
        let conversation = |assistant: Value| {
            json!({"model": "m", "max_tokens": 8, "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": assistant},
                {"role": "user", "content": "And then?"},
            ]})
        };
        let with_thinking = translate(conversation(json!([
            {"type": "thinking", "thinking": "They greet me.", "signature": ""},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Hello!"},
        ])))
        .unwrap();
        let without = translate(conversation(json!([{"type": "text", "text": "Hello!"}]))).unwrap();
        assert_eq!(with_thinking.chat.messages, without.chat.messages);
        assert!(with_thinking.ignored_fields.is_empty());
    }
}

//! Tools for chat templates that know nothing of them (SmolLM2's): the tools are described in a
//! system prompt in the Hermes format (`<tool_call>` blocks, which the Hermes parser reads back),
//! and the history's calls and tool results are written as text in that same format, so that the
//! conversation renders through any template.

use sluice_common::schema::openai::{ChatMessage, ContentPart, MessageContent};
use sluice_common::schema::openai_tools::{Tool, ToolCall};

const TOOLS_INTRO: &str = "You may call functions to help you answer. They are described below, \
one JSON object per line, between <tools> and </tools>:\n<tools>\n";

const TOOLS_USAGE: &str = "</tools>\n\nTo call a function, write a JSON object with its \"name\" \
and its \"arguments\" between <tool_call> and </tool_call>, like this:\n<tool_call>\n\
{\"name\": \"function_name\", \"arguments\": {\"argument_name\": \"value\"}}\n</tool_call>\n\
Write one such block per call. A function's result comes back between <tool_response> and \
</tool_response>.";

/// The system prompt that describes `tools`.
pub fn tools_system_prompt(tools: &[Tool]) -> String {
    let mut prompt = TOOLS_INTRO.to_owned();
    for tool in tools {
        prompt.push_str(&serde_json::to_string(tool).expect("a tool always serializes"));
        prompt.push('\n');
    }
    prompt.push_str(TOOLS_USAGE);
    prompt
}

fn call_block(call: &ToolCall) -> String {
    // Arguments are kept as the client sent them: JSON text, usually an object.
    format!(
        "<tool_call>\n{{\"name\": {}, \"arguments\": {}}}\n</tool_call>",
        serde_json::to_string(&call.function.name).expect("a string always serializes"),
        call.function.arguments
    )
}

fn text_part(text: &str) -> ContentPart {
    ContentPart {
        kind: "text".into(),
        text: Some(text.into()),
    }
}

/// `content` with `text` after it, on a line of its own.
fn appended(content: Option<MessageContent>, text: String) -> MessageContent {
    match content {
        None => MessageContent::Text(text),
        Some(MessageContent::Text(before)) if before.is_empty() => MessageContent::Text(text),
        Some(MessageContent::Text(before)) => MessageContent::Text(format!("{before}\n{text}")),
        Some(MessageContent::Parts(mut parts)) => {
            parts.push(text_part(&text));
            MessageContent::Parts(parts)
        }
    }
}

/// A message as plain templates can render it: calls and tool results as text.
fn plain_message(message: &ChatMessage) -> ChatMessage {
    let mut message = message.clone();
    if let Some(calls) = message.tool_calls.take() {
        let blocks: Vec<String> = calls.iter().map(call_block).collect();
        message.content = Some(appended(message.content.take(), blocks.join("\n")));
    }
    if message.role == "tool" {
        message.tool_call_id = None;
        message.role = "user".into();
        // Parts are joined one per line, which puts the tags on lines of their own.
        let mut parts = vec![text_part("<tool_response>")];
        match message.content.take() {
            None => {}
            Some(MessageContent::Text(text)) => parts.push(text_part(&text)),
            Some(MessageContent::Parts(more)) => parts.extend(more),
        }
        parts.push(text_part("</tool_response>"));
        message.content = Some(MessageContent::Parts(parts));
    }
    message
}

/// The conversation for a template without tools: `tools` (when given) described in the system
/// message, which is added first when there is none, and the history's calls and results as text.
pub fn plain_template_messages(
    messages: &[ChatMessage],
    tools: Option<&[Tool]>,
) -> Vec<ChatMessage> {
    let mut plain: Vec<ChatMessage> = messages.iter().map(plain_message).collect();
    if let Some(tools) = tools {
        let prompt = tools_system_prompt(tools);
        match plain.first_mut() {
            Some(first) if first.role == "system" || first.role == "developer" => {
                let content = first.content.take();
                first.content = Some(match content {
                    Some(MessageContent::Text(text)) if !text.is_empty() => {
                        MessageContent::Text(format!("{text}\n\n{prompt}"))
                    }
                    content => appended(content, prompt),
                });
            }
            _ => plain.insert(0, ChatMessage::text("system", prompt)),
        }
    }
    plain
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_common::schema::openai_tools::{FunctionCall, FunctionDefinition};

    fn weather_tool() -> Tool {
        Tool {
            kind: "function".into(),
            function: FunctionDefinition {
                name: "get_weather".into(),
                description: Some("The weather in a city".into()),
                parameters: Some(serde_json::json!({"type": "object"})),
                strict: None,
            },
        }
    }

    #[test]
    fn tools_are_described_in_a_new_system_message_or_after_the_given_one() {
        let tools = [weather_tool()];
        let messages =
            plain_template_messages(&[ChatMessage::text("user", "Weather?")], Some(&tools));
        assert_eq!(messages.len(), 2);
        assert_eq!(messages[0].role, "system");
        let Some(MessageContent::Text(prompt)) = &messages[0].content else {
            panic!("{messages:?}")
        };
        assert!(prompt
            .contains("<tools>\n{\"type\":\"function\",\"function\":{\"name\":\"get_weather\""));
        assert!(prompt.contains("<tool_call>"));

        let messages = plain_template_messages(
            &[
                ChatMessage::text("system", "Be brief."),
                ChatMessage::text("user", "?"),
            ],
            Some(&tools),
        );
        assert_eq!(messages.len(), 2);
        let Some(MessageContent::Text(system)) = &messages[0].content else {
            panic!("{messages:?}")
        };
        assert!(system.starts_with("Be brief.\n\nYou may call functions"));
    }

    #[test]
    fn calls_and_results_in_the_history_become_hermes_text() {
        let assistant = ChatMessage {
            content: None,
            tool_calls: Some(vec![ToolCall {
                id: "call_1".into(),
                kind: "function".into(),
                function: FunctionCall {
                    name: "get_weather".into(),
                    arguments: "{\"city\": \"Paris\"}".into(),
                },
            }]),
            ..ChatMessage::text("assistant", "")
        };
        let result = ChatMessage {
            tool_call_id: Some("call_1".into()),
            ..ChatMessage::text("tool", "18 C")
        };
        let plain =
            plain_template_messages(&[ChatMessage::text("user", "?"), assistant, result], None);
        assert_eq!(plain.len(), 3);
        assert_eq!(
            plain[1].content,
            Some(MessageContent::Text(
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
                    .into()
            ))
        );
        assert!(plain[1].tool_calls.is_none());
        assert_eq!(plain[2].role, "user");
        let Some(MessageContent::Parts(parts)) = &plain[2].content else {
            panic!("{plain:?}")
        };
        let texts: Vec<_> = parts.iter().map(|p| p.text.clone().unwrap()).collect();
        assert_eq!(texts, ["<tool_response>", "18 C", "</tool_response>"]);
    }
}

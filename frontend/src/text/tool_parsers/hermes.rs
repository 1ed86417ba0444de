//! Hermes-style calls (Qwen, Hermes, and the prompt Sluice gives templates without tools): each
//! call is a JSON object inside `<tool_call>` and `</tool_call>`; everything else is content.

use sluice_common::schema::openai_tools::Tool;

use super::call_json::scan_call;
use super::call_schema::call_schema;
use super::lark::{calls_after, literal};
use super::tool_call_blocks::{read_blocks, CLOSE, OPEN};
use super::{CallText, OutputParse, ToolCallParser};

#[derive(Debug, Clone, Copy, Default)]
pub struct Hermes;

/// The call a block's inner text holds: a lone JSON object. None when it is not one (yet).
fn block_call(inner: &str, closed: bool) -> Option<CallText> {
    let start = inner.len() - inner.trim_start().len();
    if start == inner.len() {
        return (!closed).then(CallText::default);
    }
    if !inner[start..].starts_with('{') {
        return None;
    }
    let scanned = scan_call(inner, start);
    match scanned.end {
        Some(end) if closed => {
            (scanned.valid && inner[end..].trim().is_empty()).then_some(scanned.call)
        }
        _ if closed => None,
        _ => Some(scanned.call),
    }
}

impl ToolCallParser for Hermes {
    fn name(&self) -> String {
        "hermes".into()
    }

    fn lazy_grammar(&self, tools: &[Tool], at_most_one: bool) -> Option<String> {
        // Each call is the schema's JSON between the tags.
        Some(format!(
            "{}call: /[ \\t\\r\\n]*/ %json {} /[ \\t\\r\\n]*/ {}\n",
            calls_after(OPEN, at_most_one),
            call_schema(tools, "arguments"),
            literal(CLOSE),
        ))
    }

    fn parse(&self, text: &str, finished: bool) -> OutputParse {
        read_blocks(text, finished, block_call)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lazy_grammar_frees_text_and_holds_calls_to_the_schema() {
        let tools: Vec<Tool> = serde_json::from_value(serde_json::json!(
            [{"type": "function", "function": {"name": "f"}}]
        ))
        .unwrap();
        let many = Hermes.lazy_grammar(&tools, false).unwrap();
        assert!(
            many.contains("TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/"),
            "{many}"
        );
        assert!(many.contains("prefix[stop=\"<tool_call>\"]"), "{many}");
        let schema = call_schema(&tools, "arguments");
        assert!(many.contains(&format!("%json {schema}")), "{many}");
        assert!(many.contains("more: TEXT | prefix call more"), "{many}");
        let one = Hermes.lazy_grammar(&tools, true).unwrap();
        assert!(one.contains("more: TEXT\n"), "{one}");
    }

    #[test]
    fn blocks_are_calls_and_the_rest_is_content() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"now\"}</tool_call>";
        let parse = Hermes.parse(text, true);
        assert_eq!(parse.content, "Let me check.\n\n");
        assert_eq!(
            parse.calls,
            vec![
                CallText::named("get_weather", "{\"city\": \"Paris\"}"),
                CallText::named("now", "{}")
            ]
        );
    }

    #[test]
    fn text_without_blocks_is_all_content() {
        let parse = Hermes.parse("Just an answer, a < b.", true);
        assert_eq!(parse.content, "Just an answer, a < b.");
        assert!(parse.calls.is_empty());
    }

    #[test]
    fn a_malformed_block_stays_content() {
        let text = "<tool_call>not json</tool_call> and <tool_call>{\"name\": \"f\"}</tool_call>";
        let parse = Hermes.parse(text, true);
        assert_eq!(parse.content, "<tool_call>not json</tool_call> and ");
        assert_eq!(parse.calls, vec![CallText::named("f", "{}")]);
    }

    #[test]
    fn an_unclosed_last_block_counts_once_finished() {
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n";
        assert_eq!(
            Hermes.parse(text, true).calls,
            vec![CallText::named("f", "{\"a\": 1}")]
        );
        let truncated = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1";
        let parse = Hermes.parse(truncated, true);
        assert!(parse.calls.is_empty());
        assert_eq!(parse.content, truncated);
    }

    #[test]
    fn growing_output_parses_extend_each_other() {
        let text =
            "Sure <tool_call>{\"name\": \"f\", \"arguments\": {\"q\": \"x<y\"}}</tool_call> done";
        let whole = Hermes.parse(text, true);
        for cut in (0..=text.len()).filter(|&cut| text.is_char_boundary(cut)) {
            let partial = Hermes.parse(&text[..cut], false);
            assert!(
                whole.content.starts_with(&partial.content),
                "{cut}: {partial:?}"
            );
            for (partial, whole) in partial.calls.iter().zip(&whole.calls) {
                assert!(
                    partial.name.is_none() || partial.name == whole.name,
                    "{cut}"
                );
                assert!(whole.arguments.starts_with(&partial.arguments), "{cut}");
            }
        }
        assert_eq!(Hermes.parse("Sure <tool_", false).content, "Sure ");
        assert_eq!(whole.content, "Sure  done");
    }
}

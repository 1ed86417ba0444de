//! Llama 3.1+ JSON calls: an output that opens with `{` (after `<|python_tag|>`, when special
//! tokens are kept) is one or more call objects (`"name"` and `"parameters"`), separated by `;`.
//! Any other output is content.

use super::call_json::scan_call;
use super::call_schema::call_schema;
use super::{CallText, OutputParse, ToolCallParser};
use sluice_common::schema::openai_tools::Tool;

pub const PYTHON_TAG: &str = "<|python_tag|>";

#[derive(Debug, Clone, Copy, Default)]
pub struct Llama3Json;

/// The calls of `text` from `start`, separated by `;`; once finished, None unless all are valid.
fn call_sequence(text: &str, mut at: usize, finished: bool) -> Option<Vec<CallText>> {
    let mut calls = Vec::new();
    loop {
        let scanned = scan_call(text, at);
        calls.push(scanned.call);
        let end = match scanned.end {
            Some(end) if scanned.valid => end,
            _ => return (!finished).then_some(calls),
        };
        let rest = text[end..].trim_start();
        let rest = rest.strip_prefix(';').unwrap_or(rest).trim_start();
        if rest.is_empty() {
            return Some(calls);
        }
        if !rest.starts_with('{') {
            return (!finished).then_some(calls);
        }
        at = text.len() - rest.len();
    }
}

impl ToolCallParser for Llama3Json {
    fn name(&self) -> String {
        "llama3_json".into()
    }

    fn lazy_grammar(&self, tools: &[Tool], at_most_one: bool) -> Option<String> {
        // An output is prose (TEXT never opens with `{`), or calls from its start: the schema's
        // JSON objects, `;` between them. `<|python_tag|>` is a special token, which a grammar
        // leaves out: the calls are written without it, as the parser also reads them.
        let more = if at_most_one { "" } else { " (SEP call)*" };
        Some(format!(
            "start: TEXT | WS call{more} WS\n\
             TEXT: /(?s:.*)/ & ~/[ \\t\\r\\n]*\\{{(?s:.*)/\n\
             WS: /[ \\t\\r\\n]*/\n\
             SEP: /[ \\t\\r\\n]*;[ \\t\\r\\n]*/\n\
             call: %json {schema}\n",
            schema = call_schema(tools, "parameters"),
        ))
    }

    fn parse(&self, text: &str, finished: bool) -> OutputParse {
        let trimmed = text.trim_start();
        let body = trimmed
            .strip_prefix(PYTHON_TAG)
            .unwrap_or(trimmed)
            .trim_start();
        if !finished && (body.is_empty() || PYTHON_TAG.starts_with(body)) {
            return OutputParse::default();
        }
        if body.starts_with('{') {
            if let Some(calls) = call_sequence(text, text.len() - body.len(), finished) {
                return OutputParse {
                    content: String::new(),
                    calls,
                };
            }
        }
        OutputParse {
            content: text.to_owned(),
            calls: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_objects_separated_by_semicolons_are_calls() {
        let text = "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", \"parameters\": {}}";
        let parse = Llama3Json.parse(text, true);
        assert_eq!(parse.content, "");
        let names: Vec<_> = parse
            .calls
            .iter()
            .map(|c| c.name.clone().unwrap())
            .collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(parse.calls[0].arguments, "{\"x\": 1}");
    }

    #[test]
    fn the_lazy_grammar_is_prose_or_calls_with_parameters_from_the_start() {
        let tools: Vec<Tool> = serde_json::from_value(serde_json::json!(
            [{"type": "function", "function": {"name": "f"}}]
        ))
        .unwrap();
        let many = Llama3Json.lazy_grammar(&tools, false).unwrap();
        let schema = call_schema(&tools, "parameters");
        assert_eq!(
            many,
            format!(
                "start: TEXT | WS call (SEP call)* WS\n\
                 TEXT: /(?s:.*)/ & ~/[ \\t\\r\\n]*\\{{(?s:.*)/\n\
                 WS: /[ \\t\\r\\n]*/\n\
                 SEP: /[ \\t\\r\\n]*;[ \\t\\r\\n]*/\n\
                 call: %json {schema}\n"
            )
        );
        let one = Llama3Json.lazy_grammar(&tools, true).unwrap();
        assert!(one.starts_with("start: TEXT | WS call WS\n"), "{one}");
    }

    #[test]
    fn prose_and_broken_json_are_content() {
        for text in [
            "The answer is 4.",
            "{\"name\": \"a\", \"parameters\": {",
            "{\"x\": 1} and more",
        ] {
            let parse = Llama3Json.parse(text, true);
            assert_eq!(parse.content, text);
            assert!(parse.calls.is_empty());
        }
    }

    #[test]
    fn a_call_being_written_is_read_as_far_as_it_goes() {
        let parse = Llama3Json.parse("{\"name\": \"a\", \"parameters\": {\"x\": ", false);
        assert_eq!(parse.calls[0].name.as_deref(), Some("a"));
        assert_eq!(parse.calls[0].arguments, "{\"x\": ");
        assert_eq!(Llama3Json.parse(" ", false), OutputParse::default());
        assert_eq!(Llama3Json.parse("Hi", false).content, "Hi");
    }
}

//! Mistral's calls: content, then `[TOOL_CALLS]` and a JSON array of call objects. With special
//! tokens skipped the marker is gone from the text, so an output that opens with an array of
//! objects is read as calls too.

use sluice_common::schema::openai_tools::Tool;

use super::call_json::scan_call_array;
use super::call_schema::call_schema;
use super::lark::{call_list, free_text, holding, prefix};
use super::{OutputParse, ToolCallParser};
use crate::text::partial_marker::partial_marker_len;

pub const MARKER: &str = "[TOOL_CALLS]";

#[derive(Debug, Clone, Copy, Default)]
pub struct Mistral;

/// Where the array of calls opens: after the marker, or at the start (past whitespace).
enum ArrayStart {
    At(usize),
    /// The text may still become calls: hold it all back.
    Undecided,
    None,
}

fn array_start(text: &str, finished: bool) -> ArrayStart {
    if let Some(found) = text.find(MARKER) {
        let after = found + MARKER.len();
        let rest = &text[after..];
        return match rest.trim_start() {
            "" if !finished => ArrayStart::Undecided,
            array if array.starts_with('[') => ArrayStart::At(text.len() - array.len()),
            _ => ArrayStart::None,
        };
    }
    let body = text.trim_start();
    let after_bracket = body.strip_prefix('[').map(str::trim_start);
    match after_bracket {
        Some(objects) if objects.starts_with('{') => ArrayStart::At(text.len() - body.len()),
        Some("") if !finished => ArrayStart::Undecided,
        None if !finished && body.is_empty() => ArrayStart::Undecided,
        _ => ArrayStart::None,
    }
}

impl ToolCallParser for Mistral {
    fn name(&self) -> String {
        "mistral".into()
    }

    fn lazy_grammar(&self, tools: &[Tool], at_most_one: bool) -> Option<String> {
        // The two ways parse() reads calls: an array that opens the output (the marker is a
        // special token, gone from the text when special tokens are skipped; a grammar over text
        // cannot name it without the vocabulary, so a model whose vocabulary has it writes calls
        // this way), or text up to the marker written as text, then the array; nothing but
        // whitespace after it. TEXT is neither: it never holds the marker, nor opens with `[` and
        // `{`; text before the marker does not open so either, so that it ends at the `{`.
        let opening = r"\s*\[\s*\{(?s:.*)".to_owned();
        Some(format!(
            "start: TEXT | calls | prefix calls\n\
             {text}\
             {prefix}\
             {calls}\
             call: %json {schema}\n",
            text = free_text(&[holding(MARKER), opening.clone()]),
            prefix = prefix(MARKER, &[opening]),
            calls = call_list(at_most_one),
            schema = call_schema(tools, "arguments"),
        ))
    }

    fn parse(&self, text: &str, finished: bool) -> OutputParse {
        let calls = match array_start(text, finished) {
            ArrayStart::At(start) => scan_call_array(text, start, finished).filter(|(_, end)| {
                !finished || end.is_some_and(|end| text[end..].trim().is_empty())
            }),
            ArrayStart::Undecided => Some((Vec::new(), None)),
            ArrayStart::None => None,
        };
        match calls {
            // Without the marker the array opens the output: no content comes before it.
            Some((calls, _)) => OutputParse {
                content: text[..text.find(MARKER).unwrap_or(0)].to_owned(),
                calls,
            },
            None => {
                let held = if finished {
                    0
                } else {
                    partial_marker_len(text, MARKER)
                };
                OutputParse {
                    content: text[..text.len() - held].to_owned(),
                    calls: Vec::new(),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_array_after_the_marker_holds_the_calls() {
        let text = "Checking.[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"arguments\": {}}]";
        let parse = Mistral.parse(text, true);
        assert_eq!(parse.content, "Checking.");
        assert_eq!(parse.calls.len(), 2);
        assert_eq!(parse.calls[1].name.as_deref(), Some("b"));
    }

    #[test]
    fn an_array_without_its_marker_is_read_too() {
        let parse = Mistral.parse(" [{\"name\": \"a\", \"arguments\": {}}]", true);
        assert_eq!(parse.calls.len(), 1);
        assert_eq!(parse.content, "");
    }

    #[test]
    fn prose_and_broken_arrays_are_content() {
        for text in [
            "[1] is a citation",
            "Hello",
            "[TOOL_CALLS][{\"name\": \"a\"",
        ] {
            let parse = Mistral.parse(text, true);
            assert_eq!(parse.content, text);
            assert!(parse.calls.is_empty());
        }
    }

    #[test]
    fn the_lazy_grammar_takes_an_opening_array_or_one_after_the_marker() {
        let tools: Vec<Tool> = serde_json::from_value(serde_json::json!(
            [{"type": "function", "function": {"name": "f"}}]
        ))
        .unwrap();
        let many = Mistral.lazy_grammar(&tools, false).unwrap();
        assert!(
            many.starts_with("start: TEXT | calls | prefix calls\n"),
            "{many}"
        );
        assert!(
            many.contains("prefix[stop=\"[TOOL_CALLS]\"]: /(?s:.*)/ & ~/\\s*\\[\\s*\\{(?s:.*)/\n"),
            "{many}"
        );
        let schema = call_schema(&tools, "arguments");
        assert!(many.contains(&format!("call: %json {schema}\n")), "{many}");
        assert!(
            many.contains("calls: OPEN call (SEP call)* CLOSE\n"),
            "{many}"
        );
        let one = Mistral.lazy_grammar(&tools, true).unwrap();
        assert!(one.contains("calls: OPEN call CLOSE\n"), "{one}");
        // What it takes, the parser reads as calls.
        let call = "{\"name\": \"f\", \"arguments\": {}}";
        for text in [
            format!(" [{call}, {call}]\n"),
            format!("Sure.[TOOL_CALLS] [{call}] "),
        ] {
            assert_eq!(
                Mistral.parse(&text, true).calls.len(),
                text.matches("\"f\"").count()
            );
        }
    }

    #[test]
    fn undecided_text_is_held_back() {
        assert_eq!(Mistral.parse("Hi [TOOL_", false).content, "Hi ");
        assert_eq!(Mistral.parse("[", false).content, "");
        let parse = Mistral.parse(
            "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\"",
            false,
        );
        assert_eq!(parse.content, "");
        assert_eq!(parse.calls[0].arguments, "{\"x\"");
    }
}

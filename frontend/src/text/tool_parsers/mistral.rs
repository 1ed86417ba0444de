//! Mistral's calls: content, then `[TOOL_CALLS]` and a JSON array of call objects. With special
//! tokens skipped the marker is gone from the text, so an output that opens with an array of
//! objects is read as calls too.

use super::call_json::scan_call_array;
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

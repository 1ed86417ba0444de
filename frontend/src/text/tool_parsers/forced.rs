//! The outputs of forced calls, which structured output constrains to JSON: a named function's
//! arguments object (`tool_choice` naming it), or an array of call objects (`"required"`).

use super::call_json::scan_call_array;
use super::{CallText, OutputParse, ToolCallParser};

/// `tool_choice` named this function: the whole output is its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedFunction(pub String);

impl ToolCallParser for NamedFunction {
    fn name(&self) -> String {
        format!("named function {}", self.0)
    }

    fn parse(&self, text: &str, finished: bool) -> OutputParse {
        let arguments = if finished && text.trim().is_empty() {
            "{}".to_owned()
        } else {
            text.to_owned()
        };
        OutputParse {
            content: String::new(),
            calls: vec![CallText {
                name: Some(self.0.clone()),
                arguments,
            }],
        }
    }
}

/// `tool_choice: "required"`: the output is a JSON array of `{"name", "arguments"}` objects.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequiredCalls;

impl ToolCallParser for RequiredCalls {
    fn name(&self) -> String {
        "required calls".into()
    }

    fn parse(&self, text: &str, finished: bool) -> OutputParse {
        let start = text.len() - text.trim_start().len();
        let calls = match text[start..].chars().next() {
            Some('[') => scan_call_array(text, start, finished).map(|(calls, _)| calls),
            None if !finished => Some(Vec::new()),
            _ => None,
        };
        match calls {
            Some(calls) => OutputParse {
                content: String::new(),
                calls,
            },
            // Not what the constraint allows (cut short by max_tokens): the text stays content.
            None => OutputParse {
                content: text.to_owned(),
                calls: Vec::new(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_function_takes_the_whole_output_as_arguments() {
        let parse = NamedFunction("f".into()).parse("{\"a\":1}", true);
        assert_eq!(parse.calls[0].name.as_deref(), Some("f"));
        assert_eq!(parse.calls[0].arguments, "{\"a\":1}");
        assert_eq!(
            NamedFunction("f".into()).parse("", true).calls[0].arguments,
            "{}"
        );
        assert_eq!(
            NamedFunction("f".into()).parse("", false).calls[0].arguments,
            ""
        );
    }

    #[test]
    fn required_calls_are_an_array() {
        let text = "[{\"name\":\"a\",\"arguments\":{\"x\":1}},{\"name\":\"b\",\"arguments\":{}}]";
        let parse = RequiredCalls.parse(text, true);
        assert_eq!(parse.calls.len(), 2);
        assert_eq!(parse.calls[0].arguments, "{\"x\":1}");
        let cut = RequiredCalls.parse(&text[..20], true);
        assert!(cut.calls.is_empty());
        assert_eq!(cut.content, &text[..20]);
        assert_eq!(RequiredCalls.parse(&text[..20], false).calls.len(), 1);
    }
}

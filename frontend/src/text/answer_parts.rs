//! One choice's output read as the parts an answer is made of: thinking (`--reasoning-parser`),
//! text, and tool calls (a call's opening, then pieces of its arguments), whole or as it grows.
//! Anthropic's content blocks and the Responses API's output items are both built from these
//! parts; chat keeps its own deltas, which OpenAI defines per choice.

use crate::text::reasoning::{split_whole, ReasoningStream};
use crate::text::tool_call_stream::{read_whole, ToolCallReader, ToolCallStream};
use sluice_common::schema::openai_tools::ToolCall;

/// What a piece of output added, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AnswerPart {
    Thinking(String),
    Text(String),
    /// Call `call` (numbered from 0 in the answer) begins.
    CallOpened {
        call: u32,
        id: String,
        name: String,
    },
    /// More of call `call`'s arguments (JSON text).
    CallArguments {
        call: u32,
        json: String,
    },
}

/// A choice's output split as it grows.
pub struct AnswerStream {
    reasoning: Option<ReasoningStream>,
    calls: Option<ToolCallStream>,
}

impl AnswerStream {
    /// `starts_thinking` when the request's thinking is split out (whether the output begins
    /// inside it); `calls` when its answer is read for tool calls.
    pub fn new(starts_thinking: Option<bool>, calls: Option<ToolCallReader>) -> Self {
        AnswerStream {
            reasoning: starts_thinking.map(ReasoningStream::new),
            calls: calls.map(ToolCallStream::new),
        }
    }

    /// Whether a call has been opened.
    pub fn made_calls(&self) -> bool {
        self.calls.as_ref().is_some_and(ToolCallStream::made_calls)
    }

    /// Takes the next piece of output (`finished` on the last) and answers what it added. Empty
    /// text is never a part.
    pub fn push(&mut self, text: &str, finished: bool) -> Vec<AnswerPart> {
        let mut parts = Vec::new();
        let answer = match &mut self.reasoning {
            Some(stream) => {
                let piece = stream.push(text, finished);
                if !piece.reasoning.is_empty() {
                    parts.push(AnswerPart::Thinking(piece.reasoning));
                }
                piece.content
            }
            None => text.to_owned(),
        };
        let Some(calls) = &mut self.calls else {
            if !answer.is_empty() {
                parts.push(AnswerPart::Text(answer));
            }
            return parts;
        };
        let piece = calls.push(&answer, finished);
        if !piece.content.is_empty() {
            parts.push(AnswerPart::Text(piece.content));
        }
        for delta in piece.calls {
            let call = delta.index;
            if let (Some(id), Some(name)) = (delta.id, delta.function.name) {
                parts.push(AnswerPart::CallOpened { call, id, name });
            }
            if let Some(json) = delta.function.arguments.filter(|json| !json.is_empty()) {
                parts.push(AnswerPart::CallArguments { call, json });
            }
        }
        parts
    }
}

/// A whole output: its thinking (when split out), its text (None when it made calls and wrote
/// nothing else) and its calls.
pub struct WholeAnswer {
    pub thinking: Option<String>,
    pub text: Option<String>,
    pub calls: Vec<ToolCall>,
}

pub fn whole_answer(
    starts_thinking: Option<bool>,
    calls: Option<ToolCallReader>,
    output: String,
) -> WholeAnswer {
    let (thinking, answer) = match starts_thinking {
        Some(starts_thinking) => split_whole(starts_thinking, &output),
        None => (None, output),
    };
    let (text, calls) = match calls {
        Some(reader) => read_whole(reader, &answer),
        None => (Some(answer), Vec::new()),
    };
    WholeAnswer {
        thinking,
        text,
        calls,
    }
}

/// Parts of every kind, as the parsers give them: thinking, text in two pieces, then a call whose
/// arguments come in two pieces (for the tests of what is built from parts).
#[cfg(test)]
pub fn sample_parts() -> Vec<AnswerPart> {
    vec![
        AnswerPart::Thinking("Hmm.".into()),
        AnswerPart::Text("Let me ".into()),
        AnswerPart::Text("check.".into()),
        AnswerPart::CallOpened {
            call: 0,
            id: "call_1".into(),
            name: "f".into(),
        },
        AnswerPart::CallArguments {
            call: 0,
            json: "{\"a\":".into(),
        },
        AnswerPart::CallArguments {
            call: 0,
            json: "1}".into(),
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::tool_parsers::parser_by_name;

    fn hermes() -> ToolCallReader {
        ToolCallReader {
            parser: parser_by_name("hermes").unwrap(),
            max_calls: None,
        }
    }

    #[test]
    fn thinking_text_and_calls_come_apart_in_order() {
        let output = "<think>Hmm.</think>Let me check.<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>";
        let mut stream = AnswerStream::new(Some(false), Some(hermes()));
        let mut parts = Vec::new();
        let chars: Vec<char> = output.chars().collect();
        for (at, piece) in chars.chunks(3).enumerate() {
            let piece: String = piece.iter().collect();
            parts.extend(stream.push(&piece, (at + 1) * 3 >= chars.len()));
        }
        assert!(stream.made_calls());
        let thinking: String = parts
            .iter()
            .filter_map(|p| match p {
                AnswerPart::Thinking(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        let text: String = parts
            .iter()
            .filter_map(|p| match p {
                AnswerPart::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        let arguments: String = parts
            .iter()
            .filter_map(|p| match p {
                AnswerPart::CallArguments { call: 0, json } => Some(json.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(thinking, "Hmm.");
        assert_eq!(text, "Let me check.");
        assert_eq!(arguments, "{\"a\": 1}");
        let opened = parts
            .iter()
            .position(|p| matches!(p, AnswerPart::CallOpened { call: 0, name, .. } if name == "f"))
            .expect("the call opens");
        let first_arguments = parts
            .iter()
            .position(|p| matches!(p, AnswerPart::CallArguments { .. }))
            .unwrap();
        assert!(opened < first_arguments);
        let whole = whole_answer(Some(false), Some(hermes()), output.into());
        assert_eq!(whole.thinking.as_deref(), Some("Hmm."));
        assert_eq!(whole.text.as_deref(), Some("Let me check."));
        assert_eq!(whole.calls.len(), 1);
        assert_eq!(whole.calls[0].function.arguments, "{\"a\": 1}");
    }

    #[test]
    fn without_parsers_the_output_is_text() {
        let mut stream = AnswerStream::new(None, None);
        assert_eq!(
            stream.push("<think>x", false),
            [AnswerPart::Text("<think>x".into())]
        );
        assert_eq!(stream.push("", true), []);
        assert!(!stream.made_calls());
        let whole = whole_answer(None, None, "plain".into());
        assert_eq!(
            (whole.thinking, whole.text, whole.calls.len()),
            (None, Some("plain".into()), 0)
        );
    }
}

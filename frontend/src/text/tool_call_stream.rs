//! One choice's output read for tool calls as it grows: what is new since the last piece (content
//! text, a call's id and name, more of a call's arguments), which is what OpenAI streams, and, read
//! in one piece, the whole message's content and calls.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::text::tool_parsers::ToolCallParser;
use sluice_common::schema::openai_tools::{
    FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta,
};

/// How a request's outputs are read for tool calls.
#[derive(Clone)]
pub struct ToolCallReader {
    pub parser: Arc<dyn ToolCallParser>,
    /// At most this many calls are kept (1 with `parallel_tool_calls: false`).
    pub max_calls: Option<usize>,
}

impl fmt::Debug for ToolCallReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolCallReader")
            .field("parser", &self.parser.name())
            .field("max_calls", &self.max_calls)
            .finish()
    }
}

impl PartialEq for ToolCallReader {
    fn eq(&self, other: &Self) -> bool {
        self.parser.name() == other.parser.name() && self.max_calls == other.max_calls
    }
}

/// What one piece of output added.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolCallPiece {
    pub content: String,
    /// A call's opening delta (id, type, name, empty arguments) comes before its arguments.
    pub calls: Vec<ToolCallDelta>,
}

struct SentCall {
    name: String,
    arguments_sent: usize,
}

pub struct ToolCallStream {
    reader: ToolCallReader,
    text: String,
    content_sent: usize,
    sent: Vec<SentCall>,
}

/// An id unique to this process and unpredictable, in OpenAI's `call_` form.
fn call_id() -> String {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(CALLS.fetch_add(1, Ordering::Relaxed));
    let high = hasher.finish();
    hasher.write_u64(high);
    format!("call_{high:016x}{:08x}", hasher.finish() as u32)
}

impl ToolCallStream {
    pub fn new(reader: ToolCallReader) -> Self {
        ToolCallStream {
            reader,
            text: String::new(),
            content_sent: 0,
            sent: Vec::new(),
        }
    }

    /// Whether a call has been announced.
    pub fn made_calls(&self) -> bool {
        !self.sent.is_empty()
    }

    /// Takes the next piece of output (`finished` on the last) and answers what it added.
    pub fn push(&mut self, text: &str, finished: bool) -> ToolCallPiece {
        self.text.push_str(text);
        let mut parse = self.reader.parser.parse(&self.text, finished);
        if let Some(max_calls) = self.reader.max_calls {
            parse.calls.truncate(max_calls);
        }
        let mut piece = ToolCallPiece::default();
        for (index, call) in parse.calls.iter().enumerate() {
            // Calls are announced in order, each once its name is known.
            let Some(name) = &call.name else { break };
            if index == self.sent.len() {
                self.sent.push(SentCall {
                    name: name.clone(),
                    arguments_sent: 0,
                });
                piece.calls.push(ToolCallDelta {
                    index: index as u32,
                    id: Some(call_id()),
                    kind: Some("function".into()),
                    function: FunctionCallDelta {
                        name: Some(name.clone()),
                        arguments: Some(String::new()),
                    },
                });
            }
            let sent = &mut self.sent[index];
            // A call that turned out malformed left its place to another: nothing more is sent.
            if sent.name != *name
                || call.arguments.len() <= sent.arguments_sent
                || !call.arguments.is_char_boundary(sent.arguments_sent)
            {
                continue;
            }
            piece.calls.push(ToolCallDelta {
                index: index as u32,
                id: None,
                kind: None,
                function: FunctionCallDelta {
                    name: None,
                    arguments: Some(call.arguments[sent.arguments_sent..].to_owned()),
                },
            });
            sent.arguments_sent = call.arguments.len();
        }
        // Whitespace waits for what follows it: around calls, it is dropped.
        let content_end = if finished && !self.made_calls() {
            parse.content.len()
        } else {
            parse.content.trim_end().len()
        };
        if content_end > self.content_sent && parse.content.is_char_boundary(self.content_sent) {
            piece.content = parse.content[self.content_sent..content_end].to_owned();
            self.content_sent = content_end;
        }
        piece
    }
}

/// A whole output read at once: its content (None when it made calls and has no other text) and
/// its calls.
pub fn read_whole(reader: ToolCallReader, text: &str) -> (Option<String>, Vec<ToolCall>) {
    let mut stream = ToolCallStream::new(reader);
    let piece = stream.push(text, true);
    let mut calls: Vec<ToolCall> = Vec::new();
    for delta in piece.calls {
        let arguments = delta.function.arguments.unwrap_or_default();
        match (delta.id, delta.function.name) {
            (Some(id), Some(name)) => calls.push(ToolCall {
                id,
                kind: "function".into(),
                function: FunctionCall { name, arguments },
            }),
            _ => calls[delta.index as usize]
                .function
                .arguments
                .push_str(&arguments),
        }
    }
    let content = (!piece.content.is_empty() || calls.is_empty()).then_some(piece.content);
    (content, calls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::tool_parsers::{parser_by_name, NamedFunction};

    fn reader(name: &str) -> ToolCallReader {
        ToolCallReader {
            parser: parser_by_name(name).unwrap(),
            max_calls: None,
        }
    }

    const HERMES_OUTPUT: &str = "I'll look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}\n</tool_call>";

    #[test]
    fn a_whole_output_becomes_content_and_calls() {
        let (content, calls) = read_whole(reader("hermes"), HERMES_OUTPUT);
        assert_eq!(content.as_deref(), Some("I'll look."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].function.name, "get_weather");
        assert_eq!(calls[0].function.arguments, "{\"city\": \"Paris\"}");
        assert_eq!(calls[1].function.arguments, "{\"zone\": \"CET\"}");
        assert!(calls[0].id.starts_with("call_") && calls[0].id.len() == 29);
        assert_ne!(calls[0].id, calls[1].id);
    }

    #[test]
    fn plain_text_is_kept_exactly() {
        let (content, calls) = read_whole(reader("hermes"), "  two spaces and a newline\n");
        assert_eq!(content.as_deref(), Some("  two spaces and a newline\n"));
        assert!(calls.is_empty());
        let (content, calls) = read_whole(reader("hermes"), "");
        assert_eq!(content.as_deref(), Some(""));
        assert!(calls.is_empty());
    }

    /// Streams `text` in pieces of `size` bytes and joins what came out as a client would.
    fn streamed(
        reader: ToolCallReader,
        text: &str,
        size: usize,
    ) -> (String, Vec<(String, String)>) {
        let mut stream = ToolCallStream::new(reader);
        let mut content = String::new();
        let mut calls: Vec<(String, String)> = Vec::new();
        let mut at = 0;
        while at < text.len() {
            let mut end = (at + size).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            let piece = stream.push(&text[at..end], end == text.len());
            content.push_str(&piece.content);
            for delta in piece.calls {
                let index = delta.index as usize;
                if let Some(name) = delta.function.name {
                    assert_eq!(index, calls.len(), "calls open in order");
                    assert!(delta.id.is_some() && delta.kind.is_some());
                    calls.push((name, String::new()));
                }
                calls[index].1.push_str(&delta.function.arguments.unwrap());
            }
            at = end;
        }
        (content, calls)
    }

    #[test]
    fn streaming_in_any_piece_size_adds_up_to_the_whole_reading() {
        let cases = [
            ("hermes", HERMES_OUTPUT),
            ("hermes", "No calls here, just <b>text</b> and a < sign.  "),
            ("llama3_json", "{\"name\": \"f\", \"parameters\": {\"q\": \"a;b\"}}; {\"name\": \"g\", \"parameters\": {}}"),
            ("mistral", "Sure.[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"n\": [1, 2]}}]"),
            ("pythonic", "[f(q='a, b', n=[1, 2]), g()]"),
            ("pythonic", "[Not a call] but text"),
            ("qwen3_coder", "Let me see.\n<tool_call>\n<function=f>\n<parameter=q>\na</b>\n</parameter>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=g>\n</function>\n</tool_call>"),
        ];
        for (name, text) in cases {
            let (content, calls) = read_whole(reader(name), text);
            let whole_calls: Vec<_> = calls
                .into_iter()
                .map(|call| (call.function.name, call.function.arguments))
                .collect();
            for size in [1, 2, 3, 5, 8, 13, 1000] {
                let (streamed_content, streamed_calls) = streamed(reader(name), text, size);
                assert_eq!(
                    streamed_content,
                    content.clone().unwrap_or_default(),
                    "{name} {size}"
                );
                assert_eq!(streamed_calls, whole_calls, "{name} {size}");
            }
        }
    }

    #[test]
    fn a_call_opens_with_its_name_before_its_arguments_arrive() {
        let mut stream = ToolCallStream::new(reader("hermes"));
        assert_eq!(
            stream.push("<tool_call>{\"name\": \"f", false),
            ToolCallPiece::default()
        );
        let piece = stream.push("\", \"arguments\": {\"a\"", false);
        assert_eq!(piece.calls.len(), 2);
        assert_eq!(piece.calls[0].function.name.as_deref(), Some("f"));
        assert_eq!(piece.calls[0].function.arguments.as_deref(), Some(""));
        assert_eq!(piece.calls[1].function.arguments.as_deref(), Some("{\"a\""));
        let piece = stream.push(": 1}}</tool_call>", true);
        assert_eq!(piece.calls[0].function.arguments.as_deref(), Some(": 1}"));
        assert!(stream.made_calls());
    }

    #[test]
    fn parallel_tool_calls_off_keeps_the_first_call() {
        let reader = ToolCallReader {
            max_calls: Some(1),
            ..reader("hermes")
        };
        let (_, calls) = read_whole(reader, HERMES_OUTPUT);
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].function.name, "get_weather");
    }

    #[test]
    fn a_named_function_streams_its_arguments_from_the_first_token() {
        let reader = ToolCallReader {
            parser: Arc::new(NamedFunction("f".into())),
            max_calls: None,
        };
        let (content, calls) = streamed(reader.clone(), "{\"city\":\"Paris\"}", 4);
        assert_eq!(content, "");
        assert_eq!(
            calls,
            vec![("f".to_string(), "{\"city\":\"Paris\"}".to_string())]
        );
        let (content, calls) = read_whole(reader, "{\"city\":\"Paris\"}");
        assert_eq!(content, None);
        assert_eq!(calls[0].function.arguments, "{\"city\":\"Paris\"}");
    }
}

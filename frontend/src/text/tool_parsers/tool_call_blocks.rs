//! Outputs whose calls sit in `<tool_call>` ... `</tool_call>` blocks (Hermes' JSON, Qwen3-Coder's
//! XML): the text between blocks is content, and each block's inner text is read by the format.

use super::{CallText, OutputParse};
use crate::text::partial_marker::partial_marker_len;

pub const OPEN: &str = "<tool_call>";
pub const CLOSE: &str = "</tool_call>";

/// Reads `text` (the output so far; `finished` once it is whole) block by block. `block_call`
/// reads a block's inner text, `closed` when no more of it will come: Some call when it is one
/// (or, not closed, may still become one), None when it is not (then a closed block stays in the
/// content as it was written).
pub fn read_blocks(
    text: &str,
    finished: bool,
    block_call: impl Fn(&str, bool) -> Option<CallText>,
) -> OutputParse {
    let mut parse = OutputParse::default();
    let mut at = 0;
    loop {
        let rest = &text[at..];
        let Some(found) = rest.find(OPEN) else {
            let held = if finished {
                0
            } else {
                partial_marker_len(rest, OPEN)
            };
            parse.content.push_str(&rest[..rest.len() - held]);
            return parse;
        };
        let open = at + found;
        parse.content.push_str(&text[at..open]);
        let body = open + OPEN.len();
        let (inner, next) = match text[body..].find(CLOSE) {
            Some(close) => (&text[body..body + close], Some(body + close + CLOSE.len())),
            None => (&text[body..], None),
        };
        // An unclosed block at the end of a finished output still counts: the model may stop
        // right after the call.
        let closed = next.is_some() || finished;
        match block_call(inner, closed) {
            Some(call) => parse.calls.push(call),
            None if closed => parse
                .content
                .push_str(&text[open..next.unwrap_or(text.len())]),
            None => {}
        }
        match next {
            Some(next) => at = next,
            None => return parse,
        }
    }
}

//! Text held back while it may still be the beginning of a marker (a tool call's or a think
//! block's tag), so that a stream never sends half a tag as text.

/// How many bytes at the end of `text` begin `marker` (but are not all of it): text to hold back
/// while the rest of the marker may still come.
pub fn partial_marker_len(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&len| text.ends_with(&marker[..len]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_markers_are_held_back() {
        assert_eq!(partial_marker_len("abc <tool_", "<tool_call>"), 6);
        assert_eq!(partial_marker_len("abc <", "<tool_call>"), 1);
        assert_eq!(partial_marker_len("abc", "<tool_call>"), 0);
        // A whole marker is not partial; the parser has found it already.
        assert_eq!(partial_marker_len("<tool_call>", "<tool_call>"), 0);
    }
}

//! Tool calls written as JSON objects (`{"name": ..., "arguments": {...}}`, or `"parameters"` as
//! Llama 3 names them), read while they are still being written: the name once its string is
//! complete, and the arguments' own text as it grows.

use super::CallText;

/// A call object read from its `{`: the call so far, and whether it is a complete, valid call.
#[derive(Debug, Clone, PartialEq)]
pub struct ScannedCall {
    pub call: CallText,
    /// Just past the object's closing `}`, once it has come.
    pub end: Option<usize>,
    /// Closed, valid JSON, with a string `name`.
    pub valid: bool,
}

const ARGUMENT_KEYS: [&str; 2] = ["arguments", "parameters"];

fn skip_whitespace(bytes: &[u8], mut at: usize) -> usize {
    while at < bytes.len() && bytes[at].is_ascii_whitespace() {
        at += 1;
    }
    at
}

/// Just past the JSON value that starts at `start`, or None when `text` ends before it does.
/// The value is assumed well formed; its end is found by counting brackets outside strings.
pub fn value_end(text: &str, start: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (at, &byte) in bytes.iter().enumerate().skip(start) {
        if in_string {
            if escaped {
                escaped = false;
            } else if byte == b'\\' {
                escaped = true;
            } else if byte == b'"' {
                in_string = false;
                if depth == 0 {
                    return Some(at + 1);
                }
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' if depth > 0 => {
                depth -= 1;
                if depth == 0 {
                    return Some(at + 1);
                }
            }
            // A number, true, false or null ends at what follows it.
            b',' | b'}' | b']' | b' ' | b'\t' | b'\r' | b'\n' if depth == 0 => return Some(at),
            _ => {}
        }
    }
    None
}

/// Reads the call object whose `{` is at `start`.
pub fn scan_call(text: &str, start: usize) -> ScannedCall {
    let bytes = text.as_bytes();
    debug_assert_eq!(bytes.get(start), Some(&b'{'));
    let mut call = CallText::default();
    let mut has_arguments = false;
    let mut at = start + 1;
    let incomplete = |call: CallText| ScannedCall {
        call,
        end: None,
        valid: false,
    };
    loop {
        at = skip_whitespace(bytes, at);
        match bytes.get(at) {
            None => return incomplete(call),
            Some(b'}') => break,
            Some(b',') => {
                at += 1;
                continue;
            }
            Some(b'"') => {}
            // Not an object of keys: it never becomes a call.
            Some(_) => return incomplete(call),
        }
        let Some(key_end) = value_end(text, at) else {
            return incomplete(call);
        };
        let key = serde_json::from_str::<String>(&text[at..key_end]).unwrap_or_default();
        at = skip_whitespace(bytes, key_end);
        match bytes.get(at) {
            Some(b':') => at = skip_whitespace(bytes, at + 1),
            _ => return incomplete(call),
        }
        if at >= bytes.len() {
            return incomplete(call);
        }
        let end = value_end(text, at);
        let value = &text[at..end.unwrap_or(text.len())];
        if key == "name" {
            if end.is_some() {
                call.name = serde_json::from_str::<String>(value).ok();
            }
        } else if ARGUMENT_KEYS.contains(&key.as_str()) && !has_arguments {
            has_arguments = true;
            call.arguments = if bytes[at] == b'"' {
                // Arguments written as a JSON string of JSON: their text once the string is whole.
                end.and_then(|_| serde_json::from_str::<String>(value).ok())
                    .unwrap_or_default()
            } else {
                value.to_owned()
            };
        }
        match end {
            Some(end) => at = end,
            None => return incomplete(call),
        }
    }
    let end = at + 1;
    if !has_arguments {
        call.arguments = "{}".into();
    }
    let valid = call.name.is_some()
        && serde_json::from_str::<serde_json::Value>(&text[start..end])
            .is_ok_and(|v| v.is_object());
    ScannedCall {
        call,
        end: Some(end),
        valid,
    }
}

/// The calls of the JSON array whose `[` is at `start`, and where it ends. While the output
/// grows, the calls so far; once finished, None unless it is a whole array of valid calls.
pub fn scan_call_array(
    text: &str,
    start: usize,
    finished: bool,
) -> Option<(Vec<CallText>, Option<usize>)> {
    let bytes = text.as_bytes();
    debug_assert_eq!(bytes.get(start), Some(&b'['));
    let mut calls = Vec::new();
    let mut at = start + 1;
    let unfinished = |calls| (!finished).then_some((calls, None));
    loop {
        at = skip_whitespace(bytes, at);
        match bytes.get(at) {
            None => return unfinished(calls),
            Some(b']') => return Some((calls, Some(at + 1))),
            Some(b',') if !calls.is_empty() => at += 1,
            Some(b'{') => {
                let scanned = scan_call(text, at);
                calls.push(scanned.call);
                match scanned.end {
                    Some(end) if scanned.valid => at = end,
                    _ => return unfinished(calls),
                }
            }
            Some(_) => return unfinished(calls),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_ends_follow_brackets_outside_strings() {
        let text = r#"{"a": "}\"]", "b": [1, {"c": 2}]} tail"#;
        assert_eq!(value_end(text, 0), Some(text.len() - 5));
        assert_eq!(value_end(r#""x\"y" "#, 0), Some(6));
        assert_eq!(value_end("12, 3", 0), Some(2));
        assert_eq!(value_end("12", 0), None);
        assert_eq!(value_end(r#"{"a": [1"#, 0), None);
    }

    #[test]
    fn a_whole_call_is_read_with_its_raw_arguments() {
        let text = r#"{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}"#;
        let scanned = scan_call(text, 0);
        assert_eq!(
            scanned.call,
            CallText::named("get_weather", r#"{"city": "Paris", "days": [1, 2]}"#)
        );
        assert_eq!(scanned.end, Some(text.len()));
        assert!(scanned.valid);
    }

    #[test]
    fn every_prefix_of_a_call_reads_as_a_prefix_of_it() {
        let text = r#"{"name": "f", "parameters": {"q": "a}b", "n": 12}}"#;
        let whole = scan_call(text, 0).call;
        for cut in 1..text.len() {
            let partial = scan_call(&text[..cut], 0);
            assert!(!partial.valid && partial.end.is_none(), "{cut}");
            assert!(
                whole.arguments.starts_with(&partial.call.arguments),
                "{cut}: {partial:?}"
            );
            if let Some(name) = partial.call.name {
                assert_eq!(name, "f");
            }
        }
        assert_eq!(scan_call(&text[..20], 0).call.name.as_deref(), Some("f"));
    }

    #[test]
    fn arguments_given_as_a_string_are_its_text_and_absent_ones_are_empty() {
        let scanned = scan_call(r#"{"name": "f", "arguments": "{\"a\": 1}"}"#, 0);
        assert_eq!(scanned.call, CallText::named("f", r#"{"a": 1}"#));
        let scanned = scan_call(r#"{"name": "f"}"#, 0);
        assert_eq!(scanned.call, CallText::named("f", "{}"));
        assert!(scanned.valid);
    }

    #[test]
    fn objects_without_a_name_or_not_json_are_not_valid() {
        assert!(!scan_call(r#"{"arguments": {}}"#, 0).valid);
        assert!(!scan_call(r#"{"name": "f", "arguments": {,}}"#, 0).valid);
        assert!(!scan_call(r#"{name: "f"}"#, 0).valid);
    }

    #[test]
    fn arrays_hold_calls_and_only_whole_ones_count_when_finished() {
        let text = r#"[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}] "#;
        let (calls, end) = scan_call_array(text, 0, true).unwrap();
        assert_eq!(
            calls,
            vec![
                CallText::named("a", r#"{"x": 1}"#),
                CallText::named("b", "{}")
            ]
        );
        assert_eq!(end, Some(text.len() - 1));
        let (calls, end) = scan_call_array(&text[..51], 0, false).unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].name.as_deref(), Some("b"));
        assert_eq!(end, None);
        assert_eq!(scan_call_array(&text[..51], 0, true), None);
        assert_eq!(scan_call_array("[1, 2]", 0, true), None);
    }
}

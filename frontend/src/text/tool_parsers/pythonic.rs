//! Pythonic calls (Llama 3.2 and 4, and other models prompted so): the output is a Python list of
//! calls with keyword arguments, `[get_weather(city="Paris", days=3), get_time()]`, perhaps between
//! Llama 4's `<|python_start|>` and `<|python_end|>`. Argument values are Python literals (strings,
//! numbers, True, False, None, lists, tuples, dicts), turned into JSON. An output that is not such a
//! list is all content. The arguments grow one whole keyword argument at a time.

use serde_json::{Map, Number, Value};

use super::{CallText, OutputParse, ToolCallParser};

const PYTHON_START: &str = "<|python_start|>";
const PYTHON_END: &str = "<|python_end|>";

#[derive(Debug, Clone, Copy, Default)]
pub struct Pythonic;

/// Where reading stopped: at the end of the text (more may come), or at something that cannot be
/// part of a call list.
#[derive(Debug, PartialEq)]
enum Stop {
    More,
    Invalid,
}

type Read<T> = Result<(T, usize), Stop>;

fn skip_space(bytes: &[u8], mut at: usize) -> usize {
    while at < bytes.len() && bytes[at].is_ascii_whitespace() {
        at += 1;
    }
    at
}

fn is_name_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'.' || byte == b'-'
}

/// A name (function or keyword) at `at`, and just past it; More when the text ends inside it.
fn read_name(text: &str, at: usize) -> Read<&str> {
    let bytes = text.as_bytes();
    let end = (at..bytes.len())
        .find(|&i| !is_name_byte(bytes[i]))
        .unwrap_or(bytes.len());
    if end == bytes.len() {
        return Err(Stop::More);
    }
    if end == at || !(bytes[at].is_ascii_alphabetic() || bytes[at] == b'_') {
        return Err(Stop::Invalid);
    }
    Ok((&text[at..end], end))
}

/// A Python string literal (single or double quotes, backslash escapes) at `at`.
fn read_string(text: &str, at: usize) -> Read<Value> {
    let quote = text.as_bytes()[at] as char;
    let mut value = String::new();
    let mut chars = text[at + 1..].char_indices();
    while let Some((offset, ch)) = chars.next() {
        match ch {
            '\\' => {
                let Some((_, escaped)) = chars.next() else {
                    return Err(Stop::More);
                };
                value.push(match escaped {
                    'n' => '\n',
                    't' => '\t',
                    'r' => '\r',
                    '0' => '\0',
                    other => other,
                });
            }
            '\n' => return Err(Stop::Invalid),
            _ if ch == quote => return Ok((Value::String(value), at + 1 + offset + 1)),
            _ => value.push(ch),
        }
    }
    Err(Stop::More)
}

/// A number, or True, False or None, at `at`.
fn read_atom(text: &str, at: usize) -> Read<Value> {
    let bytes = text.as_bytes();
    let end = (at..bytes.len())
        .find(|&i| !(bytes[i].is_ascii_alphanumeric() || b"+-._".contains(&bytes[i])))
        .unwrap_or(bytes.len());
    if end == bytes.len() {
        return Err(Stop::More);
    }
    let word = text[at..end].replace('_', "");
    let value = match word.as_str() {
        "True" => Value::Bool(true),
        "False" => Value::Bool(false),
        "None" => Value::Null,
        number => {
            if let Ok(int) = number.parse::<i64>() {
                Value::Number(int.into())
            } else {
                let float = number.parse::<f64>().map_err(|_| Stop::Invalid)?;
                Value::Number(Number::from_f64(float).ok_or(Stop::Invalid)?)
            }
        }
    };
    Ok((value, end))
}

/// The items of a list, tuple or dict up to `close`, each read by `item`.
fn read_items<T>(
    text: &str,
    mut at: usize,
    close: u8,
    mut item: impl FnMut(&str, usize) -> Read<T>,
) -> Read<Vec<T>> {
    let bytes = text.as_bytes();
    let mut items = Vec::new();
    loop {
        at = skip_space(bytes, at);
        match bytes.get(at) {
            None => return Err(Stop::More),
            Some(&byte) if byte == close => return Ok((items, at + 1)),
            Some(_) => {}
        }
        let (value, end) = item(text, at)?;
        items.push(value);
        at = skip_space(bytes, end);
        match bytes.get(at) {
            None => return Err(Stop::More),
            Some(b',') => at += 1,
            Some(&byte) if byte == close => return Ok((items, at + 1)),
            Some(_) => return Err(Stop::Invalid),
        }
    }
}

/// A Python literal at `at` as JSON.
fn read_value(text: &str, at: usize) -> Read<Value> {
    let bytes = text.as_bytes();
    let at = skip_space(bytes, at);
    match bytes.get(at) {
        None => Err(Stop::More),
        Some(b'"' | b'\'') => read_string(text, at),
        Some(b'[') => read_items(text, at + 1, b']', read_value)
            .map(|(items, end)| (Value::Array(items), end)),
        Some(b'(') => read_items(text, at + 1, b')', read_value)
            .map(|(items, end)| (Value::Array(items), end)),
        Some(b'{') => {
            let entry = |text: &str, at: usize| -> Read<(String, Value)> {
                let (key, end) = read_value(text, at)?;
                let bytes = text.as_bytes();
                let colon = skip_space(bytes, end);
                match bytes.get(colon) {
                    None => return Err(Stop::More),
                    Some(b':') => {}
                    Some(_) => return Err(Stop::Invalid),
                }
                let (value, end) = read_value(text, colon + 1)?;
                let key = match key {
                    Value::String(key) => key,
                    other => other.to_string(),
                };
                Ok(((key, value), end))
            };
            read_items(text, at + 1, b'}', entry).map(|(entries, end)| {
                (
                    Value::Object(entries.into_iter().collect::<Map<_, _>>()),
                    end,
                )
            })
        }
        Some(_) => read_atom(text, at),
    }
}

/// One call at `at`: its name once read, its arguments as far as whole, and just past its `)` when
/// it is complete.
fn read_call(text: &str, at: usize) -> Result<(CallText, Option<usize>), Stop> {
    let bytes = text.as_bytes();
    let (name, mut at) = match read_name(text, at) {
        Ok(read) => read,
        Err(Stop::More) => return Ok((CallText::default(), None)),
        Err(Stop::Invalid) => return Err(Stop::Invalid),
    };
    if bytes.get(at) != Some(&b'(') {
        return Err(Stop::Invalid);
    }
    at += 1;
    let mut call = CallText::named(name, "{");
    let mut first = true;
    loop {
        at = skip_space(bytes, at);
        match bytes.get(at) {
            None => return Ok((call, None)),
            Some(b')') => {
                call.arguments.push('}');
                return Ok((call, Some(at + 1)));
            }
            Some(_) => {}
        }
        let (key, end) = match read_name(text, at) {
            Ok(read) => read,
            Err(Stop::More) => return Ok((call, None)),
            Err(Stop::Invalid) => return Err(Stop::Invalid),
        };
        let equals = skip_space(bytes, end);
        match bytes.get(equals) {
            None => return Ok((call, None)),
            Some(b'=') => {}
            Some(_) => return Err(Stop::Invalid),
        }
        let (value, end) = match read_value(text, equals + 1) {
            Ok(read) => read,
            Err(Stop::More) => return Ok((call, None)),
            Err(Stop::Invalid) => return Err(Stop::Invalid),
        };
        if !first {
            call.arguments.push(',');
        }
        first = false;
        call.arguments
            .push_str(&Value::String(key.to_owned()).to_string());
        call.arguments.push(':');
        call.arguments.push_str(&value.to_string());
        at = skip_space(bytes, end);
        match bytes.get(at) {
            None => return Ok((call, None)),
            Some(b',') => at += 1,
            Some(b')') => {}
            Some(_) => return Err(Stop::Invalid),
        }
    }
}

/// The calls of a call list whose `[` is at `at`, and whether the list is complete and nothing but
/// whitespace (or Llama 4's end tag) follows it.
fn read_list(text: &str, at: usize) -> Result<(Vec<CallText>, bool), Stop> {
    let bytes = text.as_bytes();
    let mut calls = Vec::new();
    let mut at = at + 1;
    loop {
        at = skip_space(bytes, at);
        match bytes.get(at) {
            None => return Ok((calls, false)),
            Some(b']') if !calls.is_empty() => {
                let rest = text[at + 1..].trim();
                let rest = rest.strip_prefix(PYTHON_END).unwrap_or(rest).trim();
                return if rest.is_empty() {
                    Ok((calls, true))
                } else {
                    Err(Stop::Invalid)
                };
            }
            Some(_) => {}
        }
        let (call, end) = read_call(text, at)?;
        calls.push(call);
        let Some(end) = end else {
            return Ok((calls, false));
        };
        at = skip_space(bytes, end);
        match bytes.get(at) {
            None => return Ok((calls, false)),
            Some(b',') => at += 1,
            Some(b']') => {}
            Some(_) => return Err(Stop::Invalid),
        }
    }
}

impl ToolCallParser for Pythonic {
    fn name(&self) -> String {
        "pythonic".into()
    }

    fn parse(&self, text: &str, finished: bool) -> OutputParse {
        let content = |text: &str| OutputParse {
            content: text.to_owned(),
            calls: Vec::new(),
        };
        let trimmed = text.trim_start();
        let body = trimmed.strip_prefix(PYTHON_START).unwrap_or(trimmed);
        let start = text.len() - body.trim_start().len();
        if start == text.len() || (!finished && PYTHON_START.starts_with(trimmed)) {
            // Nothing but whitespace, or the start tag's beginning: what it is shows later.
            return if finished {
                content(text)
            } else {
                OutputParse::default()
            };
        }
        if text.as_bytes()[start] != b'[' {
            return content(text);
        }
        match read_list(text, start) {
            Ok((calls, true)) => OutputParse {
                content: String::new(),
                calls,
            },
            Ok((calls, false)) if !finished => OutputParse {
                content: String::new(),
                calls,
            },
            // Unfinished when the output ended, or not a call list: the model's text, as it is.
            _ => content(text),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn arguments(call: &CallText) -> Value {
        serde_json::from_str(&call.arguments).unwrap()
    }

    #[test]
    fn a_call_list_becomes_calls_with_json_arguments() {
        let text = "[get_weather(city='San Francisco', days=3, metric=True, note=None, \
                    tags=[\"a\", 'b'], box=(1, 2.5), where={'lat': -1.5, \"n\": 1_000}), get_time()]";
        let parse = Pythonic.parse(text, true);
        assert_eq!(parse.content, "");
        assert_eq!(parse.calls.len(), 2);
        assert_eq!(parse.calls[0].name.as_deref(), Some("get_weather"));
        assert_eq!(
            arguments(&parse.calls[0]),
            json!({"city": "San Francisco", "days": 3, "metric": true, "note": null,
                   "tags": ["a", "b"], "box": [1, 2.5], "where": {"lat": -1.5, "n": 1000}})
        );
        assert_eq!(parse.calls[1], CallText::named("get_time", "{}"));
        let llama4 = "<|python_start|>[f(q=\"it's \\\"x\\\"\\n\")]<|python_end|>";
        let parse = Pythonic.parse(llama4, true);
        assert_eq!(arguments(&parse.calls[0]), json!({"q": "it's \"x\"\n"}));
    }

    #[test]
    fn anything_else_is_content() {
        for text in [
            "The weather is fine.",
            "[1, 2, 3]",
            "[f(1)]",
            "[f(a=1)] and more",
            "[f(a=1)",
            "[]",
            "",
        ] {
            let parse = Pythonic.parse(text, true);
            assert!(parse.calls.is_empty(), "{text}");
            assert_eq!(parse.content, text);
        }
    }

    #[test]
    fn a_growing_list_grows_whole_arguments_and_holds_its_text_back() {
        let text = "[search(query=\"rust (lang)\", limit=5), open(url='https://x.example/?a=[1]')]";
        let whole = Pythonic.parse(text, true);
        let mut last: Vec<CallText> = Vec::new();
        for end in 1..text.len() {
            let parse = Pythonic.parse(&text[..end], false);
            assert_eq!(parse.content, "", "{}", &text[..end]);
            for (at, call) in parse.calls.iter().enumerate() {
                if call.name.is_none() {
                    continue;
                }
                assert_eq!(call.name, whole.calls[at].name);
                assert!(whole.calls[at].arguments.starts_with(&call.arguments));
                if let Some(before) = last.get(at).filter(|before| before.name.is_some()) {
                    assert!(call.arguments.starts_with(&before.arguments));
                }
            }
            last = parse.calls;
        }
    }
}

//! Pythonic calls (Llama 3.2 and 4, and other models prompted so): the output is a Python list of
//! calls with keyword arguments, `[get_weather(city="Paris", days=3), get_time()]`, perhaps between
//! Llama 4's `<|python_start|>` and `<|python_end|>`. Argument values are Python literals (strings,
//! numbers, True, False, None, lists, tuples, dicts), turned into JSON; a string's `\b`, `\f` and
//! `\uXXXX` escapes read as in both Python and JSON (whose strings the lazy grammar writes). An
//! output that is not such a list is all content. The arguments grow one whole keyword argument at
//! a time.

use serde_json::{Map, Number, Value};
use sluice_common::schema::openai_tools::Tool;

use super::call_schema::{arguments_schema, listed_values, nameable_properties, of_type};
use super::lark::{call_list, free_text, literal, regex_escape, sequence};
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

/// The four hex digits of a `\u` escape, next in `chars`.
fn hex4(chars: &mut impl Iterator<Item = (usize, char)>) -> Result<u32, Stop> {
    let mut unit = 0;
    for _ in 0..4 {
        let (_, digit) = chars.next().ok_or(Stop::More)?;
        unit = unit * 16 + digit.to_digit(16).ok_or(Stop::Invalid)?;
    }
    Ok(unit)
}

/// The character of a `\uXXXX` escape whose digits are next in `chars`. Python and JSON read it
/// alike (the lazy grammar writes strings as JSON's), except that JSON writes a character beyond
/// the Basic Multilingual Plane as a pair of them, which is read as that one character.
fn unicode_escape(chars: &mut impl Iterator<Item = (usize, char)>) -> Result<char, Stop> {
    let unit = hex4(chars)?;
    if !(0xD800..0xDC00).contains(&unit) {
        return char::from_u32(unit).ok_or(Stop::Invalid);
    }
    match (chars.next(), chars.next()) {
        (Some((_, '\\')), Some((_, 'u'))) => {}
        (None, _) | (Some((_, '\\')), None) => return Err(Stop::More),
        _ => return Err(Stop::Invalid),
    }
    let low = hex4(chars)?;
    if !(0xDC00..0xE000).contains(&low) {
        return Err(Stop::Invalid);
    }
    char::from_u32(0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)).ok_or(Stop::Invalid)
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
                    'b' => '\u{8}',
                    'f' => '\u{c}',
                    'u' => unicode_escape(&mut chars)?,
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

/// Whether read_name() reads `name` whole: a letter or `_`, then letters, digits, `_`, `.` or `-`.
fn is_name(name: &str) -> bool {
    name.bytes()
        .next()
        .is_some_and(|byte| byte.is_ascii_alphabetic() || byte == b'_')
        && name.bytes().all(is_name_byte)
}

/// A JSON value as the Python literal that read_value() reads back as it. JSON's strings and
/// numbers are such literals already.
fn python_literal(value: &Value) -> String {
    match value {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Number(_) | Value::String(_) => value.to_string(),
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(python_literal).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Object(entries) => {
            let entries: Vec<String> = entries
                .iter()
                .map(|(key, value)| {
                    format!("{}: {}", Value::from(key.as_str()), python_literal(value))
                })
                .collect();
            format!("{{{}}}", entries.join(", "))
        }
    }
}

/// Any literal: a JSON string or number, True, False, None, or a list or dict of literals.
const ANY_LITERAL: &str = "pyval: %json {\"type\":[\"string\",\"number\"]} | \"True\" | \"False\" \
    | \"None\" | pylist | pydict\n\
    pylist: \"[\" WS \"]\" | \"[\" WS pyval (WS \",\" WS pyval)* WS \"]\"\n\
    pydict: \"{\" WS \"}\" | \"{\" WS pyentry (WS \",\" WS pyentry)* WS \"}\"\n\
    pyentry: %json {\"type\":\"string\"} WS \":\" WS pyval\n";

/// The Lark rules of the Python literals that arguments' schemas allow.
#[derive(Default)]
struct Literals {
    rules: String,
    objects: usize,
    /// Whether some value is any literal, so that ANY_LITERAL's rules are needed.
    any: bool,
}

impl Literals {
    /// A Lark expression (one name, or in parentheses) of the literals `schema` allows: its
    /// listed values; by its types, strings and numbers as JSON of the schema (which enforces the
    /// rest of it), True or False, None, lists of its items and dicts of its properties (in its
    /// order, required ones present, no others); anything else (no type, `anyOf`, `$ref`) is any
    /// literal.
    fn value(&mut self, schema: &Value) -> String {
        let listed = listed_values(schema);
        if !listed.is_empty() {
            let choices: Vec<String> = listed
                .into_iter()
                .map(|value| literal(&python_literal(value)))
                .collect();
            return format!("({})", choices.join(" | "));
        }
        let kinds: Vec<&str> = match schema.get("type") {
            Some(Value::String(kind)) => vec![kind],
            Some(Value::Array(kinds)) => kinds.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        if kinds.is_empty() {
            return self.any("pyval");
        }
        let alternatives: Vec<String> = kinds
            .into_iter()
            .map(|kind| match kind {
                "string" | "integer" | "number" => format!("%json {}", of_type(schema, kind)),
                "boolean" => "\"True\" | \"False\"".into(),
                "null" => "\"None\"".into(),
                "array" => {
                    let item = match schema.get("items") {
                        Some(items) if items.is_object() => self.value(items),
                        _ => self.any("pyval"),
                    };
                    format!("\"[\" WS \"]\" | \"[\" WS {item} (WS \",\" WS {item})* WS \"]\"")
                }
                "object" => self.object(schema),
                _ => self.any("pyval"),
            })
            .collect();
        format!("({})", alternatives.join(" | "))
    }

    fn object(&mut self, schema: &Value) -> String {
        let properties = nameable_properties(schema, |_| true).unwrap_or_default();
        if properties.is_empty() {
            return self.any("pydict");
        }
        let entries: Vec<(String, bool)> = properties
            .into_iter()
            .map(|(key, property, required)| {
                let key = literal(&Value::from(key).to_string());
                (
                    format!("{key} WS \":\" WS {}", self.value(property)),
                    required,
                )
            })
            .collect();
        let rule = format!("pyobject{}", self.objects);
        self.objects += 1;
        self.rules
            .push_str(&sequence(&rule, &entries, "WS \",\" WS"));
        format!("\"{{\" WS {rule} WS \"}}\"")
    }

    fn any(&mut self, rule: &str) -> String {
        self.any = true;
        rule.into()
    }
}

impl ToolCallParser for Pythonic {
    fn name(&self) -> String {
        "pythonic".into()
    }

    fn lazy_grammar(&self, tools: &[Tool], at_most_one: bool) -> Option<String> {
        // An output is prose or a call list from its start (after whitespace), whitespace after
        // it. Llama 4's tags are special tokens, which a grammar leaves out, as llama3_json's
        // `<|python_tag|>`: the list is written without them, as the parser also reads it. A call
        // is a tool's name and its properties as keyword arguments, in its schema's order
        // (required ones present, no others), valued by `Literals`. A tool that the parser cannot
        // read back (its name, or a required property's, is not a name read_name() reads) is left
        // out, as is an optional property that it cannot.
        let mut literals = Literals::default();
        let mut calls = String::new();
        let mut alternatives = Vec::new();
        for tool in tools {
            let schema = arguments_schema(tool);
            let Some(properties) = nameable_properties(&schema, is_name) else {
                continue;
            };
            if !is_name(&tool.function.name) {
                continue;
            }
            let rule = format!("c{}", alternatives.len());
            let mut arguments = String::new();
            let call_arguments = if properties.is_empty() {
                String::new()
            } else {
                let items: Vec<(String, bool)> = properties
                    .into_iter()
                    .map(|(key, property, required)| {
                        let value = literals.value(property);
                        (format!("{} WS \"=\" WS {value}", literal(key)), required)
                    })
                    .collect();
                arguments = sequence(&format!("{rule}_a"), &items, "WS \",\" WS");
                format!(" {rule}_a WS")
            };
            let open = literal(&format!("{}(", tool.function.name));
            calls.push_str(&format!(
                "{rule}: {open} WS{call_arguments} \")\"\n{arguments}"
            ));
            alternatives.push(rule);
        }
        // Text that opens with `[` and a name may be a call list (the parser reads anything else
        // there as content), so it is not TEXT.
        let text = free_text(&[format!(
            r"\s*({}\s*)?\[[ \t\n\f\r]*[A-Za-z_](?s:.*)",
            regex_escape(PYTHON_START)
        )]);
        if alternatives.is_empty() {
            return Some(format!("start: TEXT\n{text}"));
        }
        let any = if literals.any { ANY_LITERAL } else { "" };
        Some(format!(
            "start: TEXT | calls\n\
             {text}\
             {}\
             WS: /[ \\t\\r\\n]*/\n\
             call: {}\n\
             {calls}{}{any}",
            call_list(at_most_one),
            alternatives.join(" | "),
            literals.rules,
        ))
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
    fn strings_read_json_escapes_as_python_does() {
        let text = r#"[f(q="a\bb\f\u0001\u00e9\ud83d\ude00\/")]"#;
        let parse = Pythonic.parse(text, true);
        assert_eq!(
            arguments(&parse.calls[0]),
            json!({"q": "a\u{8}b\u{c}\u{1}\u{e9}\u{1f600}/"})
        );
        let parse = Pythonic.parse(r#"[f(q="\ud83d")]"#, true);
        assert!(parse.calls.is_empty());
        assert_eq!(Pythonic.parse(r#"[f(q="\u00"#, false).calls.len(), 1);
    }

    #[test]
    fn the_lazy_grammar_writes_the_schemas_as_python_literals() {
        let tools: Vec<Tool> = serde_json::from_value(json!([
            {"type": "function", "function": {"name": "search", "parameters": {
                "type": "object", "required": ["query"], "properties": {
                    "query": {"type": "string", "maxLength": 9}, "exact": {"type": "boolean"},
                    "unit": {"enum": ["C", null, true]}, "tags": {"type": "array", "items": {"type": "integer"}},
                    "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
                    "extra": {}, "not a name": {}
                }}}},
            {"type": "function", "function": {"name": "1st"}},
            {"type": "function", "function": {"name": "g", "parameters": {
                "type": "object", "required": ["a b"], "properties": {"a b": {}}}}},
            {"type": "function", "function": {"name": "now"}}
        ]))
        .unwrap();
        let many = Pythonic.lazy_grammar(&tools, false).unwrap();
        assert!(many.starts_with("start: TEXT | calls\n"), "{many}");
        assert!(
            many.contains("calls: OPEN call (SEP call)* CLOSE\n"),
            "{many}"
        );
        // Tools whose names (or required properties' names) are not names are left out.
        assert!(many.contains("call: c0 | c1\n"), "{many}");
        assert!(many.contains("c1: \"now(\" WS \")\"\n"), "{many}");
        assert!(!many.contains("not a name"), "{many}");
        for piece in [
            "c0: \"search(\" WS c0_a WS \")\"\n",
            "c0_a: \"query\" WS \"=\" WS (%json {\"type\":\"string\",\"maxLength\":9}) c0_a_t1\n",
            "\"exact\" WS \"=\" WS (\"True\" | \"False\")",
            "\"unit\" WS \"=\" WS (\"\\\"C\\\"\" | \"None\" | \"True\")",
            "(%json {\"type\":\"integer\"}) (WS \",\" WS (%json {\"type\":\"integer\"}))* WS \"]\"",
            "\"where\" WS \"=\" WS (\"{\" WS pyobject0 WS \"}\")",
            "pyobject0: (\"\\\"lat\\\"\" WS \":\" WS (%json {\"type\":\"number\"}))?\n",
            "\"extra\" WS \"=\" WS pyval)?",
            "pyval: %json",
        ] {
            assert!(many.contains(piece), "{piece} in {many}");
        }
        let one = Pythonic.lazy_grammar(&tools, true).unwrap();
        assert!(one.contains("calls: OPEN call CLOSE\n"), "{one}");
        // What it takes, the parser reads back as the literals' JSON.
        let text = r#" [search(query="x\ty", exact=False, unit=None, tags=[1, -2], where={"lat": 1.5e1}, extra={"k": [True]}), now()]"#;
        let parse = Pythonic.parse(text, true);
        assert_eq!(
            arguments(&parse.calls[0]),
            json!({"query": "x\ty", "exact": false, "unit": null, "tags": [1, -2],
                   "where": {"lat": 15.0}, "extra": {"k": [true]}})
        );
        assert_eq!(parse.calls[1], CallText::named("now", "{}"));
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

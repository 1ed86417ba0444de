//! Qwen3-Coder's XML calls:
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! A parameter's value is text, one newline trimmed at each end. It becomes JSON by the type that
//! its tool's schema gives it (the request's tools: `for_tools`): a string stays the text; an
//! integer, number, boolean, null, object or array is read as JSON, and a value that does not read
//! as its type stays a string rather than being lost. A parameter the schema does not name is a
//! string. The arguments grow one whole parameter at a time, so a stream never sends half a value.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;

use super::call_schema::{arguments_schema, listed_values, nameable_properties, of_type};
use super::lark::{calls_after, free_text, holding, literal, sequence};
use super::tool_call_blocks::{read_blocks, CLOSE, OPEN};
use super::{CallText, OutputParse, ToolCallParser};
use sluice_common::schema::openai_tools::Tool;

const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// The JSON type of each parameter, by function name and parameter name.
type ParameterTypes = HashMap<String, HashMap<String, String>>;

#[derive(Debug, Clone, Default)]
pub struct Qwen3Coder {
    types: Arc<ParameterTypes>,
}

/// A schema's type: its `type`, or the first non-null one of a list of types.
fn schema_type(schema: &Value) -> Option<String> {
    match schema.get("type")? {
        Value::String(kind) => Some(kind.clone()),
        Value::Array(kinds) => kinds
            .iter()
            .filter_map(Value::as_str)
            .find(|kind| *kind != "null")
            .map(str::to_owned),
        _ => None,
    }
}

/// A parameter's text as the JSON value of its type.
fn typed_value(text: &str, kind: Option<&str>) -> Value {
    let as_json = || serde_json::from_str::<Value>(text.trim()).ok();
    let read = match kind {
        Some("integer" | "number") => as_json().filter(Value::is_number),
        Some("boolean") => match text.trim().to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
        Some("null") => as_json().filter(Value::is_null),
        Some("object") => as_json().filter(Value::is_object),
        Some("array") => as_json().filter(Value::is_array),
        _ => None,
    };
    read.unwrap_or_else(|| Value::String(text.to_owned()))
}

/// `text` with at most one newline trimmed at each end (the format puts the value on lines of its
/// own; any other whitespace is the value's).
fn trim_one_newline(text: &str) -> &str {
    let text = text.strip_prefix('\n').unwrap_or(text);
    text.strip_suffix('\n').unwrap_or(text)
}

/// Whether parse() reads `name` back as written, as a function's or a parameter's: it ends at the
/// first `>` and is trimmed, and a function's holds no `<` or newline.
fn is_tag_name(name: &str) -> bool {
    !name.is_empty() && name.trim() == name && !name.contains(['<', '>', '\n'])
}

/// A parameter's value and its closing tag, held to what parse() makes of it by its schema's type:
/// an integer, number, boolean, null, object or array is read as JSON, so it is written as JSON
/// of the schema (held to that type); any other value stays the text, so it is text that does not
/// close the parameter early (`VALUE`), or one of the schema's strings when it lists them.
fn value_grammar(schema: &Value) -> String {
    let close = literal(&format!("\n{PARAMETER_END}"));
    match schema_type(schema).as_deref() {
        Some(kind @ ("integer" | "number" | "boolean" | "null" | "object" | "array")) => {
            format!("%json {} {close}", of_type(schema, kind))
        }
        _ => {
            let strings: Option<Vec<&str>> = listed_values(schema)
                .into_iter()
                .map(Value::as_str)
                .collect();
            match strings.filter(|strings| !strings.is_empty()) {
                Some(strings) => {
                    let choices: Vec<String> = strings.into_iter().map(literal).collect();
                    format!("({}) {close}", choices.join(" | "))
                }
                None => "VALUE".into(),
            }
        }
    }
}

impl Qwen3Coder {
    /// The call in a block's inner text: whole, or (not `closed`) as far as it has come; None when
    /// the text is not (and, closed, will not become) one call.
    fn block_call(&self, inner: &str, closed: bool) -> Option<CallText> {
        let body = inner.trim_start();
        if body.is_empty() || (FUNCTION.starts_with(body) && body.len() < FUNCTION.len()) {
            return (!closed).then(CallText::default);
        }
        let after_tag = body.strip_prefix(FUNCTION)?;
        let Some(name_end) = after_tag.find('>') else {
            return (!closed).then(CallText::default);
        };
        let name = after_tag[..name_end].trim();
        if name.is_empty() || name.contains(['<', '\n']) {
            return None;
        }
        let types = self.types.get(name);
        let mut arguments = String::from("{");
        let mut rest = &after_tag[name_end + 1..];
        let mut pairs = 0;
        loop {
            let trimmed = rest.trim_start();
            if let Some(after) = trimmed.strip_prefix(FUNCTION_END) {
                if !after.trim().is_empty() {
                    return None;
                }
                arguments.push('}');
                return Some(CallText::named(name, &arguments));
            }
            let Some(parameter) = trimmed.strip_prefix(PARAMETER) else {
                // Whitespace, or the start of a tag, while the output may still grow.
                let may_grow = [FUNCTION_END, PARAMETER]
                    .iter()
                    .any(|tag| tag.starts_with(trimmed));
                return match (may_grow, closed) {
                    (true, false) => Some(CallText::named(name, &arguments)),
                    // A finished output that stopped between parameters: the call is whole.
                    (_, true) if trimmed.is_empty() => {
                        arguments.push('}');
                        Some(CallText::named(name, &arguments))
                    }
                    _ => None,
                };
            };
            let Some(key_end) = parameter.find('>') else {
                return (!closed).then(|| CallText::named(name, &arguments));
            };
            let key = parameter[..key_end].trim();
            let value_text = &parameter[key_end + 1..];
            let Some(value_end) = value_text.find(PARAMETER_END) else {
                // The value is still being written: it goes out whole, later.
                return (!closed).then(|| CallText::named(name, &arguments));
            };
            let kind = types.and_then(|types| types.get(key)).map(String::as_str);
            let value = typed_value(trim_one_newline(&value_text[..value_end]), kind);
            if pairs > 0 {
                arguments.push(',');
            }
            arguments.push_str(&Value::String(key.to_owned()).to_string());
            arguments.push(':');
            arguments.push_str(&value.to_string());
            pairs += 1;
            rest = &value_text[value_end + PARAMETER_END.len()..];
        }
    }
}

impl ToolCallParser for Qwen3Coder {
    fn name(&self) -> String {
        "qwen3_coder".into()
    }

    fn for_tools(&self, tools: &[Tool]) -> Option<Arc<dyn ToolCallParser>> {
        let types = tools
            .iter()
            .map(|tool| {
                let properties = tool
                    .function
                    .parameters
                    .as_ref()
                    .and_then(|schema| schema.get("properties"))
                    .and_then(Value::as_object);
                let kinds = properties
                    .into_iter()
                    .flatten()
                    .filter_map(|(name, schema)| Some((name.clone(), schema_type(schema)?)))
                    .collect();
                (tool.function.name.clone(), kinds)
            })
            .collect();
        Some(Arc::new(Qwen3Coder {
            types: Arc::new(types),
        }))
    }

    fn lazy_grammar(&self, tools: &[Tool], at_most_one: bool) -> Option<String> {
        // Calls in `<tool_call>` blocks, as Hermes': each is a tool's function tag, then its
        // parameters in its schema's order (required ones present, no others), one tag and one
        // value each, on lines of their own as the template writes them.
        let mut calls = Vec::new();
        let mut rules = String::new();
        for tool in tools {
            let name = &tool.function.name;
            let schema = arguments_schema(tool);
            let Some(properties) = nameable_properties(&schema, is_tag_name) else {
                continue;
            };
            if !is_tag_name(name) {
                continue;
            }
            let rule = format!("c{}", calls.len());
            let parameters: Vec<(String, bool)> = properties
                .iter()
                .map(|(key, property, required)| {
                    let open = literal(&format!("{PARAMETER}{key}>\n"));
                    let item = format!("{open} {} \"\\n\"", value_grammar(property));
                    (item, *required)
                })
                .collect();
            let arguments = if parameters.is_empty() {
                String::new()
            } else {
                rules.push_str(&sequence(&format!("{rule}_a"), &parameters, ""));
                format!(" {rule}_a")
            };
            calls.push(format!(
                "{rule}: {}{arguments} {}\n",
                literal(&format!("\n{FUNCTION}{name}>\n")),
                literal(&format!("{FUNCTION_END}\n{CLOSE}"))
            ));
        }
        if calls.is_empty() {
            return Some(format!("start: TEXT\n{}", free_text(&[holding(OPEN)])));
        }
        let alternatives: Vec<String> = (0..calls.len()).map(|at| format!("c{at}")).collect();
        Some(format!(
            "{}call: {}\n{}{rules}VALUE: (/(?s:.*)/ & ~/{}/) {}\n",
            calls_after(OPEN, at_most_one),
            alternatives.join(" | "),
            calls.concat(),
            holding(PARAMETER_END),
            literal(&format!("\n{PARAMETER_END}")),
        ))
    }

    fn parse(&self, text: &str, finished: bool) -> OutputParse {
        read_blocks(text, finished, |inner, closed| {
            self.block_call(inner, closed)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parser() -> Arc<dyn ToolCallParser> {
        let tools: Vec<Tool> = serde_json::from_value(json!([{
            "type": "function",
            "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"},
                "metric": {"type": ["boolean", "null"]}, "where": {"type": "object"},
                "tags": {"type": "array"}
            }}}
        }]))
        .unwrap();
        Qwen3Coder::default().for_tools(&tools).unwrap()
    }

    const CALL: &str = "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n\
        New York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n\
        </parameter>\n<parameter=where>\n{\"lat\": 1.5}\n</parameter>\n<parameter=tags>\n[\"a\"]\n\
        </parameter>\n<parameter=note>\n  two\nlines \n</parameter>\n</function>\n</tool_call>";

    #[test]
    fn parameters_become_json_of_their_schema_types() {
        let parse = parser().parse(CALL, true);
        assert_eq!(parse.content, "Checking.\n");
        let [call] = &parse.calls[..] else {
            panic!("{:?}", parse.calls)
        };
        assert_eq!(call.name.as_deref(), Some("get_weather"));
        assert_eq!(
            serde_json::from_str::<Value>(&call.arguments).unwrap(),
            json!({"city": "New York", "days": 3, "metric": true, "where": {"lat": 1.5},
                   "tags": ["a"], "note": "  two\nlines "})
        );
    }

    #[test]
    fn a_growing_output_grows_its_arguments_whole_parameters_at_a_time() {
        let parser = parser();
        let whole = parser.parse(CALL, true).calls[0].arguments.clone();
        let mut last = String::new();
        for end in (0..=CALL.len()).filter(|&end| CALL.is_char_boundary(end)) {
            let parse = parser.parse(&CALL[..end], false);
            assert!(
                "Checking.\n".starts_with(&parse.content),
                "{:?}",
                parse.content
            );
            // A call is announced once its name is known.
            if let Some(call) = parse.calls.first().filter(|call| call.name.is_some()) {
                assert!(whole.starts_with(&call.arguments), "{}", call.arguments);
                assert!(call.arguments.starts_with(&last));
                // Only ever whole values: each prefix is valid JSON, or is once closed.
                let valid = |text: &str| serde_json::from_str::<Value>(text).is_ok();
                assert!(
                    valid(&call.arguments) || valid(&format!("{}}}", call.arguments)),
                    "{}",
                    call.arguments
                );
                last = call.arguments.clone();
            }
        }
        assert_eq!(last, whole);
    }

    #[test]
    fn the_lazy_grammar_types_values_as_the_parser_reads_them() {
        let tools: Vec<Tool> = serde_json::from_value(json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "required": ["city"], "properties": {
                    "city": {"type": "string"}, "days": {"type": "integer"},
                    "metric": {"type": ["boolean", "null"]}, "unit": {"enum": ["C", "F"]},
                    "odd>name": {"type": "string"}
                }}}},
            {"type": "function", "function": {"name": "bad>name"}},
            {"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "required": ["a b>"], "properties": {"a b>": {}}}}}
        ]))
        .unwrap();
        let many = Qwen3Coder::default().lazy_grammar(&tools, false).unwrap();
        assert!(
            many.starts_with("start: TEXT | prefix call more\n"),
            "{many}"
        );
        // A tool or a required parameter that parse() cannot read back is left out.
        assert!(many.contains("call: c0\n"), "{many}");
        assert!(!many.contains("odd>name"), "{many}");
        for piece in [
            "c0: \"\\n<function=get_weather>\\n\" c0_a \"</function>\\n</tool_call>\"\n",
            "c0_a: \"<parameter=city>\\n\" VALUE \"\\n\" c0_a_t1\n",
            "\"<parameter=days>\\n\" %json {\"type\":\"integer\"} \"\\n</parameter>\" \"\\n\"",
            "%json {\"type\":\"boolean\"}",
            "(\"C\" | \"F\") \"\\n</parameter>\"",
            "VALUE: (/(?s:.*)/ & ~/(?s:.*<\\/parameter>.*)/) \"\\n</parameter>\"\n",
        ] {
            assert!(many.contains(piece), "{piece} in {many}");
        }
        let one = Qwen3Coder::default().lazy_grammar(&tools, true).unwrap();
        assert!(one.contains("more: TEXT\n"), "{one}");
        // What it takes, the parser reads as a call of the schema's types.
        let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\na\n</parameter>\n\
            <parameter=days>\n2\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n\
            <parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>";
        let parser = Qwen3Coder::default().for_tools(&tools).unwrap();
        let parse = parser.parse(text, true);
        assert_eq!(
            serde_json::from_str::<Value>(&parse.calls[0].arguments).unwrap(),
            json!({"city": "a", "days": 2, "metric": false, "unit": "C"})
        );
    }

    #[test]
    fn untyped_and_mistyped_values_stay_strings_and_malformed_blocks_stay_content() {
        let parse = Qwen3Coder::default().parse(
            "<tool_call><function=f><parameter=n>\n7\n</parameter></function></tool_call>",
            true,
        );
        assert_eq!(parse.calls, vec![CallText::named("f", "{\"n\":\"7\"}")]);
        let parse = parser().parse(
            "<tool_call><function=get_weather><parameter=days>soon</parameter></function></tool_call>",
            true,
        );
        assert_eq!(parse.calls[0].arguments, "{\"days\":\"soon\"}");
        for malformed in [
            "<tool_call>{\"name\": \"f\"}</tool_call>",
            "<tool_call><function=f><parameter=a>1</tool_call>",
            "<tool_call><function=f></function> trailing</tool_call>",
        ] {
            let parse = parser().parse(malformed, true);
            assert!(parse.calls.is_empty(), "{malformed}");
            assert_eq!(parse.content, malformed);
        }
        // Cut off after its last parameter, a finished call is still whole.
        let parse = parser().parse(
            "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n",
            true,
        );
        assert_eq!(
            parse.calls,
            vec![CallText::named("get_weather", "{\"days\":2}")]
        );
    }
}

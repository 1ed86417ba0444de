//! The JSON schemas of the calls a request's tools allow: what forced calls are constrained to and
//! what the parsers' lazy grammars hold an opened call to.

use serde_json::{json, Value};
use sluice_common::schema::openai_tools::Tool;

/// The arguments' schema of a function; a function without one takes any object.
pub fn arguments_schema(tool: &Tool) -> Value {
    tool.function
        .parameters
        .clone()
        .unwrap_or_else(|| json!({"type": "object"}))
}

/// One call of any of `tools`: `{"name": <its name>, <arguments_key>: <its parameters>}` (formats
/// name the arguments `arguments` or, as Llama 3's, `parameters`).
pub fn call_schema(tools: &[Tool], arguments_key: &str) -> Value {
    let calls: Vec<Value> = tools
        .iter()
        .map(|tool| {
            json!({
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    arguments_key: arguments_schema(tool),
                },
                "required": ["name", arguments_key],
                "additionalProperties": false,
            })
        })
        .collect();
    json!({"anyOf": calls})
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_common::schema::openai_tools::FunctionDefinition;

    #[test]
    fn each_tool_is_one_alternative_with_its_arguments_under_the_formats_key() {
        let tool = |name: &str, parameters: Option<Value>| Tool {
            kind: "function".into(),
            function: FunctionDefinition {
                name: name.into(),
                description: None,
                parameters,
                strict: None,
            },
        };
        let schema = call_schema(
            &[
                tool("f", Some(json!({"type": "object", "required": ["a"]}))),
                tool("g", None),
            ],
            "parameters",
        );
        assert_eq!(
            schema,
            json!({"anyOf": [
                {"type": "object", "properties": {"name": {"type": "string", "enum": ["f"]},
                 "parameters": {"type": "object", "required": ["a"]}},
                 "required": ["name", "parameters"], "additionalProperties": false},
                {"type": "object", "properties": {"name": {"type": "string", "enum": ["g"]},
                 "parameters": {"type": "object"}},
                 "required": ["name", "parameters"], "additionalProperties": false},
            ]})
        );
    }
}

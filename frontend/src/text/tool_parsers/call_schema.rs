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

/// `schema` held to one of its types, `kind`: a format that reads a value by one type (Qwen3-Coder's
/// XML), or writes some types its own way (pythonic `True`), constrains the rest as JSON of it.
pub fn of_type(schema: &Value, kind: &str) -> Value {
    let mut schema = match schema {
        Value::Object(_) => schema.clone(),
        // `true` or another schema that is not an object: it allows anything.
        _ => json!({}),
    };
    schema["type"] = kind.into();
    schema
}

/// The values a schema lists, by `const` or `enum`; none when it lists none.
pub fn listed_values(schema: &Value) -> Vec<&Value> {
    match (schema.get("const"), schema.get("enum")) {
        (Some(one), _) => vec![one],
        (None, Some(Value::Array(values))) => values.iter().collect(),
        _ => Vec::new(),
    }
}

/// The properties of an object schema, in its order, each with whether it is required, that a
/// format can write (`nameable`, by name); None when a required one cannot be written, so that no
/// call in the format matches the schema.
pub fn nameable_properties(
    schema: &Value,
    nameable: impl Fn(&str) -> bool,
) -> Option<Vec<(&str, &Value, bool)>> {
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let mut properties = Vec::new();
    for (name, property) in schema
        .get("properties")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
    {
        let is_required = required.contains(&name.as_str());
        if nameable(name) {
            properties.push((name.as_str(), property, is_required));
        } else if is_required {
            return None;
        }
    }
    Some(properties)
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

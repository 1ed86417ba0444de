//! The request fields that constrain the output's shape, read into the engine's one
//! `structured_output` value: OpenAI's `response_format`, vLLM's `guided_*` fields and its newer
//! `structured_outputs` object. At most one constraint per request. The engine core compiles it;
//! one that does not compile comes back as a 400 naming the field it came from.

use serde_json::{Map, Value};

use crate::api::error::ApiError;
use crate::engine::protocol::StructuredOutput;
use sluice_common::schema::openai::SamplingFields;

/// A request's constraint and the field that carried it (the param of its errors).
#[derive(Debug, Clone, PartialEq)]
pub struct Constraint {
    pub value: StructuredOutput,
    pub field: &'static str,
}

/// The one constraint among the request's fields, if any.
pub fn constraint(fields: &SamplingFields) -> Result<Option<Constraint>, ApiError> {
    let mut found: Option<Constraint> = None;
    let candidates = [
        (
            "response_format",
            fields.response_format.as_ref().map(response_format),
        ),
        ("guided_json", fields.guided_json.as_ref().map(guided_json)),
        (
            "guided_regex",
            fields
                .guided_regex
                .as_ref()
                .map(|v| text("guided_regex", v).map(regex).map(Some)),
        ),
        (
            "guided_choice",
            fields
                .guided_choice
                .as_ref()
                .map(|v| choice("guided_choice", v).map(Some)),
        ),
        (
            "guided_grammar",
            fields
                .guided_grammar
                .as_ref()
                .map(|v| text("guided_grammar", v).map(grammar).map(Some)),
        ),
        (
            "structured_outputs",
            fields.structured_outputs.as_ref().map(structured_outputs),
        ),
    ];
    for (field, parsed) in candidates {
        let Some(value) = parsed.transpose()?.flatten() else {
            continue;
        };
        if let Some(first) = &found {
            return Err(invalid(
                field,
                format!(
                    "{field} cannot be combined with {}: give one output constraint",
                    first.field
                ),
            ));
        }
        found = Some(Constraint { value, field });
    }
    Ok(found)
}

fn invalid(param: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::InvalidParameter {
        param,
        message: message.into(),
    }
}

fn kind(kind: &str, spec: String) -> StructuredOutput {
    StructuredOutput {
        kind: kind.to_owned(),
        spec,
        after: String::new(),
    }
}

fn regex(pattern: &str) -> StructuredOutput {
    kind("regex", pattern.to_owned())
}

fn grammar(grammar: &str) -> StructuredOutput {
    kind("grammar", grammar.to_owned())
}

fn text<'a>(param: &'static str, value: &'a Value) -> Result<&'a str, ApiError> {
    value
        .as_str()
        .ok_or_else(|| invalid(param, format!("{param} must be a string")))
}

/// A JSON schema: an object or a boolean, or either as JSON text.
fn schema(param: &'static str, value: &Value) -> Result<StructuredOutput, ApiError> {
    let parsed;
    let schema = match value {
        Value::String(text) => {
            parsed = serde_json::from_str::<Value>(text)
                .map_err(|e| invalid(param, format!("{param} is not valid JSON: {e}")))?;
            &parsed
        }
        other => other,
    };
    if !(schema.is_object() || schema.is_boolean()) {
        return Err(invalid(
            param,
            format!("{param} must be a JSON schema (an object)"),
        ));
    }
    Ok(kind("json_schema", schema.to_string()))
}

fn guided_json(value: &Value) -> Result<Option<StructuredOutput>, ApiError> {
    schema("guided_json", value).map(Some)
}

fn choice(param: &'static str, value: &Value) -> Result<StructuredOutput, ApiError> {
    let choices: Option<Vec<&str>> = value
        .as_array()
        .and_then(|items| items.iter().map(Value::as_str).collect());
    match choices {
        Some(choices) if !choices.is_empty() => {
            Ok(kind("choice", Value::from(choices).to_string()))
        }
        _ => Err(invalid(
            param,
            format!("{param} must be a non-empty array of strings"),
        )),
    }
}

fn object<'a>(param: &'static str, value: &'a Value) -> Result<&'a Map<String, Value>, ApiError> {
    value
        .as_object()
        .ok_or_else(|| invalid(param, format!("{param} must be an object")))
}

/// OpenAI's `response_format`: `{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`.
fn response_format(value: &Value) -> Result<Option<StructuredOutput>, ApiError> {
    const PARAM: &str = "response_format";
    let format = object(PARAM, value)?;
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(kind("json_object", String::new()))),
        Some("json_schema") => {
            let Some(Value::Object(inner)) = format.get("json_schema") else {
                return Err(invalid(
                    PARAM,
                    "response_format json_schema needs a json_schema object",
                ));
            };
            if inner
                .get("strict")
                .is_some_and(|strict| !strict.is_boolean() && !strict.is_null())
            {
                return Err(invalid(
                    PARAM,
                    "response_format json_schema.strict must be a boolean",
                ));
            }
            // Output is always held to the schema, strict or not; an absent schema allows any JSON.
            match inner.get("schema") {
                None => Ok(Some(kind("json_schema", "{}".to_owned()))),
                Some(schema_value) => schema(PARAM, schema_value).map(Some),
            }
        }
        Some(other) => Err(invalid(
            PARAM,
            format!("response_format type must be text, json_object or json_schema, got {other:?}"),
        )),
        None => Err(invalid(PARAM, "response_format needs a string type")),
    }
}

/// vLLM's `structured_outputs`: one of `json`, `regex`, `choice`, `grammar`, `json_object`.
fn structured_outputs(value: &Value) -> Result<Option<StructuredOutput>, ApiError> {
    const PARAM: &str = "structured_outputs";
    let mut found = None;
    for (key, inner) in object(PARAM, value)? {
        if inner.is_null() || (key == "json_object" && inner == &Value::Bool(false)) {
            continue;
        }
        let parsed = match key.as_str() {
            "json" => schema(PARAM, inner)?,
            "regex" => regex(text(PARAM, inner)?),
            "choice" => choice(PARAM, inner)?,
            "grammar" => grammar(text(PARAM, inner)?),
            "json_object" if inner == &Value::Bool(true) => kind("json_object", String::new()),
            _ => {
                return Err(invalid(
                    PARAM,
                    format!("structured_outputs.{key} is not supported (json, regex, choice, grammar, json_object)"),
                ))
            }
        };
        if found.replace(parsed).is_some() {
            return Err(invalid(
                PARAM,
                "structured_outputs takes exactly one constraint",
            ));
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(value: Value) -> SamplingFields {
        serde_json::from_value(value).expect("sampling fields")
    }

    fn param_of(result: Result<Option<Constraint>, ApiError>) -> &'static str {
        match result {
            Err(ApiError::InvalidParameter { param, .. }) => param,
            other => panic!("expected a 400 naming a field, got {other:?}"),
        }
    }

    #[test]
    fn response_format_json_schema_carries_the_schema_as_json_text() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let got = constraint(&fields(json!({"response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema": schema}
        }})))
        .unwrap()
        .unwrap();
        assert_eq!(got.field, "response_format");
        assert_eq!(got.value.kind, "json_schema");
        assert_eq!(
            serde_json::from_str::<Value>(&got.value.spec).unwrap(),
            schema
        );
    }

    #[test]
    fn response_format_text_is_no_constraint_and_json_object_is_one() {
        let none = constraint(&fields(json!({"response_format": {"type": "text"}}))).unwrap();
        assert_eq!(none, None);
        let object =
            constraint(&fields(json!({"response_format": {"type": "json_object"}}))).unwrap();
        assert_eq!(object.unwrap().value, kind("json_object", String::new()));
    }

    #[test]
    fn guided_fields_map_to_their_kinds() {
        let cases = [
            (json!({"guided_regex": "a+"}), "regex", "a+".to_owned()),
            (
                json!({"guided_choice": ["x", "y"]}),
                "choice",
                r#"["x","y"]"#.to_owned(),
            ),
            (
                json!({"guided_grammar": "start: \"a\""}),
                "grammar",
                "start: \"a\"".to_owned(),
            ),
            (
                json!({"guided_json": "{\"type\": \"string\"}"}),
                "json_schema",
                r#"{"type":"string"}"#.to_owned(),
            ),
            (
                json!({"structured_outputs": {"regex": "b"}}),
                "regex",
                "b".to_owned(),
            ),
            (
                json!({"structured_outputs": {"choice": ["z"]}}),
                "choice",
                r#"["z"]"#.to_owned(),
            ),
        ];
        for (body, expected_kind, expected_spec) in cases {
            let got = constraint(&fields(body.clone())).unwrap().unwrap();
            assert_eq!(
                (got.value.kind.as_str(), got.value.spec),
                (expected_kind, expected_spec),
                "{body}"
            );
        }
    }

    #[test]
    fn bad_constraints_name_their_field() {
        assert_eq!(
            param_of(constraint(&fields(
                json!({"response_format": {"type": "xml"}})
            ))),
            "response_format"
        );
        assert_eq!(
            param_of(constraint(&fields(
                json!({"response_format": {"type": "json_schema"}})
            ))),
            "response_format"
        );
        assert_eq!(
            param_of(constraint(&fields(json!({"guided_json": "{not json"})))),
            "guided_json"
        );
        assert_eq!(
            param_of(constraint(&fields(json!({"guided_json": 3})))),
            "guided_json"
        );
        assert_eq!(
            param_of(constraint(&fields(json!({"guided_choice": []})))),
            "guided_choice"
        );
        assert_eq!(
            param_of(constraint(&fields(json!({"guided_choice": [1]})))),
            "guided_choice"
        );
        assert_eq!(
            param_of(constraint(&fields(json!({"guided_regex": 5})))),
            "guided_regex"
        );
        assert_eq!(
            param_of(constraint(&fields(
                json!({"structured_outputs": {"regex": "a", "choice": ["b"]}})
            ))),
            "structured_outputs"
        );
        assert_eq!(
            param_of(constraint(&fields(
                json!({"structured_outputs": {"structural_tag": "x"}})
            ))),
            "structured_outputs"
        );
    }

    #[test]
    fn two_constraints_are_refused() {
        let body = json!({"guided_regex": "a", "guided_choice": ["b"]});
        assert_eq!(param_of(constraint(&fields(body))), "guided_choice");
    }
}

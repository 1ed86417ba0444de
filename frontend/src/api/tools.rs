//! Tool calling's request fields (`tools`, `tool_choice`, `parallel_tool_calls`; the deprecated
//! `functions` and `function_call` are refused), checked into what the chat template is given,
//! how the output is read, and the structured output that forces a call.

use std::sync::Arc;

use serde_json::Value;

use crate::api::error::ApiError;
use crate::engine::protocol::StructuredOutput;
use crate::text::tool_call_stream::ToolCallReader;
use crate::text::tool_parsers::call_schema::{arguments_schema, call_schema};
use crate::text::tool_parsers::{NamedFunction, RequiredCalls, ToolCallParser};
use sluice_common::schema::openai::ChatCompletionRequest;
use sluice_common::schema::openai_tools::{Tool, ToolChoice};

/// A request's tool calling, checked.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ValidTools {
    /// The tools the chat template is given: none with `tool_choice: "none"`.
    pub rendered: Option<Vec<Tool>>,
    /// How the output is read for calls: none when no call can be made.
    pub reader: Option<ToolCallReader>,
    /// What forces a call (`"required"` or a named function).
    pub structured_output: Option<StructuredOutput>,
    /// `"auto"`'s lazy grammar, when the parser has one: free text, but a call that the model
    /// opens is well formed and one of the tools (applied unless `--no-tool-call-grammar`).
    pub lazy_grammar: Option<StructuredOutput>,
}

fn invalid(param: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::InvalidParameter {
        param,
        message: message.into(),
    }
}

/// OpenAI's rule for function names.
fn valid_function_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-')
}

pub fn check_tool_definitions(tools: &[Tool]) -> Result<(), ApiError> {
    for (index, tool) in tools.iter().enumerate() {
        if tool.kind != "function" {
            return Err(invalid(
                "tools",
                format!(
                    "tools[{index}].type must be \"function\", got {:?}",
                    tool.kind
                ),
            ));
        }
        let name = &tool.function.name;
        if !valid_function_name(name) {
            return Err(invalid(
                "tools",
                format!(
                    "tools[{index}].function.name must be 1 to 64 letters, digits, '_' or '-', \
                     got {name:?}"
                ),
            ));
        }
        if tools[..index].iter().any(|t| t.function.name == *name) {
            return Err(invalid(
                "tools",
                format!("tools[{index}].function.name {name:?} is defined twice"),
            ));
        }
        if let Some(parameters) = &tool.function.parameters {
            if !parameters.is_object() {
                return Err(invalid(
                    "tools",
                    format!("tools[{index}].function.parameters must be a JSON schema object"),
                ));
            }
        }
    }
    Ok(())
}

/// The schema of `"required"`'s output: an array of one or more calls of the given tools.
fn required_calls_schema(tools: &[Tool], at_most_one: bool) -> Value {
    let mut schema = serde_json::json!({"type": "array", "minItems": 1, "items": call_schema(tools, "arguments")});
    if at_most_one {
        schema["maxItems"] = 1.into();
    }
    schema
}

fn json_schema(schema: &Value) -> Option<StructuredOutput> {
    Some(StructuredOutput {
        kind: "json_schema".into(),
        spec: schema.to_string(),
        after: String::new(),
    })
}

fn grammar(lark: String) -> StructuredOutput {
    StructuredOutput {
        kind: "grammar".into(),
        spec: lark,
        after: String::new(),
    }
}

/// Checks a chat request's tool fields. `auto_parser` reads `"auto"`'s output: the server's
/// parser, or Hermes' when the template has no tools and the Hermes prompt describes them.
pub fn check_tools(
    request: &ChatCompletionRequest,
    auto_parser: Arc<dyn ToolCallParser>,
) -> Result<ValidTools, ApiError> {
    if request.functions.is_some() {
        return Err(invalid(
            "functions",
            "functions is deprecated and not supported; send tools instead",
        ));
    }
    if request.function_call.is_some() {
        return Err(invalid(
            "function_call",
            "function_call is deprecated and not supported; send tool_choice instead",
        ));
    }
    let tools = request.tools.clone().unwrap_or_default();
    check_tool_definitions(&tools)?;
    let max_calls = match request.parallel_tool_calls {
        Some(false) => Some(1),
        _ => None,
    };
    let reader = |parser: Arc<dyn ToolCallParser>| Some(ToolCallReader { parser, max_calls });
    let choice = match &request.tool_choice {
        None if tools.is_empty() => return Ok(ValidTools::default()),
        None => ToolChoice::Mode("auto".into()),
        Some(choice) => choice.clone(),
    };
    let named = match choice {
        ToolChoice::Mode(mode) if mode == "none" => return Ok(ValidTools::default()),
        _ if tools.is_empty() => {
            return Err(invalid(
                "tool_choice",
                "tool_choice other than \"none\" needs tools",
            ))
        }
        ToolChoice::Mode(mode) if mode == "auto" => {
            // A format that types values by the tools' schemas reads with this request's.
            let parser = auto_parser.for_tools(&tools).unwrap_or(auto_parser);
            let lazy_grammar = parser
                .lazy_grammar(&tools, max_calls.is_some())
                .map(grammar);
            return Ok(ValidTools {
                rendered: Some(tools),
                reader: reader(parser),
                structured_output: None,
                lazy_grammar,
            });
        }
        ToolChoice::Mode(mode) if mode == "required" => {
            let schema = required_calls_schema(&tools, max_calls.is_some());
            return Ok(ValidTools {
                structured_output: json_schema(&schema),
                rendered: Some(tools),
                reader: reader(Arc::new(RequiredCalls)),
                lazy_grammar: None,
            });
        }
        ToolChoice::Mode(mode) => {
            return Err(invalid(
                "tool_choice",
                format!(
                    "tool_choice must be \"none\", \"auto\", \"required\" or a named function, \
                     got {mode:?}"
                ),
            ))
        }
        ToolChoice::Named(named) if named.kind != "function" => {
            return Err(invalid(
                "tool_choice",
                format!(
                    "tool_choice.type must be \"function\", got {:?}",
                    named.kind
                ),
            ))
        }
        ToolChoice::Named(named) => named.function.name,
    };
    let Some(tool) = tools.iter().find(|tool| tool.function.name == named) else {
        return Err(invalid(
            "tool_choice",
            format!("tool_choice names {named:?}, which is not among the tools"),
        ));
    };
    Ok(ValidTools {
        structured_output: json_schema(&arguments_schema(tool)),
        reader: reader(Arc::new(NamedFunction(named))),
        rendered: Some(tools),
        lazy_grammar: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::tool_parsers::Hermes;

    fn request(extra: Value) -> ChatCompletionRequest {
        let mut body = serde_json::json!({
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [
                {"type": "function", "function": {"name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
                {"type": "function", "function": {"name": "now"}}
            ]
        });
        for (key, value) in extra.as_object().unwrap() {
            body[key] = value.clone();
        }
        serde_json::from_value(body).unwrap()
    }

    fn checked(extra: Value) -> Result<ValidTools, ApiError> {
        check_tools(&request(extra), Arc::new(Hermes))
    }

    fn param_of(result: Result<ValidTools, ApiError>) -> &'static str {
        match result.unwrap_err() {
            ApiError::InvalidParameter { param, .. } => param,
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn tools_default_to_auto_which_parses_without_forcing() {
        let tools = checked(serde_json::json!({})).unwrap();
        assert_eq!(tools.rendered.unwrap().len(), 2);
        assert_eq!(tools.reader.unwrap().parser.name(), "hermes");
        assert_eq!(tools.structured_output, None);
    }

    #[test]
    fn none_renders_and_parses_nothing() {
        let tools = checked(serde_json::json!({"tool_choice": "none"})).unwrap();
        assert_eq!(tools, ValidTools::default());
        let mut no_tools = request(serde_json::json!({}));
        no_tools.tools = None;
        assert_eq!(
            check_tools(&no_tools, Arc::new(Hermes)).unwrap(),
            ValidTools::default()
        );
    }

    #[test]
    fn required_forces_an_array_of_calls() {
        let tools = checked(serde_json::json!({"tool_choice": "required"})).unwrap();
        let output = tools.structured_output.unwrap();
        assert_eq!(output.kind, "json_schema");
        let schema: Value = serde_json::from_str(&output.spec).unwrap();
        assert_eq!(schema["type"], "array");
        assert_eq!(schema["minItems"], 1);
        assert!(schema.get("maxItems").is_none());
        let calls = schema["items"]["anyOf"].as_array().unwrap();
        assert_eq!(calls[0]["properties"]["name"]["enum"][0], "get_weather");
        assert_eq!(
            calls[0]["properties"]["arguments"]["properties"]["city"]["type"],
            "string"
        );
        assert_eq!(
            calls[1]["properties"]["arguments"],
            serde_json::json!({"type": "object"})
        );
        assert_eq!(tools.reader.unwrap().parser.name(), "required calls");

        let one =
            checked(serde_json::json!({"tool_choice": "required", "parallel_tool_calls": false}))
                .unwrap();
        let schema: Value = serde_json::from_str(&one.structured_output.unwrap().spec).unwrap();
        assert_eq!(schema["maxItems"], 1);
        assert_eq!(one.reader.unwrap().max_calls, Some(1));
    }

    #[test]
    fn a_named_function_forces_its_arguments_schema() {
        let tools = checked(serde_json::json!(
            {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        ))
        .unwrap();
        let schema: Value = serde_json::from_str(&tools.structured_output.unwrap().spec).unwrap();
        assert_eq!(schema["properties"]["city"]["type"], "string");
        assert_eq!(
            tools.reader.unwrap().parser.name(),
            "named function get_weather"
        );
    }

    #[test]
    fn bad_tool_fields_are_400s_naming_them() {
        let unknown =
            serde_json::json!({"tool_choice": {"type": "function", "function": {"name": "fly"}}});
        assert_eq!(param_of(checked(unknown)), "tool_choice");
        assert_eq!(
            param_of(checked(serde_json::json!({"tool_choice": "always"}))),
            "tool_choice"
        );
        let bad_type =
            serde_json::json!({"tool_choice": {"type": "tool", "function": {"name": "now"}}});
        assert_eq!(param_of(checked(bad_type)), "tool_choice");
        for tools in [
            serde_json::json!([{"type": "retrieval", "function": {"name": "a"}}]),
            serde_json::json!([{"type": "function", "function": {"name": "has space"}}]),
            serde_json::json!([{"type": "function", "function": {"name": "a"}},
                               {"type": "function", "function": {"name": "a"}}]),
            serde_json::json!([{"type": "function", "function": {"name": "a", "parameters": [1]}}]),
        ] {
            assert_eq!(
                param_of(checked(serde_json::json!({"tools": tools}))),
                "tools"
            );
        }
        let mut no_tools = request(serde_json::json!({"tool_choice": "required"}));
        no_tools.tools = None;
        assert_eq!(
            param_of(check_tools(&no_tools, Arc::new(Hermes))),
            "tool_choice"
        );
        let legacy = serde_json::json!({"functions": [{"name": "a"}]});
        assert_eq!(param_of(checked(legacy)), "functions");
        assert_eq!(
            param_of(checked(serde_json::json!({"function_call": "auto"}))),
            "function_call"
        );
    }
}

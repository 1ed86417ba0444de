//! The OpenAI API's tool-calling bodies: tool definitions and `tool_choice` in requests, tool calls
//! in the history's assistant messages and in responses, and their stream deltas.

use serde::{Deserialize, Serialize};

/// One entry of `tools`; only `"type": "function"` exists.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, utoipa::ToSchema)]
pub struct Tool {
    #[serde(rename = "type")]
    #[schema(pattern = "^function$")]
    pub kind: String,
    pub function: FunctionDefinition,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, utoipa::ToSchema)]
pub struct FunctionDefinition {
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The arguments' JSON schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"`, or one named function.
#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    Named(NamedToolChoice),
}

#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
pub struct NamedToolChoice {
    #[serde(rename = "type")]
    #[schema(pattern = "^function$")]
    pub kind: String,
    pub function: FunctionName,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, utoipa::ToSchema)]
pub struct FunctionName {
    pub name: String,
}

/// A call the assistant made: in a response, or in an assistant message of the history.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, utoipa::ToSchema)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_kind")]
    #[schema(pattern = "^function$")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".into()
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, utoipa::ToSchema)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as JSON text, as the model wrote them.
    pub arguments: String,
}

/// A stream's piece of tool call `index`: its id, type and name come first, in one delta, then
/// its arguments arrive as text pieces.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, utoipa::ToSchema)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionCallDelta,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize, utoipa::ToSchema)]
pub struct FunctionCallDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_choice_takes_a_mode_or_a_named_function() {
        assert_eq!(
            serde_json::from_str::<ToolChoice>(r#""required""#).unwrap(),
            ToolChoice::Mode("required".into())
        );
        let named: ToolChoice =
            serde_json::from_str(r#"{"type":"function","function":{"name":"f"}}"#).unwrap();
        assert!(matches!(named, ToolChoice::Named(choice) if choice.function.name == "f"));
        assert!(serde_json::from_str::<ToolChoice>(r#"{"type":"function"}"#).is_err());
    }

    #[test]
    fn history_tool_calls_default_their_type() {
        let call: ToolCall =
            serde_json::from_str(r#"{"id":"c1","function":{"name":"f","arguments":"{}"}}"#)
                .unwrap();
        assert_eq!(call.kind, "function");
    }

    #[test]
    fn deltas_omit_what_they_do_not_carry() {
        let delta = ToolCallDelta {
            index: 0,
            id: None,
            kind: None,
            function: FunctionCallDelta {
                name: None,
                arguments: Some("{\"a".into()),
            },
        };
        assert_eq!(
            serde_json::to_string(&delta).unwrap(),
            r#"{"index":0,"function":{"arguments":"{\"a"}}"#
        );
    }
}

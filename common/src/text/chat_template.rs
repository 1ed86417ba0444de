//! The model's chat template, rendered the way transformers'
//! `apply_chat_template(..., tokenize=False)` renders it.
//!
//! transformers runs templates in Jinja2 with `trim_blocks`, `lstrip_blocks`,
//! the loop-controls extension, Python's string methods on values, and the
//! globals `raise_exception` and `strftime_now`, and its own `tojson` (Python's
//! `json.dumps`, non-ASCII kept). The environment below mirrors that, so that
//! a prompt rendered here tokenizes exactly like one rendered in Python.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::schema::openai::{ChatMessage, MessageContent};
use crate::text::python_compat;

const TEMPLATE_NAME: &str = "chat_template";
/// Template instructions a request's own template may run per rendering: far more than a model's
/// template spends on a long conversation, far less than a runaway loop.
const REQUEST_TEMPLATE_FUEL: u64 = 20_000_000;

/// Errors from loading or rendering a chat template. Loading errors
/// (`Io`, `Config`, `Missing`, `Syntax`) are the server's; rendering errors
/// (`Raised`, `Render`, `UnsupportedContentPart`, `MissingPartText`) are the request's (HTTP 400).
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("invalid {path}: {source}")]
    Config {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("the model has no chat template")]
    Missing,
    #[error("invalid chat template: {0}")]
    Syntax(minijinja::Error),
    /// The template called `raise_exception(message)`, usually to reject the
    /// conversation (e.g. roles that do not alternate).
    #[error("{0}")]
    Raised(String),
    #[error("chat template rendering failed: {0}")]
    Render(minijinja::Error),
    #[error("content part of type {0:?} is not supported; only \"text\" parts are")]
    UnsupportedContentPart(String),
    #[error("a content part of type \"text\" has no \"text\" string")]
    MissingPartText,
    #[error("continue_final_message: the final message's text does not appear in the rendered conversation")]
    FinalMessageNotRendered,
}

impl ChatTemplateError {
    /// Whether the request (rather than the server's model files) is at fault.
    pub fn is_request_error(&self) -> bool {
        matches!(
            self,
            Self::Raised(_)
                | Self::Render(_)
                | Self::UnsupportedContentPart(_)
                | Self::MissingPartText
                | Self::FinalMessageNotRendered
        )
    }
}

/// The message of a template's `raise_exception`, carried as the render error's source.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct RaisedByTemplate(String);

/// A compiled chat template with the special tokens it may refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Whether the template reads the `tools` variable (else tools go in a system prompt).
    uses_tools: bool,
    /// The template's text, by which a tool-call format is recognised.
    source: String,
}

#[derive(Deserialize)]
struct TokenizerConfig {
    chat_template: Option<TemplateSource>,
    bos_token: Option<SpecialToken>,
    eos_token: Option<SpecialToken>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TemplateSource {
    Single(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

/// Special tokens are written as plain strings or as `AddedToken` objects.
#[derive(Deserialize)]
#[serde(untagged)]
enum SpecialToken {
    Text(String),
    Added { content: String },
}

impl SpecialToken {
    fn into_text(self) -> String {
        match self {
            Self::Text(text) | Self::Added { content: text } => text,
        }
    }
}

#[derive(Serialize)]
struct TemplateMessage<'a> {
    role: &'a str,
    content: Cow<'a, str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<TemplateToolCall<'a>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
}

/// A call as templates read it: like transformers' callers (vLLM), arguments are a JSON value
/// rather than text, so that templates can iterate them.
#[derive(Serialize)]
struct TemplateToolCall<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    function: TemplateFunctionCall<'a>,
}

#[derive(Serialize)]
struct TemplateFunctionCall<'a> {
    name: &'a str,
    arguments: serde_json::Value,
}

impl ChatTemplate {
    /// Loads the template of a Hugging Face model folder: `chat_template.jinja`
    /// if present (transformers prefers it), else `tokenizer_config.json`'s
    /// `chat_template`, a string or a list of named templates (the one named
    /// "default" is used). Special tokens come from `tokenizer_config.json`.
    pub fn from_model_dir(model_dir: &Path) -> Result<Self, ChatTemplateError> {
        let config_path = model_dir.join("tokenizer_config.json");
        let config =
            match std::fs::read_to_string(&config_path) {
                Ok(text) => Some(serde_json::from_str::<TokenizerConfig>(&text).map_err(
                    |source| ChatTemplateError::Config {
                        path: config_path.clone(),
                        source,
                    },
                )?),
                Err(error) if error.kind() == io::ErrorKind::NotFound => None,
                Err(source) => {
                    return Err(ChatTemplateError::Io {
                        path: config_path,
                        source,
                    })
                }
            };
        let (config_template, bos_token, eos_token) = match config {
            Some(config) => (
                config.chat_template,
                config.bos_token.map(SpecialToken::into_text),
                config.eos_token.map(SpecialToken::into_text),
            ),
            None => (None, None, None),
        };

        let jinja_path = model_dir.join("chat_template.jinja");
        let source = match std::fs::read_to_string(&jinja_path) {
            Ok(source) => source,
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                default_template(config_template).ok_or(ChatTemplateError::Missing)?
            }
            Err(source) => {
                return Err(ChatTemplateError::Io {
                    path: jinja_path,
                    source,
                })
            }
        };
        Self::from_source(source, bos_token, eos_token)
    }

    /// Compiles a template given as text.
    pub fn from_source(
        source: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ChatTemplateError> {
        let mut env = Environment::new();
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("the default delimiters are valid"),
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", python_compat::strftime_now);
        env.add_filter("tojson", python_compat::python_tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(ChatTemplateError::Syntax)?;
        let uses_tools = env
            .get_template(TEMPLATE_NAME)
            .expect("the template was just added")
            .undeclared_variables(false)
            .contains("tools");
        Ok(Self {
            env,
            bos_token,
            eos_token,
            uses_tools,
            source,
        })
    }

    /// A request's own template (vLLM's `chat_template`, under `--trust-request-chat-template`),
    /// with this one's special tokens. Its rendering is bounded by `REQUEST_TEMPLATE_FUEL`, so a
    /// template that loops forever fails the request instead of holding a tokenizer worker.
    pub fn for_request(&self, source: String) -> Result<Self, ChatTemplateError> {
        let mut template =
            Self::from_source(source, self.bos_token.clone(), self.eos_token.clone())?;
        template.env.set_fuel(Some(REQUEST_TEMPLATE_FUEL));
        Ok(template)
    }

    pub fn uses_tools(&self) -> bool {
        self.uses_tools
    }

    /// The template's text (what a tool-call format is recognised by).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders the conversation into the prompt text.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatTemplateError> {
        self.render_with_kwargs(messages, add_generation_prompt, &serde_json::Map::new())
    }

    /// Renders with extra template variables (vLLM's `chat_template_kwargs`);
    /// they cannot replace `messages`, `add_generation_prompt` or the special tokens.
    pub fn render_with_kwargs(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatTemplateError> {
        let messages = messages
            .iter()
            .map(template_message)
            .collect::<Result<Vec<_>, _>>()?;

        let mut context: BTreeMap<String, Value> = kwargs
            .iter()
            .map(|(key, value)| (key.clone(), Value::from(Serde(value))))
            .collect();
        context.insert("messages".into(), Value::from(Serde(&messages)));
        context.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        for (name, token) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ] {
            if let Some(token) = token {
                context.insert(name.into(), Value::from(token.as_str()));
            }
        }

        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .expect("the template was added at construction");
        template
            .render(Value::from(context))
            .map_err(|error| match raised_message(&error) {
                Some(message) => ChatTemplateError::Raised(message),
                None => ChatTemplateError::Render(error),
            })
    }
}

/// The template of a `tokenizer_config.json` entry: the single one, or the one
/// named "default" among named ones.
fn default_template(source: Option<TemplateSource>) -> Option<String> {
    match source? {
        TemplateSource::Single(template) => Some(template),
        TemplateSource::Named(templates) => templates
            .into_iter()
            .find(|named| named.name == "default")
            .map(|named| named.template),
    }
}

/// `rendered` (a conversation rendered without a generation prompt) cut after the final message's
/// text, so that the model continues that message, as transformers' `continue_final_message`
/// does: whatever the template writes after the text (the end of the turn) goes.
pub fn continue_final_message(
    rendered: String,
    messages: &[ChatMessage],
) -> Result<String, ChatTemplateError> {
    let Some(last) = messages.last() else {
        return Ok(rendered);
    };
    let message = template_message(last)?;
    let trimmed = message.content.trim();
    let start = rendered
        .rfind(trimmed)
        .filter(|_| !trimmed.is_empty())
        .ok_or(ChatTemplateError::FinalMessageNotRendered)?;
    // Trailing spaces of the text stay where the template kept them ("The answer is ").
    let kept = message.content.trim_start();
    let end = if rendered[start..].starts_with(kept) {
        start + kept.len()
    } else {
        start + trimmed.len()
    };
    let mut rendered = rendered;
    rendered.truncate(end);
    Ok(rendered)
}

/// A message's text as templates see it: content parts are joined into one string, one part per
/// line, as vLLM does for text-only templates; no content (an assistant's calls, say) is the empty
/// string, as vLLM renders it.
pub fn message_text(message: &ChatMessage) -> Result<Cow<'_, str>, ChatTemplateError> {
    Ok(match &message.content {
        None => Cow::Borrowed(""),
        Some(MessageContent::Text(text)) => Cow::Borrowed(text.as_str()),
        Some(MessageContent::Parts(parts)) => {
            let texts = parts
                .iter()
                .map(|part| match (part.kind.as_str(), &part.text) {
                    ("text", Some(text)) => Ok(text.as_str()),
                    ("text", None) => Err(ChatTemplateError::MissingPartText),
                    _ => Err(ChatTemplateError::UnsupportedContentPart(part.kind.clone())),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Cow::Owned(texts.join("\n"))
        }
    })
}

/// A message as templates see it: its text (`message_text`), its role and its calls.
fn template_message(message: &ChatMessage) -> Result<TemplateMessage<'_>, ChatTemplateError> {
    let content = message_text(message)?;
    // OpenAI's `developer` role is the newer name of `system`, which templates know.
    let role = match message.role.as_str() {
        "developer" => "system",
        role => role,
    };
    let tool_calls = message.tool_calls.as_ref().map(|calls| {
        calls
            .iter()
            .map(|call| TemplateToolCall {
                id: &call.id,
                kind: &call.kind,
                function: TemplateFunctionCall {
                    name: &call.function.name,
                    arguments: serde_json::from_str(&call.function.arguments)
                        .unwrap_or_else(|_| call.function.arguments.clone().into()),
                },
            })
            .collect()
    });
    Ok(TemplateMessage {
        role,
        content,
        name: message.name.as_deref(),
        tool_calls,
        tool_call_id: message.tool_call_id.as_deref(),
    })
}

fn raised_message(error: &minijinja::Error) -> Option<String> {
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        if let Some(raised) = cause.downcast_ref::<RaisedByTemplate>() {
            return Some(raised.0.clone());
        }
        source = cause.source();
    }
    None
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(
        minijinja::Error::new(ErrorKind::InvalidOperation, message.clone())
            .with_source(RaisedByTemplate(message)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::openai::ContentPart;
    use crate::text::default_model::default_model_dir;

    fn golden_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden_chat")
    }

    #[derive(Deserialize)]
    struct GoldenCase {
        name: String,
        messages: Vec<ChatMessage>,
        add_generation_prompt: bool,
    }

    #[test]
    fn default_model_template_matches_transformers_golden_strings() {
        let template = ChatTemplate::from_model_dir(&default_model_dir()).unwrap();
        let cases: Vec<GoldenCase> = serde_json::from_str(
            &std::fs::read_to_string(golden_dir().join("cases.json")).unwrap(),
        )
        .unwrap();
        assert!(cases.len() >= 6);
        for case in cases {
            let expected = std::fs::read(golden_dir().join(format!("{}.txt", case.name))).unwrap();
            let rendered = template
                .render(&case.messages, case.add_generation_prompt)
                .unwrap();
            assert_eq!(
                rendered.as_bytes(),
                expected.as_slice(),
                "case {}:\n{rendered}",
                case.name
            );
        }
    }

    #[test]
    fn template_from_tokenizer_config_renders_like_the_jinja_file() {
        let model_dir = default_model_dir();
        let from_folder = ChatTemplate::from_model_dir(&model_dir).unwrap();
        let config: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(model_dir.join("tokenizer_config.json")).unwrap(),
        )
        .unwrap();
        let source = config["chat_template"].as_str().unwrap().to_owned();
        let from_config = ChatTemplate::from_source(source, None, None).unwrap();
        let messages = [
            ChatMessage::text("user", "Hi"),
            ChatMessage::text("assistant", "Hello!"),
        ];
        assert_eq!(
            from_folder.render(&messages, true).unwrap(),
            from_config.render(&messages, true).unwrap()
        );
    }

    #[test]
    fn named_templates_in_tokenizer_config_use_the_default_one() {
        let dir = std::env::temp_dir().join(format!("sluice-chat-template-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = serde_json::json!({
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}
            ]
        });
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let template = ChatTemplate::from_model_dir(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            template
                .render(&[ChatMessage::text("user", "x")], false)
                .unwrap(),
            "<s>x</s>"
        );
    }

    #[test]
    fn content_parts_are_joined_into_one_string() {
        let template = ChatTemplate::from_model_dir(&default_model_dir()).unwrap();
        let text_part = |text: &str| ContentPart {
            kind: "text".into(),
            text: Some(text.into()),
        };
        let with_parts = ChatMessage::new(
            "user",
            Some(MessageContent::Parts(vec![
                text_part("Hello"),
                text_part("world"),
            ])),
        );
        assert_eq!(
            template.render(&[with_parts], true).unwrap(),
            template
                .render(&[ChatMessage::text("user", "Hello\nworld")], true)
                .unwrap()
        );

        let image = ChatMessage::new(
            "user",
            Some(MessageContent::Parts(vec![ContentPart {
                kind: "image_url".into(),
                text: None,
            }])),
        );
        let error = template.render(&[image], true).unwrap_err();
        assert!(
            matches!(error, ChatTemplateError::UnsupportedContentPart(ref kind) if kind == "image_url")
        );
        assert!(error.is_request_error());

        let no_text = ChatMessage::new(
            "user",
            Some(MessageContent::Parts(vec![ContentPart {
                kind: "text".into(),
                text: None,
            }])),
        );
        let error = template.render(&[no_text], true).unwrap_err();
        assert!(
            matches!(error, ChatTemplateError::MissingPartText),
            "{error}"
        );
        assert!(error.to_string().contains("has no \"text\""), "{error}");
        assert!(error.is_request_error());
    }

    #[test]
    fn the_developer_role_renders_as_system() {
        let template = ChatTemplate::from_model_dir(&default_model_dir()).unwrap();
        let user = ChatMessage::text("user", "Hi");
        assert_eq!(
            template
                .render(
                    &[ChatMessage::text("developer", "Be brief."), user.clone()],
                    true
                )
                .unwrap(),
            template
                .render(&[ChatMessage::text("system", "Be brief."), user], true)
                .unwrap()
        );
    }

    #[test]
    fn raise_exception_becomes_a_typed_error() {
        let source = "{% for m in messages %}{% if m.role == 'assistant' and loop.first %}\
            {{ raise_exception('Conversation roles must start with user') }}{% endif %}\
            {{ m.content }}{% endfor %}";
        let template = ChatTemplate::from_source(source.into(), None, None).unwrap();
        let error = template
            .render(&[ChatMessage::text("assistant", "hi")], false)
            .unwrap_err();
        match &error {
            ChatTemplateError::Raised(text) => {
                assert_eq!(text, "Conversation roles must start with user")
            }
            other => panic!("expected Raised, got {other:?}"),
        }
        assert!(error.is_request_error());
        assert_eq!(
            template
                .render(&[ChatMessage::text("user", "ok")], false)
                .unwrap(),
            "ok"
        );
    }

    #[test]
    fn template_errors_are_typed() {
        let error = ChatTemplate::from_source("{% for %}".into(), None, None).unwrap_err();
        assert!(matches!(error, ChatTemplateError::Syntax(_)));
        assert!(!error.is_request_error());

        // A template that fails on the messages it is given fails the request.
        let template =
            ChatTemplate::from_source("{{ messages[0].content.nope() }}".into(), None, None)
                .unwrap();
        let message = ChatMessage::new("user", None);
        let error = template.render(&[message], false).unwrap_err();
        assert!(matches!(error, ChatTemplateError::Render(_)), "{error:?}");
        assert!(error.is_request_error());
    }

    #[test]
    fn no_content_renders_as_the_empty_string_as_in_vllm() {
        let template = ChatTemplate::from_model_dir(&default_model_dir()).unwrap();
        let no_content = ChatMessage::new("user", None);
        let empty = ChatMessage {
            content: Some(MessageContent::Text(String::new())),
            ..no_content.clone()
        };
        assert_eq!(
            template.render(&[no_content], true).unwrap(),
            template.render(&[empty], true).unwrap()
        );
    }

    #[test]
    fn loop_controls_tojson_and_string_methods_render_like_jinja2() {
        let source = "\
{% for m in messages %}
{% if m.role == 'system' %}{% continue %}{% endif %}
{% if m.content.strip().startswith('STOP') %}{% break %}{% endif %}
[{{ m.role.upper() }}] {{ m.content.strip() | tojson }} {{ m | tojson }}
{% endfor %}
{{ {'list': [1, 2.5, none, true], 'text': 'é\"<'} | tojson }}
{{ {'a': [1, {}], 'b': []} | tojson(indent=2) }}
{{ 'é' | tojson(ensure_ascii=true) }} {{ 'x,y'.split(',') | tojson(separators=[',', ':']) }}
{{ '  Title Case  '.strip().lower().replace('case', 'CASE') }}{{ bos_token }}{{ eos_token }}";
        let template =
            ChatTemplate::from_source(source.into(), Some("<s>".into()), Some("</s>".into()))
                .unwrap();
        let messages = [
            ChatMessage::text("system", "hidden"),
            ChatMessage::text("user", "  Héllo \"you\"  "),
            ChatMessage::text("assistant", "ok"),
            ChatMessage::text("user", " STOP here"),
            ChatMessage::text("assistant", "never"),
        ];
        // What transformers' own Jinja2 environment renders for the same input.
        let expected = "\
[USER] \"Héllo \\\"you\\\"\" {\"role\": \"user\", \"content\": \"  Héllo \\\"you\\\"  \"}
[ASSISTANT] \"ok\" {\"role\": \"assistant\", \"content\": \"ok\"}
{\"list\": [1, 2.5, null, true], \"text\": \"é\\\"<\"}
{
  \"a\": [
    1,
    {}
  ],
  \"b\": []
}
\"\\u00e9\" [\"x\",\"y\"]
title CASE<s></s>";
        assert_eq!(template.render(&messages, false).unwrap(), expected);
    }

    #[test]
    fn generation_prompt_and_kwargs_reach_the_template() {
        let source = "{{ messages | length }}{% if add_generation_prompt %}+gen{% endif %}\
            {% if enable_thinking is defined and not enable_thinking %} no-thinking{% endif %}";
        let template = ChatTemplate::from_source(source.into(), None, None).unwrap();
        let messages = [ChatMessage::text("user", "a")];
        assert_eq!(template.render(&messages, true).unwrap(), "1+gen");
        assert_eq!(template.render(&messages, false).unwrap(), "1");
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("enable_thinking".into(), false.into());
        kwargs.insert("messages".into(), serde_json::json!([1, 2, 3]));
        assert_eq!(
            template
                .render_with_kwargs(&messages, false, &kwargs)
                .unwrap(),
            "1 no-thinking"
        );
    }

    #[test]
    fn templates_with_tools_are_seen_and_read_calls_as_json() {
        let source = "{% for tool in tools %}[{{ tool.function.name }}]{% endfor %}\
            {% for m in messages %}{% for call in m.tool_calls or [] %}\
            {{ call.function.name }}({{ call.function.arguments.city }}){% endfor %}\
            {% if m.tool_call_id %}<{{ m.tool_call_id }}:{{ m.content }}>{% endif %}{% endfor %}";
        let template = ChatTemplate::from_source(source.into(), None, None).unwrap();
        assert!(template.uses_tools());
        assert!(!ChatTemplate::from_model_dir(&default_model_dir())
            .unwrap()
            .uses_tools());
        let messages: Vec<ChatMessage> = serde_json::from_value(serde_json::json!([
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "18 C"}
        ]))
        .unwrap();
        let mut kwargs = serde_json::Map::new();
        kwargs.insert(
            "tools".into(),
            serde_json::json!([{"type": "function", "function": {"name": "get_weather"}}]),
        );
        assert_eq!(
            template
                .render_with_kwargs(&messages, false, &kwargs)
                .unwrap(),
            "[get_weather]get_weather(Paris)<c1:18 C>"
        );
    }

    #[test]
    fn continue_final_message_cuts_after_the_final_text() {
        let template = ChatTemplate::from_model_dir(&default_model_dir()).unwrap();
        let messages = [
            ChatMessage::text("user", "Name a colour."),
            ChatMessage::text("assistant", "The colour is "),
        ];
        let rendered = template.render(&messages, false).unwrap();
        assert!(
            rendered.ends_with("The colour is <|im_end|>\n"),
            "{rendered:?}"
        );
        assert_eq!(
            continue_final_message(rendered.clone(), &messages).unwrap(),
            rendered.strip_suffix("<|im_end|>\n").unwrap(),
            "the end of the turn goes; the text stays, with the space the template kept"
        );
        // A template that trims the text: the cut is after the trimmed text.
        let trimming = ChatTemplate::from_source(
            "{% for m in messages %}[{{ m.content | trim }}]{% endfor %}".into(),
            None,
            None,
        )
        .unwrap();
        let rendered = trimming.render(&messages, false).unwrap();
        assert_eq!(
            continue_final_message(rendered, &messages).unwrap(),
            "[Name a colour.][The colour is"
        );
        let empty = [
            ChatMessage::text("user", "Hi"),
            ChatMessage::text("assistant", "  "),
        ];
        let rendered = template.render(&empty, false).unwrap();
        assert!(matches!(
            continue_final_message(rendered, &empty),
            Err(ChatTemplateError::FinalMessageNotRendered)
        ));
    }
}

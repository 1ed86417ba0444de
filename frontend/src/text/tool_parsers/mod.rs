//! Tool-call parsers: each reads a model's output format (Hermes' `<tool_call>` blocks, Llama 3's
//! bare JSON, Mistral's `[TOOL_CALLS]` array, Qwen3-Coder's XML, pythonic call lists, and the JSON
//! that forced calls are constrained to)
//! into content and calls, behind one trait; each registered format also gives `tool_choice:
//! "auto"` its lazy grammar, so that a call the model opens is one it reads. [`REGISTRY`] names the
//! ones `--tool-call-parser` picks from: a new format is a file implementing [`ToolCallParser`]
//! and one line there.

mod call_json;
pub mod call_schema;
mod forced;
mod hermes;
mod lark;
mod llama3_json;
mod mistral;
mod pythonic;
mod qwen3_coder;
mod tool_call_blocks;

use std::fmt::Debug;
use std::sync::Arc;

use sluice_common::schema::openai_tools::Tool;

pub use forced::{NamedFunction, RequiredCalls};
pub use hermes::Hermes;
pub use llama3_json::Llama3Json;
pub use mistral::Mistral;
pub use pythonic::Pythonic;
pub use qwen3_coder::Qwen3Coder;

/// One tool call found in an output, perhaps still being written.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CallText {
    /// Known once its JSON string is complete.
    pub name: Option<String>,
    /// The arguments' JSON text so far; once the output is finished, `{}` when the call had none.
    pub arguments: String,
}

impl CallText {
    /// A call whose name is known.
    pub fn named(name: &str, arguments: &str) -> Self {
        CallText {
            name: Some(name.into()),
            arguments: arguments.into(),
        }
    }
}

/// What a parser reads in an output so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OutputParse {
    /// The text that is not (and can no longer become) a tool call.
    pub content: String,
    pub calls: Vec<CallText>,
}

/// Reads one output format. Parses of a growing output extend each other: a later parse's
/// `content`, each call's `name` once known, and each call's `arguments` start with the earlier
/// ones (text that may still turn into a call is held back), so a stream sends differences. Only a
/// call that turns out malformed breaks this; it then stays in the content of the finished parse.
pub trait ToolCallParser: Send + Sync + Debug {
    /// The name `--tool-call-parser` knows it by.
    fn name(&self) -> String;
    /// Reads `text`, the whole output so far; `finished` once no more text will come.
    fn parse(&self, text: &str, finished: bool) -> OutputParse;
    /// The parser for one request's `tools`, for a format that needs them (to type values); None:
    /// this one serves every request.
    fn for_tools(&self, _tools: &[Tool]) -> Option<Arc<dyn ToolCallParser>> {
        None
    }
    /// `tool_choice: "auto"`'s lazy grammar in this format (llguidance's Lark), for a format that
    /// has one: text runs free until the model opens a call; from there the call must be well
    /// formed and a call of one of `tools`; `at_most_one` allows one call. None: outputs are only
    /// read, never constrained.
    fn lazy_grammar(&self, _tools: &[Tool], _at_most_one: bool) -> Option<String> {
        None
    }
}

type MakeParser = fn() -> Arc<dyn ToolCallParser>;

/// The parsers `--tool-call-parser` picks from, by name.
pub const REGISTRY: &[(&str, MakeParser)] = &[
    ("hermes", || Arc::new(Hermes)),
    ("llama3_json", || Arc::new(Llama3Json)),
    ("mistral", || Arc::new(Mistral)),
    ("pythonic", || Arc::new(Pythonic)),
    ("qwen3_coder", || Arc::new(Qwen3Coder::default())),
];

pub fn parser_by_name(name: &str) -> Option<Arc<dyn ToolCallParser>> {
    REGISTRY
        .iter()
        .find(|(known, _)| *known == name)
        .map(|(_, make)| make())
}

/// What `--tool-call-parser` takes: auto, or a registered parser's name.
pub fn parser_choices() -> Vec<&'static str> {
    std::iter::once("auto")
        .chain(REGISTRY.iter().map(|(name, _)| *name))
        .collect()
}

/// The parser a model's chat template and vocabulary suggest: Qwen3-Coder's XML calls where the
/// template writes `<function=` and `<parameter=` tags, pythonic calls where it shows them (Llama
/// 3.2's `[func_name1(params_name1=...`), Mistral's `[TOOL_CALLS]` token, Llama 3's
/// `<|python_tag|>`, else Hermes (also the format of the prompt given to templates without tools).
pub fn default_parser_name(template: &str, has_token: impl Fn(&str) -> bool) -> &'static str {
    if template.contains("<function=") && template.contains("<parameter=") {
        "qwen3_coder"
    } else if template.contains("[func_name1(") {
        "pythonic"
    } else if has_token(mistral::MARKER) {
        "mistral"
    } else if has_token(llama3_json::PYTHON_TAG) {
        "llama3_json"
    } else {
        "hermes"
    }
}

/// The parser `auto` tool choice reads outputs with: `choice` ("auto" or a registered name; auto
/// follows the template and the vocabulary), except that a template without tools (`tools_template`
/// None: the source of the chat template when it renders tools) gets the Hermes prompt and so the
/// Hermes parser.
pub fn serving_parser(
    choice: &str,
    tools_template: Option<&str>,
    has_token: impl Fn(&str) -> bool,
) -> Result<Arc<dyn ToolCallParser>, String> {
    let name = match choice {
        "auto" => default_parser_name(tools_template.unwrap_or(""), has_token),
        name => name,
    };
    let parser = parser_by_name(name).ok_or_else(|| {
        format!(
            "--tool-call-parser {name:?} is not one of {}",
            parser_choices().join(", ")
        )
    })?;
    Ok(if tools_template.is_some() {
        parser
    } else {
        Arc::new(Hermes)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn every_registered_parser_answers_to_its_name() {
        for (name, _) in REGISTRY {
            assert_eq!(parser_by_name(name).unwrap().name(), *name);
        }
        assert!(parser_by_name("nope").is_none());
    }

    #[test]
    fn the_default_follows_the_template_then_the_vocabulary() {
        let qwen3_coder = "{{- '<tool_call>\\n<function=' + name }}<parameter=";
        assert_eq!(default_parser_name(qwen3_coder, |_| true), "qwen3_coder");
        let llama32 = "[func_name1(params_name1=params_value1, params_name2=params_value2...)]";
        assert_eq!(default_parser_name(llama32, |_| true), "pythonic");
        assert_eq!(default_parser_name("", |t| t == "[TOOL_CALLS]"), "mistral");
        assert_eq!(
            default_parser_name("", |t| t == "<|python_tag|>"),
            "llama3_json"
        );
        assert_eq!(default_parser_name("<tool_call>", |_| false), "hermes");
    }

    /// tests/golden/lazy_grammars.json, whose grammars the engine's llguidance compiles and runs
    /// on calls and prose in `tests/golden/test_lazy_grammars.py`: each parser's lazy grammar for
    /// the golden tools is the golden text (SLUICE_REGENERATE_GOLDEN=1 writes it).
    #[test]
    fn lazy_grammars_follow_the_golden_file() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/golden/lazy_grammars.json"
        );
        let mut golden: Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let tools: Vec<Tool> = serde_json::from_value(golden["tools"].clone()).unwrap();
        let mut made = serde_json::Map::new();
        for (name, make) in REGISTRY {
            let parser = make();
            if let (Some(many), Some(one)) = (
                parser.lazy_grammar(&tools, false),
                parser.lazy_grammar(&tools, true),
            ) {
                made.insert(
                    (*name).into(),
                    serde_json::json!({"many": many, "one": one}),
                );
            }
        }
        if std::env::var_os("SLUICE_REGENERATE_GOLDEN").is_some() {
            golden["grammars"] = Value::Object(made);
            let text = serde_json::to_string_pretty(&golden).unwrap() + "\n";
            std::fs::write(path, text).unwrap();
            return;
        }
        assert_eq!(golden["grammars"], Value::Object(made));
    }

    #[test]
    fn serving_parser_takes_the_choice_unless_the_template_has_no_tools() {
        let mistral = |t: &str| t == "[TOOL_CALLS]";
        let tools = Some("{{ tools }}");
        assert_eq!(
            serving_parser("auto", tools, mistral).unwrap().name(),
            "mistral"
        );
        assert_eq!(
            serving_parser("llama3_json", tools, mistral)
                .unwrap()
                .name(),
            "llama3_json"
        );
        assert_eq!(
            serving_parser("auto", None, mistral).unwrap().name(),
            "hermes"
        );
        let error = serving_parser("qwen", tools, mistral).unwrap_err();
        assert!(
            error.contains("hermes, llama3_json, mistral, pythonic, qwen3_coder"),
            "{error}"
        );
    }

    #[test]
    fn only_a_format_that_needs_the_tools_is_made_per_request() {
        assert!(Hermes.for_tools(&[]).is_none());
        let typed = Qwen3Coder::default().for_tools(&[]).unwrap();
        assert_eq!(typed.name(), "qwen3_coder");
    }
}

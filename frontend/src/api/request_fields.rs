//! The fields of a request (completions, chat, /tokenize, embeddings, score and rerank) that its
//! typed struct does not read.
//!
//! A field that OpenAI or vLLM defines but Sluice cannot honour is a 400 naming it, unless it holds
//! the value that asks for nothing (`use_beam_search: false`, `modalities: ["text"]`). Any other
//! field is unknown: accepted, as vLLM accepts it, logged once per name in the process, and listed in
//! the response's `x-sluice-ignored-fields` header so that a client can see it had no effect.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use axum::http::HeaderValue;
use axum::response::Response;
use serde_json::Value;

use crate::api::error::ApiError;

/// The response header that lists the request's ignored fields, comma-separated.
pub const IGNORED_FIELDS_HEADER: &str = "x-sluice-ignored-fields";
/// Field names logged once each; beyond this many, a client sending random names cannot grow the set.
const MAX_LOGGED_NAMES: usize = 1024;
/// The most names one header lists, and the longest name it carries whole.
const MAX_LISTED_NAMES: usize = 32;
const MAX_LISTED_NAME_CHARS: usize = 64;

/// A field Sluice knows but cannot honour.
pub struct Unsupported {
    pub name: &'static str,
    /// Completes "`name` is not supported: ...".
    pub why: &'static str,
    /// Whether a value asks for nothing, so that it may be accepted.
    pub inert: fn(&Value) -> bool,
}

fn absent(value: &Value) -> bool {
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::String(text) => text.is_empty(),
        Value::Array(items) => items.is_empty(),
        Value::Object(fields) => fields.is_empty(),
        Value::Number(_) | Value::Bool(true) => false,
    }
}

fn absent_or_one(value: &Value) -> bool {
    absent(value) || value.as_f64() == Some(1.0)
}

fn absent_or_text_only(value: &Value) -> bool {
    absent(value) || *value == serde_json::json!(["text"])
}

const fn unsupported(name: &'static str, why: &'static str) -> Unsupported {
    Unsupported {
        name,
        why,
        inert: absent,
    }
}

/// Fields both endpoints refuse (vLLM's extensions this server does not implement).
const COMMON: &[Unsupported] = &[
    unsupported(
        "logits_processors",
        "custom logits processors are not implemented",
    ),
    unsupported(
        "kv_transfer_params",
        "disaggregated prefill is not implemented",
    ),
    unsupported("vllm_xargs", "no extension reads extra arguments"),
];

/// Fields only completions refuse.
const COMPLETIONS: &[Unsupported] = &[unsupported(
    "prompt_embeds",
    "prompts are text or token ids",
)];

const CHAT_BEAM_SEARCH: &str = "beam search is served on /v1/completions only (a chat \
                                request's rendered prompt can be sent there as its prompt)";

/// Fields only chat refuses.
const CHAT: &[Unsupported] = &[
    unsupported("use_beam_search", CHAT_BEAM_SEARCH),
    Unsupported {
        name: "length_penalty",
        why: CHAT_BEAM_SEARCH,
        inert: absent_or_one,
    },
    unsupported("early_stopping", CHAT_BEAM_SEARCH),
    unsupported("audio", "this model produces text only"),
    Unsupported {
        name: "modalities",
        why: "this model produces text only",
        inert: absent_or_text_only,
    },
    unsupported("web_search_options", "this server does not search the web"),
    unsupported(
        "verbosity",
        "this model has no verbosity setting; ask for brevity in a message or limit max_tokens",
    ),
    unsupported("mm_processor_kwargs", "this model takes text only"),
];

/// Fields /tokenize (where they would make its count differ from the chat request's), /score and
/// /rerank refuse.
const TEXT_ONLY: &[Unsupported] = &[unsupported(
    "mm_processor_kwargs",
    "this model takes text only",
)];

fn absent_or_float32(value: &Value) -> bool {
    absent(value) || value == "float32"
}

fn absent_or_little_endian(value: &Value) -> bool {
    absent(value) || value == "little"
}

/// Fields /v1/embeddings refuses: vLLM's other layouts of an embedding's bytes, which a client
/// would misread if they were ignored.
const EMBEDDINGS: &[Unsupported] = &[
    Unsupported {
        name: "embed_dtype",
        why: "embeddings are float32 values",
        inert: absent_or_float32,
    },
    Unsupported {
        name: "endianness",
        why: "embeddings are little-endian",
        inert: absent_or_little_endian,
    },
    unsupported("mm_processor_kwargs", "this model takes text only"),
];

fn null(value: &Value) -> bool {
    value.is_null()
}

fn absent_or_true(value: &Value) -> bool {
    matches!(value, Value::Null | Value::Bool(true))
}

const OWN_ACTIVATION: &str = "a cross-encoder's score is always its classifier's logit through the \
                              model's own activation (the sigmoid, unless its sentence-transformers \
                              config names another)";

/// Fields /score and /rerank refuse when the model is a cross-encoder (on top of [`TEXT_ONLY`]): its
/// score is what its classifier gives, one number, not an embedding to shape. (An embedding
/// model's /score knows none of them: they are unknown fields there, ignored and listed.)
const CROSS_ENCODER: &[Unsupported] = &[
    Unsupported {
        name: "dimensions",
        why: "a cross-encoder's score is one number, not an embedding to shorten",
        inert: null,
    },
    Unsupported {
        name: "normalize",
        why: "a cross-encoder's score is one number, not an embedding to normalise",
        inert: null,
    },
    // vLLM's switch between the classifier's logit and its activation, by its older and newer names.
    Unsupported {
        name: "activation",
        why: OWN_ACTIVATION,
        inert: absent_or_true,
    },
    Unsupported {
        name: "use_activation",
        why: OWN_ACTIVATION,
        inert: absent_or_true,
    },
];

/// Which endpoint a request came to, for the fields it refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
    Tokenize,
    Embeddings,
    /// `/score` and `/rerank`.
    Score,
    /// `/score` and `/rerank` when the model is a cross-encoder.
    CrossEncoderScore,
}

impl Endpoint {
    fn unsupported(self) -> impl Iterator<Item = &'static Unsupported> {
        // Generation's refusals are sampling features: /tokenize and pooling sample nothing.
        let (common, own) = match self {
            Endpoint::Completions => (COMMON, COMPLETIONS),
            Endpoint::Chat => (COMMON, CHAT),
            Endpoint::Tokenize | Endpoint::Score => (&[][..], TEXT_ONLY),
            Endpoint::Embeddings => (&[][..], EMBEDDINGS),
            Endpoint::CrossEncoderScore => (TEXT_ONLY, CROSS_ENCODER),
        };
        common.iter().chain(own)
    }
}

/// The names of `other_fields` (the top level's) and `nested` (a nested object's, named with their
/// parent: `stream_options.x`) that are ignored, or the 400 for the first field that cannot be
/// honoured. Every ignored name is logged, once per process.
pub fn ignored_fields<'a>(
    endpoint: Endpoint,
    other_fields: &BTreeMap<String, Value>,
    nested: impl IntoIterator<Item = (&'static str, &'a BTreeMap<String, Value>)>,
) -> Result<Vec<String>, ApiError> {
    let mut ignored = Vec::new();
    for (name, value) in other_fields {
        match endpoint.unsupported().find(|field| field.name == name) {
            Some(field) if !(field.inert)(value) => {
                return Err(ApiError::InvalidParameter {
                    param: field.name,
                    message: format!("{} is not supported: {}", field.name, field.why),
                })
            }
            Some(_) => {}
            None => ignored.push(name.clone()),
        }
    }
    for (parent, fields) in nested {
        ignored.extend(fields.keys().map(|name| format!("{parent}.{name}")));
    }
    log_once(&ignored);
    Ok(ignored)
}

/// Logs each name the first time this process ignores it.
fn log_once(names: &[String]) {
    static LOGGED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    if names.is_empty() {
        return;
    }
    let mut logged = LOGGED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    for name in names {
        if logged.len() < MAX_LOGGED_NAMES && !logged.contains(name) {
            eprintln!(
                "sluice-frontend: ignoring the unknown request field {:?} (logged once; the \
                 {IGNORED_FIELDS_HEADER} response header lists it)",
                listed_name(name)
            );
            logged.insert(name.clone());
        }
    }
}

/// The header value listing `names`: each cut to a bounded length, and escaped where a byte is
/// not one a header may carry, so that any JSON key makes a valid header.
pub fn header_value(names: &[String]) -> String {
    let mut listed: Vec<String> = names
        .iter()
        .take(MAX_LISTED_NAMES)
        .map(|name| listed_name(name))
        .collect();
    if names.len() > MAX_LISTED_NAMES {
        listed.push(format!("(and {} more)", names.len() - MAX_LISTED_NAMES));
    }
    listed.join(", ")
}

/// `response` with the header that lists `names`, when there are any.
pub fn with_ignored_fields(mut response: Response, names: &[String]) -> Response {
    if !names.is_empty() {
        let value = HeaderValue::from_str(&header_value(names))
            .expect("header_value writes printable ASCII only");
        response.headers_mut().insert(IGNORED_FIELDS_HEADER, value);
    }
    response
}

/// `name`, at most [`MAX_LISTED_NAME_CHARS`] characters, with every byte outside printable ASCII,
/// the comma and the percent sign percent-encoded.
fn listed_name(name: &str) -> String {
    let cut: String = name.chars().take(MAX_LISTED_NAME_CHARS).collect();
    let mut listed = String::with_capacity(cut.len());
    for byte in cut.bytes() {
        if byte.is_ascii_graphic() && byte != b',' && byte != b'%' {
            listed.push(byte as char);
        } else {
            listed.push_str(&format!("%{byte:02X}"));
        }
    }
    if name.chars().count() > MAX_LISTED_NAME_CHARS {
        listed.push_str("...");
    }
    listed
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(value: Value) -> BTreeMap<String, Value> {
        serde_json::from_value(value).unwrap()
    }

    fn refused(endpoint: Endpoint, value: Value) -> &'static str {
        match ignored_fields(endpoint, &fields(value), []) {
            Err(ApiError::InvalidParameter { param, message }) => {
                assert!(message.contains("not supported"), "{message}");
                param
            }
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn unknown_fields_are_ignored_and_listed() {
        let ignored = ignored_fields(
            Endpoint::Completions,
            &fields(json!({"frobnicate": 1, "zeta": null})),
            [("stream_options", &fields(json!({"colour": "red"})))],
        )
        .unwrap();
        assert_eq!(ignored, ["frobnicate", "zeta", "stream_options.colour"]);
    }

    #[test]
    fn fields_that_cannot_be_honoured_are_refused_by_name() {
        assert_eq!(
            refused(Endpoint::Chat, json!({"use_beam_search": true})),
            "use_beam_search"
        );
        assert_eq!(
            refused(Endpoint::Chat, json!({"early_stopping": "never"})),
            "early_stopping"
        );
        assert_eq!(
            refused(Endpoint::Chat, json!({"length_penalty": 0.5})),
            "length_penalty"
        );
        assert_eq!(
            refused(Endpoint::Chat, json!({"modalities": ["text", "audio"]})),
            "modalities"
        );
        assert_eq!(
            refused(Endpoint::Chat, json!({"audio": {"voice": "alloy"}})),
            "audio"
        );
        assert_eq!(
            refused(Endpoint::Completions, json!({"prompt_embeds": "AAAA"})),
            "prompt_embeds"
        );
    }

    #[test]
    fn values_that_ask_for_nothing_are_accepted_and_not_listed() {
        let inert = json!({"use_beam_search": false, "length_penalty": 1.0, "modalities": ["text"],
            "audio": null});
        assert_eq!(
            ignored_fields(Endpoint::Chat, &fields(inert), []),
            Ok(Vec::new())
        );
    }

    #[test]
    fn a_field_is_refused_only_where_the_endpoint_defines_it() {
        // Completions refuse prompt_embeds; chat has no such field, so it is ignored there.
        assert_eq!(
            ignored_fields(Endpoint::Chat, &fields(json!({"prompt_embeds": "x"})), []),
            Ok(vec!["prompt_embeds".to_string()])
        );
        // /tokenize samples nothing: generation's refusals are unknown there.
        assert_eq!(
            refused(
                Endpoint::Tokenize,
                json!({"mm_processor_kwargs": {"size": 1}})
            ),
            "mm_processor_kwargs"
        );
        assert_eq!(
            ignored_fields(
                Endpoint::Tokenize,
                &fields(json!({"use_beam_search": true})),
                []
            ),
            Ok(vec!["use_beam_search".to_string()])
        );
    }

    #[test]
    fn embeddings_refuse_other_byte_layouts_and_ignore_sampling_fields() {
        assert_eq!(
            refused(Endpoint::Embeddings, json!({"embed_dtype": "float16"})),
            "embed_dtype"
        );
        assert_eq!(
            refused(Endpoint::Embeddings, json!({"endianness": "big"})),
            "endianness"
        );
        let inert = json!({"embed_dtype": "float32", "endianness": "little", "temperature": 0.5});
        assert_eq!(
            ignored_fields(Endpoint::Embeddings, &fields(inert), []),
            Ok(vec!["temperature".to_string()])
        );
    }

    #[test]
    fn a_cross_encoders_scores_refuse_what_would_shape_an_embedding() {
        for (field, value) in [
            ("dimensions", json!(64)),
            ("normalize", json!(false)),
            ("activation", json!(false)),
            ("use_activation", json!(false)),
            ("mm_processor_kwargs", json!({"size": 1})),
        ] {
            let request = json!({ field: value });
            assert_eq!(refused(Endpoint::CrossEncoderScore, request), field);
        }
        let inert = json!({"dimensions": null, "normalize": null, "use_activation": true,
            "queries": ["x"]});
        assert_eq!(
            ignored_fields(Endpoint::CrossEncoderScore, &fields(inert), []),
            Ok(vec!["queries".to_string()])
        );
        // An embedding model's /score knows none of them.
        let shaped = json!({"dimensions": 64, "use_activation": false});
        assert_eq!(
            ignored_fields(Endpoint::Score, &fields(shaped), []),
            Ok(vec!["dimensions".to_string(), "use_activation".to_string()])
        );
    }

    #[test]
    fn the_header_value_is_bounded_and_always_a_valid_header() {
        let names: Vec<String> = ["plain", "with space", "ünï,%", &"x".repeat(100)]
            .into_iter()
            .map(str::to_owned)
            .collect();
        let value = header_value(&names);
        assert_eq!(
            value,
            format!(
                "plain, with%20space, %C3%BCn%C3%AF%2C%25, {}...",
                "x".repeat(64)
            )
        );
        assert!(axum::http::HeaderValue::from_str(&value).is_ok());
        let many: Vec<String> = (0..40).map(|i| format!("f{i}")).collect();
        let value = header_value(&many);
        assert!(value.ends_with("f31, (and 8 more)"), "{value}");
    }
}

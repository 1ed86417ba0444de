//! Arbitrary bytes and arbitrary request-shaped JSON through the real router's completions and chat
//! handlers (parsing and validation): never a panic, never a 5xx, every refusal a 4xx in OpenAI's
//! error shape. There is no engine, so a request that passes validation ends at the engine's door
//! with the one 503 that says it is not ready; that 503 is the "accepted" outcome here.

mod common;

use std::sync::{Arc, OnceLock};

use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use proptest::prelude::*;
use serde_json::{json, Map, Value};
use sluice_frontend::api::routes;
use sluice_frontend::state::AppState;
use tower::ServiceExt;

const MODEL: &str = "smol";
const PATHS: [&str; 2] = ["/v1/completions", "/v1/chat/completions"];
/// Every field either endpoint reads, so that generated objects hit the validation of each.
const FIELDS: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "stop_token_ids",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "ignore_eos",
    "min_tokens",
    "stream",
    "stream_options",
    "user",
    "logprobs",
    "top_logprobs",
    "echo",
    "add_generation_prompt",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "priority",
    "metadata",
    "store",
    "service_tier",
    "suffix",
    "add_special_tokens",
    "chat_template_kwargs",
    "reasoning_effort",
    "use_beam_search",
    "modalities",
    "an_unknown_field",
    "best_of",
    "prompt_logprobs",
];

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    })
}

fn app() -> Router {
    static STATE: OnceLock<Arc<AppState>> = OnceLock::new();
    let state = STATE.get_or_init(|| {
        let config = common::server_config(MODEL);
        Arc::new(AppState::load(config).expect("the default model's tokenizer loads"))
    });
    routes::router(state.clone())
}

fn post(path: &str, body: Vec<u8>) -> (StatusCode, Bytes) {
    runtime().block_on(async {
        let request = Request::builder()
            .method("POST")
            .uri(path)
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap();
        let response = app().oneshot(request).await.unwrap();
        let status = response.status();
        (
            status,
            response.into_body().collect().await.unwrap().to_bytes(),
        )
    })
}

/// POSTs `body` to `path` and checks the answer is a 4xx in OpenAI's shape or the engine-not-ready
/// 503.
fn assert_refused_cleanly_or_accepted(path: &str, body: Vec<u8>) -> Result<(), TestCaseError> {
    let (status, bytes) = post(path, body);
    let text = String::from_utf8_lossy(&bytes);
    let answer: Value = serde_json::from_slice(&bytes)
        .map_err(|e| TestCaseError::fail(format!("{status} body is not JSON ({e}): {text}")))?;
    let error = &answer["error"];
    prop_assert_eq!(
        answer.as_object().map(Map::len),
        Some(1),
        "{}: {}",
        status,
        text
    );
    let fields: Vec<&String> = error
        .as_object()
        .map(|e| e.keys().collect())
        .unwrap_or_default();
    // In OpenAI's order.
    prop_assert_eq!(
        fields,
        ["message", "type", "param", "code"],
        "{}: {}",
        status,
        text
    );
    prop_assert!(
        error["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{}",
        text
    );
    if status == StatusCode::SERVICE_UNAVAILABLE {
        prop_assert_eq!(&error["code"], "engine_unavailable", "{}", text);
    } else {
        prop_assert!(status.is_client_error(), "{}: {}", status, text);
        prop_assert_eq!(&error["type"], "invalid_request_error", "{}", text);
    }
    Ok(())
}

fn json_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-3i64..=40).prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        prop::sample::select(vec![
            0.0,
            -0.0,
            1e39,
            -1e39,
            1e-320,
            0.5,
            2.0,
            100.0,
            f64::MAX
        ])
        .prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
        prop::sample::select(vec![
            "text",
            "user",
            "system",
            "assistant",
            "tool",
            "17",
            " 5",
            "-1"
        ])
        .prop_map(Value::from),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    json_leaf().prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    ".{0,6}",
                    prop::sample::select(vec!["type", "text", "role", "content"])
                        .prop_map(str::to_owned)
                ],
                inner,
                0..4
            )
            .prop_map(|fields| Value::Object(fields.into_iter().collect())),
        ]
    })
}

fn message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        prop::sample::select(vec!["system", "user", "assistant", "developer"])
            .prop_map(Value::from),
        json_leaf(),
    ];
    let part =
        (json_value(), json_value()).prop_map(|(kind, text)| json!({"type": kind, "text": text}));
    let content = prop_oneof![
        ".{0,40}".prop_map(Value::from),
        prop::collection::vec(part, 0..3).prop_map(Value::Array),
        json_value(),
    ];
    (role, content).prop_map(|(role, content)| json!({"role": role, "content": content}))
}

/// An object of known fields with arbitrary values; `model` is usually right so that the rest is
/// validated, and prompts and messages usually have their shapes so that they reach tokenization.
fn request_body() -> impl Strategy<Value = Value> {
    let fields = prop::collection::btree_map(prop::sample::select(FIELDS), json_value(), 0..8);
    let prompt = prop_oneof![
        ".{0,40}".prop_map(Value::from),
        prop::collection::vec(0u32..70_000, 0..8).prop_map(|ids| json!(ids)),
        json_value(),
    ];
    let messages = prop_oneof![
        prop::collection::vec(message(), 0..4).prop_map(Value::Array),
        json_value()
    ];
    (fields, any::<bool>(), prompt, messages).prop_map(|(fields, right_model, prompt, messages)| {
        let mut body: Map<String, Value> =
            fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        if right_model {
            body.insert("model".into(), MODEL.into());
        }
        body.entry("prompt").or_insert(prompt);
        body.entry("messages").or_insert(messages);
        Value::Object(body)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_are_refused_in_openai_shape(
        body in prop::collection::vec(any::<u8>(), 0..64),
        path in prop::sample::select(&PATHS[..]),
    ) {
        assert_refused_cleanly_or_accepted(path, body)?;
    }

    #[test]
    fn arbitrary_json_is_refused_in_openai_shape(
        value in json_value(),
        path in prop::sample::select(&PATHS[..]),
    ) {
        assert_refused_cleanly_or_accepted(path, serde_json::to_vec(&value).unwrap())?;
    }

    #[test]
    fn request_shaped_json_is_refused_in_openai_shape_or_reaches_the_engine(
        body in request_body(),
        path in prop::sample::select(&PATHS[..]),
    ) {
        assert_refused_cleanly_or_accepted(path, serde_json::to_vec(&body).unwrap())?;
    }
}

/// Found by schemathesis: `max_tokens: 0` was accepted when `max_completion_tokens` overrode it,
/// and `top_logprobs` out of range when `logprobs` was off.
#[test]
fn chat_checks_fields_that_another_overrides_or_disables() {
    let message = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (
            json!({"max_tokens": 0, "max_completion_tokens": 2}),
            "max_tokens",
        ),
        (
            json!({"top_logprobs": 21, "logprobs": false}),
            "top_logprobs",
        ),
        (json!({"top_logprobs": 3_000_000_000u64}), "top_logprobs"),
    ];
    for (fields, param) in cases {
        let mut body = json!({"model": MODEL, "messages": message});
        body.as_object_mut()
            .unwrap()
            .extend(fields.as_object().unwrap().clone());
        let (status, bytes) = post("/v1/chat/completions", body.to_string().into_bytes());
        let answer: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body} -> {answer}");
        assert_eq!(answer["error"]["param"], param, "{body} -> {answer}");
    }
}

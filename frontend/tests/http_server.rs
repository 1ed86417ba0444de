//! The real router, tokenizer and chat template of the default model, against a fake engine core:
//! a task bound on the engine's side of the seam (ipc:// in a temporary directory) that answers
//! each add_request with scripted tokens and records every message it receives.

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use sluice_common::text::default_model::default_model_dir;
use sluice_frontend::api::routes;
use sluice_frontend::engine::client_config::EngineClientConfig;
use sluice_frontend::engine::protocol::{
    decode, encode, AddRequest, EngineOutput, EngineStats, FinishReason, HealthResult,
    KvCacheSnapshot, Logprobs, Message, Outputs, PoolingParams, Ready, Runner, UtilityMethod,
    UtilityResult, UtilityValue,
};
use sluice_frontend::state::{self, AppState, ServerConfig};
use tokio::sync::{mpsc, oneshot};
use tower::ServiceExt;
use zeromq::{PullSocket, PushSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const PATIENCE: Duration = Duration::from_secs(10);
const MODEL: &str = "smol";
const MAX_MODEL_LEN: u32 = 2048;
/// What the fake engine generates: multi-byte characters make tokens that split them.
const TEXT: &str = "Hello there! 日本語 👋🏽 and more.";
/// The fake pooling model's embedding size.
const EMBEDDING_SIZE: u32 = 8;

fn config() -> ServerConfig {
    common::server_config(MODEL)
}

/// How the fake engine answers each add_request.
#[derive(Clone)]
enum Script {
    /// Every token in its own step, the last one finishing with the reason.
    Finish(FinishReason),
    /// Every token in its own step, never finishing (until aborted).
    Open,
    /// Nothing at all.
    Silent,
}

struct Server {
    app: Router,
    state: Arc<AppState>,
    tokens: Vec<u32>,
    script: Arc<Mutex<Script>>,
    seen: mpsc::UnboundedReceiver<Message>,
    kill: Option<oneshot::Sender<()>>,
    dir: PathBuf,
    pending: Option<(PullSocket, PushSocket)>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn temp_dir() -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "sluice-http-server-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A server whose engine core has bound its sockets but not sent `ready` yet.
async fn unready(config: ServerConfig) -> Server {
    let dir = temp_dir();
    let input_address = format!("ipc://{}/input", dir.display());
    let output_address = format!("ipc://{}/output", dir.display());
    let mut input = PullSocket::new();
    input.bind(&input_address).await.unwrap();
    let mut output = PushSocket::new();
    output.bind(&output_address).await.unwrap();

    let state = Arc::new(AppState::load(config).unwrap());
    let mut engine_config = EngineClientConfig::new(input_address, output_address);
    engine_config.ready_timeout = PATIENCE;
    let connecting = state.clone();
    tokio::spawn(async move {
        state::connect_engine(&connecting, engine_config)
            .await
            .unwrap()
    });
    let tokens = state
        .pool
        .tokenizer()
        .encode(TEXT, false)
        .unwrap()
        .get_ids()
        .to_vec();
    let (_, seen) = mpsc::unbounded_channel();
    Server {
        app: routes::router(state.clone()),
        state,
        tokens,
        script: Arc::new(Mutex::new(Script::Finish(FinishReason::Length))),
        seen,
        kill: None,
        dir,
        pending: Some((input, output)),
    }
}

async fn started(config: ServerConfig) -> Server {
    let mut server = unready(config).await;
    server.send_ready().await;
    server
}

/// The ready of a generative model.
fn generative() -> Ready {
    Ready {
        max_model_len: MAX_MODEL_LEN,
        num_kv_blocks: 100,
        block_size: 16,
        runner: Runner::Generate,
        embedding_size: 576,
        matryoshka_dimensions: None,
        cross_encoder: false,
        eos_token_ids: vec![2],
    }
}

/// A server of a cross-encoder: the fake engine answers each pair with one score.
async fn cross_encoder() -> Server {
    let mut server = unready(config()).await;
    server
        .send_ready_as(Ready {
            runner: Runner::Pooling,
            embedding_size: 1,
            cross_encoder: true,
            eos_token_ids: vec![2],
            ..generative()
        })
        .await;
    server
}

/// A server of an embedding model that takes any `dimensions`.
async fn pooling() -> Server {
    let mut server = unready(config()).await;
    server
        .send_ready_as(Ready {
            runner: Runner::Pooling,
            embedding_size: EMBEDDING_SIZE,
            matryoshka_dimensions: Some(Vec::new()),
            ..generative()
        })
        .await;
    server
}

impl Server {
    async fn send_ready(&mut self) {
        self.send_ready_as(generative()).await;
    }

    async fn send_ready_as(&mut self, ready: Ready) {
        let (input, mut output) = self.pending.take().unwrap();
        let ready = encode(&Message::Ready(ready));
        // A bound PUSH socket refuses to send until the client's PULL has connected.
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while output.send(ZmqMessage::from(ready.clone())).await.is_err() {
            assert!(tokio::time::Instant::now() < deadline, "never connected");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while self.state.engine().is_err() {
            assert!(tokio::time::Instant::now() < deadline, "never ready");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (seen_tx, seen) = mpsc::unbounded_channel();
        let (kill, killed) = oneshot::channel();
        self.seen = seen;
        self.kill = Some(kill);
        tokio::spawn(fake_engine(
            input,
            output,
            self.tokens.clone(),
            self.script.clone(),
            seen_tx,
            killed,
        ));
    }

    fn script(&self, script: Script) {
        *self.script.lock().unwrap() = script;
    }

    /// The next message of the given type the engine received.
    async fn next_seen(&mut self, type_name: &str) -> Message {
        loop {
            let message = tokio::time::timeout(PATIENCE, self.seen.recv())
                .await
                .unwrap_or_else(|_| panic!("the engine never received {type_name}"))
                .expect("the fake engine stopped");
            if message.type_name() == type_name {
                return message;
            }
        }
    }

    fn text(&self) -> String {
        self.state
            .pool
            .tokenizer()
            .decode(&self.tokens, true)
            .unwrap()
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        self.state
            .pool
            .tokenizer()
            .encode(text, false)
            .unwrap()
            .get_ids()
            .to_vec()
    }

    async fn call(&self, request: Request<Body>) -> axum::response::Response {
        tokio::time::timeout(PATIENCE, self.app.clone().oneshot(request))
            .await
            .expect("no response")
            .unwrap()
    }

    async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        let response = self.call(post(path, body.to_string())).await;
        json_of(response).await
    }

    async fn get(&self, path: &str) -> (StatusCode, String) {
        let request = Request::get(path).body(Body::empty()).unwrap();
        let response = self.call(request).await;
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(bytes.to_vec()).unwrap())
    }

    /// Every event's data of a streamed response.
    async fn stream(&self, path: &str, body: Value) -> Vec<String> {
        let response = self.call(post(path, body.to_string())).await;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        let bytes = tokio::time::timeout(PATIENCE, response.into_body().collect())
            .await
            .expect("the stream never ended")
            .unwrap()
            .to_bytes();
        events(std::str::from_utf8(&bytes).unwrap())
    }
}

fn post(path: &str, body: String) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap()
}

async fn json_of(response: axum::response::Response) -> (StatusCode, Value) {
    let status = response.status();
    let bytes = tokio::time::timeout(PATIENCE, response.into_body().collect())
        .await
        .expect("the body never ended")
        .unwrap()
        .to_bytes();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| panic!("not JSON: {}", String::from_utf8_lossy(&bytes)));
    (status, value)
}

fn events(body: &str) -> Vec<String> {
    assert!(body.ends_with("\n\n"), "unterminated event in {body:?}");
    body.split_terminator("\n\n")
        .map(|event| {
            event
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {event:?}"))
                .to_owned()
        })
        .collect()
}

fn chunks(events: &[String]) -> Vec<Value> {
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    events[..events.len() - 1]
        .iter()
        .map(|event| serde_json::from_str(event).unwrap())
        .collect()
}

async fn fake_engine(
    mut input: PullSocket,
    mut output: PushSocket,
    tokens: Vec<u32>,
    script: Arc<Mutex<Script>>,
    seen: mpsc::UnboundedSender<Message>,
    mut killed: oneshot::Receiver<()>,
) {
    loop {
        let frame = tokio::select! {
            frame = input.recv() => frame,
            _ = &mut killed => return,
        };
        let Ok(frame) = frame else { return };
        let message = decode(frame.get(0).unwrap()).unwrap();
        let replies = replies_to(&message, &tokens, &script.lock().unwrap().clone());
        let _ = seen.send(message);
        for reply in replies {
            output.send(ZmqMessage::from(encode(&reply))).await.unwrap();
        }
    }
}

fn step(outputs: Vec<EngineOutput>) -> Message {
    Message::Outputs(Outputs {
        outputs,
        stats: EngineStats {
            num_running: 1,
            kv_cache_usage: 0.25,
            num_eager_fallbacks: 5,
            ..EngineStats::default()
        },
        timestamp: 0.0,
    })
}

/// The fake cross-encoder's score of a pair: where its second text starts, as a share of its tokens.
fn fake_pair_score(prompt_len: usize, second_text_start: u32) -> f32 {
    second_text_start as f32 / prompt_len as f32
}

/// The fake pooling model's embedding of a prompt: its length, then steps of a half.
fn fake_embedding(prompt_len: usize, dimensions: u32) -> Vec<f32> {
    (0..dimensions)
        .map(|i| prompt_len as f32 + i as f32 * 0.5)
        .collect()
}

fn replies_to(message: &Message, tokens: &[u32], script: &Script) -> Vec<Message> {
    match message {
        Message::AddRequest(request) => {
            let finish = match script {
                Script::Silent => return Vec::new(),
                Script::Open => None,
                Script::Finish(reason) => Some(*reason),
            };
            if let (Some(_), Some(start)) = (request.pooling, request.second_text_start) {
                let score = fake_pair_score(request.prompt_token_ids.len(), start);
                return vec![step(vec![EngineOutput {
                    finish_reason: Some(FinishReason::Stop),
                    error: None,
                    embedding: Some(score.to_le_bytes().to_vec()),
                    ..EngineOutput::failed(&request.request_id, "")
                }])];
            }
            if let Some(pooling) = request.pooling {
                let dimensions = pooling.dimensions.unwrap_or(EMBEDDING_SIZE);
                let embedding = fake_embedding(request.prompt_token_ids.len(), dimensions);
                return vec![step(vec![EngineOutput {
                    finish_reason: Some(FinishReason::Stop),
                    error: None,
                    num_cached_tokens: 1,
                    first_scheduled_time: Some(request.arrival_time),
                    embedding: Some(embedding.iter().flat_map(|v| v.to_le_bytes()).collect()),
                    ..EngineOutput::failed(&request.request_id, "")
                }])];
            }
            let logprobs = |token: u32| {
                request.params.logprobs.map(|top| {
                    vec![Logprobs {
                        token_ids: (0..=top).map(|i| token + i).collect(),
                        logprobs: (0..=top).map(|i| -0.5 - f64::from(i)).collect(),
                        sampled_rank: 1,
                    }]
                })
            };
            tokens
                .iter()
                .enumerate()
                .map(|(i, &token)| {
                    step(vec![EngineOutput {
                        request_id: request.request_id.clone(),
                        new_token_ids: vec![token],
                        new_logprobs: logprobs(token),
                        finish_reason: if i + 1 == tokens.len() { finish } else { None },
                        stop_reason: None,
                        // As if the prefix cache held all of the prompt it may serve.
                        num_cached_tokens: request.prompt_token_ids.len() as u32 - 1,
                        error: None,
                        first_scheduled_time: Some(request.arrival_time),
                        invalid_param: None,
                        prompt_logprobs: None,
                        embedding: None,
                    }])
                })
                .collect()
        }
        Message::Abort(abort) => vec![step(
            abort
                .request_ids
                .iter()
                .map(|id| EngineOutput {
                    request_id: id.clone(),
                    new_token_ids: Vec::new(),
                    new_logprobs: None,
                    finish_reason: Some(FinishReason::Abort),
                    stop_reason: None,
                    num_cached_tokens: 0,
                    error: None,
                    first_scheduled_time: None,
                    invalid_param: None,
                    prompt_logprobs: None,
                    embedding: None,
                })
                .collect(),
        )],
        Message::UtilityCall(call) => vec![Message::UtilityResult(UtilityResult {
            call_id: call.call_id,
            result: Some(match call.method {
                UtilityMethod::KvCache => UtilityValue::KvCache(KvCacheSnapshot {
                    seq: 4,
                    block_size: 16,
                    kv_events_port: Some(5557),
                    block_hashes: vec!["ab".repeat(32)],
                }),
                _ => UtilityValue::Health(HealthResult { ok: true }),
            }),
            error: None,
        })],
        _ => Vec::new(),
    }
}

#[tokio::test]
async fn completion_text_streamed_equals_whole_with_usage() {
    let server = started(config()).await;
    let (status, body) = server
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Say hi", "max_tokens": 50}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["choices"][0]["text"], server.text());
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    let prompt_tokens = server.encode("Say hi").len();
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": server.tokens.len(),
               "total_tokens": prompt_tokens + server.tokens.len(),
               "prompt_tokens_details": {"cached_tokens": prompt_tokens - 1}})
    );

    let events = server
        .stream(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Say hi", "max_tokens": 50, "stream": true,
                   "stream_options": {"include_usage": true}}),
        )
        .await;
    let chunks = chunks(&events);
    let (usage, texts) = chunks.split_last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"], body["usage"]);
    let streamed: String = texts
        .iter()
        .map(|c| {
            assert_eq!(c["object"], "text_completion");
            c["choices"][0]["text"].as_str().unwrap()
        })
        .collect();
    assert_eq!(streamed, body["choices"][0]["text"].as_str().unwrap());
    assert!(texts.len() > 3, "the text should arrive in several chunks");
    assert_eq!(
        texts.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
}

#[tokio::test]
async fn chat_stream_opens_with_the_role_and_ends_with_the_finish_reason() {
    let mut server = started(config()).await;
    let messages = json!([{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Hi"}]);
    let events = server
        .stream(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": messages, "stream": true,
                   "max_completion_tokens": 40}),
        )
        .await;
    let chunks = chunks(&events);
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks[1..]
        .iter()
        .all(|c| c["choices"][0]["delta"].get("role").is_none()));
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, server.text());
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "length"
    );
    assert!(chunks.iter().all(|c| c["usage"].is_null()));

    // The template's own special tokens are not doubled by the tokenizer.
    let Message::AddRequest(request) = server.next_seen("add_request").await else {
        unreachable!()
    };
    let rendered = server
        .state
        .chat_template
        .as_ref()
        .unwrap()
        .render(&serde_json::from_value::<Vec<_>>(messages).unwrap(), true)
        .unwrap();
    assert_eq!(request.prompt_token_ids, server.encode(&rendered));
    assert_eq!(request.params.max_tokens, 40);
    assert_eq!((request.pooling, request.second_text_start), (None, None));
}

#[tokio::test]
async fn chat_whole_response_has_message_usage_and_logprobs() {
    let server = started(config()).await;
    let (status, body) = server
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                   "logprobs": true, "top_logprobs": 2}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["choices"][0]["message"]["content"], server.text());
    let content = body["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(content.len(), server.tokens.len());
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert_eq!(body["usage"]["completion_tokens"], server.tokens.len());
}

#[tokio::test]
async fn n_two_fans_out_with_consecutive_seeds_and_indices() {
    let mut server = started(config()).await;
    let (status, body) = server
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": ["a", "b"], "n": 2, "seed": 5,
                   "max_tokens": 30, "logprobs": 1}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let choices = body["choices"].as_array().unwrap();
    let indices: Vec<_> = choices.iter().map(|c| c["index"].clone()).collect();
    assert_eq!(indices, [json!(0), json!(1), json!(2), json!(3)]);
    for choice in choices {
        assert_eq!(choice["text"], server.text());
        let logprobs = &choice["logprobs"];
        assert_eq!(
            logprobs["tokens"].as_array().unwrap().len(),
            server.tokens.len()
        );
        assert_eq!(logprobs["text_offset"][0], 0);
    }
    assert_eq!(body["usage"]["completion_tokens"], 4 * server.tokens.len());
    let mut seeds = Vec::new();
    for _ in 0..4 {
        let Message::AddRequest(request) = server.next_seen("add_request").await else {
            unreachable!()
        };
        let suffix = request.request_id.rsplit('-').next().unwrap().to_owned();
        seeds.push((suffix, request.params.seed));
    }
    seeds.sort();
    assert_eq!(
        seeds,
        [
            ("0".to_string(), Some(5)),
            ("1".to_string(), Some(6)),
            ("2".to_string(), Some(5)),
            ("3".to_string(), Some(6))
        ]
    );
}

#[tokio::test]
async fn stop_string_cuts_the_text_and_aborts_the_engine_request() {
    let mut server = started(config()).await;
    server.script(Script::Open);
    let (status, body) = server
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": 100, "stop": ["語 👋", "zzz"]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["choices"][0]["text"], "Hello there! 日本");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let Message::AddRequest(request) = server.next_seen("add_request").await else {
        unreachable!()
    };
    let Message::Abort(abort) = server.next_seen("abort").await else {
        unreachable!()
    };
    assert_eq!(abort.request_ids, [request.request_id]);

    let events = server
        .stream(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": 100, "stop": "語 👋",
                   "stream": true}),
        )
        .await;
    let chunks = chunks(&events);
    let streamed: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, "Hello there! 日本");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
}

#[tokio::test]
async fn client_disconnect_mid_stream_aborts_the_engine_request() {
    let mut server = started(config()).await;
    server.script(Script::Open);
    let response = server
        .call(post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": 100, "stream": true}).to_string(),
        ))
        .await;
    let mut body = response.into_body();
    let first = tokio::time::timeout(PATIENCE, body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(first.data_ref().unwrap().starts_with(b"data: "));
    drop(body);
    let Message::AddRequest(request) = server.next_seen("add_request").await else {
        unreachable!()
    };
    let Message::Abort(abort) = server.next_seen("abort").await else {
        unreachable!()
    };
    assert_eq!(abort.request_ids, [request.request_id]);
    assert_eq!(server.state.permits.available_permits(), 64);
}

async fn assert_error(server: &Server, request: Request<Body>, status: u16, expected: Value) {
    let (got, body) = json_of(server.call(request).await).await;
    assert_eq!(got.as_u16(), status, "{body}");
    let error = &body["error"];
    for (key, value) in expected.as_object().unwrap() {
        assert_eq!(&error[key], value, "{key} in {body}");
    }
    assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()));
}

#[tokio::test]
async fn bad_inputs_get_their_status_and_openai_error_body() {
    let server = started(config()).await;
    let completions = |body: Value| post("/v1/completions", body.to_string());
    let cases = [
        (
            post("/v1/completions", "{\"model\": ".into()),
            400,
            json!({"type": "invalid_request_error"}),
        ),
        (
            completions(json!({"model": MODEL, "prompt": "x", "max_tokens": "5"})),
            400,
            json!({"type": "invalid_request_error"}),
        ),
        (
            completions(json!({"model": "gpt-9", "prompt": "x"})),
            404,
            json!({"param": "model", "code": "model_not_found"}),
        ),
        (
            completions(json!({"model": MODEL, "prompt": "x", "temperature": -1})),
            400,
            json!({"param": "temperature"}),
        ),
        (
            completions(json!({"model": MODEL, "prompt": "x", "top_p": 0})),
            400,
            json!({"param": "top_p"}),
        ),
        (
            completions(json!({"model": MODEL, "prompt": "x", "n": 0})),
            400,
            json!({"param": "n"}),
        ),
        (
            completions(json!({"model": MODEL, "prompt": "x", "logprobs": 21})),
            400,
            json!({"param": "logprobs"}),
        ),
        (
            completions(json!({"model": MODEL, "prompt": "x", "logit_bias": {"999999": 1}})),
            400,
            json!({"param": "logit_bias"}),
        ),
        (
            completions(json!({"model": MODEL, "prompt": "x", "n": 2, "best_of": 1})),
            400,
            json!({"param": "best_of"}),
        ),
        (
            completions(
                json!({"model": MODEL, "prompt": "x", "prompt_logprobs": 1, "stream": true}),
            ),
            400,
            json!({"param": "prompt_logprobs"}),
        ),
        (
            completions(json!({"model": MODEL, "prompt": ""})),
            400,
            json!({"param": "prompt"}),
        ),
        (
            completions(json!({"model": MODEL, "prompt": [9999999]})),
            400,
            json!({"param": "prompt"}),
        ),
        (
            completions(json!({"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN})),
            400,
            json!({"param": "max_tokens", "code": "context_length_exceeded"}),
        ),
        (
            completions(json!({"model": MODEL, "prompt": vec![1; MAX_MODEL_LEN as usize]})),
            400,
            json!({"param": "prompt", "code": "context_length_exceeded"}),
        ),
        (
            post(
                "/v1/chat/completions",
                json!({"model": MODEL, "messages": []}).to_string(),
            ),
            400,
            json!({"param": "messages"}),
        ),
    ];
    for (request, status, expected) in cases {
        assert_error(&server, request, status, expected).await;
    }
}

#[tokio::test]
async fn body_over_the_limit_is_413() {
    let server = started(ServerConfig {
        max_body_bytes: 1024,
        ..config()
    })
    .await;
    let body = json!({"model": MODEL, "prompt": "x".repeat(2048)}).to_string();
    assert_error(
        &server,
        post("/v1/completions", body),
        413,
        json!({"code": "request_too_large"}),
    )
    .await;
}

#[tokio::test]
async fn api_key_guards_every_route_but_health() {
    let server = started(ServerConfig {
        api_key: Some("secret".into()),
        ..config()
    })
    .await;
    let body = json!({"model": MODEL, "prompt": "x", "max_tokens": 5}).to_string();
    assert_error(
        &server,
        post("/v1/completions", body.clone()),
        401,
        json!({"code": "invalid_api_key"}),
    )
    .await;
    let mut wrong = post("/v1/completions", body.clone());
    wrong
        .headers_mut()
        .insert("authorization", "Bearer nope".parse().unwrap());
    assert_error(&server, wrong, 401, json!({"code": "invalid_api_key"})).await;
    let mut right = post("/v1/completions", body);
    right
        .headers_mut()
        .insert("authorization", "Bearer secret".parse().unwrap());
    assert_eq!(server.call(right).await.status(), StatusCode::OK);
    assert_eq!(server.get("/health").await.0, StatusCode::OK);
    // The playground's static page and assets: no data, and a browser cannot send the key.
    for path in [
        "/",
        "/playground/playground.js",
        "/playground/playground.css",
    ] {
        assert_eq!(server.get(path).await.0, StatusCode::OK, "{path}");
    }
    for path in [
        "/playground/",
        "/playground/nothing.js",
        "/index.html",
        "/metrics",
        "/v1/models",
        "/v1/models/x",
        "/version",
        "/sluice/kv_cache",
        "/nowhere",
    ] {
        assert_eq!(server.get(path).await.0, StatusCode::UNAUTHORIZED, "{path}");
    }
    for path in ["/tokenize", "/detokenize"] {
        let status = server.call(post(path, "{}".into())).await.status();
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{path}");
    }
    let open = started(ServerConfig {
        api_key: Some("secret".into()),
        metrics_without_auth: true,
        ..config()
    })
    .await;
    assert_eq!(open.get("/metrics").await.0, StatusCode::OK);
    assert_eq!(open.get("/v1/models").await.0, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn kv_cache_serves_the_engine_snapshot_as_json() {
    let server = started(config()).await;
    let (status, text) = server.get("/sluice/kv_cache").await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        body,
        json!({"seq": 4, "block_size": 16, "kv_events_port": 5557, "block_hashes": ["ab".repeat(32)]})
    );
}

#[tokio::test]
async fn full_waiting_queue_is_429_at_once() {
    let server = started(ServerConfig {
        max_waiting_requests: 2,
        ..config()
    })
    .await;
    server.script(Script::Silent);
    let held = server
        .call(post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "n": 2, "stream": true}).to_string(),
        ))
        .await;
    assert_eq!(held.status(), StatusCode::OK);
    assert_eq!(server.state.permits.available_permits(), 0);
    assert_error(
        &server,
        post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x"}).to_string(),
        ),
        429,
        json!({"type": "rate_limit_error", "code": "rate_limit_exceeded"}),
    )
    .await;
    drop(held);
    assert_eq!(server.state.permits.available_permits(), 2);
}

#[tokio::test]
async fn a_request_stops_counting_as_waiting_at_its_first_token() {
    let server = started(ServerConfig {
        max_waiting_requests: 2,
        ..config()
    })
    .await;
    server.script(Script::Open);
    let response = server
        .call(post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "n": 2, "max_tokens": 100, "stream": true})
                .to_string(),
        ))
        .await;
    let mut body = response.into_body();
    let mut seen = String::new();
    while !(seen.contains("\"index\":0") && seen.contains("\"index\":1")) {
        let frame = tokio::time::timeout(PATIENCE, body.frame())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        seen.push_str(std::str::from_utf8(frame.data_ref().unwrap()).unwrap());
    }
    // Both choices are generating, so nothing waits: the whole queue is free again.
    assert_eq!(server.state.permits.available_permits(), 2);
    drop(body);
}

#[tokio::test]
async fn tokenize_waits_in_the_queue_and_a_request_that_can_never_fit_is_400() {
    let server = started(ServerConfig {
        max_waiting_requests: 2,
        ..config()
    })
    .await;
    server.script(Script::Silent);
    let held = server
        .call(post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "n": 2, "stream": true}).to_string(),
        ))
        .await;
    assert_eq!(held.status(), StatusCode::OK);
    let refused = server
        .call(post("/tokenize", json!({"prompt": "x"}).to_string()))
        .await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "1");
    drop(held);
    let (status, _) = server.post("/tokenize", json!({"prompt": "x"})).await;
    assert_eq!(status, StatusCode::OK);
    for body in [
        json!({"model": MODEL, "prompt": ["a", "b"], "n": 2}),
        json!({"model": MODEL, "prompt": [[1], [2], [3]]}),
    ] {
        let (status, answer) = server.post("/v1/completions", body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
        assert_eq!(answer["error"]["param"], "n");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains("--max-waiting-requests"), "{message}");
    }
}

#[tokio::test]
async fn unknown_routes_and_methods_are_openai_errors_and_the_model_card_is_served() {
    let server = started(config()).await;
    let (status, text) = server.get("/v2/nothing").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");
    let (status, text) = server.get("/v1/completions").await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert!(serde_json::from_str::<Value>(&text).unwrap()["error"]["message"].is_string());
    let (status, text) = server.get(&format!("/v1/models/{MODEL}")).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["id"], MODEL);
    let (status, text) = server.get("/v1/models/gpt-9").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap()["error"]["code"],
        "model_not_found"
    );
}

#[tokio::test]
async fn health_follows_the_engine_and_its_death_fails_in_flight_requests() {
    let mut server = unready(config()).await;
    assert_eq!(
        server.get("/health").await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_error(
        &server,
        post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x"}).to_string(),
        ),
        503,
        json!({"type": "server_error"}),
    )
    .await;
    server.send_ready().await;
    assert_eq!(server.get("/health").await.0, StatusCode::OK);

    server.script(Script::Open);
    let streaming = server
        .call(post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": 100, "stream": true}).to_string(),
        ))
        .await;
    let whole = tokio::spawn(server.app.clone().oneshot(post(
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}).to_string(),
    )));
    server.next_seen("add_request").await;
    server.next_seen("add_request").await;
    server.kill.take().unwrap().send(()).unwrap();

    let whole = tokio::time::timeout(PATIENCE, whole)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let (status, body) = json_of(whole).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "engine_unavailable");
    let bytes = tokio::time::timeout(PATIENCE, streaming.into_body().collect())
        .await
        .expect("the stream never ended")
        .unwrap()
        .to_bytes();
    let events = events(std::str::from_utf8(&bytes).unwrap());
    // The error event, then [DONE], so that a client reading to [DONE] stops.
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let error: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(error["error"]["code"], "engine_unavailable");
    assert_eq!(
        server.get("/health").await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
}

#[tokio::test]
async fn metrics_count_requests_and_report_engine_gauges() {
    let server = started(config()).await;
    let (status, _) = server
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": 50}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, text) = server.get("/metrics").await;
    assert_eq!(status, StatusCode::OK);
    for name in [
        "sluice:num_requests_running{model_name=\"smol\"} 1",
        "sluice:kv_cache_usage_perc{model_name=\"smol\"} 0.25",
        "sluice:graph_eager_fallbacks_total{model_name=\"smol\"} 5",
        "sluice:request_success_total{model_name=\"smol\",finished_reason=\"length\"} 1",
        "sluice:time_to_first_token_seconds_count{model_name=\"smol\"} 1",
        "sluice:e2e_request_latency_seconds_count{model_name=\"smol\"} 1",
        "sluice:request_queue_time_seconds_count",
        "sluice:inter_token_latency_seconds_count",
        "sluice:prompt_tokens_total",
        "sluice:generation_tokens_total",
    ] {
        assert!(text.contains(name), "{name} missing from\n{text}");
    }
}

#[tokio::test]
async fn models_tokenize_detokenize_and_version() {
    let server = started(config()).await;
    let (status, models) = server.get("/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["data"][0]["max_model_len"], MAX_MODEL_LEN);

    let (status, tokenized) = server
        .post("/tokenize", json!({"model": MODEL, "prompt": TEXT}))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(tokenized["tokens"], json!(server.tokens));
    assert_eq!(tokenized["count"], server.tokens.len());
    assert_eq!(tokenized["max_model_len"], MAX_MODEL_LEN);

    let (status, chat) = server
        .post(
            "/tokenize",
            json!({"messages": [{"role": "user", "content": "Hi"}]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert!(chat["count"].as_u64().unwrap() > 3);

    let (status, detokenized) = server
        .post("/detokenize", json!({"tokens": server.tokens}))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(detokenized["prompt"], TEXT);

    let (status, version) = server.get("/version").await;
    assert_eq!(status, StatusCode::OK);
    let version: Value = serde_json::from_str(&version).unwrap();
    assert_eq!(version["version"], env!("CARGO_PKG_VERSION"));
    // The CPU kernels' tier that `sluice serve` passes (common::server_config says avx2).
    assert_eq!(version["cpu_kernels"], "avx2");
}

#[tokio::test]
async fn echo_prepends_the_prompt() {
    let server = started(config()).await;
    let (status, body) = server
        .post(
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Say: ", "echo": true, "max_tokens": 50}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body["choices"][0]["text"],
        format!("Say: {}", server.text())
    );
}

/// The status of `GET path` on the binary's port, or None while nothing listens there.
/// A server whose fake engine generates `text` and stops.
async fn generating(text: &str) -> Server {
    generating_with(config(), text).await
}

async fn generating_with(config: ServerConfig, text: &str) -> Server {
    let mut server = unready(config).await;
    // The engine stops on the model's end-of-turn token, whose text is not part of the output.
    server.tokens = server.encode(&format!("{text}<|im_end|>"));
    server.script(Script::Finish(FinishReason::Stop));
    server.send_ready().await;
    server
}

#[tokio::test]
async fn no_tool_call_grammar_leaves_auto_unconstrained_and_still_reads_calls() {
    // The off switch of auto's lazy grammar (`--no-tool-call-grammar`): the output is only read.
    let output = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
    let config = ServerConfig {
        tool_call_grammar: false,
        ..config()
    };
    let mut server = generating_with(config, output).await;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
                      "tools": weather_tools()});
    let (status, whole) = server.post("/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{whole}");
    assert_eq!(
        whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
        "{\"city\": \"Oslo\"}"
    );
    let Message::AddRequest(request) = server.next_seen("add_request").await else {
        unreachable!()
    };
    assert_eq!(request.params.structured_output, None);
}

/// The tool calls of a stream, joined as a client joins them: [id, name, arguments] each.
fn streamed_calls(chunks: &[Value]) -> Vec<[String; 3]> {
    let mut calls: Vec<[String; 3]> = Vec::new();
    for chunk in chunks {
        for delta in chunk["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let index = delta["index"].as_u64().unwrap() as usize;
            let arguments = delta["function"]["arguments"].as_str().unwrap();
            if let Some(id) = delta["id"].as_str() {
                assert_eq!(index, calls.len());
                assert_eq!(delta["type"], "function");
                assert_eq!(arguments, "", "a call opens before its arguments");
                let name = delta["function"]["name"].as_str().unwrap();
                calls.push([id.into(), name.into(), String::new()]);
            } else {
                assert!(delta["function"].get("name").is_none());
                calls[index][2].push_str(arguments);
            }
        }
    }
    calls
}

fn weather_tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
}

#[tokio::test]
async fn auto_tool_calls_are_read_from_the_output_whole_and_streamed() {
    let output = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    let mut server = generating(output).await;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
                      "tools": weather_tools()});
    let (status, whole) = server.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, StatusCode::OK, "{whole}");
    let choice = &whole["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], "Let me check.");
    let call = &choice["message"]["tool_calls"][0];
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["function"]["name"], "get_weather");
    assert_eq!(call["function"]["arguments"], "{\"city\": \"Paris\"}");
    // SmolLM2's template has no tools: they reach the prompt as the Hermes system prompt.
    let Message::AddRequest(request) = server.next_seen("add_request").await else {
        unreachable!()
    };
    let prompt = server
        .state
        .pool
        .tokenizer()
        .decode(&request.prompt_token_ids, false)
        .unwrap();
    assert!(
        prompt.contains("<tools>\n{\"type\":\"function\",\"function\":{\"name\":\"get_weather\""),
        "{prompt}"
    );
    // `auto` is held to the hermes parser's lazy grammar: free text, then calls of these tools.
    let grammar = request
        .params
        .structured_output
        .as_ref()
        .expect("auto's lazy grammar");
    assert_eq!(grammar.kind, "grammar");
    assert!(
        grammar.spec.contains("prefix[stop=\"<tool_call>\"]")
            && grammar.spec.contains("\"enum\":[\"get_weather\"]"),
        "{}",
        grammar.spec
    );

    let mut streamed = body;
    streamed["stream"] = json!(true);
    let chunks = chunks(&server.stream("/v1/chat/completions", streamed).await);
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "Let me check.");
    let calls = streamed_calls(&chunks);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0][1..], ["get_weather", "{\"city\": \"Paris\"}"]);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );
}

#[tokio::test]
async fn a_named_tool_choice_is_forced_with_its_schema_and_read_as_its_arguments() {
    let mut server = generating("{\"city\":\"Paris\"}").await;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
                      "tools": weather_tools(), "stream": true,
                      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    let chunks = chunks(&server.stream("/v1/chat/completions", body).await);
    let Message::AddRequest(request) = server.next_seen("add_request").await else {
        unreachable!()
    };
    let forced = request
        .params
        .structured_output
        .expect("the call is forced");
    assert_eq!(forced.kind, "json_schema");
    assert_eq!(
        serde_json::from_str::<Value>(&forced.spec).unwrap(),
        json!({"type": "object", "properties": {"city": {"type": "string"}}})
    );
    let calls = streamed_calls(&chunks);
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0][1..], ["get_weather", "{\"city\":\"Paris\"}"]);
    assert!(chunks.iter().all(|c| c["choices"][0]["delta"]["content"]
        .as_str()
        .unwrap_or("")
        .is_empty()));
}

/// The tokens of a text input to /v1/embeddings: with the tokenizer's special tokens.
fn input_len(server: &Server, text: &str) -> usize {
    server
        .state
        .pool
        .tokenizer()
        .encode(text, true)
        .unwrap()
        .len()
}

#[tokio::test]
async fn embeddings_answer_each_input_in_order_as_one_pooling_request_each() {
    let mut server = pooling().await;
    let body = json!({"model": MODEL, "input": ["Hello there", "x"], "frobnicate": 1});
    let response = server.call(post("/v1/embeddings", body.to_string())).await;
    assert_eq!(response.headers()["x-sluice-ignored-fields"], "frobnicate");
    let (status, body) = json_of(response).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let lens = [input_len(&server, "Hello there"), input_len(&server, "x")];
    assert_ne!(lens[0], lens[1]);
    for (index, len) in lens.into_iter().enumerate() {
        assert_eq!(
            body["data"][index],
            json!({"object": "embedding", "index": index,
                   "embedding": fake_embedding(len, EMBEDDING_SIZE)})
        );
    }
    let prompt_tokens = lens.iter().sum::<usize>();
    assert_eq!(body["object"], "list");
    assert_eq!(body["model"], MODEL);
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens})
    );
    let mut ids = Vec::new();
    for _ in 0..2 {
        let Message::AddRequest(request) = server.next_seen("add_request").await else {
            unreachable!()
        };
        assert_eq!(request.params.max_tokens, 1);
        let pooling = request.pooling.expect("a pooling request");
        assert_eq!((pooling.dimensions, pooling.normalize), (None, None));
        ids.push(request.request_id.rsplit('-').next().unwrap().to_owned());
    }
    ids.sort();
    assert_eq!(ids, ["0", "1"]);
    let (_, metrics) = server.get("/metrics").await;
    assert!(
        metrics.contains(&format!(
            "sluice:prompt_tokens_total{{model_name=\"{MODEL}\"}} {prompt_tokens}\n"
        )),
        "{metrics}"
    );
    assert_eq!(server.state.permits.available_permits(), 64);
}

#[tokio::test]
async fn embeddings_in_base64_are_the_engines_bytes_cut_to_the_dimensions_asked() {
    let mut server = pooling().await;
    let (status, body) = server
        .post(
            "/v1/embeddings",
            json!({"model": MODEL, "input": [[5, 6, 7]], "encoding_format": "base64",
                   "dimensions": 3, "normalize": false}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let bytes = base64::decode(body["data"][0]["embedding"].as_str().unwrap()).unwrap();
    let floats: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|value| f32::from_le_bytes(value.try_into().unwrap()))
        .collect();
    assert_eq!(floats, fake_embedding(3, 3));
    let Message::AddRequest(request) = server.next_seen("add_request").await else {
        unreachable!()
    };
    let pooling = request.pooling.unwrap();
    assert_eq!(
        (pooling.dimensions, pooling.normalize),
        (Some(3), Some(false))
    );
    assert_eq!(request.prompt_token_ids, [5, 6, 7]);
}

#[tokio::test]
async fn embeddings_refuse_bad_inputs_naming_the_field() {
    let server = pooling().await;
    let embeddings = |fields: Value| {
        let mut body = json!({"model": MODEL, "input": "x"});
        body.as_object_mut()
            .unwrap()
            .extend(fields.as_object().unwrap().clone());
        post("/v1/embeddings", body.to_string())
    };
    let too_long = vec![1; MAX_MODEL_LEN as usize + 1];
    let cases = [
        (json!({"input": []}), json!({"param": "input"})),
        (json!({"input": [[1], []]}), json!({"param": "input"})),
        (json!({"input": [9_999_999]}), json!({"param": "input"})),
        (json!({"input": vec!["x"; 2049]}), json!({"param": "input"})),
        (
            json!({"input": too_long}),
            json!({"param": "input", "code": "context_length_exceeded"}),
        ),
        (
            json!({"input": [1], "truncate_prompt_tokens": 0}),
            json!({"param": "truncate_prompt_tokens"}),
        ),
        (json!({"dimensions": 0}), json!({"param": "dimensions"})),
        (
            json!({"dimensions": EMBEDDING_SIZE + 1}),
            json!({"param": "dimensions"}),
        ),
        (
            json!({"encoding_format": "binary"}),
            json!({"param": "encoding_format"}),
        ),
        (
            json!({"embed_dtype": "float16"}),
            json!({"param": "embed_dtype"}),
        ),
        (json!({"priority": 1}), json!({"param": "priority"})),
    ];
    for (fields, expected) in cases {
        assert_error(&server, embeddings(fields), 400, expected).await;
    }
    assert_error(
        &server,
        embeddings(json!({"model": "gpt-9"})),
        404,
        json!({"param": "model", "code": "model_not_found"}),
    )
    .await;
    // Truncated, an input longer than the context fits it.
    let (status, body) = server
        .post(
            "/v1/embeddings",
            json!({"model": MODEL, "input": too_long, "truncate_prompt_tokens": -1}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], MAX_MODEL_LEN);
}

/// The cosine of the fake engine's embeddings of prompts of these lengths.
fn fake_cosine(a: usize, b: usize) -> f64 {
    let [a, b] = [a, b].map(|len| {
        fake_embedding(len, EMBEDDING_SIZE)
            .into_iter()
            .map(f64::from)
            .collect::<Vec<_>>()
    });
    let dot = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(x, y)| x * y).sum::<f64>();
    dot(&a, &b) / (dot(&a, &a) * dot(&b, &b)).sqrt()
}

/// The add_requests the engine has received so far.
fn add_requests_seen(server: &mut Server) -> Vec<AddRequest> {
    std::iter::from_fn(|| server.seen.try_recv().ok())
        .filter_map(|message| match message {
            Message::AddRequest(request) => Some(*request),
            _ => None,
        })
        .collect()
}

/// The prompts of the add_requests the engine has received so far, none a cross-encoder's pair.
fn prompts_seen(server: &mut Server) -> Vec<Vec<u32>> {
    add_requests_seen(server)
        .into_iter()
        .map(|request| {
            assert_eq!(request.second_text_start, None);
            request.prompt_token_ids
        })
        .collect()
}

/// The scores under `field` of `list`'s items, each checked against `expected` to within what
/// serde_json's float parsing may round (its last bit).
fn assert_scores(list: &Value, field: &str, expected: &[f64]) {
    let scores: Vec<f64> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|item| item[field].as_f64().unwrap())
        .collect();
    assert_eq!(scores.len(), expected.len(), "{list}");
    for (score, expected) in scores.iter().zip(expected) {
        assert!(
            (score - expected).abs() < 1e-15,
            "{list} against {expected:?}"
        );
    }
}

#[tokio::test]
async fn score_embeds_each_distinct_text_once_and_answers_each_pairs_cosine() {
    let mut server = pooling().await;
    let body = json!({"model": MODEL, "text_1": [[1, 2]], "text_2": [[3], [4, 5, 6], [1, 2]],
                      "queries": ["x"]});
    let response = server.call(post("/score", body.to_string())).await;
    assert_eq!(response.headers()["x-sluice-ignored-fields"], "queries");
    let (status, body) = json_of(response).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body["id"].as_str().unwrap().starts_with("score-"), "{body}");
    assert_eq!(
        (&body["object"], &body["model"]),
        (&json!("list"), &json!(MODEL))
    );
    assert!(body["created"].as_u64().unwrap() > 0);
    for (index, item) in body["data"].as_array().unwrap().iter().enumerate() {
        assert_eq!(item["index"], index);
        assert_eq!(item["object"], "score");
    }
    assert_scores(
        &body["data"],
        "score",
        &[fake_cosine(2, 1), fake_cosine(2, 3), 1.0],
    );
    let mut prompts = prompts_seen(&mut server);
    prompts.sort();
    assert_eq!(prompts, [vec![1, 2], vec![3], vec![4, 5, 6]]);
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 6, "total_tokens": 6})
    );

    let (status, body) = server
        .post(
            "/score",
            json!({"model": MODEL, "data_1": [[1], [2, 3]], "data_2": [[4, 5], [6]]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_scores(
        &body["data"],
        "score",
        &[fake_cosine(1, 2), fake_cosine(2, 1)],
    );
    assert_eq!(server.state.permits.available_permits(), 64);
}

#[tokio::test]
async fn rerank_orders_the_documents_by_relevance_with_their_text() {
    let server = pooling().await;
    let documents = ["one two three four", "one", "one two"];
    let query = "one two three";
    let lens = documents.map(|document| input_len(&server, document));
    let query_len = input_len(&server, query);
    let mut expected: Vec<(usize, f64)> = (0..documents.len())
        .map(|index| (index, fake_cosine(query_len, lens[index])))
        .collect();
    expected.sort_by(|a, b| b.1.total_cmp(&a.1));
    let tokens = query_len + lens.iter().sum::<usize>();
    assert_reranked(&server, query, &documents, &expected, tokens).await;
}

/// Each rerank route answers the documents in `expected`'s order (index, score), with their texts
/// and `tokens` prompt tokens; `top_n` 1 without `return_documents` answers the best one alone.
async fn assert_reranked(
    server: &Server,
    query: &str,
    documents: &[&str],
    expected: &[(usize, f64)],
    tokens: usize,
) {
    for path in ["/rerank", "/v1/rerank", "/v2/rerank"] {
        let (status, body) = server
            .post(
                path,
                json!({"model": MODEL, "query": query, "documents": documents}),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{path}: {body}");
        assert!(
            body["id"].as_str().unwrap().starts_with("rerank-"),
            "{body}"
        );
        assert_eq!(body["model"], MODEL);
        let results = body["results"].as_array().unwrap();
        for (result, &(index, _)) in results.iter().zip(expected) {
            assert_eq!(result["index"], index, "{path}: {body}");
            assert_eq!(result["document"], json!({"text": documents[index]}));
        }
        let scores: Vec<f64> = expected.iter().map(|&(_, score)| score).collect();
        assert_scores(&body["results"], "relevance_score", &scores);
        assert_eq!(
            body["usage"],
            json!({"prompt_tokens": tokens, "total_tokens": tokens})
        );
    }
    let (status, body) = server
        .post(
            "/v1/rerank",
            json!({"model": MODEL, "query": query, "documents": documents, "top_n": 1,
                   "return_documents": false}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["results"][0]["index"], expected[0].0);
    assert_eq!(body["results"][0].get("document"), None);
    assert_scores(&body["results"], "relevance_score", &[expected[0].1]);
}

#[tokio::test]
async fn score_and_rerank_refuse_bad_inputs_naming_the_field() {
    let server = pooling().await;
    let too_long = vec![1; MAX_MODEL_LEN as usize + 1];
    let score = |body: Value| post("/score", body.to_string());
    let rerank = |body: Value| post("/rerank", body.to_string());
    let cases = [
        (
            score(json!({"model": MODEL, "text_1": ["a", "b"], "text_2": ["a", "b", "c"]})),
            json!({"param": "text_2"}),
        ),
        (
            score(json!({"model": MODEL, "text_1": [], "text_2": "a"})),
            json!({"param": "text_1"}),
        ),
        (
            score(json!({"model": MODEL, "text_1": "a", "text_2": []})),
            json!({"param": "text_2"}),
        ),
        (
            score(json!({"model": MODEL, "text_1": "a", "text_2": ["b", ""]})),
            json!({"param": "text_2"}),
        ),
        (
            score(json!({"model": MODEL, "text_1": "a", "text_2": vec!["b"; 2048]})),
            json!({"param": "text_2"}),
        ),
        (
            score(json!({"model": MODEL, "text_1": too_long, "text_2": "b"})),
            json!({"param": "text_1", "code": "context_length_exceeded"}),
        ),
        (
            score(json!({"model": MODEL, "text_1": "a", "text_2": "b", "priority": 1})),
            json!({"param": "priority"}),
        ),
        (
            rerank(json!({"model": MODEL, "query": "q", "documents": []})),
            json!({"param": "documents"}),
        ),
        (
            rerank(json!({"model": MODEL, "query": "", "documents": ["d"]})),
            json!({"param": "query"}),
        ),
        (
            rerank(json!({"model": MODEL, "query": "q", "documents": ["d"], "top_n": -1})),
            json!({"param": "top_n"}),
        ),
        (
            rerank(json!({"model": MODEL, "query": "q", "documents": ["d"],
                          "mm_processor_kwargs": {"x": 1}})),
            json!({"param": "mm_processor_kwargs"}),
        ),
    ];
    for (request, expected) in cases {
        assert_error(&server, request, 400, expected).await;
    }
    assert_error(
        &server,
        rerank(json!({"model": "gpt-9", "query": "q", "documents": ["d"], "top_n": -1})),
        404,
        json!({"param": "model", "code": "model_not_found"}),
    )
    .await;
    // Truncated, a text longer than the context fits it.
    let (status, body) = server
        .post(
            "/score",
            json!({"model": MODEL, "text_1": too_long, "text_2": [[1]],
                   "truncate_prompt_tokens": -1}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], MAX_MODEL_LEN + 1);
}

/// A pair as the default model's tokenizer makes it one prompt (its pair template types the second
/// text 1), and the fake cross-encoder's score of it.
fn fake_pair(server: &Server, first: &str, second: &str) -> (Vec<u32>, u32, f64) {
    let encoding = server
        .state
        .pool
        .tokenizer()
        .encode((first, second), true)
        .unwrap();
    let start = encoding.get_type_ids().iter().filter(|&&t| t == 0).count() as u32;
    assert_eq!(start as usize, server.encode(first).len());
    let ids = encoding.get_ids().to_vec();
    let score = f64::from(fake_pair_score(ids.len(), start));
    (ids, start, score)
}

#[tokio::test]
async fn a_cross_encoder_scores_each_pair_as_one_prompt_with_its_second_text_typed_1() {
    let mut server = cross_encoder().await;
    let query = "what is a dog";
    let documents = ["a dog is an animal", "a cat", "a dog is an animal"];
    let pairs = documents.map(|document| fake_pair(&server, query, document));
    let response = server
        .call(post(
            "/score",
            json!({"model": MODEL, "text_1": query, "text_2": documents, "queries": ["x"]})
                .to_string(),
        ))
        .await;
    assert_eq!(response.headers()["x-sluice-ignored-fields"], "queries");
    let (status, body) = json_of(response).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body["id"].as_str().unwrap().starts_with("score-"), "{body}");
    let scores: Vec<f64> = pairs.iter().map(|&(_, _, score)| score).collect();
    assert_scores(&body["data"], "score", &scores);
    // One pooling request per pair, repeated pairs too, each the pair's one prompt.
    let requests = add_requests_seen(&mut server);
    assert_eq!(requests.len(), pairs.len());
    for (request, (ids, start, _)) in requests.iter().zip(&pairs) {
        assert_eq!(&request.prompt_token_ids, ids);
        assert_eq!(request.second_text_start, Some(*start));
        assert_eq!(
            request.pooling,
            Some(PoolingParams {
                dimensions: None,
                normalize: None
            })
        );
    }
    let tokens: usize = pairs.iter().map(|(ids, _, _)| ids.len()).sum();
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": tokens, "total_tokens": tokens})
    );

    // One to one.
    let (status, body) = server
        .post(
            "/score",
            json!({"model": MODEL, "data_1": ["a", "b c"], "data_2": ["d e", "f"]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let one_to_one = [
        fake_pair(&server, "a", "d e"),
        fake_pair(&server, "b c", "f"),
    ];
    let scores: Vec<f64> = one_to_one.iter().map(|&(_, _, score)| score).collect();
    assert_scores(&body["data"], "score", &scores);

    let mut expected: Vec<(usize, f64)> = (0..).zip(pairs.iter().map(|pair| pair.2)).collect();
    expected.sort_by(|a, b| b.1.total_cmp(&a.1));
    assert_reranked(&server, query, &documents, &expected, tokens).await;
    assert_eq!(server.state.permits.available_permits(), 64);
}

#[tokio::test]
async fn a_cross_encoder_refuses_what_cannot_apply_to_a_pair_naming_the_field() {
    let server = cross_encoder().await;
    let score = |body: Value| post("/score", body.to_string());
    let rerank = |body: Value| post("/rerank", body.to_string());
    let too_long = "hello ".repeat(MAX_MODEL_LEN as usize);
    let cases = [
        (
            score(json!({"model": MODEL, "text_1": [[1, 2]], "text_2": "b"})),
            json!({"param": "text_1"}),
        ),
        (
            score(json!({"model": MODEL, "text_1": "a", "text_2": [3, 4]})),
            json!({"param": "text_2"}),
        ),
        (
            score(json!({"model": MODEL, "text_1": "a", "text_2": "b",
                         "truncate_prompt_tokens": -1})),
            json!({"param": "truncate_prompt_tokens"}),
        ),
        (
            rerank(json!({"model": MODEL, "query": "q", "documents": ["d"],
                          "truncate_prompt_tokens": 8})),
            json!({"param": "truncate_prompt_tokens"}),
        ),
        (
            score(json!({"model": MODEL, "text_1": "a", "text_2": "b", "dimensions": 1})),
            json!({"param": "dimensions"}),
        ),
        (
            rerank(json!({"model": MODEL, "query": "q", "documents": ["d"], "normalize": true})),
            json!({"param": "normalize"}),
        ),
        (
            score(json!({"model": MODEL, "text_1": "a", "text_2": "b",
                         "use_activation": false})),
            json!({"param": "use_activation"}),
        ),
        (
            score(json!({"model": MODEL, "text_1": "a", "text_2": ["b", ""]})),
            json!({"param": "text_2"}),
        ),
        (
            rerank(json!({"model": MODEL, "query": "", "documents": ["d"]})),
            json!({"param": "query"}),
        ),
        (
            score(json!({"model": MODEL, "text_1": too_long, "text_2": "b"})),
            json!({"param": "text_2", "code": "context_length_exceeded"}),
        ),
        (
            rerank(json!({"model": MODEL, "query": "q", "documents": ["d", too_long]})),
            json!({"param": "documents", "code": "context_length_exceeded"}),
        ),
    ];
    for (request, expected) in cases {
        assert_error(&server, request, 400, expected).await;
    }
    // Neither embeddings nor generation: each says what the model serves.
    for path in ["/v1/embeddings", "/v1/completions", "/v1/chat/completions"] {
        let (status, body) = server
            .post(path, json!({"model": MODEL, "input": "a", "prompt": "a"}))
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {body}");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["param"], "model");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("is a cross-encoder: it serves /score and /rerank"),
            "{message}"
        );
    }
}

#[tokio::test]
async fn each_runner_refuses_the_routes_of_the_other() {
    let pooling = pooling().await;
    for path in ["/v1/completions", "/v1/chat/completions", "/v1/responses"] {
        let (status, body) = pooling.post(path, json!({"model": MODEL})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("serves /v1/embeddings"), "{message}");
        assert_eq!(body["error"]["param"], "model");
    }
    // Anthropic's route answers in Anthropic's shape.
    let (status, body) = pooling.post("/v1/messages", json!({"model": MODEL})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["type"], "error");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("/v1/embeddings"));

    let generative = started(config()).await;
    for path in [
        "/v1/embeddings",
        "/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
    ] {
        let (status, body) = generative.post(path, json!({"model": MODEL})).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("generative model") && message.contains("--runner pooling"),
            "{message}"
        );
        assert_eq!(body["error"]["param"], "model");
    }
}

fn http_status(port: u16, path: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(PATIENCE)).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    response.split(' ').nth(1)?.parse().ok()
}

async fn wait_for(what: &str, done: impl FnMut() -> bool) {
    wait_within(PATIENCE, what, done).await
}

async fn wait_within(patience: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + patience;
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Not a test: the fake engine core as a process of its own (this test binary re-run), so that
/// killing it closes its sockets as a real engine's death does.
#[tokio::test]
#[ignore = "run by binary_turns_unhealthy_and_exits_3_when_the_engine_dies"]
async fn fake_engine_process() {
    let Some(dir) = std::env::var_os("SLUICE_FAKE_ENGINE_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let mut input = PullSocket::new();
    input
        .bind(&format!("ipc://{}/input", dir.display()))
        .await
        .unwrap();
    let mut output = PushSocket::new();
    output
        .bind(&format!("ipc://{}/output", dir.display()))
        .await
        .unwrap();
    let ready = encode(&Message::Ready(generative()));
    while output.send(ZmqMessage::from(ready.clone())).await.is_err() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let script = Arc::new(Mutex::new(Script::Silent));
    let (seen, _seen) = mpsc::unbounded_channel();
    let (_kill, killed) = oneshot::channel();
    fake_engine(input, output, Vec::new(), script, seen, killed).await;
}

#[tokio::test]
async fn binary_turns_unhealthy_and_exits_3_when_the_engine_dies() {
    let dir = temp_dir();
    let input_address = format!("ipc://{}/input", dir.display());
    let output_address = format!("ipc://{}/output", dir.display());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut engine = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "fake_engine_process", "--ignored", "--quiet"])
        .env("SLUICE_FAKE_ENGINE_DIR", &dir)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sluice-frontend"))
        .args(["--model-dir".as_ref(), default_model_dir().as_os_str()])
        .args(["--served-model-name", MODEL, "--host", "127.0.0.1"])
        .args(["--port", &port.to_string()])
        .args(["--engine-input", &input_address])
        .args(["--engine-output", &output_address])
        .args(["--exit-grace-seconds", "0.5"])
        .args(["--engine-pid", &engine.id().to_string()])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for("healthy", || http_status(port, "/health") == Some(200)).await;

    engine.kill().unwrap();
    engine.wait().unwrap();
    // The engine's process id is watched, so its death shows well before its silence would.
    wait_within(Duration::from_secs(3), "unhealthy", || {
        http_status(port, "/health") != Some(200)
    })
    .await;
    let mut status = None;
    wait_for("exit", || {
        status = child.try_wait().unwrap();
        status.is_some()
    })
    .await;
    assert_eq!(status.unwrap().code(), Some(3));
    let _ = std::fs::remove_dir_all(&dir);
}

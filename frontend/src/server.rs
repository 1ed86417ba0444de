//! The HTTP server: shared state, the router, and the small endpoints
//! (models, tokenize, detokenize, health, version, metrics). Completions and chat have their
//! own modules. Handlers are thin: parse, call one function, map the result.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tokio::sync::Semaphore;

use crate::admission;
use crate::api_error::ApiError;
use crate::auth;
use crate::chat;
use crate::chat_template::{ChatTemplate, ChatTemplateError};
use crate::completions;
use crate::engine_client::{EngineClient, EngineClientConfig, EngineError};
use crate::generation::engine_unavailable;
use crate::metrics::{EngineGauges, Metrics};
use crate::openai::{
    DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse,
};
use crate::protocol::{KvCacheSnapshot, UtilityMethod, UtilityValue};
use crate::request_body::{self, BodyLimits};
use crate::tokenizer_pool::{load_tokenizer, TokenizerPool, TokenizerPoolError};
use crate::validation;

/// Jobs that may wait for a tokenizer worker before callers wait in turn.
const TOKENIZER_QUEUE_DEPTH: usize = 1024;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub model_dir: PathBuf,
    pub served_model_name: String,
    pub api_key: Option<String>,
    /// Serve /metrics without the API key (Prometheus scrapers often carry none).
    pub metrics_without_auth: bool,
    pub max_waiting_requests: usize,
    pub max_body_bytes: usize,
    /// How long a request body may take to arrive.
    pub body_read_timeout: std::time::Duration,
    /// Body bytes that all requests being read or handled may hold together.
    pub max_body_bytes_in_flight: usize,
    pub tokenizer_workers: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error(transparent)]
    Tokenizer(#[from] TokenizerPoolError),
    #[error(transparent)]
    ChatTemplate(#[from] ChatTemplateError),
}

/// Everything the handlers share. The engine client is set once the engine core is ready.
pub struct AppState {
    pub config: ServerConfig,
    pub pool: TokenizerPool,
    /// None when the model has no chat template: chat requests are then answered with a 400.
    pub chat_template: Option<Arc<ChatTemplate>>,
    pub metrics: Arc<Metrics>,
    /// One permit per engine request admitted and not yet finished.
    pub permits: Arc<Semaphore>,
    pub vocab_size: u32,
    engine: OnceLock<EngineClient>,
    next_id: AtomicU64,
}

impl AppState {
    /// Loads the tokenizer and chat template of `config.model_dir`.
    pub fn load(config: ServerConfig) -> Result<Self, StartupError> {
        let tokenizer = load_tokenizer(&config.model_dir)?;
        let vocab_size = u32::try_from(tokenizer.get_vocab_size(true)).unwrap_or(u32::MAX);
        let chat_template = match ChatTemplate::from_model_dir(&config.model_dir) {
            Ok(template) => Some(Arc::new(template)),
            Err(ChatTemplateError::Missing) => {
                eprintln!("sluice-frontend: the model has no chat template; chat is disabled");
                None
            }
            Err(error) => return Err(error.into()),
        };
        Ok(AppState {
            pool: TokenizerPool::new(
                Arc::new(tokenizer),
                config.tokenizer_workers.max(1),
                TOKENIZER_QUEUE_DEPTH,
            ),
            chat_template,
            metrics: Arc::new(Metrics::new(config.served_model_name.clone())),
            permits: Arc::new(Semaphore::new(config.max_waiting_requests)),
            vocab_size,
            engine: OnceLock::new(),
            next_id: AtomicU64::new(0),
            config,
        })
    }

    /// Makes the server serve with `engine`; only the first call has an effect.
    pub fn set_engine(&self, engine: EngineClient) {
        let _ = self.engine.set(engine);
    }

    /// The engine client, or a 503 while the engine core is not ready yet.
    pub fn engine(&self) -> Result<&EngineClient, ApiError> {
        self.engine
            .get()
            .ok_or_else(|| ApiError::EngineUnavailable("the engine core is not ready yet".into()))
    }

    pub fn is_healthy(&self) -> bool {
        self.engine.get().is_some_and(EngineClient::is_healthy)
    }

    pub fn max_model_len(&self) -> Result<u32, ApiError> {
        Ok(self.engine()?.ready().max_model_len)
    }

    /// A response id unique within this process, such as `cmpl-18c2f3a9d6e1b-7`.
    pub fn request_id(&self, kind: &str) -> String {
        let sequence = self.next_id.fetch_add(1, Ordering::Relaxed);
        let started = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("{kind}-{started:x}-{sequence}")
    }

    pub fn check_model(&self, model: &str) -> Result<(), ApiError> {
        validation::check_model(model, &self.config.served_model_name)
    }
}

/// Connects to the engine core, waits for its `ready`, and starts serving with it.
pub async fn connect_engine(
    state: &AppState,
    config: EngineClientConfig,
) -> Result<EngineClient, EngineError> {
    let client = EngineClient::connect(config).await?;
    state.set_engine(client.clone());
    Ok(client)
}

pub fn router(state: Arc<AppState>) -> Router {
    let body_limits = Arc::new(BodyLimits::new(
        state.config.max_body_bytes,
        state.config.body_read_timeout,
        state.config.max_body_bytes_in_flight,
    ));
    Router::new()
        .route("/v1/completions", post(completions::create))
        .route("/v1/chat/completions", post(chat::create))
        .route("/v1/models", get(models))
        .route("/v1/models/{model}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/sluice/kv_cache", get(kv_cache))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .fallback(no_such_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .layer(middleware::from_fn_with_state(
            body_limits,
            request_body::read_body,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_api_key,
        ))
        .with_state(state)
}

async fn no_such_route(method: Method, uri: Uri) -> ApiError {
    ApiError::NoSuchRoute(format!("{method} {}", uri.path()))
}

async fn method_not_allowed(method: Method) -> ApiError {
    ApiError::MethodNotAllowed(method.to_string())
}

pub fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn models(State(state): State<Arc<AppState>>) -> Result<Json<ModelList>, ApiError> {
    Ok(Json(model_list(&state)?))
}

fn model_list(state: &AppState) -> Result<ModelList, ApiError> {
    Ok(ModelList {
        object: "list".into(),
        data: vec![model_card(state)?],
    })
}

/// `GET /v1/models/{model}`: the served model's card, or a 404 in OpenAI's shape.
async fn model(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    state.check_model(&model)?;
    Ok(Json(model_card(&state)?))
}

fn model_card(state: &AppState) -> Result<ModelCard, ApiError> {
    Ok(ModelCard {
        id: state.config.served_model_name.clone(),
        object: "model".into(),
        created: unix_time(),
        owned_by: "sluice".into(),
        max_model_len: state.max_model_len()?,
    })
}

async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Json<TokenizeRequest>, JsonRejection>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let Json(request) = body?;
    Ok(Json(tokenized(&state, request).await?))
}

/// vLLM's /tokenize: a prompt (special tokens added by default), or messages rendered through
/// the chat template (which holds the special tokens already).
async fn tokenized(
    state: &AppState,
    request: TokenizeRequest,
) -> Result<TokenizeResponse, ApiError> {
    if let Some(model) = &request.model {
        state.check_model(model)?;
    }
    let _waiting = admission::admit(state, 1)?;
    let tokens = match (request.prompt, request.messages) {
        (Some(prompt), None) => {
            let add_special_tokens = request.add_special_tokens.unwrap_or(true);
            state.pool.encode(prompt, add_special_tokens).await?
        }
        (None, Some(messages)) => {
            validation::check_messages(&messages)?;
            let add_generation_prompt = request.add_generation_prompt.unwrap_or(true);
            let text = chat::render(state, messages, add_generation_prompt).await?;
            let add_special_tokens = request.add_special_tokens.unwrap_or(false);
            state.pool.encode(text, add_special_tokens).await?
        }
        _ => {
            return Err(ApiError::InvalidRequest(
                "give exactly one of `prompt` and `messages`".into(),
            ))
        }
    };
    Ok(TokenizeResponse {
        count: tokens.len(),
        max_model_len: state.max_model_len()?,
        tokens,
    })
}

async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Json<DetokenizeRequest>, JsonRejection>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let Json(request) = body?;
    Ok(Json(detokenized(&state, request).await?))
}

async fn detokenized(
    state: &AppState,
    request: DetokenizeRequest,
) -> Result<DetokenizeResponse, ApiError> {
    if let Some(model) = &request.model {
        state.check_model(model)?;
    }
    validation::check_token_ids("tokens", &request.tokens, state.vocab_size)?;
    let _waiting = admission::admit(state, 1)?;
    Ok(DetokenizeResponse {
        prompt: state.pool.decode(request.tokens, true).await?,
    })
}

async fn health(State(state): State<Arc<AppState>>) -> StatusCode {
    if state.is_healthy() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// The engine core's prefix cache, for a cache-aware router's index (and the tests that check it).
async fn kv_cache(State(state): State<Arc<AppState>>) -> Result<Json<KvCacheSnapshot>, ApiError> {
    match state.engine()?.utility(UtilityMethod::KvCache).await {
        Ok(Some(UtilityValue::KvCache(snapshot))) => Ok(Json(snapshot)),
        Ok(other) => Err(ApiError::Internal(format!(
            "the engine core answered kv_cache with {other:?}"
        ))),
        Err(error) => Err(engine_unavailable(error)),
    }
}

async fn version() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "version": env!("CARGO_PKG_VERSION") }))
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let gauges = state
        .engine
        .get()
        .and_then(EngineClient::latest_stats)
        .map(|stats| EngineGauges {
            num_running: stats.num_running,
            num_waiting: stats.num_waiting,
            kv_cache_usage: stats.kv_cache_usage,
            prefix_cache_queries: stats.prefix_cache_queries,
            prefix_cache_hits: stats.prefix_cache_hits,
            num_preemptions: stats.num_preemptions,
            num_eager_fallbacks: stats.num_eager_fallbacks,
        })
        .unwrap_or_default();
    let mut response = state.metrics.render(&gauges).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

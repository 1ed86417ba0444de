//! What every handler shares (the configuration, the tokenizer pool, the chat template, the
//! metrics, the waiting-queue permits and the engine client), and the clocks requests are
//! stamped with. It sits below the handlers, so no handler module is imported by it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use sluice_common::cors::CorsLayer;
use tokio::sync::Semaphore;

use crate::engine::client::EngineClient;
use crate::engine::client_config::EngineClientConfig;
use crate::engine::error::EngineError;
use crate::engine::protocol::EngineStats;
use crate::metrics::{Metrics, MetricsPrefix};
use crate::response_store::{ResponseStore, StoreBounds};
use crate::text::reasoning::ReasoningParser;
use crate::text::tokenizer_pool::{TokenizerPool, TokenizerPoolError};
use crate::text::tool_parsers::{serving_parser, ToolCallParser};
use sluice_common::text::chat_template::{ChatTemplate, ChatTemplateError};
use sluice_common::text::tokenizer_file::load_tokenizer;

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
    /// Texts longer than this are encoded in pieces where exact; 0: whole.
    pub tokenize_piece_bytes: usize,
    pub metrics_prefix: MetricsPrefix,
    /// The engine core's scheduling policy, which decides whether a request may carry a priority.
    pub scheduling_policy: SchedulingPolicy,
    /// `--tool-call-parser`: "auto" or a registered parser's name.
    pub tool_call_parser: String,
    /// `tool_choice: "auto"` is held to the parser's lazy grammar (off: `--no-tool-call-grammar`).
    pub tool_call_grammar: bool,
    /// `--reasoning-parser`: how chat splits thinking from the answer, if it does.
    pub reasoning_parser: Option<ReasoningParser>,
    /// Requests may bring their own `chat_template`.
    pub trust_request_chat_template: bool,
    /// The origins whose pages may call the API from a browser, if any (`--allowed-origins`).
    pub cors: Option<CorsLayer>,
    /// The instruction-set tier of the CPU kernels that the engine core's workers run (`sluice serve`
    /// resolves `--cpu-isa` on this machine), or `none`: shown on /version and /metrics.
    pub cpu_kernels: String,
    /// The SQLite file of `/v1/responses`' stored conversations, and its bounds.
    pub responses_store: PathBuf,
    pub responses_bounds: StoreBounds,
}

/// The engine core's `--scheduling-policy`, mirrored here: `sluice serve` passes the same value to both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SchedulingPolicy {
    /// First come, first served: every request has priority 0.
    #[default]
    Fcfs,
    /// By (priority, arrival time), lower first.
    Priority,
}

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error(transparent)]
    Tokenizer(#[from] TokenizerPoolError),
    #[error(transparent)]
    ChatTemplate(#[from] ChatTemplateError),
    #[error("{0}")]
    ToolCallParser(String),
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
    /// What `tool_choice: "auto"` reads outputs with.
    pub tool_call_parser: Arc<dyn ToolCallParser>,
    /// `/v1/responses`' stored conversations.
    pub responses: Arc<ResponseStore>,
    engine: OnceLock<EngineClient>,
    next_id: AtomicU64,
}

/// Before the engine core's ready message there is nothing to serve with; `api` answers 503.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the engine core is not ready yet")]
pub struct EngineNotReady;

impl AppState {
    /// Loads the tokenizer and chat template of `config.model_dir`.
    pub fn load(config: ServerConfig) -> Result<Self, StartupError> {
        let tokenizer = load_tokenizer(&config.model_dir).map_err(TokenizerPoolError::from)?;
        let vocab_size = u32::try_from(tokenizer.get_vocab_size(true)).unwrap_or(u32::MAX);
        let chat_template = match ChatTemplate::from_model_dir(&config.model_dir) {
            Ok(template) => Some(Arc::new(template)),
            Err(ChatTemplateError::Missing) => {
                eprintln!("sluice-frontend: the model has no chat template; chat is disabled");
                None
            }
            Err(error) => return Err(error.into()),
        };
        let tool_call_parser = serving_parser(
            &config.tool_call_parser,
            chat_template
                .as_ref()
                .filter(|template| template.uses_tools())
                .map(|template| template.source()),
            |token| tokenizer.token_to_id(token).is_some(),
        )
        .map_err(StartupError::ToolCallParser)?;
        Ok(AppState {
            pool: TokenizerPool::new(
                Arc::new(tokenizer),
                config.tokenizer_workers.max(1),
                TOKENIZER_QUEUE_DEPTH,
                config.tokenize_piece_bytes,
            ),
            chat_template,
            metrics: Arc::new(
                Metrics::new(config.served_model_name.clone(), config.metrics_prefix)
                    .with_cpu_kernels(config.cpu_kernels.clone()),
            ),
            permits: Arc::new(Semaphore::new(config.max_waiting_requests)),
            vocab_size,
            tool_call_parser,
            responses: Arc::new(ResponseStore::new(
                config.responses_store.clone(),
                config.responses_bounds.clone(),
            )),
            engine: OnceLock::new(),
            next_id: AtomicU64::new(0),
            config,
        })
    }

    /// Makes the server serve with `engine`; only the first call has an effect.
    pub fn set_engine(&self, engine: EngineClient) {
        let _ = self.engine.set(engine);
    }

    /// The engine client, or EngineNotReady (a 503) while the engine core is not ready yet.
    pub fn engine(&self) -> Result<&EngineClient, EngineNotReady> {
        self.engine.get().ok_or(EngineNotReady)
    }

    pub fn is_healthy(&self) -> bool {
        self.engine.get().is_some_and(EngineClient::is_healthy)
    }

    /// Restarted engine cores that took over, as the engine client counts them.
    pub fn engine_restarts(&self) -> u64 {
        self.engine.get().map_or(0, EngineClient::restarts)
    }

    /// The engine's counters after its last step, or None before the engine core is ready.
    pub fn latest_stats(&self) -> Option<EngineStats> {
        self.engine.get().and_then(EngineClient::latest_stats)
    }

    pub fn max_model_len(&self) -> Result<u32, EngineNotReady> {
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

/// When a request arrived, on both clocks: the monotonic one for latencies, the wall clock for
/// the engine (its `arrival_time`).
#[derive(Debug, Clone, Copy)]
pub struct Arrival {
    pub instant: Instant,
    pub unix_seconds: f64,
}

impl Arrival {
    pub fn now() -> Self {
        Arrival {
            instant: Instant::now(),
            unix_seconds: unix_seconds(),
        }
    }
}

/// Seconds since the Unix epoch, as OpenAI's `created` fields carry them.
pub fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

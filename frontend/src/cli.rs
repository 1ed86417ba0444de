//! The `sluice-frontend` command: flags, startup, and the serving loop (the binary itself is
//! src/main.rs).
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use crate::api::routes;
use crate::engine::client_config::EngineClientConfig;
use crate::metrics::MetricsPrefix;
use crate::response_store::StoreBounds;
use crate::state::{self, AppState, SchedulingPolicy, ServerConfig};
use crate::text::reasoning::ReasoningParser;
use crate::text::tool_parsers::parser_choices;
use clap::builder::PossibleValuesParser;
use clap::Parser;
use sluice_common::connections;
use sluice_common::flag_schema;
use sluice_common::server_args::{positive_seconds, ServerArgs};
use sluice_common::text::piecewise_encoder::DEFAULT_PIECE_BYTES;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// Sluice's OpenAI-compatible HTTP frontend for one engine core.
#[derive(Parser, Debug)]
#[command(name = "sluice-frontend", version)]
struct Args {
    /// Hugging Face model folder (tokenizer.json, chat template).
    #[arg(long)]
    model_dir: PathBuf,
    /// The model name clients must send.
    #[arg(long)]
    served_model_name: String,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The engine core's input socket (it binds PULL; we connect PUSH).
    #[arg(long)]
    engine_input: String,
    /// The engine core's output socket (it binds PUSH; we connect PULL).
    #[arg(long)]
    engine_output: String,
    #[command(flatten)]
    server: ServerArgs,
    /// Engine requests (one per choice: prompts x n) and tokenizer calls that may wait at once;
    /// a request waits until its first token. Beyond it, 429; a request larger than it, 400.
    #[arg(long, default_value_t = 512)]
    max_waiting_requests: usize,
    /// Body bytes that all requests being read or handled may hold together; more wait.
    #[arg(long, default_value_t = 134_217_728)]
    max_body_bytes_in_flight: usize,
    /// Threads that tokenize prompts and detokenize outputs.
    #[arg(long, default_value_t = 2)]
    tokenizer_workers: usize,
    /// Texts longer than this are encoded in pieces of this size, with the same ids and a
    /// bounded peak of memory, where the tokenizer allows it exactly; 0: every text whole.
    #[arg(long, default_value_t = DEFAULT_PIECE_BYTES)]
    tokenize_piece_bytes: usize,
    /// Seconds between engine death and exiting with code 3.
    #[arg(long, default_value_t = 2.0)]
    exit_grace_seconds: f64,
    /// The engine core's process id, when it runs on this machine: its exit is noticed at once,
    /// even before its socket closes.
    #[arg(long)]
    engine_pid: Option<u32>,
    /// When the engine core goes away, fail what is in flight, answer 503 meanwhile and wait for
    /// the engine core its supervisor restarts on the same addresses, instead of exiting.
    #[arg(long)]
    reconnect_engine: bool,
    /// The namespace of /metrics' names: `vllm` renders vLLM's exact names, for its dashboards.
    #[arg(long, value_enum, default_value_t = MetricsPrefix::Sluice)]
    metrics_prefix: MetricsPrefix,
    /// The engine core's scheduling policy: a request's `priority` other than 0 needs `priority`.
    #[arg(long, value_enum, default_value_t = SchedulingPolicy::Fcfs)]
    scheduling_policy: SchedulingPolicy,
    /// How `tool_choice: "auto"` finds calls in outputs: hermes, llama3_json, mistral, pythonic or
    /// qwen3_coder; auto picks by the chat template, then the model's vocabulary. A chat template
    /// without tools gets a Hermes prompt, so hermes.
    #[arg(long, default_value = "auto", value_parser = PossibleValuesParser::new(parser_choices()))]
    tool_call_parser: String,
    /// Leave `tool_choice: "auto"` unconstrained: without this, the parser's lazy grammar (every
    /// parser has one) makes every call the model opens well formed and one of the request's tools.
    #[arg(long)]
    no_tool_call_grammar: bool,
    /// Split a reasoning model's thinking (`<think>...</think>`) out of chat's answer, as
    /// `reasoning_content`: qwen3 or deepseek_r1. Without it the thinking stays in `content`.
    #[arg(long, value_enum)]
    reasoning_parser: Option<ReasoningParser>,
    /// Let a chat or /tokenize request bring its own `chat_template` (vLLM's flag): a template is
    /// code that runs here, so only for clients that are trusted.
    #[arg(long)]
    trust_request_chat_template: bool,
    /// The instruction-set tier of the CPU kernels the engine core's workers run (`sluice serve` passes
    /// what its `--cpu-isa` resolves to here), shown on /version and as /metrics' cpu_kernels_info.
    #[arg(long, default_value = "none")]
    cpu_kernels: String,
    /// The SQLite file that keeps /v1/responses' stored conversations (created at the first stored
    /// response). Default: responses-<port>.sqlite3 in the cache folder ($SLUICE_CACHE, or
    /// ~/.cache/sluice).
    #[arg(long)]
    responses_store: Option<PathBuf>,
    /// The megabytes of responses the store keeps: past it the oldest are evicted.
    #[arg(long, default_value_t = 1024.0)]
    responses_store_max_mb: f64,
    /// Seconds a stored response stays retrievable (default 30 days, as OpenAI's).
    #[arg(long, default_value_t = 2_592_000.0)]
    responses_store_max_age_s: f64,
}

impl Args {
    fn server_config(&self) -> Result<ServerConfig, String> {
        Ok(ServerConfig {
            model_dir: self.model_dir.clone(),
            served_model_name: self.served_model_name.clone(),
            api_key: self.server.api_key()?,
            metrics_without_auth: self.server.metrics_without_auth,
            max_waiting_requests: self.max_waiting_requests,
            max_body_bytes: self.server.max_body_bytes,
            body_read_timeout: self.server.body_read_timeout()?,
            max_body_bytes_in_flight: self.max_body_bytes_in_flight,
            tokenizer_workers: self.tokenizer_workers,
            tokenize_piece_bytes: self.tokenize_piece_bytes,
            metrics_prefix: self.metrics_prefix,
            scheduling_policy: self.scheduling_policy,
            tool_call_parser: self.tool_call_parser.clone(),
            reasoning_parser: self.reasoning_parser,
            tool_call_grammar: !self.no_tool_call_grammar,
            trust_request_chat_template: self.trust_request_chat_template,
            cors: self.server.cors()?,
            cpu_kernels: self.cpu_kernels.clone(),
            responses_store: self
                .responses_store
                .clone()
                .unwrap_or_else(|| cache_folder().join(format!("responses-{}.sqlite3", self.port))),
            responses_bounds: self.responses_bounds()?,
        })
    }

    fn responses_bounds(&self) -> Result<StoreBounds, String> {
        let max_mb = self.responses_store_max_mb;
        if !(max_mb.is_finite() && max_mb > 0.0) {
            return Err(format!(
                "--responses-store-max-mb must be a positive number, got {max_mb}"
            ));
        }
        Ok(StoreBounds {
            max_bytes: (max_mb * 1e6) as u64,
            max_age: positive_seconds("responses-store-max-age-s", self.responses_store_max_age_s)?,
        })
    }
}

/// Sluice's cache folder, as the Python side has it (`sluice_cache_dir`): $SLUICE_CACHE, else
/// ~/.cache/sluice.
fn cache_folder() -> PathBuf {
    std::env::var_os("SLUICE_CACHE")
        .filter(|path| !path.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache/sluice")))
        .unwrap_or_else(|| std::env::temp_dir().join("sluice"))
}

/// Exit status when the engine core dies or never becomes ready, so a supervisor restarts us.
const EXIT_ENGINE_DEAD: u8 = 3;
/// Exit status for bad arguments or model files.
const EXIT_STARTUP: u8 = 2;

/// The `sluice-frontend` binary's main.
#[tokio::main]
pub async fn main() -> ExitCode {
    if flag_schema::print_if_asked::<Args>() {
        return ExitCode::SUCCESS;
    }
    let args = Args::parse();
    let (config, limits, tls) = match args
        .server_config()
        .and_then(|config| Ok((config, args.server.connection_limits()?, args.server.tls()?)))
    {
        Ok(all) => all,
        Err(error) => {
            eprintln!("sluice-frontend: {error}");
            return ExitCode::from(EXIT_STARTUP);
        }
    };
    let state = match AppState::load(config) {
        Ok(state) => Arc::new(state),
        Err(error) => {
            eprintln!("sluice-frontend: {error}");
            return ExitCode::from(EXIT_STARTUP);
        }
    };
    let listener = match TcpListener::bind((args.host.as_str(), args.port)).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!(
                "sluice-frontend: cannot listen on {}:{}: {error}",
                args.host, args.port
            );
            return ExitCode::from(EXIT_STARTUP);
        }
    };
    eprintln!(
        "sluice-frontend: listening on http://{}:{}",
        args.host, args.port
    );

    let (engine_exit, mut engine_exited) = mpsc::channel::<()>(1);
    let mut engine_config =
        EngineClientConfig::new(args.engine_input.clone(), args.engine_output.clone());
    engine_config.engine_pid = args.engine_pid;
    engine_config.reconnect = args.reconnect_engine;
    let grace = Duration::from_secs_f64(args.exit_grace_seconds.max(0.0));
    let engine_state = state.clone();
    tokio::spawn(async move {
        match state::connect_engine(&engine_state, engine_config).await {
            Ok(engine) => {
                eprintln!("sluice-frontend: the engine core is ready");
                let reason = engine.dead().await;
                eprintln!("sluice-frontend: the engine core died: {reason}; exiting in {grace:?}");
                // In-flight requests have been failed already; give their error events time to go out.
                tokio::time::sleep(grace).await;
            }
            Err(error) => eprintln!("sluice-frontend: {error}"),
        }
        let _ = engine_exit.send(()).await;
    });

    let app = routes::router(state);
    tokio::select! {
        () = connections::serve(listener, app, limits, tls, shutdown_signal()) => ExitCode::SUCCESS,
        Some(()) = engine_exited.recv() => ExitCode::from(EXIT_ENGINE_DEAD),
    }
}

/// Resolves on SIGINT or SIGTERM; axum then stops accepting and drains in-flight requests.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = interrupt => {}
        _ = terminate => {}
    }
    eprintln!("sluice-frontend: shutting down, draining in-flight requests");
}

//! What the integration tests of this folder share.

use std::time::Duration;

use sluice_common::text::default_model::default_model_dir;
use sluice_frontend::metrics::MetricsPrefix;
use sluice_frontend::response_store::StoreBounds;
use sluice_frontend::state::{SchedulingPolicy, ServerConfig};

/// A server of the default model serving it as `served_model_name`, without an API key.
pub fn server_config(served_model_name: &str) -> ServerConfig {
    ServerConfig {
        model_dir: default_model_dir(),
        served_model_name: served_model_name.into(),
        api_key: None,
        metrics_without_auth: false,
        max_waiting_requests: 64,
        max_body_bytes: 1 << 20,
        body_read_timeout: Duration::from_secs(10),
        max_body_bytes_in_flight: 1 << 24,
        tokenizer_workers: 2,
        tokenize_piece_bytes: 16_384,
        metrics_prefix: MetricsPrefix::Sluice,
        scheduling_policy: SchedulingPolicy::Fcfs,
        tool_call_parser: "auto".into(),
        reasoning_parser: None,
        tool_call_grammar: true,
        trust_request_chat_template: false,
        cors: None,
        cpu_kernels: "avx2".into(),
        responses_store: std::env::temp_dir().join(format!(
            "sluice-test-responses-{}-{served_model_name}.sqlite3",
            std::process::id()
        )),
        responses_bounds: StoreBounds {
            max_bytes: 1 << 20,
            max_age: Duration::from_secs(3600),
        },
    }
}

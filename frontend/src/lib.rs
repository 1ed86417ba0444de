//! Sluice's frontend: everything that touches text and HTTP.
pub mod api_error;
pub mod chat;
pub mod chat_template;
pub mod cli;
pub mod completions;
pub mod detokenizer;
pub mod engine_client;
pub mod generation;
pub mod metrics;
pub mod openai;
pub mod openapi;
pub mod protocol;
pub mod server;
pub mod sse;
pub mod stop_strings;
pub mod tokenizer_pool;
pub mod validation;

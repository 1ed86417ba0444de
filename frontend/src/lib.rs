//! Sluice's frontend: everything that touches text and HTTP.
//!
//! Layers, each using only those below it: `api` (HTTP routes, validation, fan-out, framing)
//! over `state` (what the handlers share) over `text` (the tokenizer pool, detokenizer, stop strings,
//! choice streams) and `engine` (the ZeroMQ seam to the engine core), over the crate it shares with
//! the router, `sluice_common` (OpenAI's request and response types, the chat template, the API key
//! check, HTTP connections). `cli` starts it all.
pub mod api;
pub mod cli;
pub mod engine;
pub mod metrics;
pub mod response_store;
pub mod state;
pub mod text;

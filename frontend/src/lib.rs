//! Sluice's frontend: everything that touches text and HTTP.
//!
//! Layers, each using only those below it: `api` (HTTP routes, validation, fan-out, framing)
//! over `state` (what the handlers share) over `text` (tokenizer, detokenizer, stop strings,
//! chat template, choice streams) and `engine` (the ZeroMQ seam to the engine core), over
//! `schema` (OpenAI's request and response types). `cli` starts it all.
pub mod allocator;
pub mod api;
pub mod cli;
pub mod engine;
pub mod metrics;
pub mod schema;
pub mod state;
pub mod text;

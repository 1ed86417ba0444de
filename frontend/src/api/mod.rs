//! The OpenAI-compatible HTTP API: routes, wire types, validation, fan-out and SSE framing.
pub mod chat;
pub mod completions;
pub mod error;
pub mod fan_out;
pub mod openai;
pub mod openapi;
pub mod routes;
pub mod sse;
pub mod tokenize;
pub mod validate;

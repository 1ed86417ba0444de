//! The OpenAI-compatible HTTP API: routes, wire types, validation, fan-out and SSE framing.
pub mod admission;
pub mod auth;
pub mod chat;
pub mod completions;
pub mod connections;
pub mod error;
pub mod fan_out;
pub mod openai;
pub mod openai_tools;
pub mod openapi;
pub mod request_body;
pub mod routes;
pub mod sse;
pub mod tokenize;
pub mod tools;
pub mod validate;

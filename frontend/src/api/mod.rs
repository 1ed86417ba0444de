//! The OpenAI-compatible HTTP API (with OpenAI's Responses API and Anthropic's Messages API, both
//! translated to chat, and OpenAI's embeddings and vLLM's score and rerank for pooling models):
//! routes, validation (`validate`'s field rules, `valid_request`'s typed values, `prepare`'s
//! rendering and tokenizing), fan-out (or beam search) and SSE framing (the wire types are `sluice_common::schema`'s).
pub mod admission;
pub mod auth;
pub mod beam_search;
pub mod best_of;
pub mod chat;
pub mod completions;
pub mod embeddings;
pub mod error;
pub mod fan_out;
pub mod generation;
pub mod input_items;
pub mod messages;
pub mod messages_request;
pub mod openapi;
pub mod prepare;
pub mod prompt_logprobs;
pub mod request_body;
pub mod request_fields;
pub mod responses;
pub mod responses_request;
pub mod routes;
pub mod score;
pub mod sse;
pub mod structured_output;
pub mod token_label;
pub mod tokenize;
pub mod tools;
pub mod valid_request;
pub mod validate;

//! OpenAI's request and response types (and vLLM's extensions), OpenAI's Responses API and
//! Anthropic's Messages API: the HTTP seam's one declaration of each value, read by the handlers in
//! `api` and by the chat template and tool prompts in `text`.
pub mod anthropic;
pub mod openai;
pub mod openai_tools;
pub mod responses;
pub mod whole_number;

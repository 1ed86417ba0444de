//! OpenAI's request and response types (and vLLM's extensions), OpenAI's Responses API,
//! Anthropic's Messages API and vLLM's score and rerank: the HTTP seam's one declaration of each
//! value, read by the handlers in `api` and by the chat template and tool prompts in `text`.
pub mod anthropic;
pub mod openai;
pub mod openai_tools;
pub mod responses;
pub mod score;
pub mod whole_number;

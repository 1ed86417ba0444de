//! OpenAI's request and response types (and vLLM's extensions): the HTTP seam's one declaration of
//! each value, read by the handlers in `api` and by the chat template and tool prompts in `text`.
pub mod openai;
pub mod openai_tools;
pub mod whole_number;

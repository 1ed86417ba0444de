//! Text on both sides of the engine: tokenization, chat templates, and generated tokens turned
//! back into text.
pub mod chat_template;
pub mod choice_stream;
pub mod default_model;
pub mod detokenizer;
pub mod piecewise_encoder;
pub mod prompt_logprobs;
pub mod python_compat;
pub mod stop_strings;
pub mod tokenizer_pool;
pub mod tool_call_stream;
pub mod tool_parsers;
pub mod tool_prompt;

//! Text on both sides of the engine: tokenization, chat templates, and generated tokens turned
//! back into text.
pub mod answer_parts;
pub mod choice_stream;
pub mod detokenizer;
pub mod partial_marker;
pub mod prompt_logprobs;
pub mod reasoning;
pub mod stop_strings;
pub mod tokenizer_pool;
pub mod tool_call_stream;
pub mod tool_parsers;
pub mod tool_prompt;

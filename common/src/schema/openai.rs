//! The OpenAI API's request and response bodies, plus vLLM's sampling extensions.
//!
//! Requests deserialize leniently about unknown fields (as vLLM does) and strictly about types:
//! a wrong type is a serde error, which the HTTP layer answers with a 400.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::schema::openai_tools::{FunctionDefinition, Tool, ToolCall, ToolCallDelta, ToolChoice};
use crate::schema::whole_number;

/// A completions prompt: a string, strings, token ids, or lists of token ids.
#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// `stop`: one string or several.
#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum StopSequences {
    One(String),
    Many(Vec<String>),
}

impl StopSequences {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopSequences::One(s) => vec![s],
            StopSequences::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize, utoipa::ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    /// vLLM's: usage (completion tokens of the chunk's choice so far) on every chunk.
    #[serde(default)]
    pub continuous_usage_stats: bool,
    /// Accepted and does nothing: events are not padded to hide the length of their text.
    pub include_obfuscation: Option<bool>,
    /// Fields this type does not know: ignored and reported (see `api::request_fields`).
    #[serde(flatten)]
    #[schema(ignore)]
    pub other_fields: BTreeMap<String, serde_json::Value>,
}

/// Fields common to completions and chat, as OpenAI and vLLM name them: sampling, output text,
/// scheduling, and OpenAI's fields that change nothing here.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, utoipa::ToSchema)]
pub struct SamplingFields {
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub max_tokens: Option<u32>,
    #[schema(minimum = 0.0)]
    pub temperature: Option<f64>,
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    pub top_p: Option<f64>,
    #[schema(minimum = -1)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub top_k: Option<i64>,
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub min_p: Option<f64>,
    #[schema(minimum = 1, maximum = 128)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub n: Option<u32>,
    pub stop: Option<StopSequences>,
    pub stop_token_ids: Option<Vec<u32>>,
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub seed: Option<i64>,
    #[schema(minimum = -2.0, maximum = 2.0)]
    pub presence_penalty: Option<f64>,
    #[schema(minimum = -2.0, maximum = 2.0)]
    pub frequency_penalty: Option<f64>,
    #[schema(exclusive_minimum = 0.0)]
    pub repetition_penalty: Option<f64>,
    /// Token ids as JSON object keys, which are always strings.
    pub logit_bias: Option<BTreeMap<String, f64>>,
    /// vLLM's: the only token ids that may be sampled.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM's: words the output must not contain (as tokens: each word's last token is never
    /// sampled right after the rest of it).
    pub bad_words: Option<Vec<String>>,
    pub ignore_eos: Option<bool>,
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub min_tokens: Option<u32>,
    /// vLLM's: the prompt's and the output's token ids in the response (`prompt_token_ids`,
    /// each choice's `token_ids`); streamed, the prompt's come with a choice's first chunk.
    pub return_token_ids: Option<bool>,
    /// vLLM's: logprobs name each token (sampled and alternatives) as `token_id:N`, not its text;
    /// chat's `bytes` are then those of that name.
    pub return_tokens_as_token_ids: Option<bool>,
    /// vLLM's: the request shares the prefix cache only with requests that give the same salt
    /// (so that one tenant cannot learn another's prompts from cache timing). Non-empty.
    pub cache_salt: Option<String>,
    /// vLLM's: keep only the prompt's last N tokens (-1: the last max_model_len).
    #[schema(minimum = -1)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub truncate_prompt_tokens: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    /// vLLM's: keep the matched stop string, or the stop token's text, at the end of the output.
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM's: leave special tokens out of the output text (default true).
    pub skip_special_tokens: Option<bool>,
    /// vLLM's: changes only a slow (Python) tokenizer's output, so it does nothing here, as in
    /// vLLM with a fast tokenizer.
    pub spaces_between_special_tokens: Option<bool>,
    /// vLLM's: under `--scheduling-policy priority` a lower value runs earlier; under fcfs only 0.
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub priority: Option<i64>,
    /// Accepted and does nothing, as OpenAI's storage, tiers and caching hints do not apply here.
    pub metadata: Option<BTreeMap<String, String>>,
    pub store: Option<bool>,
    pub service_tier: Option<String>,
    pub prompt_cache_key: Option<String>,
    pub safety_identifier: Option<String>,
    /// OpenAI's output format: `{"type": "text" | "json_object" | "json_schema", ...}`.
    pub response_format: Option<serde_json::Value>,
    /// vLLM's structured output fields (api/structured_output.rs reads them, with named errors).
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<serde_json::Value>,
    pub guided_choice: Option<serde_json::Value>,
    pub guided_grammar: Option<serde_json::Value>,
    pub structured_outputs: Option<serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Completions take an int: the sampled token plus the top N.
    #[schema(maximum = 20)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
    /// Text after the completion (fill-in-the-middle): a 400 unless empty.
    pub suffix: Option<String>,
    /// vLLM's: whether a text prompt gets the tokenizer's special tokens (default true).
    pub add_special_tokens: Option<bool>,
    /// Candidates generated per prompt, of which the `n` with the highest cumulative logprob are
    /// returned; at least `n`, not with `stream`.
    #[schema(minimum = 1, maximum = 128)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub best_of: Option<u32>,
    /// vLLM's: each prompt token's logprob plus the top N, in each choice's `prompt_logprobs`.
    #[schema(maximum = 20)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub prompt_logprobs: Option<u32>,
    /// vLLM's: each prompt's `n` best beams (`n` is the beam width, at most 10), best first.
    pub use_beam_search: Option<bool>,
    /// vLLM's, with beam search: a beam's score is its cumulative logprob over its output length
    /// to this power (default 1.0; above 0 favours longer outputs, below 0 shorter ones).
    pub length_penalty: Option<f64>,
    /// vLLM's, with beam search: `true` stops once `n` beams have finished, `false` (the default)
    /// also once no live beam can beat the worst of them, `"never"` runs every beam to its end.
    pub early_stopping: Option<EarlyStopping>,
    /// Fields this type does not know: refused or ignored and reported (see `api::request_fields`).
    #[serde(flatten)]
    #[schema(ignore)]
    pub other_fields: BTreeMap<String, serde_json::Value>,
}

/// Beam search's `early_stopping`: `true`, `false` or `"never"` (another string is a 400 naming it).
#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum EarlyStopping {
    Flag(bool),
    Word(String),
}

/// A chat message's content: a string, or OpenAI's array of parts of which text parts are joined.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, utoipa::ToSchema)]
pub struct ContentPart {
    #[serde(rename = "type")]
    #[schema(pattern = "^text$")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, utoipa::ToSchema)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<MessageContent>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant message's calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// A `tool` message's answer to this call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message with no name and no tool calls.
    pub fn new(role: &str, content: Option<MessageContent>) -> Self {
        ChatMessage {
            role: role.into(),
            content,
            name: None,
            tool_calls: None,
            tool_call_id: None,
        }
    }

    /// A message whose content is `text`.
    pub fn text(role: &str, text: impl Into<String>) -> Self {
        Self::new(role, Some(MessageContent::Text(text.into())))
    }
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize, utoipa::ToSchema)]
pub struct ChatCompletionRequest {
    pub model: String,
    #[schema(min_items = 1)]
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// The newer name of max_tokens; when both are given this one wins, as in OpenAI's API.
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub max_completion_tokens: Option<u32>,
    /// Chat takes a bool, and `top_logprobs` for how many alternatives.
    pub logprobs: Option<bool>,
    #[schema(maximum = 20)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub top_logprobs: Option<u32>,
    pub add_generation_prompt: Option<bool>,
    /// vLLM's: the model continues the final message (a prefilled assistant answer) instead of
    /// starting a new one; add_generation_prompt then defaults to false.
    pub continue_final_message: Option<bool>,
    /// vLLM's: when the final message is the assistant's (a prefilled answer), each choice's
    /// content starts with that message's text, so that it reads whole.
    pub echo: Option<bool>,
    /// vLLM's: variables for the chat template (`enable_thinking`, ...); they cannot replace
    /// `messages`, `add_generation_prompt` or the special tokens.
    pub chat_template_kwargs: Option<BTreeMap<String, serde_json::Value>>,
    /// vLLM's: a Jinja chat template to render this request with instead of the model's; refused
    /// unless the server runs with `--trust-request-chat-template`.
    pub chat_template: Option<String>,
    /// Passed to the chat template as the variable `reasoning_effort`, as vLLM does.
    #[schema(pattern = "^(none|minimal|low|medium|high|xhigh)$")]
    pub reasoning_effort: Option<String>,
    /// vLLM's: under `--reasoning-parser`, at most this many tokens of thinking; then the end of
    /// thinking is forced and the answer follows.
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub thinking_token_budget: Option<u32>,
    /// vLLM's: whether the rendered prompt gets the tokenizer's special tokens (default false:
    /// the template writes them).
    pub add_special_tokens: Option<bool>,
    /// vLLM's: each prompt token's logprob plus the top N, in the response's `prompt_logprobs`.
    #[schema(maximum = 20)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub prompt_logprobs: Option<u32>,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<ToolChoice>,
    pub parallel_tool_calls: Option<bool>,
    /// The deprecated names of `tools` and `tool_choice`.
    pub functions: Option<Vec<FunctionDefinition>>,
    #[schema(value_type = Option<Object>)]
    pub function_call: Option<serde_json::Value>,
    /// Fields this type does not know: refused or ignored and reported (see `api::request_fields`).
    #[serde(flatten)]
    #[schema(ignore)]
    pub other_fields: BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    /// OpenAI's: in a response's (or a stream's closing) usage, how many prompt tokens the
    /// prefix cache served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
    /// OpenAI's: with a reasoning parser, how many completion tokens were the thinking (left out
    /// without one, as vLLM does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Option<CompletionTokensDetails>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CompletionTokensDetails {
    /// The output tokens up to and including the end of thinking (`</think>`).
    pub reasoning_tokens: u32,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: None,
            completion_tokens_details: None,
        }
    }

    /// The usage with its thinking tokens, where they were counted (None: no reasoning parser).
    pub fn with_reasoning_tokens(self, reasoning_tokens: Option<u32>) -> Self {
        Usage {
            completion_tokens_details: reasoning_tokens
                .map(|reasoning_tokens| CompletionTokensDetails { reasoning_tokens }),
            ..self
        }
    }

    pub fn with_cached_tokens(self, cached_tokens: u32) -> Self {
        Usage {
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens }),
            ..self
        }
    }
}

/// Completions' logprobs: parallel arrays over the generated tokens.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f64>>,
    pub top_logprobs: Vec<Option<BTreeMap<String, f64>>>,
    pub text_offset: Vec<u32>,
}

/// vLLM's logprob of one token in `prompt_logprobs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PromptTokenLogprob {
    pub logprob: f64,
    /// 1 = the most likely token.
    pub rank: u32,
    pub decoded_token: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<String>,
    /// vLLM's, only when the request asked for `prompt_logprobs`: per prompt token (null for the
    /// first), the actual token and the top N, keyed by token id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Vec<Option<BTreeMap<String, PromptTokenLogprob>>>>,
    /// vLLM's, only with `return_token_ids` (streamed: in a choice's first chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// vLLM's, only with `return_token_ids`: the generated tokens (streamed: the chunk's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// Both the whole response and each stream chunk (`object` is "text_completion" in both).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f64,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ChatLogprobToken {
    pub token: String,
    pub logprob: f64,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<ChatLogprobToken>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AssistantMessage {
    pub role: String,
    /// None (null) when the assistant only called tools.
    pub content: Option<String>,
    /// With `--reasoning-parser`: the model's thinking, apart from its answer (vLLM's field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
    /// vLLM's, only with `return_token_ids`: the generated tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ChatCompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    /// vLLM's, only when the request asked for `prompt_logprobs`: per prompt token (null for the
    /// first), the actual token and the top N, keyed by token id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Vec<Option<BTreeMap<String, PromptTokenLogprob>>>>,
    /// vLLM's, only with `return_token_ids`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// With `--reasoning-parser`: more of the model's thinking.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
    /// vLLM's, only with `return_token_ids`: the chunk's generated tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    pub usage: Option<Usage>,
    /// vLLM's, only with `return_token_ids`: in each choice's opening chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    pub max_model_len: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

/// vLLM's /tokenize: a prompt, or chat messages rendered through the template first.
#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessage>>,
    /// Default: true for a prompt, false for messages (the template writes them).
    pub add_special_tokens: Option<bool>,
    /// Messages only, as in chat: default true, or false with continue_final_message.
    pub add_generation_prompt: Option<bool>,
    /// Messages only, as in chat.
    pub continue_final_message: Option<bool>,
    /// Messages only, as in chat.
    pub chat_template_kwargs: Option<BTreeMap<String, serde_json::Value>>,
    /// vLLM's: a Jinja chat template to render this request with instead of the model's; refused
    /// unless the server runs with `--trust-request-chat-template`.
    pub chat_template: Option<String>,
    /// Messages only: rendered as chat renders them.
    pub tools: Option<Vec<Tool>>,
    /// vLLM's: each token's text (the vocabulary's string) in `token_strs`.
    pub return_token_strs: Option<bool>,
    /// Fields this type does not know: refused or ignored and reported (see `api::request_fields`).
    #[serde(flatten)]
    #[schema(ignore)]
    pub other_fields: BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: u32,
    pub tokens: Vec<u32>,
    /// With `return_token_strs`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_strs: Option<Vec<String>>,
}

#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

/// OpenAI's embeddings request, with vLLM's extensions: one embedding per input.
#[derive(Debug, Clone, PartialEq, Deserialize, utoipa::ToSchema)]
pub struct EmbeddingRequest {
    pub model: String,
    /// A string, strings, token ids, or lists of token ids: at most 2048 inputs, none empty.
    pub input: Prompt,
    /// `float` (the default): numbers; `base64`: the little-endian float32 bytes, base64-encoded.
    #[schema(pattern = "^(float|base64)$")]
    pub encoding_format: Option<String>,
    /// Keep each embedding's first N values: a Matryoshka model's sizes only.
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub dimensions: Option<i64>,
    pub user: Option<String>,
    /// vLLM's: keep only each input's last N tokens (-1: the last max_model_len).
    #[schema(minimum = -1)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's: whether a text input gets the tokenizer's special tokens (default true).
    pub add_special_tokens: Option<bool>,
    /// vLLM's: true or false forces L2 normalisation; absent, the model's own choice.
    pub normalize: Option<bool>,
    /// vLLM's: under `--scheduling-policy priority` a lower value runs earlier; under fcfs only 0.
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub priority: Option<i64>,
    /// Fields this type does not know: refused or ignored and reported (see `api::request_fields`).
    #[serde(flatten)]
    #[schema(ignore)]
    pub other_fields: BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EmbeddingResponse {
    /// "list".
    pub object: String,
    /// One per input, in the inputs' order.
    pub data: Vec<Embedding>,
    pub model: String,
    pub usage: EmbeddingUsage,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Embedding {
    /// "embedding".
    pub object: String,
    pub index: u32,
    pub embedding: EmbeddingVector,
}

/// An embedding as `encoding_format` asks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum EmbeddingVector {
    /// float32 values widened to float64, so that they read back exactly as either.
    Floats(Vec<f64>),
    /// The little-endian float32 bytes, base64-encoded.
    Base64(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct EmbeddingUsage {
    pub prompt_tokens: u32,
    pub total_tokens: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_takes_all_four_shapes() {
        let shapes = [
            (r#""hi""#, Prompt::Text("hi".into())),
            (r#"["a","b"]"#, Prompt::Texts(vec!["a".into(), "b".into()])),
            ("[1,2,3]", Prompt::Tokens(vec![1, 2, 3])),
            ("[[1],[2,3]]", Prompt::TokenLists(vec![vec![1], vec![2, 3]])),
        ];
        for (json, expected) in shapes {
            assert_eq!(serde_json::from_str::<Prompt>(json).unwrap(), expected);
        }
        assert!(serde_json::from_str::<Prompt>("[1.5]").is_err());
        assert!(serde_json::from_str::<Prompt>("{}").is_err());
    }

    #[test]
    fn completion_request_reads_openai_and_vllm_fields() {
        let body = r#"{"model":"m","prompt":"x","max_tokens":5,"temperature":0.5,"top_k":4,
            "stop":"\n","logprobs":2,"echo":true,"logit_bias":{"17":-100},"ignore_eos":true,
            "stream":true,"stream_options":{"include_usage":true},"unknown_field":1}"#;
        let req: CompletionRequest = serde_json::from_str(body).unwrap();
        assert_eq!(req.sampling.max_tokens, Some(5));
        assert_eq!(req.sampling.top_k, Some(4));
        assert_eq!(
            req.sampling.stop.clone().map(StopSequences::into_vec),
            Some(vec!["\n".to_string()])
        );
        assert_eq!(req.logprobs, Some(2));
        assert_eq!(req.sampling.logit_bias.unwrap()["17"], -100.0);
        assert!(req.sampling.stream_options.unwrap().include_usage);
    }

    #[test]
    fn only_fields_no_struct_reads_are_other_fields() {
        let body = r#"{"model":"m","prompt":"x","max_tokens":5,"priority":1,"user":"u",
            "suffix":"","stream_options":{"include_usage":true,"colour":"red"},"frobnicate":1,
            "guided_json":{}}"#;
        let req: CompletionRequest = serde_json::from_str(body).unwrap();
        assert_eq!(req.other_fields.keys().collect::<Vec<_>>(), ["frobnicate"]);
        assert_eq!(req.sampling.guided_json, Some(serde_json::json!({})));
        assert_eq!(req.sampling.priority, Some(1));
        let options = req.sampling.stream_options.unwrap();
        assert_eq!(options.other_fields.keys().collect::<Vec<_>>(), ["colour"]);
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"top_k":3,
            "chat_template_kwargs":{"enable_thinking":false},"tools":[]}"#;
        let req: ChatCompletionRequest = serde_json::from_str(body).unwrap();
        assert!(req.other_fields.is_empty(), "{:?}", req.other_fields);
        assert_eq!(req.tools, Some(Vec::new()));
        assert_eq!(req.sampling.top_k, Some(3));
        assert_eq!(
            req.chat_template_kwargs.unwrap()["enable_thinking"],
            serde_json::json!(false)
        );
    }

    #[test]
    fn embedding_request_reads_openai_and_vllm_fields() {
        let body = r#"{"model":"m","input":[[1,2],[3]],"encoding_format":"base64",
            "dimensions":64.0,"user":"u","truncate_prompt_tokens":-1,"add_special_tokens":false,
            "normalize":true,"priority":2,"frobnicate":1}"#;
        let req: EmbeddingRequest = serde_json::from_str(body).unwrap();
        assert_eq!(req.input, Prompt::TokenLists(vec![vec![1, 2], vec![3]]));
        assert_eq!(req.encoding_format.as_deref(), Some("base64"));
        assert_eq!(req.dimensions, Some(64));
        assert_eq!(req.truncate_prompt_tokens, Some(-1));
        assert_eq!(
            (req.add_special_tokens, req.normalize, req.priority),
            (Some(false), Some(true), Some(2))
        );
        assert_eq!(req.other_fields.keys().collect::<Vec<_>>(), ["frobnicate"]);
        assert!(serde_json::from_str::<EmbeddingRequest>(r#"{"model":"m"}"#).is_err());
    }

    #[test]
    fn an_embedding_is_numbers_or_a_base64_string() {
        let embedding = |vector| Embedding {
            object: "embedding".into(),
            index: 1,
            embedding: vector,
        };
        assert_eq!(
            serde_json::to_value(embedding(EmbeddingVector::Floats(vec![0.5, -2.0]))).unwrap(),
            serde_json::json!({"object": "embedding", "index": 1, "embedding": [0.5, -2.0]})
        );
        assert_eq!(
            serde_json::to_value(embedding(EmbeddingVector::Base64("AAAAPw==".into()))).unwrap(),
            serde_json::json!({"object": "embedding", "index": 1, "embedding": "AAAAPw=="})
        );
    }

    #[test]
    fn wrong_types_are_errors() {
        assert!(serde_json::from_str::<CompletionRequest>(
            r#"{"model":"m","prompt":"x","max_tokens":"5"}"#
        )
        .is_err());
        assert!(
            serde_json::from_str::<ChatCompletionRequest>(r#"{"model":"m","messages":"hi"}"#)
                .is_err()
        );
        assert!(serde_json::from_str::<CompletionRequest>(r#"{"prompt":"x"}"#).is_err());
    }

    #[test]
    fn integer_fields_take_whole_floats_as_vllm_does() {
        let body = r#"{"model":"m","prompt":"x","max_tokens":5.0,"n":2.0,"seed":-7.0,
            "logprobs":1.0,"best_of":2,"top_k":-1.0}"#;
        let req: CompletionRequest = serde_json::from_str(body).unwrap();
        assert_eq!(req.sampling.max_tokens, Some(5));
        assert_eq!(req.sampling.n, Some(2));
        assert_eq!(req.sampling.seed, Some(-7));
        assert_eq!(req.sampling.top_k, Some(-1));
        assert_eq!((req.logprobs, req.best_of), (Some(1), Some(2)));
        let body = r#"{"model":"m","messages":[],"max_completion_tokens":8.0,"top_logprobs":2.0}"#;
        let req: ChatCompletionRequest = serde_json::from_str(body).unwrap();
        assert_eq!(req.max_completion_tokens, Some(8));
        assert_eq!(req.top_logprobs, Some(2));
        for fraction in [
            r#"{"model":"m","prompt":"x","max_tokens":5.5}"#,
            r#"{"model":"m","prompt":"x","n":-1.0}"#,
        ] {
            let error = serde_json::from_str::<CompletionRequest>(fraction).unwrap_err();
            assert!(error.to_string().contains("integer") || error.to_string().contains("range"));
        }
    }

    #[test]
    fn stream_options_must_be_an_object() {
        for options in ["[]", "[true]", "1", "\"x\""] {
            let body = format!(r#"{{"model":"m","prompt":"x","stream_options":{options}}}"#);
            assert!(
                serde_json::from_str::<CompletionRequest>(&body).is_err(),
                "stream_options {options} was accepted"
            );
            let body = format!(r#"{{"model":"m","messages":[],"stream_options":{options}}}"#);
            assert!(
                serde_json::from_str::<ChatCompletionRequest>(&body).is_err(),
                "stream_options {options} was accepted in chat"
            );
        }
    }

    #[test]
    fn chat_request_reads_content_parts_and_logprob_flags() {
        let body = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],
            "logprobs":true,"top_logprobs":3,"max_completion_tokens":7}"#;
        let req: ChatCompletionRequest = serde_json::from_str(body).unwrap();
        assert_eq!(req.logprobs, Some(true));
        assert_eq!(req.top_logprobs, Some(3));
        assert_eq!(req.max_completion_tokens, Some(7));
        assert!(matches!(
            req.messages[0].content,
            Some(MessageContent::Parts(_))
        ));
    }

    #[test]
    fn chunk_delta_omits_absent_fields() {
        let chunk = ChatChunkChoice {
            index: 0,
            delta: ChatDelta::default(),
            logprobs: None,
            finish_reason: None,
            token_ids: None,
        };
        let json = serde_json::to_string(&chunk).unwrap();
        assert_eq!(
            json,
            r#"{"index":0,"delta":{},"logprobs":null,"finish_reason":null}"#
        );
    }
}

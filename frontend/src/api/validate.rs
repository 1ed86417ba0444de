//! Request validation: one entry point per endpoint ([`completion`], [`chat`]) that returns a
//! typed, complete, valid request, built from one check per concern, each answering with a typed
//! [`ApiError`].
//!
//! Ranges follow vLLM's `SamplingParams`. Everything the engine core receives has passed here,
//! so the engine may trust it.

use std::collections::BTreeMap;

use futures::future::try_join_all;

use crate::api::admission;
use crate::api::error::ApiError;
use crate::api::request_fields::{self, Endpoint};
use crate::api::structured_output::{self, Constraint};
use crate::api::tools::{self, ValidTools};
use crate::engine::protocol::SamplingParams;
use crate::schema::openai::{
    ChatCompletionRequest, ChatMessage, CompletionRequest, Prompt, SamplingFields, StopSequences,
    TokenizeRequest,
};
use crate::schema::openai_tools::Tool;
use crate::state::{AppState, SchedulingPolicy};
use crate::text::chat_template::{continue_final_message, message_text, ChatTemplateError};
use crate::text::tool_call_stream::ToolCallReader;
use crate::text::tool_prompt;

pub const MAX_N: u32 = 128;
pub const MAX_LOGPROBS: u32 = 20;
/// Completions' default, as in OpenAI's API.
pub const DEFAULT_COMPLETION_MAX_TOKENS: u32 = 16;
/// `developer` is OpenAI's newer name of `system`; the chat template renders it as one.
const CHAT_ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

fn out_of_range(param: &'static str, message: String) -> ApiError {
    ApiError::InvalidParameter { param, message }
}

pub fn check_model_name(requested: &str, served: &str) -> Result<(), ApiError> {
    if requested == served {
        Ok(())
    } else {
        Err(ApiError::ModelNotFound(requested.to_owned()))
    }
}

/// Whether `value` is in range both as sent and as the 32-bit float the sampler uses, where 1e39
/// overflows to infinity (and then NaN) and 1e-50 underflows to 0.
fn holds(value: f64, in_range: impl Fn(f64) -> bool) -> bool {
    let as_f32 = f64::from(value as f32);
    in_range(value) && as_f32.is_finite() && in_range(as_f32)
}

/// A sampling float in the range that `rule` states.
fn check_float(
    param: &'static str,
    value: f64,
    rule: &str,
    in_range: impl Fn(f64) -> bool,
) -> Result<(), ApiError> {
    if holds(value, in_range) {
        Ok(())
    } else {
        Err(out_of_range(
            param,
            // Debug writes 1e39 rather than its 40 digits.
            format!("{param} must be {rule}, got {value:?}"),
        ))
    }
}

pub fn check_temperature(temperature: f64) -> Result<(), ApiError> {
    check_float("temperature", temperature, "in [0, 2]", |t| {
        (0.0..=2.0).contains(&t)
    })
}

pub fn check_top_p(top_p: f64) -> Result<(), ApiError> {
    check_float("top_p", top_p, "in (0, 1]", |p| p > 0.0 && p <= 1.0)
}

/// -1 and 0 both disable top-k; the engine's spelling is -1.
pub fn top_k(top_k: i64) -> Result<i32, ApiError> {
    match top_k {
        -1 | 0 => Ok(-1),
        k if k >= 1 => Ok(i32::try_from(k).unwrap_or(i32::MAX)),
        k => Err(out_of_range(
            "top_k",
            format!("top_k must be -1 or 0 (disabled), or at least 1, got {k}"),
        )),
    }
}

pub fn check_min_p(min_p: f64) -> Result<(), ApiError> {
    check_float("min_p", min_p, "in [0, 1]", |p| (0.0..=1.0).contains(&p))
}

/// vLLM's rule: a salt, when given, is a non-empty string.
pub fn check_cache_salt(cache_salt: Option<&str>) -> Result<(), ApiError> {
    match cache_salt {
        Some("") => Err(out_of_range(
            "cache_salt",
            "cache_salt must be a non-empty string".into(),
        )),
        _ => Ok(()),
    }
}

pub fn check_n(n: u32) -> Result<(), ApiError> {
    if (1..=MAX_N).contains(&n) {
        Ok(())
    } else {
        Err(out_of_range(
            "n",
            format!("n must be in [1, {MAX_N}], got {n}"),
        ))
    }
}

pub fn check_max_tokens(max_tokens: u32) -> Result<(), ApiError> {
    if max_tokens >= 1 {
        Ok(())
    } else {
        Err(out_of_range(
            "max_tokens",
            format!("max_tokens must be at least 1, got {max_tokens}"),
        ))
    }
}

pub fn check_min_tokens(min_tokens: u32, max_tokens: Option<u32>) -> Result<(), ApiError> {
    match max_tokens {
        Some(max_tokens) if min_tokens > max_tokens => Err(out_of_range(
            "min_tokens",
            format!("min_tokens must be at most max_tokens ({max_tokens}), got {min_tokens}"),
        )),
        _ => Ok(()),
    }
}

/// presence_penalty and frequency_penalty.
pub fn check_additive_penalty(param: &'static str, penalty: f64) -> Result<(), ApiError> {
    check_float(param, penalty, "in [-2, 2]", |p| (-2.0..=2.0).contains(&p))
}

pub fn check_repetition_penalty(penalty: f64) -> Result<(), ApiError> {
    check_float(
        "repetition_penalty",
        penalty,
        "greater than 0 and a finite 32-bit float",
        |p| p > 0.0,
    )
}

/// `logprobs` (completions) and `top_logprobs` (chat).
pub fn check_logprobs(param: &'static str, logprobs: u32) -> Result<(), ApiError> {
    if logprobs <= MAX_LOGPROBS {
        Ok(())
    } else {
        Err(out_of_range(
            param,
            format!("{param} must be at most {MAX_LOGPROBS}, got {logprobs}"),
        ))
    }
}

/// Parses JSON's string keys into token ids below `vocab_size`, with biases in [-100, 100].
pub fn logit_bias(
    bias: &BTreeMap<String, f64>,
    vocab_size: u32,
) -> Result<BTreeMap<u32, f64>, ApiError> {
    bias.iter()
        .map(|(key, &value)| {
            let token = key
                .trim()
                .parse::<u32>()
                .ok()
                .filter(|&id| id < vocab_size)
                .ok_or_else(|| {
                    out_of_range(
                        "logit_bias",
                        format!("logit_bias key {key:?} is not a token id below {vocab_size}"),
                    )
                })?;
            if !holds(value, |bias| (-100.0..=100.0).contains(&bias)) {
                return Err(out_of_range(
                    "logit_bias",
                    format!("logit_bias values must be in [-100, 100], got {value:?} for {key}"),
                ));
            }
            Ok((token, value))
        })
        .collect()
}

pub fn check_token_ids(param: &'static str, ids: &[u32], vocab_size: u32) -> Result<(), ApiError> {
    match ids.iter().find(|&&id| id >= vocab_size) {
        Some(id) => Err(out_of_range(
            param,
            format!("token id {id} is outside the vocabulary (size {vocab_size})"),
        )),
        None => Ok(()),
    }
}

/// vLLM's `allowed_token_ids`: token ids of the vocabulary, at least one.
pub fn check_allowed_token_ids(ids: &[u32], vocab_size: u32) -> Result<(), ApiError> {
    if ids.is_empty() {
        return Err(out_of_range(
            "allowed_token_ids",
            "allowed_token_ids must name at least one token, got an empty list".into(),
        ));
    }
    check_token_ids("allowed_token_ids", ids, vocab_size)
}

/// Whitespace as Python's `str.isspace` has it, which vLLM's word stripping uses: Unicode's
/// White_Space (Rust's) and the four separators U+001C..U+001F.
fn python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// vLLM's `bad_words`: each a word with something in it besides whitespace.
pub fn check_bad_words(words: &[String]) -> Result<(), ApiError> {
    match words
        .iter()
        .find(|word| word.trim_matches(python_space).is_empty())
    {
        Some(word) => Err(out_of_range(
            "bad_words",
            format!("bad_words must be strings that are not blank, got {word:?}"),
        )),
        None => Ok(()),
    }
}

/// The token sequences of `bad_words`, as LLM.generate makes them: each word with its leading
/// whitespace removed, and again after one space (the word inside text), without special tokens.
async fn bad_words_token_ids(
    state: &AppState,
    words: &[String],
) -> Result<Vec<Vec<u32>>, ApiError> {
    let texts = words.iter().flat_map(|word| {
        [
            word.trim_start_matches(python_space).to_owned(),
            format!(" {}", word.trim_start_matches(python_space)),
        ]
    });
    let encoded = try_join_all(texts.map(|text| state.pool.encode(text, false))).await?;
    let mut sequences: Vec<Vec<u32>> = Vec::with_capacity(encoded.len());
    for ids in encoded {
        if !sequences.contains(&ids) {
            sequences.push(ids);
        }
    }
    Ok(sequences)
}

/// `stream_options` only shapes a stream, so without `stream` it is a mistake (vLLM's rule).
pub fn check_stream_options(fields: &SamplingFields) -> Result<(), ApiError> {
    if fields.stream_options.is_some() && !fields.stream.unwrap_or(false) {
        Err(out_of_range(
            "stream_options",
            "stream_options is only allowed when stream is true".into(),
        ))
    } else {
        Ok(())
    }
}

/// A priority other than 0 needs the engine's priority policy, as in vLLM: under fcfs it would
/// have no effect.
pub fn check_priority(priority: i64, policy: SchedulingPolicy) -> Result<(), ApiError> {
    if priority == 0 || policy == SchedulingPolicy::Priority {
        Ok(())
    } else {
        Err(out_of_range(
            "priority",
            format!(
                "priority {priority} needs priority scheduling; the server runs the fcfs policy \
                 (start it with --scheduling-policy priority)"
            ),
        ))
    }
}

/// Fill-in-the-middle needs a model trained for it; an empty suffix asks for nothing.
pub fn check_suffix(suffix: Option<&str>) -> Result<(), ApiError> {
    match suffix {
        Some(suffix) if !suffix.is_empty() => Err(out_of_range(
            "suffix",
            "suffix is not supported: this server does not fill in the middle".into(),
        )),
        _ => Ok(()),
    }
}

/// Chat's `top_logprobs` says how many alternatives `logprobs` returns: alone it would do nothing.
pub fn check_top_logprobs(top_logprobs: Option<u32>, logprobs: bool) -> Result<(), ApiError> {
    match top_logprobs {
        Some(top) if top > 0 && !logprobs => Err(out_of_range(
            "top_logprobs",
            "top_logprobs needs logprobs set to true".into(),
        )),
        _ => Ok(()),
    }
}

/// The values of `reasoning_effort` that OpenAI defines.
pub const REASONING_EFFORTS: [&str; 6] = ["none", "minimal", "low", "medium", "high", "xhigh"];

/// The chat template's extra variables: `chat_template_kwargs`, and `reasoning_effort` as one more.
pub fn template_kwargs(
    chat_template_kwargs: Option<&BTreeMap<String, serde_json::Value>>,
    reasoning_effort: Option<&String>,
) -> Result<serde_json::Map<String, serde_json::Value>, ApiError> {
    let mut kwargs: serde_json::Map<String, serde_json::Value> = chat_template_kwargs
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .collect();
    if let Some(effort) = reasoning_effort {
        if !REASONING_EFFORTS.contains(&effort.as_str()) {
            return Err(out_of_range(
                "reasoning_effort",
                format!("reasoning_effort must be one of {REASONING_EFFORTS:?}, got {effort:?}"),
            ));
        }
        kwargs.insert("reasoning_effort".into(), effort.clone().into());
    }
    Ok(kwargs)
}

/// vLLM's `prompt_logprobs`: at most [`MAX_LOGPROBS`], and not streamed (as in vLLM).
pub fn check_prompt_logprobs(prompt_logprobs: u32, stream: bool) -> Result<(), ApiError> {
    check_logprobs("prompt_logprobs", prompt_logprobs)?;
    if stream {
        return Err(out_of_range(
            "prompt_logprobs",
            "prompt_logprobs is not available with stream".into(),
        ));
    }
    Ok(())
}

/// Candidates per prompt: `best_of` in [n, MAX_N]; choosing among them needs them whole, so a
/// streamed request may not ask for more than it returns (OpenAI refuses best_of with stream).
pub fn best_of(best_of: Option<u32>, n: u32, stream: bool) -> Result<u32, ApiError> {
    let Some(best_of) = best_of else {
        return Ok(n);
    };
    if !(n..=MAX_N).contains(&best_of) {
        return Err(out_of_range(
            "best_of",
            format!("best_of must be in [n, {MAX_N}] (n is {n}), got {best_of}"),
        ));
    }
    if stream && best_of > n {
        return Err(out_of_range(
            "best_of",
            "best_of greater than n cannot be streamed".into(),
        ));
    }
    Ok(best_of)
}

pub fn check_messages(messages: &[ChatMessage]) -> Result<(), ApiError> {
    if messages.is_empty() {
        return Err(ApiError::EmptyMessages);
    }
    if let Some(message) = messages
        .iter()
        .find(|m| !CHAT_ROLES.contains(&m.role.as_str()))
    {
        return Err(out_of_range(
            "messages",
            format!(
                "unsupported message role {:?}; expected one of {CHAT_ROLES:?}",
                message.role
            ),
        ));
    }
    // A history's calls are rendered as function calls: any other type is not one.
    match messages
        .iter()
        .flat_map(|m| m.tool_calls.iter().flatten())
        .find(|call| call.kind != "function")
    {
        Some(call) => Err(out_of_range(
            "messages",
            format!(
                "a message's tool call has type {:?}; the only type is \"function\"",
                call.kind
            ),
        )),
        None => Ok(()),
    }
}

/// vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: the last max_model_len),
/// and whether any were cut.
pub fn truncated_prompt(
    mut ids: Vec<u32>,
    keep: Option<i64>,
    max_model_len: u32,
) -> Result<(Vec<u32>, bool), ApiError> {
    let keep = match keep {
        None => return Ok((ids, false)),
        Some(-1) => max_model_len as usize,
        Some(keep) if keep >= 1 && keep <= i64::from(max_model_len) => keep as usize,
        Some(keep) => {
            return Err(out_of_range(
                "truncate_prompt_tokens",
                format!(
                    "truncate_prompt_tokens must be -1 or between 1 and max_model_len ({max_model_len}), got {keep}"
                ),
            ))
        }
    };
    let cut = ids.len().saturating_sub(keep);
    ids.drain(..cut);
    Ok((ids, cut > 0))
}

pub fn check_prompt_not_empty(ids: &[u32]) -> Result<(), ApiError> {
    if ids.is_empty() {
        Err(out_of_range("prompt", "the prompt is empty".into()))
    } else {
        Ok(())
    }
}

/// The max_tokens a request runs with. An explicit max_tokens must fit after the prompt; an absent
/// one is `default` (or the whole remaining context when `default` is None) clipped to what fits.
pub fn effective_max_tokens(
    prompt_len: usize,
    requested: Option<u32>,
    default: Option<u32>,
    max_model_len: u32,
) -> Result<u32, ApiError> {
    let max_model_len = max_model_len as usize;
    if prompt_len >= max_model_len {
        return Err(ApiError::ContextLengthExceeded {
            param: "prompt",
            message: format!(
                "This model's maximum context length is {max_model_len} tokens, \
                 but the prompt has {prompt_len} tokens, leaving no room to generate"
            ),
        });
    }
    let room = (max_model_len - prompt_len) as u32;
    match requested {
        Some(max_tokens) if max_tokens > room => Err(ApiError::ContextLengthExceeded {
            param: "max_tokens",
            message: format!(
                "This model's maximum context length is {max_model_len} tokens. However, you \
                 requested {} tokens ({prompt_len} in the prompt, {max_tokens} for the completion)",
                prompt_len + max_tokens as usize
            ),
        }),
        Some(max_tokens) => Ok(max_tokens),
        None => Ok(default.map_or(room, |default| default.min(room))),
    }
}

/// Every sampling field checked, waiting only for the max_tokens of each prompt.
#[derive(Debug, Clone)]
pub struct CheckedSampling<'a> {
    fields: &'a SamplingFields,
    logit_bias: Option<BTreeMap<u32, f64>>,
    /// The engine's count: the sampled token plus the top N.
    logprobs: Option<u32>,
    structured_output: Option<Constraint>,
    /// Engine requests per prompt, of which the n most likely are returned.
    best_of: u32,
    /// vLLM's `prompt_logprobs`: the top N shown per prompt token.
    prompt_logprobs: Option<u32>,
    /// Completions' echo with logprobs: the prompt's tokens lead the logprobs, with the top N.
    echo_logprobs: Option<u32>,
    /// `bad_words` tokenized (by `tokenize_bad_words`).
    bad_words_token_ids: Option<Vec<Vec<u32>>>,
}

/// Checks every sampling field; `max_tokens` is the client's (chat's max_completion_tokens wins).
pub fn check_sampling<'a>(
    fields: &'a SamplingFields,
    max_tokens: Option<u32>,
    logprobs: Option<u32>,
    vocab_size: u32,
) -> Result<CheckedSampling<'a>, ApiError> {
    let defaults = SamplingParams::default();
    check_temperature(fields.temperature.unwrap_or(defaults.temperature))?;
    check_top_p(fields.top_p.unwrap_or(defaults.top_p))?;
    top_k(fields.top_k.unwrap_or(-1))?;
    check_min_p(fields.min_p.unwrap_or(defaults.min_p))?;
    check_n(fields.n.unwrap_or(1))?;
    check_cache_salt(fields.cache_salt.as_deref())?;
    if let Some(max_tokens) = max_tokens {
        check_max_tokens(max_tokens)?;
    }
    check_min_tokens(fields.min_tokens.unwrap_or(0), max_tokens)?;
    check_additive_penalty("presence_penalty", fields.presence_penalty.unwrap_or(0.0))?;
    check_additive_penalty("frequency_penalty", fields.frequency_penalty.unwrap_or(0.0))?;
    check_repetition_penalty(fields.repetition_penalty.unwrap_or(1.0))?;
    let logit_bias = fields
        .logit_bias
        .as_ref()
        .map(|bias| logit_bias(bias, vocab_size))
        .transpose()?
        .filter(|bias| !bias.is_empty());
    if let Some(ids) = &fields.stop_token_ids {
        check_token_ids("stop_token_ids", ids, vocab_size)?;
    }
    if let Some(ids) = &fields.allowed_token_ids {
        check_allowed_token_ids(ids, vocab_size)?;
    }
    if let Some(words) = &fields.bad_words {
        check_bad_words(words)?;
    }
    check_stream_options(fields)?;
    let structured_output = structured_output::constraint(fields)?;
    let n = fields.n.unwrap_or(1);
    Ok(CheckedSampling {
        fields,
        logit_bias,
        logprobs,
        structured_output,
        best_of: n,
        prompt_logprobs: None,
        echo_logprobs: None,
        bad_words_token_ids: None,
    })
}

impl CheckedSampling<'_> {
    /// The engine's parameters for one prompt that leaves room for `max_tokens`.
    pub fn params(&self, max_tokens: u32) -> SamplingParams {
        let fields = self.fields;
        let defaults = SamplingParams::default();
        SamplingParams {
            max_tokens,
            temperature: fields.temperature.unwrap_or(defaults.temperature),
            top_p: fields.top_p.unwrap_or(defaults.top_p),
            top_k: top_k(fields.top_k.unwrap_or(-1)).expect("checked by check_sampling"),
            min_p: fields.min_p.unwrap_or(defaults.min_p),
            repetition_penalty: fields.repetition_penalty.unwrap_or(1.0),
            presence_penalty: fields.presence_penalty.unwrap_or(0.0),
            frequency_penalty: fields.frequency_penalty.unwrap_or(0.0),
            logit_bias: self.logit_bias.clone(),
            seed: fields.seed,
            // Choosing the best candidates ranks them by their tokens' logprobs.
            logprobs: if self.best_of > self.n() {
                Some(self.logprobs.unwrap_or(0))
            } else {
                self.logprobs
            },
            stop_token_ids: fields.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: fields.ignore_eos.unwrap_or(false),
            // An absent max_tokens may have been clipped below min_tokens by the context left.
            min_tokens: fields.min_tokens.unwrap_or(0).min(max_tokens),
            structured_output: self.structured_output.as_ref().map(|c| c.value.clone()),
            prompt_logprobs: self.prompt_logprobs.max(self.echo_logprobs),
            allowed_token_ids: fields.allowed_token_ids.clone(),
            bad_words_token_ids: self.bad_words_token_ids.clone(),
        }
    }

    /// Tokenizes `bad_words` on the tokenizer pool, for `params`.
    pub async fn tokenize_bad_words(&mut self, state: &AppState) -> Result<(), ApiError> {
        if let Some(words) = self
            .fields
            .bad_words
            .as_deref()
            .filter(|words| !words.is_empty())
        {
            let sequences = bad_words_token_ids(state, words).await?;
            check_token_ids("bad_words", &sequences.concat(), state.vocab_size)?;
            self.bad_words_token_ids = Some(sequences);
        }
        Ok(())
    }

    pub fn n(&self) -> u32 {
        self.fields.n.unwrap_or(1)
    }

    pub fn stop(&self) -> Vec<String> {
        self.fields
            .stop
            .clone()
            .map(StopSequences::into_vec)
            .unwrap_or_default()
    }

    fn response(
        &self,
        model: String,
        prompts: Vec<ValidPrompt>,
        ignored_fields: Vec<String>,
    ) -> ValidRequest {
        let fields = self.fields;
        let stream_options = fields.stream_options.clone().unwrap_or_default();
        ValidRequest {
            model,
            prompts,
            n: self.n(),
            stop: self.stop(),
            logprobs: self.logprobs.is_some(),
            stream: fields.stream.unwrap_or(false),
            include_usage: stream_options.include_usage,
            continuous_usage_stats: stream_options.continuous_usage_stats,
            include_stop_str_in_output: fields.include_stop_str_in_output.unwrap_or(false),
            skip_special_tokens: fields.skip_special_tokens.unwrap_or(true),
            priority: fields.priority.unwrap_or(0),
            ignored_fields,
            structured_output_field: self.structured_output.as_ref().map(|c| c.field),
            best_of: self.best_of,
            prompt_logprobs: self.prompt_logprobs,
            echo_logprobs: self.echo_logprobs,
            tool_calls: None,
            chat_role: None,
            return_token_ids: fields.return_token_ids.unwrap_or(false),
            return_tokens_as_token_ids: fields.return_tokens_as_token_ids.unwrap_or(false),
            cache_salt: fields.cache_salt.clone(),
        }
    }

    /// The request's fields that nothing reads, or the 400 for one that cannot be honoured.
    fn ignored_fields(
        &self,
        endpoint: Endpoint,
        other_fields: &BTreeMap<String, serde_json::Value>,
    ) -> Result<Vec<String>, ApiError> {
        let nested = self
            .fields
            .stream_options
            .as_ref()
            .map(|options| ("stream_options", &options.other_fields));
        request_fields::ignored_fields(endpoint, other_fields, nested)
    }
}

/// A completions or chat request that passed validation, complete: the fan-out only runs it.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest {
    pub model: String,
    /// At least one.
    pub prompts: Vec<ValidPrompt>,
    /// Choices per prompt.
    pub n: u32,
    pub stop: Vec<String>,
    pub logprobs: bool,
    /// Engine requests per prompt (n unless best_of asks for more); the n most likely are returned.
    pub best_of: u32,
    /// vLLM's `prompt_logprobs`: the top N shown per prompt token.
    pub prompt_logprobs: Option<u32>,
    /// Completions' echo with logprobs: the prompt's tokens lead the logprobs, with the top N.
    pub echo_logprobs: Option<u32>,
    pub stream: bool,
    pub include_usage: bool,
    /// Usage on every chunk of a stream.
    pub continuous_usage_stats: bool,
    /// Keep the stop string, or the stop token's text, at the end of the text.
    pub include_stop_str_in_output: bool,
    pub skip_special_tokens: bool,
    /// The engine's scheduling priority (lower runs earlier); 0 unless the policy is priority.
    pub priority: i64,
    /// Fields the request carried that nothing reads, listed in a response header.
    pub ignored_fields: Vec<String>,
    /// The field that carried the structured output constraint, if one did.
    pub structured_output_field: Option<&'static str>,
    /// Chat with tools: how each choice's output is read for calls.
    pub tool_calls: Option<ToolCallReader>,
    /// Chat: the role its choices' messages have (`chat_answer_role`); completions have none.
    pub chat_role: Option<String>,
    /// vLLM's `return_token_ids`: the prompt's and each choice's token ids in the response.
    pub return_token_ids: bool,
    /// vLLM's `return_tokens_as_token_ids`: logprobs name their tokens `token_id:N`.
    pub return_tokens_as_token_ids: bool,
    /// vLLM's `cache_salt`: non-empty; cached KV blocks are shared only under the same salt.
    pub cache_salt: Option<String>,
}

/// One prompt, its echo text and its engine parameters (with its own max_tokens).
#[derive(Debug, Clone, PartialEq)]
pub struct ValidPrompt {
    /// Non-empty, in the vocabulary, leaving room for `params.max_tokens`.
    pub token_ids: Vec<u32>,
    /// Completions' `echo`: the prompt's text, sent before the generated text.
    pub echo: Option<String>,
    pub params: SamplingParams,
}

impl ValidRequest {
    /// Whether the choices show their prompt's logprobs (vLLM's field, or completions' echo).
    pub fn shows_prompt_logprobs(&self) -> bool {
        self.prompt_logprobs.is_some() || self.echo_logprobs.is_some()
    }

    pub fn prompt_tokens(&self) -> u32 {
        self.prompts
            .iter()
            .map(|prompt| prompt.token_ids.len() as u32)
            .sum()
    }
}

pub fn check_model(state: &AppState, model: &str) -> Result<(), ApiError> {
    check_model_name(model, &state.config.served_model_name)
}

/// `POST /v1/completions`: text prompts tokenized (with special tokens), token prompts checked.
pub async fn completion(
    state: &AppState,
    request: CompletionRequest,
) -> Result<ValidRequest, ApiError> {
    check_model(state, &request.model)?;
    let mut sampling = check_completion_fields(&request, state.vocab_size)?;
    check_priority(
        request.sampling.priority.unwrap_or(0),
        state.config.scheduling_policy,
    )?;
    let ignored_fields = sampling.ignored_fields(Endpoint::Completions, &request.other_fields)?;
    // Before any prompt is tokenized: a request that can never be admitted is refused at once.
    admission::check_fits(
        state,
        admission::prompt_count(&request.prompt) * sampling.best_of as usize,
    )?;
    sampling.tokenize_bad_words(state).await?;
    let echo = request.echo.unwrap_or(false);
    let max_model_len = state.max_model_len()?;
    let add_special_tokens = request.add_special_tokens.unwrap_or(true);
    let inputs = prompt_inputs(state, request.prompt.clone(), add_special_tokens).await?;
    if inputs.is_empty() {
        check_prompt_not_empty(&[])?;
    }
    let mut prompts = Vec::with_capacity(inputs.len());
    for input in inputs {
        check_prompt_not_empty(&input.ids)?;
        check_token_ids("prompt", &input.ids, state.vocab_size)?;
        let (ids, cut) = truncated_prompt(
            input.ids,
            request.sampling.truncate_prompt_tokens,
            max_model_len,
        )?;
        let max_tokens = effective_max_tokens(
            ids.len(),
            request.sampling.max_tokens,
            Some(DEFAULT_COMPLETION_MAX_TOKENS),
            max_model_len,
        )?;
        // A cut prompt echoes what the model saw.
        let echo = match (echo, input.text) {
            (false, _) => None,
            (true, Some(text)) if !cut => Some(text),
            (true, _) => Some(state.pool.decode(ids.clone(), true).await?),
        };
        prompts.push(ValidPrompt {
            token_ids: ids,
            echo,
            params: sampling.params(max_tokens),
        });
    }
    Ok(sampling.response(request.model.clone(), prompts, ignored_fields))
}

/// Checks every field of a completions request but its model, its prompt and its priority.
pub fn check_completion_fields(
    request: &CompletionRequest,
    vocab_size: u32,
) -> Result<CheckedSampling<'_>, ApiError> {
    check_suffix(request.suffix.as_deref())?;
    if let Some(logprobs) = request.logprobs {
        check_logprobs("logprobs", logprobs)?;
    }
    let stream = request.sampling.stream.unwrap_or(false);
    if let Some(prompt_logprobs) = request.prompt_logprobs {
        check_prompt_logprobs(prompt_logprobs, stream)?;
    }
    let mut sampling = check_sampling(
        &request.sampling,
        request.sampling.max_tokens,
        request.logprobs,
        vocab_size,
    )?;
    sampling.best_of = best_of(request.best_of, sampling.n(), stream)?;
    sampling.prompt_logprobs = request.prompt_logprobs;
    sampling.echo_logprobs = request.logprobs.filter(|_| request.echo.unwrap_or(false));
    Ok(sampling)
}

/// A prompt as token ids, with its text when the client sent text.
struct PromptInput {
    ids: Vec<u32>,
    text: Option<String>,
}

async fn prompt_inputs(
    state: &AppState,
    prompt: Prompt,
    add_special_tokens: bool,
) -> Result<Vec<PromptInput>, ApiError> {
    let texts = match prompt {
        Prompt::Text(text) => vec![text],
        Prompt::Texts(texts) => texts,
        Prompt::Tokens(ids) => return Ok(vec![PromptInput { ids, text: None }]),
        Prompt::TokenLists(lists) => {
            return Ok(lists
                .into_iter()
                .map(|ids| PromptInput { ids, text: None })
                .collect())
        }
    };
    try_join_all(texts.into_iter().map(|text| async move {
        let ids = state.pool.encode(text.clone(), add_special_tokens).await?;
        Ok::<_, ApiError>(PromptInput {
            ids,
            text: Some(text),
        })
    }))
    .await
}

/// `POST /v1/chat/completions`: the messages rendered with the chat template, then tokenized.
pub async fn chat(
    state: &AppState,
    request: ChatCompletionRequest,
) -> Result<ValidRequest, ApiError> {
    check_model(state, &request.model)?;
    check_messages(&request.messages)?;
    let max_tokens = request
        .max_completion_tokens
        .or(request.sampling.max_tokens);
    // max_completion_tokens wins, but a max_tokens beside it is still a value to check.
    if let Some(overridden) = request.sampling.max_tokens {
        check_max_tokens(overridden)?;
    }
    if let Some(top) = request.top_logprobs {
        check_logprobs("top_logprobs", top)?;
    }
    check_top_logprobs(request.top_logprobs, request.logprobs.unwrap_or(false))?;
    let logprobs = match request.logprobs {
        Some(true) => Some(request.top_logprobs.unwrap_or(0)),
        _ => None,
    };
    if let Some(prompt_logprobs) = request.prompt_logprobs {
        check_prompt_logprobs(prompt_logprobs, request.sampling.stream.unwrap_or(false))?;
    }
    let mut sampling = check_sampling(&request.sampling, max_tokens, logprobs, state.vocab_size)?;
    sampling.prompt_logprobs = request.prompt_logprobs;
    check_priority(
        request.sampling.priority.unwrap_or(0),
        state.config.scheduling_policy,
    )?;
    let kwargs = template_kwargs(
        request.chat_template_kwargs.as_ref(),
        request.reasoning_effort.as_ref(),
    )?;
    let ignored_fields = sampling.ignored_fields(Endpoint::Chat, &request.other_fields)?;
    let ValidTools {
        rendered,
        reader,
        structured_output: forced_tool_call,
    } = tools::check_tools(&request, state.tool_call_parser.clone())?;
    if let (Some(_), Some(constraint)) = (&forced_tool_call, &sampling.structured_output) {
        return Err(out_of_range(
            "tool_choice",
            format!(
                "a required or named tool_choice is forced with structured output, so it cannot \
                 be combined with {}",
                constraint.field
            ),
        ));
    }
    sampling.tokenize_bad_words(state).await?;
    let max_model_len = state.max_model_len()?;
    let (add_generation_prompt, _) = chat_ending(
        request.add_generation_prompt,
        request.continue_final_message,
    )?;
    let role = chat_answer_role(&request.messages, add_generation_prompt);
    let echo = chat_echo(&request, &role)?;
    let text = chat_text(
        state,
        request.messages.clone(),
        request.add_generation_prompt,
        request.continue_final_message,
        kwargs,
        rendered,
        request.chat_template.clone(),
    )
    .await?;
    // By default none: the template already wrote the special tokens.
    let add_special_tokens = request.add_special_tokens.unwrap_or(false);
    let token_ids = state.pool.encode(text, add_special_tokens).await?;
    check_prompt_not_empty(&token_ids)?;
    let (token_ids, _) = truncated_prompt(
        token_ids,
        request.sampling.truncate_prompt_tokens,
        max_model_len,
    )?;
    let max_tokens = effective_max_tokens(token_ids.len(), max_tokens, None, max_model_len)?;
    let mut params = sampling.params(max_tokens);
    let forced = forced_tool_call.is_some();
    if forced_tool_call.is_some() {
        params.structured_output = forced_tool_call;
    }
    let prompt = ValidPrompt {
        token_ids,
        echo,
        params,
    };
    let mut valid = sampling.response(request.model.clone(), vec![prompt], ignored_fields);
    valid.tool_calls = reader;
    valid.chat_role = Some(role);
    if forced {
        // A forced call's schema is the tools' parameters: a schema that cannot compile is theirs.
        valid.structured_output_field = Some("tools");
    }
    Ok(valid)
}

/// The role of a chat answer, as vLLM gives it: a generation prompt starts the assistant's turn;
/// without one the answer goes on with the final message, so it has that message's role.
fn chat_answer_role(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    match messages.last() {
        Some(last) if !add_generation_prompt => last.role.clone(),
        _ => "assistant".into(),
    }
}

/// Chat's `echo`, as vLLM's: the final message's text leads every choice's content when that
/// message has the role the answer has (`role`); otherwise there is nothing to echo.
fn chat_echo(request: &ChatCompletionRequest, role: &str) -> Result<Option<String>, ApiError> {
    let Some(last) = request.messages.last() else {
        return Ok(None);
    };
    if request.echo != Some(true) || last.role != role {
        return Ok(None);
    }
    let text = message_text(last).map_err(|error| ApiError::InvalidParameter {
        param: "messages",
        message: error.to_string(),
    })?;
    Ok(Some(text.into_owned()))
}

/// `add_generation_prompt` and `continue_final_message` with their defaults: continuing the final
/// message turns the generation prompt off by default, and both at once is a 400.
fn chat_ending(
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
) -> Result<(bool, bool), ApiError> {
    let continue_final = continue_final_message.unwrap_or(false);
    let add_generation_prompt = add_generation_prompt.unwrap_or(!continue_final);
    if continue_final && add_generation_prompt {
        return Err(out_of_range(
            "continue_final_message",
            "continue_final_message continues the final message, and add_generation_prompt starts \
             a new one: set add_generation_prompt to false"
                .into(),
        ));
    }
    Ok((add_generation_prompt, continue_final))
}

/// A `/tokenize` request that passed validation: the text to encode, complete.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidTokenize {
    /// The prompt, or the messages rendered with the chat template.
    pub text: String,
    pub add_special_tokens: bool,
    pub return_token_strs: bool,
    pub ignored_fields: Vec<String>,
}

/// `POST /tokenize` (vLLM's): a prompt, or messages rendered as chat renders them, so that the
/// count is the chat request's prompt length.
pub async fn tokenize(
    state: &AppState,
    request: TokenizeRequest,
) -> Result<ValidTokenize, ApiError> {
    if let Some(model) = &request.model {
        check_model(state, model)?;
    }
    let ignored_fields =
        request_fields::ignored_fields(Endpoint::Tokenize, &request.other_fields, [])?;
    let chat_only = [
        (
            "add_generation_prompt",
            request.add_generation_prompt.is_some(),
        ),
        (
            "continue_final_message",
            request.continue_final_message.is_some(),
        ),
        (
            "chat_template_kwargs",
            request.chat_template_kwargs.is_some(),
        ),
        ("chat_template", request.chat_template.is_some()),
        ("tools", request.tools.is_some()),
    ];
    let (text, add_special_tokens) = match (request.prompt, request.messages) {
        (Some(prompt), None) => {
            if let Some((param, _)) = chat_only.iter().find(|(_, given)| *given) {
                return Err(ApiError::InvalidParameter {
                    param,
                    message: format!("{param} applies to messages, not to a prompt"),
                });
            }
            (prompt, request.add_special_tokens.unwrap_or(true))
        }
        (None, Some(messages)) => {
            check_messages(&messages)?;
            let tools = request.tools.filter(|tools| !tools.is_empty());
            if let Some(tools) = &tools {
                tools::check_tool_definitions(tools)?;
            }
            let kwargs = template_kwargs(request.chat_template_kwargs.as_ref(), None)?;
            let text = chat_text(
                state,
                messages,
                request.add_generation_prompt,
                request.continue_final_message,
                kwargs,
                tools,
                request.chat_template,
            )
            .await?;
            // The template already wrote the special tokens.
            (text, request.add_special_tokens.unwrap_or(false))
        }
        _ => {
            return Err(ApiError::InvalidRequest(
                "give exactly one of `prompt` and `messages`".into(),
            ))
        }
    };
    Ok(ValidTokenize {
        text,
        add_special_tokens,
        return_token_strs: request.return_token_strs.unwrap_or(false),
        ignored_fields,
    })
}

/// Renders checked `messages` (and `tools`) with the model's chat template, given the extra
/// variables `kwargs`, on the tokenizer pool, ending as the request's `add_generation_prompt` and
/// `continue_final_message` (`continue_final`) ask (see `chat_ending`). A template without tools gets them, and the
/// history's calls, as Hermes-style text.
pub async fn chat_text(
    state: &AppState,
    messages: Vec<ChatMessage>,
    add_generation_prompt: Option<bool>,
    continue_final: Option<bool>,
    kwargs: serde_json::Map<String, serde_json::Value>,
    tools: Option<Vec<Tool>>,
    request_template: Option<String>,
) -> Result<String, ApiError> {
    let (add_generation_prompt, continue_final) =
        chat_ending(add_generation_prompt, continue_final)?;
    check_request_template(state, request_template.as_deref())?;
    let model_template = state.chat_template.clone().ok_or_else(|| {
        ApiError::InvalidRequest("this model has no chat template; use /v1/completions".into())
    })?;
    // What fails in the request's own template is that field's fault.
    let faulty_param = if request_template.is_some() {
        "chat_template"
    } else {
        "messages"
    };
    state
        .pool
        .run(move |_| {
            let own;
            let template = match request_template {
                Some(source) => {
                    own = model_template.for_request(source)?;
                    &own
                }
                None => model_template.as_ref(),
            };
            let mut kwargs = kwargs;
            let rendered = if template.uses_tools() {
                // The request's tools win over a template variable of the same name.
                if let Some(tools) = tools {
                    kwargs.insert(
                        "tools".into(),
                        serde_json::to_value(tools).expect("tools always serialize"),
                    );
                }
                template.render_with_kwargs(&messages, add_generation_prompt, &kwargs)?
            } else {
                let messages = tool_prompt::plain_template_messages(&messages, tools.as_deref());
                template.render_with_kwargs(&messages, add_generation_prompt, &kwargs)?
            };
            if continue_final {
                continue_final_message(rendered, &messages)
            } else {
                Ok(rendered)
            }
        })
        .await?
        .map_err(|error| match error {
            ChatTemplateError::Syntax(_) => ApiError::InvalidParameter {
                param: "chat_template",
                message: error.to_string(),
            },
            _ if error.is_request_error() => ApiError::InvalidParameter {
                param: faulty_param,
                message: error.to_string(),
            },
            _ => ApiError::Internal(error.to_string()),
        })
}

/// vLLM's rule: a request may bring its own chat template only to a server that trusts them
/// (`--trust-request-chat-template`), since a template is code that runs on the server.
fn check_request_template(state: &AppState, template: Option<&str>) -> Result<(), ApiError> {
    if template.is_none() || state.config.trust_request_chat_template {
        return Ok(());
    }
    Err(ApiError::InvalidParameter {
        param: "chat_template",
        message: "a request's own chat_template is refused unless the server runs with \
                  --trust-request-chat-template; chat_template_kwargs sets the model template's \
                  variables"
            .into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::openai::MessageContent;

    fn param_of(result: Result<impl std::fmt::Debug, ApiError>) -> &'static str {
        match result.unwrap_err() {
            ApiError::InvalidParameter { param, .. }
            | ApiError::ContextLengthExceeded { param, .. } => param,
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn chat_echo_is_the_final_assistant_text_only() {
        let chat = |body: serde_json::Value| -> ChatCompletionRequest {
            serde_json::from_value(body).unwrap()
        };
        let user = serde_json::json!({"role": "user", "content": "Hi"});
        let answer = serde_json::json!({"role": "assistant", "content": [
            {"type": "text", "text": "The answer"}, {"type": "text", "text": "is"}]});
        let echoed =
            chat(serde_json::json!({"model": "m", "messages": [user, answer], "echo": true}));
        assert_eq!(
            chat_echo(&echoed, "assistant"),
            Ok(Some("The answer\nis".to_owned()))
        );
        let unasked = chat(serde_json::json!({"model": "m", "messages": [user, answer]}));
        assert_eq!(chat_echo(&unasked, "assistant"), Ok(None));
        let after_user =
            chat(serde_json::json!({"model": "m", "messages": [answer, user], "echo": true}));
        assert_eq!(chat_echo(&after_user, "assistant"), Ok(None));
        // Without a generation prompt the answer goes on as the user: the user's text is echoed.
        assert_eq!(chat_echo(&after_user, "user"), Ok(Some("Hi".to_owned())));
        let bad_part = serde_json::json!({"role": "assistant", "content": [{"type": "image_url"}]});
        let refused =
            chat(serde_json::json!({"model": "m", "messages": [user, bad_part], "echo": true}));
        assert_eq!(param_of(chat_echo(&refused, "assistant")), "messages");
    }

    #[test]
    fn the_answer_is_the_assistants_unless_it_goes_on_with_the_final_message() {
        let message = |role: &str| -> ChatMessage {
            serde_json::from_value(serde_json::json!({"role": role, "content": "x"})).unwrap()
        };
        let history = [message("system"), message("user")];
        assert_eq!(chat_answer_role(&history, true), "assistant");
        assert_eq!(chat_answer_role(&history, false), "user");
        assert_eq!(
            chat_answer_role(&[message("assistant")], false),
            "assistant"
        );
        assert_eq!(chat_answer_role(&[message("tool")], false), "tool");
    }

    #[test]
    fn model_must_be_the_served_name() {
        assert!(check_model_name("smol", "smol").is_ok());
        assert_eq!(
            check_model_name("gpt-4", "smol"),
            Err(ApiError::ModelNotFound("gpt-4".into()))
        );
    }

    #[test]
    fn temperature_is_non_negative() {
        assert!(check_temperature(0.0).is_ok());
        assert!(check_temperature(2.0).is_ok());
        assert_eq!(param_of(check_temperature(-0.1)), "temperature");
        assert_eq!(param_of(check_temperature(2.5)), "temperature");
    }

    #[test]
    fn top_p_is_in_half_open_unit_interval() {
        assert!(check_top_p(1.0).is_ok());
        assert!(check_top_p(0.01).is_ok());
        assert_eq!(param_of(check_top_p(0.0)), "top_p");
        assert_eq!(param_of(check_top_p(1.01)), "top_p");
    }

    #[test]
    fn top_k_zero_and_minus_one_disable() {
        assert_eq!(top_k(-1), Ok(-1));
        assert_eq!(top_k(0), Ok(-1));
        assert_eq!(top_k(40), Ok(40));
        assert_eq!(param_of(top_k(-2)), "top_k");
    }

    #[test]
    fn min_p_is_in_unit_interval() {
        assert!(check_min_p(0.0).is_ok());
        assert!(check_min_p(1.0).is_ok());
        assert_eq!(param_of(check_min_p(1.5)), "min_p");
    }

    #[test]
    fn n_is_between_one_and_the_cap() {
        assert!(check_n(1).is_ok());
        assert!(check_n(MAX_N).is_ok());
        assert_eq!(param_of(check_n(0)), "n");
        assert_eq!(param_of(check_n(MAX_N + 1)), "n");
    }

    #[test]
    fn max_tokens_is_at_least_one() {
        assert!(check_max_tokens(1).is_ok());
        assert_eq!(param_of(check_max_tokens(0)), "max_tokens");
    }

    #[test]
    fn min_tokens_cannot_exceed_max_tokens() {
        assert!(check_min_tokens(5, Some(5)).is_ok());
        assert!(check_min_tokens(5, None).is_ok());
        assert_eq!(param_of(check_min_tokens(6, Some(5))), "min_tokens");
    }

    #[test]
    fn additive_penalties_are_within_two() {
        assert!(check_additive_penalty("presence_penalty", -2.0).is_ok());
        assert!(check_additive_penalty("presence_penalty", 2.0).is_ok());
        assert_eq!(
            param_of(check_additive_penalty("frequency_penalty", 2.1)),
            "frequency_penalty"
        );
    }

    #[test]
    fn repetition_penalty_is_positive() {
        assert!(check_repetition_penalty(1.2).is_ok());
        assert_eq!(
            param_of(check_repetition_penalty(0.0)),
            "repetition_penalty"
        );
    }

    #[test]
    fn allowed_token_ids_are_a_non_empty_list_of_vocabulary_ids() {
        assert!(check_allowed_token_ids(&[0, 99], 100).is_ok());
        assert_eq!(
            param_of(check_allowed_token_ids(&[], 100)),
            "allowed_token_ids"
        );
        assert_eq!(
            param_of(check_allowed_token_ids(&[3, 100], 100)),
            "allowed_token_ids"
        );
    }

    #[test]
    fn logprobs_are_capped_at_twenty() {
        assert!(check_logprobs("logprobs", 20).is_ok());
        assert_eq!(param_of(check_logprobs("top_logprobs", 21)), "top_logprobs");
    }

    #[test]
    fn logit_bias_keys_are_token_ids_in_the_vocabulary() {
        let bias = BTreeMap::from([("17".to_string(), -100.0), ("3".to_string(), 5.0)]);
        assert_eq!(
            logit_bias(&bias, 100),
            Ok(BTreeMap::from([(3, 5.0), (17, -100.0)]))
        );
        for bad in ["abc", "-1", "100"] {
            let bias = BTreeMap::from([(bad.to_string(), 1.0)]);
            assert_eq!(param_of(logit_bias(&bias, 100)), "logit_bias", "{bad}");
        }
        let bias = BTreeMap::from([("1".to_string(), 100.5)]);
        assert_eq!(param_of(logit_bias(&bias, 100)), "logit_bias");
    }

    #[test]
    fn token_ids_must_be_in_the_vocabulary() {
        assert!(check_token_ids("prompt", &[0, 99], 100).is_ok());
        assert_eq!(param_of(check_token_ids("prompt", &[100], 100)), "prompt");
    }

    #[test]
    fn prompt_logprobs_are_capped_and_not_streamed() {
        assert!(check_prompt_logprobs(20, false).is_ok());
        assert_eq!(
            param_of(check_prompt_logprobs(21, false)),
            "prompt_logprobs"
        );
        assert_eq!(param_of(check_prompt_logprobs(0, true)), "prompt_logprobs");
    }

    #[test]
    fn best_of_is_at_least_n_and_not_streamed_beyond_it() {
        assert_eq!(best_of(None, 3, true), Ok(3));
        assert_eq!(best_of(Some(5), 2, false), Ok(5));
        assert_eq!(best_of(Some(2), 2, true), Ok(2));
        assert_eq!(param_of(best_of(Some(1), 2, false)), "best_of");
        assert_eq!(param_of(best_of(Some(MAX_N + 1), 1, false)), "best_of");
        assert_eq!(param_of(best_of(Some(3), 1, true)), "best_of");
    }

    #[test]
    fn echo_with_logprobs_and_best_of_set_what_the_engine_computes() {
        let request: CompletionRequest = serde_json::from_str(
            r#"{"model":"m","prompt":"x","echo":true,"logprobs":2,"prompt_logprobs":5}"#,
        )
        .unwrap();
        let params = check_completion_fields(&request, 100).unwrap().params(4);
        assert_eq!(
            (params.logprobs, params.prompt_logprobs),
            (Some(2), Some(5))
        );
        let request: CompletionRequest = serde_json::from_str(
            r#"{"model":"m","prompt":"x","echo":true,"logprobs":3,"n":2,"best_of":4}"#,
        )
        .unwrap();
        let sampling = check_completion_fields(&request, 100).unwrap();
        let params = sampling.params(4);
        assert_eq!(
            (params.logprobs, params.prompt_logprobs),
            (Some(3), Some(3))
        );
        let valid = sampling.response("m".into(), Vec::new(), Vec::new());
        assert_eq!((valid.n, valid.best_of), (2, 4));
        assert_eq!(
            (valid.echo_logprobs, valid.prompt_logprobs),
            (Some(3), None)
        );
        // Ranking candidates needs the sampled tokens' logprobs even when none are shown.
        let request: CompletionRequest =
            serde_json::from_str(r#"{"model":"m","prompt":"x","best_of":2}"#).unwrap();
        let sampling = check_completion_fields(&request, 100).unwrap();
        assert_eq!(sampling.params(4).logprobs, Some(0));
        assert!(
            !sampling
                .response("m".into(), Vec::new(), Vec::new())
                .logprobs
        );
        let request: CompletionRequest =
            serde_json::from_str(r#"{"model":"m","prompt":"x","echo":true}"#).unwrap();
        let params = check_completion_fields(&request, 100).unwrap().params(4);
        assert_eq!((params.logprobs, params.prompt_logprobs), (None, None));
    }

    #[test]
    fn messages_are_non_empty_with_known_roles() {
        let message = |role: &str| ChatMessage {
            role: role.into(),
            content: Some(MessageContent::Text("hi".into())),
            name: None,
            tool_calls: None,
            tool_call_id: None,
        };
        assert_eq!(check_messages(&[]), Err(ApiError::EmptyMessages));
        assert!(check_messages(&[message("system"), message("user")]).is_ok());
        assert!(check_messages(&[message("developer"), message("user")]).is_ok());
        assert_eq!(param_of(check_messages(&[message("wizard")])), "messages");
        let with_call = |kind: &str| ChatMessage {
            tool_calls: Some(
                serde_json::from_value(serde_json::json!([{"id": "c1", "type": kind,
                    "function": {"name": "now", "arguments": "{}"}}]))
                .unwrap(),
            ),
            ..message("assistant")
        };
        assert!(check_messages(&[message("user"), with_call("function")]).is_ok());
        assert_eq!(
            param_of(check_messages(&[message("user"), with_call("0..0")])),
            "messages"
        );
    }

    #[test]
    fn empty_prompt_is_rejected() {
        assert!(check_prompt_not_empty(&[1]).is_ok());
        assert_eq!(param_of(check_prompt_not_empty(&[])), "prompt");
    }

    #[test]
    fn prompt_and_max_tokens_must_fit_the_context() {
        assert_eq!(effective_max_tokens(10, Some(5), Some(16), 100), Ok(5));
        assert_eq!(effective_max_tokens(10, Some(90), Some(16), 100), Ok(90));
        assert_eq!(
            param_of(effective_max_tokens(10, Some(91), Some(16), 100)),
            "max_tokens"
        );
        assert_eq!(
            param_of(effective_max_tokens(100, None, Some(16), 100)),
            "prompt"
        );
        assert_eq!(
            param_of(effective_max_tokens(101, Some(1), None, 100)),
            "prompt"
        );
    }

    #[test]
    fn truncate_prompt_tokens_keeps_the_last_tokens() {
        assert_eq!(
            truncated_prompt(vec![1, 2, 3, 4], None, 8).unwrap(),
            (vec![1, 2, 3, 4], false)
        );
        assert_eq!(
            truncated_prompt(vec![1, 2, 3, 4], Some(2), 8).unwrap(),
            (vec![3, 4], true)
        );
        assert_eq!(
            truncated_prompt(vec![1, 2, 3, 4], Some(6), 8).unwrap(),
            (vec![1, 2, 3, 4], false)
        );
        assert_eq!(
            truncated_prompt(vec![1, 2, 3, 4], Some(-1), 3).unwrap(),
            (vec![2, 3, 4], true)
        );
        for keep in [0, -2, 9] {
            assert_eq!(
                param_of(truncated_prompt(vec![1], Some(keep), 8)),
                "truncate_prompt_tokens"
            );
        }
    }

    #[test]
    fn absent_max_tokens_takes_the_default_clipped_to_the_room_left() {
        assert_eq!(effective_max_tokens(10, None, Some(16), 100), Ok(16));
        assert_eq!(effective_max_tokens(90, None, Some(16), 100), Ok(10));
        assert_eq!(effective_max_tokens(10, None, None, 100), Ok(90));
    }

    #[test]
    fn checked_sampling_carries_the_checked_fields() {
        let fields = SamplingFields {
            temperature: Some(0.0),
            top_k: Some(0),
            seed: Some(7),
            stop_token_ids: Some(vec![2]),
            logit_bias: Some(BTreeMap::from([("5".to_string(), 1.0)])),
            ignore_eos: Some(true),
            min_tokens: Some(2),
            ..SamplingFields::default()
        };
        let params = check_sampling(&fields, Some(8), Some(3), 100)
            .unwrap()
            .params(8);
        assert_eq!(params.max_tokens, 8);
        assert_eq!(params.temperature, 0.0);
        assert_eq!(params.top_k, -1);
        assert_eq!(params.seed, Some(7));
        assert_eq!(params.logprobs, Some(3));
        assert_eq!(params.stop_token_ids, vec![2]);
        assert_eq!(params.logit_bias, Some(BTreeMap::from([(5, 1.0)])));
        assert!(params.ignore_eos);
        assert_eq!(params.min_tokens, 2);
    }

    #[test]
    fn check_sampling_rejects_the_first_bad_field() {
        let fields = SamplingFields {
            top_p: Some(0.0),
            ..SamplingFields::default()
        };
        assert_eq!(param_of(check_sampling(&fields, None, None, 100)), "top_p");
        let fields = SamplingFields {
            stop_token_ids: Some(vec![500]),
            ..SamplingFields::default()
        };
        assert_eq!(
            param_of(check_sampling(&fields, None, None, 100)),
            "stop_token_ids"
        );
        let fields = SamplingFields {
            min_tokens: Some(9),
            ..SamplingFields::default()
        };
        assert_eq!(
            param_of(check_sampling(&fields, Some(8), None, 100)),
            "min_tokens"
        );
    }

    /// tests/golden/sampling_limits.json, which the engine's validation runs too.
    #[test]
    fn sampling_limits_follow_the_golden_table() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/golden/sampling_limits.json"
        );
        let golden: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let vocab_size = golden["vocab_size"].as_u64().unwrap() as u32;
        let cases = golden["cases"].as_array().unwrap();
        assert!(cases.len() > 20);
        for case in cases {
            let mut body = serde_json::json!({"model": "m", "prompt": "x"});
            for (field, value) in case["params"].as_object().unwrap() {
                body[field] = value.clone();
            }
            let expected = case.get("param").map(|param| param.as_str().unwrap());
            // A value JSON cannot carry into the field's type (infinity, a negative count) is
            // refused by the parser, with a 400 of its own.
            let Ok(request) = serde_json::from_value::<CompletionRequest>(body) else {
                assert!(expected.is_some(), "{case} was refused by the parser");
                continue;
            };
            match check_completion_fields(&request, vocab_size) {
                Ok(_) => assert_eq!(expected, None, "{case} was accepted"),
                Err(error) => assert_eq!(error.param(), expected, "{case}: {error}"),
            }
        }
    }

    #[test]
    fn min_tokens_follow_a_max_tokens_clipped_by_the_context() {
        let fields = SamplingFields {
            min_tokens: Some(9),
            ..SamplingFields::default()
        };
        let params = check_sampling(&fields, None, None, 100).unwrap().params(4);
        assert_eq!((params.max_tokens, params.min_tokens), (4, 4));
    }
}

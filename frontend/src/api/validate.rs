//! The field rules of a request: one pure check per concern, each answering with a typed
//! [`ApiError`] or the typed value it stands for. `valid_request` checks a request's sampling fields
//! with them, and `prepare` builds the complete request (rendering, tokenizing, the token budget).
//!
//! Ranges follow vLLM's `SamplingParams`. Everything the engine core receives has passed here,
//! so the engine may trust it.

use std::collections::BTreeMap;

use crate::api::error::ApiError;
use crate::engine::protocol::{Ready, Runner};
use crate::state::SchedulingPolicy;
use sluice_common::schema::openai::{ChatMessage, SamplingFields};

pub const MAX_N: u32 = 128;
pub const MAX_LOGPROBS: u32 = 20;
/// Completions' default, as in OpenAI's API.
pub const DEFAULT_COMPLETION_MAX_TOKENS: u32 = 16;
/// Inputs per embeddings request, OpenAI's limit.
pub const MAX_EMBEDDING_INPUTS: usize = 2048;
/// `developer` is OpenAI's newer name of `system`; the chat template renders it as one.
const CHAT_ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

pub(crate) fn out_of_range(param: &'static str, message: String) -> ApiError {
    ApiError::InvalidParameter { param, message }
}

pub fn check_model_name(requested: &str, served: &str) -> Result<(), ApiError> {
    if requested == served {
        Ok(())
    } else {
        Err(ApiError::ModelNotFound(requested.to_owned()))
    }
}

/// What the served model is, as its engine core's `ready` announced it: which routes serve it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServedModel {
    /// Completions, chat, messages and responses.
    Generative,
    /// A bi-encoder: /v1/embeddings, and /score and /rerank as the cosines of embeddings.
    Embedding,
    /// /score and /rerank only: each pair of texts scored as one prompt.
    CrossEncoder,
}

impl ServedModel {
    pub fn of(ready: &Ready) -> Self {
        match ready.runner {
            Runner::Generate => ServedModel::Generative,
            Runner::Pooling if ready.cross_encoder => ServedModel::CrossEncoder,
            Runner::Pooling => ServedModel::Embedding,
        }
    }
}

/// The routes, by the models that serve them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Completions, chat, messages and responses: a generative model's.
    Generation,
    /// /v1/embeddings: an embedding model's.
    Embeddings,
    /// /score and /rerank: an embedding model's or a cross-encoder's.
    Scores,
}

/// A route the model `model` does not serve is a 400 that says which routes serve it.
pub fn check_served_route(served: ServedModel, route: Route, model: &str) -> Result<(), ApiError> {
    let message = match (served, route) {
        (ServedModel::Generative, Route::Generation)
        | (ServedModel::Embedding, Route::Embeddings | Route::Scores)
        | (ServedModel::CrossEncoder, Route::Scores) => return Ok(()),
        (ServedModel::Generative, _) => format!(
            "The model `{model}` is a generative model: it serves /v1/completions, \
             /v1/chat/completions, /v1/messages and /v1/responses. /v1/embeddings, /score and \
             /rerank need a pooling model: serve it with `sluice serve MODEL --runner pooling`, or \
             serve an embedding model's folder (one with a sentence-transformers modules.json)"
        ),
        (ServedModel::Embedding, _) => format!(
            "The model `{model}` is an embedding model (served with --runner pooling): it serves \
             /v1/embeddings, /score and /rerank, and generates no text"
        ),
        (ServedModel::CrossEncoder, _) => format!(
            "The model `{model}` is a cross-encoder: it serves /score and /rerank (also \
             /v1/rerank and /v2/rerank), scoring each pair of texts as one prompt; it embeds no \
             text and generates none"
        ),
    };
    Err(out_of_range("model", message))
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
pub(crate) fn python_space(c: char) -> bool {
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

/// How /v1/embeddings writes each embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncodingFormat {
    /// JSON numbers.
    Float,
    /// The engine's little-endian float32 bytes, base64-encoded (what OpenAI's client asks for).
    Base64,
}

pub fn encoding_format(format: Option<&str>) -> Result<EncodingFormat, ApiError> {
    match format {
        None | Some("float") => Ok(EncodingFormat::Float),
        Some("base64") => Ok(EncodingFormat::Base64),
        Some(other) => Err(out_of_range(
            "encoding_format",
            format!("encoding_format must be \"float\" or \"base64\", got {other:?}"),
        )),
    }
}

/// The embedding size a request asks for with `dimensions`, which the model `model` must allow: any
/// size up to `embedding_size` when `matryoshka` is empty, one of its sizes when it is not, none
/// when it is None.
pub fn embedding_dimensions(
    dimensions: Option<i64>,
    embedding_size: u32,
    matryoshka: Option<&[u32]>,
    model: &str,
) -> Result<Option<u32>, ApiError> {
    let Some(asked) = dimensions else {
        return Ok(None);
    };
    let Some(sizes) = matryoshka else {
        return Err(out_of_range(
            "dimensions",
            format!(
                "model `{model}` does not support `dimensions`: it is not a Matryoshka model \
                 (its embeddings have {embedding_size} values)"
            ),
        ));
    };
    let rule = if sizes.is_empty() {
        format!("between 1 and the embedding size, {embedding_size}")
    } else {
        format!("one of the model's sizes {sizes:?}")
    };
    u32::try_from(asked)
        .ok()
        .filter(|&size| {
            (1..=embedding_size).contains(&size) && (sizes.is_empty() || sizes.contains(&size))
        })
        .map(Some)
        .ok_or_else(|| {
            out_of_range(
                "dimensions",
                format!("dimensions must be {rule}, got {asked}"),
            )
        })
}

/// An embeddings request holds between 1 and [`MAX_EMBEDDING_INPUTS`] inputs.
pub fn check_input_count(count: usize) -> Result<(), ApiError> {
    match count {
        1..=MAX_EMBEDDING_INPUTS => Ok(()),
        0 => Err(out_of_range(
            "input",
            "input must not be an empty list".into(),
        )),
        _ => Err(out_of_range(
            "input",
            format!("input may hold at most {MAX_EMBEDDING_INPUTS} items, got {count}"),
        )),
    }
}

/// The tokens of input `index` of the field `param` (embeddings' `input`, a score's `text_1`...):
/// not empty, in the vocabulary, cut as vLLM's `truncate_prompt_tokens` asks, and then within the
/// context.
pub fn embedding_input(
    param: &'static str,
    index: usize,
    ids: Vec<u32>,
    truncate_prompt_tokens: Option<i64>,
    max_model_len: u32,
    vocab_size: u32,
) -> Result<Vec<u32>, ApiError> {
    if ids.is_empty() {
        return Err(out_of_range(
            param,
            format!("{param} {index} is empty: it has no tokens"),
        ));
    }
    check_token_ids(param, &ids, vocab_size)
        .map_err(|error| out_of_range(param, format!("{param} {index}: {error}")))?;
    let (ids, _) = truncated_prompt(ids, truncate_prompt_tokens, max_model_len)?;
    if ids.len() > max_model_len as usize {
        return Err(ApiError::ContextLengthExceeded {
            param,
            message: format!(
                "This model's maximum context length is {max_model_len} tokens, but {param} \
                 {index} has {} tokens (truncate_prompt_tokens keeps an input's last tokens)",
                ids.len()
            ),
        });
    }
    Ok(ids)
}

/// A cross-encoder's pair tokenized as one prompt (`ids`): each text with tokens of its own, every
/// token in the vocabulary, and the whole within the context. `sides` are each text's field, its
/// index there and its own tokens (the template's special tokens left out).
pub fn check_pair_input(
    sides: [(&'static str, usize, usize); 2],
    ids: &[u32],
    max_model_len: u32,
    vocab_size: u32,
) -> Result<(), ApiError> {
    for (param, index, tokens) in sides {
        if tokens == 0 {
            return Err(out_of_range(
                param,
                format!("{param} {index} is empty: it has no tokens"),
            ));
        }
    }
    let [(first, first_index, _), (second, second_index, _)] = sides;
    let pair = format!("the pair of {first} {first_index} and {second} {second_index}");
    check_token_ids(second, ids, vocab_size)
        .map_err(|error| out_of_range(second, format!("{pair}: {error}")))?;
    if ids.len() > max_model_len as usize {
        return Err(ApiError::ContextLengthExceeded {
            param: second,
            message: format!(
                "This model's maximum context length is {max_model_len} tokens, but {pair}, \
                 tokenized together, has {} tokens",
                ids.len()
            ),
        });
    }
    Ok(())
}

/// The pairs a score compares, as indices into the first side's texts followed by the second's:
/// one first text against each second one, else the two sides one to one. Each side is its field
/// and its count; both are given, and hold at most [`MAX_EMBEDDING_INPUTS`] texts together.
pub fn score_pairs(
    (first, first_len): (&'static str, usize),
    (second, second_len): (&'static str, usize),
) -> Result<Vec<(usize, usize)>, ApiError> {
    for (param, len) in [(first, first_len), (second, second_len)] {
        if len == 0 {
            return Err(out_of_range(param, format!("{param} must not be empty")));
        }
    }
    if first_len + second_len > MAX_EMBEDDING_INPUTS {
        return Err(out_of_range(
            second,
            format!(
                "{first} and {second} may hold at most {MAX_EMBEDDING_INPUTS} texts together, got \
                 {}",
                first_len + second_len
            ),
        ));
    }
    match first_len {
        1 => Ok((0..second_len).map(|j| (0, 1 + j)).collect()),
        _ if first_len == second_len => Ok((0..first_len).map(|i| (i, first_len + i)).collect()),
        _ => Err(out_of_range(
            second,
            format!(
                "{first} has {first_len} texts and {second} has {second_len}: give one {first} \
                 (scored against each {second}), or as many as {second} has (scored in pairs)"
            ),
        )),
    }
}

/// Rerank's `top_n`: the best N results, or None (0 or absent) for all of them.
pub fn top_n(top_n: Option<i64>) -> Result<Option<usize>, ApiError> {
    match top_n {
        None | Some(0) => Ok(None),
        Some(n) => usize::try_from(n).map(Some).map_err(|_| {
            out_of_range(
                "top_n",
                format!("top_n must be 0 (all results) or more, got {n}"),
            )
        }),
    }
}

/// `add_generation_prompt` and `continue_final_message` with their defaults: continuing the final
/// message turns the generation prompt off by default, and both at once is a 400.
pub fn chat_ending(
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The parameter a 400 names.
    pub(crate) fn param_of(result: Result<impl std::fmt::Debug, ApiError>) -> &'static str {
        match result.unwrap_err() {
            ApiError::InvalidParameter { param, .. }
            | ApiError::ContextLengthExceeded { param, .. } => param,
            other => panic!("unexpected {other:?}"),
        }
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
    fn messages_are_non_empty_with_known_roles() {
        let message = |role: &str| ChatMessage::text(role, "hi");
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
    fn each_model_serves_its_own_routes_and_names_them_on_the_others() {
        use {Route::*, ServedModel::*};
        for (served, route) in [
            (Generative, Generation),
            (Embedding, Embeddings),
            (Embedding, Scores),
            (CrossEncoder, Scores),
        ] {
            assert!(check_served_route(served, route, "smol").is_ok());
        }
        let message = |served, route| match check_served_route(served, route, "smol") {
            Err(ApiError::InvalidParameter { param, message }) => {
                assert_eq!(param, "model");
                assert!(message.contains("`smol`"), "{message}");
                message
            }
            other => panic!("unexpected {other:?}"),
        };
        for route in [Embeddings, Scores] {
            let generative = message(Generative, route);
            for route in ["/v1/chat/completions", "/v1/responses", "--runner pooling"] {
                assert!(generative.contains(route), "{generative}");
            }
        }
        assert!(message(Embedding, Generation).contains("serves /v1/embeddings"));
        for route in [Generation, Embeddings] {
            let cross_encoder = message(CrossEncoder, route);
            assert!(
                cross_encoder.contains("is a cross-encoder: it serves /score and /rerank"),
                "{cross_encoder}"
            );
        }
    }

    #[test]
    fn a_pooling_model_is_a_cross_encoder_only_when_ready_says_so() {
        let ready = |runner, cross_encoder| Ready {
            max_model_len: 512,
            num_kv_blocks: 64,
            block_size: 16,
            runner,
            embedding_size: 1,
            matryoshka_dimensions: None,
            cross_encoder,
            eos_token_ids: Vec::new(),
        };
        assert_eq!(
            ServedModel::of(&ready(Runner::Generate, false)),
            ServedModel::Generative
        );
        assert_eq!(
            ServedModel::of(&ready(Runner::Pooling, false)),
            ServedModel::Embedding
        );
        assert_eq!(
            ServedModel::of(&ready(Runner::Pooling, true)),
            ServedModel::CrossEncoder
        );
    }

    #[test]
    fn encoding_format_is_float_by_default_or_base64() {
        assert_eq!(encoding_format(None), Ok(EncodingFormat::Float));
        assert_eq!(encoding_format(Some("float")), Ok(EncodingFormat::Float));
        assert_eq!(encoding_format(Some("base64")), Ok(EncodingFormat::Base64));
        for bad in ["", "Float", "binary"] {
            assert_eq!(param_of(encoding_format(Some(bad))), "encoding_format");
        }
    }

    #[test]
    fn dimensions_need_a_matryoshka_model_and_one_of_its_sizes() {
        let sizes = [64, 256, 768];
        assert_eq!(embedding_dimensions(None, 768, None, "m"), Ok(None));
        assert_eq!(embedding_dimensions(None, 768, Some(&sizes), "m"), Ok(None));
        match embedding_dimensions(Some(64), 576, None, "smol") {
            Err(ApiError::InvalidParameter { param, message }) => {
                assert_eq!(param, "dimensions");
                assert!(message.contains("not a Matryoshka model"), "{message}");
            }
            other => panic!("unexpected {other:?}"),
        }
        // An empty list: any size from 1 to the embedding size.
        assert_eq!(
            embedding_dimensions(Some(1), 768, Some(&[]), "m"),
            Ok(Some(1))
        );
        assert_eq!(
            embedding_dimensions(Some(768), 768, Some(&[]), "m"),
            Ok(Some(768))
        );
        assert_eq!(
            embedding_dimensions(Some(256), 768, Some(&sizes), "m"),
            Ok(Some(256))
        );
        for (asked, listed) in [
            (769, &[][..]),
            (0, &[]),
            (-3, &[]),
            (100, &sizes),
            (1024, &sizes),
        ] {
            assert_eq!(
                param_of(embedding_dimensions(Some(asked), 768, Some(listed), "m")),
                "dimensions",
                "{asked}"
            );
        }
    }

    #[test]
    fn an_embeddings_request_has_one_to_2048_inputs() {
        assert!(check_input_count(1).is_ok());
        assert!(check_input_count(MAX_EMBEDDING_INPUTS).is_ok());
        assert_eq!(param_of(check_input_count(0)), "input");
        assert_eq!(
            param_of(check_input_count(MAX_EMBEDDING_INPUTS + 1)),
            "input"
        );
    }

    #[test]
    fn an_embeddings_input_is_in_the_vocabulary_and_fits_the_context_unless_truncated() {
        assert_eq!(
            embedding_input("input", 0, vec![1, 2, 3], None, 3, 100),
            Ok(vec![1, 2, 3])
        );
        assert_eq!(
            embedding_input("input", 0, vec![1, 2, 3, 4], Some(2), 3, 100),
            Ok(vec![3, 4])
        );
        assert_eq!(
            embedding_input("input", 0, vec![1, 2, 3, 4], Some(-1), 3, 100),
            Ok(vec![2, 3, 4])
        );
        let refusal = |result: Result<Vec<u32>, ApiError>| match result {
            Err(
                ApiError::InvalidParameter { param, message }
                | ApiError::ContextLengthExceeded { param, message },
            ) => (param, message),
            other => panic!("unexpected {other:?}"),
        };
        let (param, message) = refusal(embedding_input("input", 4, vec![], None, 8, 100));
        assert_eq!(param, "input");
        assert!(message.contains("input 4"), "{message}");
        let (param, message) = refusal(embedding_input("input", 2, vec![1, 100], None, 8, 100));
        assert_eq!(param, "input");
        assert!(
            message.contains("input 2") && message.contains("100"),
            "{message}"
        );
        let (param, message) = refusal(embedding_input("input", 1, vec![1, 2, 3, 4], None, 3, 100));
        assert_eq!(param, "input");
        assert!(message.contains("input 1 has 4 tokens"), "{message}");
        assert_eq!(
            param_of(embedding_input("input", 0, vec![1], Some(0), 3, 100)),
            "truncate_prompt_tokens"
        );
    }

    #[test]
    fn one_first_text_meets_every_second_one_else_they_pair_one_to_one() {
        let pairs = |first, second| score_pairs(("text_1", first), ("text_2", second));
        assert_eq!(pairs(1, 3), Ok(vec![(0, 1), (0, 2), (0, 3)]));
        assert_eq!(pairs(2, 2), Ok(vec![(0, 2), (1, 3)]));
        assert_eq!(pairs(1, 1), Ok(vec![(0, 1)]));
        assert_eq!(param_of(pairs(0, 2)), "text_1");
        assert_eq!(param_of(pairs(1, 0)), "text_2");
        match pairs(3, 2) {
            Err(ApiError::InvalidParameter { param, message }) => {
                assert_eq!(param, "text_2");
                assert!(
                    message.contains("text_1 has 3 texts and text_2 has 2"),
                    "{message}"
                );
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(pairs(1, MAX_EMBEDDING_INPUTS - 1).is_ok());
        assert_eq!(param_of(pairs(1, MAX_EMBEDDING_INPUTS)), "text_2");
        assert_eq!(
            param_of(score_pairs(("query", 1), ("documents", 0))),
            "documents"
        );
    }

    #[test]
    fn a_pair_needs_tokens_of_each_text_and_fits_the_context_whole() {
        let sides = |first_tokens, second_tokens| {
            [("query", 0, first_tokens), ("documents", 3, second_tokens)]
        };
        let ids = [1, 5, 6, 2, 7, 8, 2];
        assert_eq!(check_pair_input(sides(2, 2), &ids, 7, 10), Ok(()));
        assert_eq!(
            param_of(check_pair_input(sides(0, 2), &ids, 7, 10)),
            "query"
        );
        assert_eq!(
            param_of(check_pair_input(sides(2, 0), &ids, 7, 10)),
            "documents"
        );
        assert_eq!(
            param_of(check_pair_input(sides(2, 2), &ids, 7, 8)),
            "documents"
        );
        match check_pair_input(sides(2, 2), &ids, 6, 10) {
            Err(ApiError::ContextLengthExceeded { param, message }) => {
                assert_eq!(param, "documents");
                assert!(
                    message.contains(
                        "the pair of query 0 and documents 3, tokenized together, has 7 tokens"
                    ),
                    "{message}"
                );
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn top_n_of_zero_or_none_is_every_result_and_a_negative_one_is_refused() {
        assert_eq!(top_n(None), Ok(None));
        assert_eq!(top_n(Some(0)), Ok(None));
        assert_eq!(top_n(Some(3)), Ok(Some(3)));
        assert_eq!(param_of(top_n(Some(-1))), "top_n");
    }

    #[test]
    fn absent_max_tokens_takes_the_default_clipped_to_the_room_left() {
        assert_eq!(effective_max_tokens(10, None, Some(16), 100), Ok(16));
        assert_eq!(effective_max_tokens(90, None, Some(16), 100), Ok(10));
        assert_eq!(effective_max_tokens(10, None, None, 100), Ok(90));
    }
}

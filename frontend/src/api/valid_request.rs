//! The typed values that validation returns: every sampling field of a request checked
//! ([`CheckedSampling`], from [`check_completion_fields`] or [`check_chat_fields`]), and the complete
//! request that the fan-out runs ([`ValidRequest`]), which `prepare` builds.

use std::collections::BTreeMap;

use futures::future::try_join_all;

use crate::api::error::ApiError;
use crate::api::request_fields::{self, Endpoint};
use crate::api::structured_output::{self, Constraint};
use crate::api::validate::{
    best_of, check_additive_penalty, check_allowed_token_ids, check_bad_words, check_cache_salt,
    check_logprobs, check_max_tokens, check_min_p, check_min_tokens, check_n,
    check_prompt_logprobs, check_repetition_penalty, check_stream_options, check_suffix,
    check_temperature, check_token_ids, check_top_logprobs, check_top_p, logit_bias, python_space,
    top_k,
};
use crate::engine::protocol::{PoolingParams, SamplingParams};
use crate::state::AppState;
use crate::text::answer_parts::{whole_answer, WholeAnswer};
use crate::text::tool_call_stream::ToolCallReader;
use sluice_common::schema::openai::{
    ChatCompletionRequest, CompletionRequest, SamplingFields, StopSequences,
};

/// Every sampling field checked, waiting only for the max_tokens of each prompt.
#[derive(Debug, Clone)]
pub struct CheckedSampling<'a> {
    fields: &'a SamplingFields,
    logit_bias: Option<BTreeMap<u32, f64>>,
    /// The engine's count: the sampled token plus the top N.
    logprobs: Option<u32>,
    pub(crate) structured_output: Option<Constraint>,
    /// Engine requests per prompt, of which the n most likely are returned.
    pub(crate) best_of: u32,
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
            // Chat's, once its prompt says where the thinking starts (prepare::chat).
            thinking_budget: None,
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

    pub(crate) fn response(
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
            reasoning_starts_thinking: None,
            return_token_ids: fields.return_token_ids.unwrap_or(false),
            return_tokens_as_token_ids: fields.return_tokens_as_token_ids.unwrap_or(false),
            cache_salt: fields.cache_salt.clone(),
            pooling: None,
            beam_search: None,
        }
    }

    /// The request's fields that nothing reads, or the 400 for one that cannot be honoured.
    pub(crate) fn ignored_fields(
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

/// A completions, chat or embeddings request that passed validation, complete: the fan-out only
/// runs it.
#[derive(Debug, Clone, Default, PartialEq)]
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
    /// Chat with `--reasoning-parser`: thinking is split from each answer, and this says whether an
    /// output starts inside it (`ReasoningParser::starts_thinking`). None: no split.
    pub reasoning_starts_thinking: Option<bool>,
    /// vLLM's `return_token_ids`: the prompt's and each choice's token ids in the response.
    pub return_token_ids: bool,
    /// vLLM's `return_tokens_as_token_ids`: logprobs name their tokens `token_id:N`.
    pub return_tokens_as_token_ids: bool,
    /// vLLM's `cache_salt`: non-empty; cached KV blocks are shared only under the same salt.
    pub cache_salt: Option<String>,
    /// Embeddings: each prompt is a pooling request, answered with its embedding.
    pub pooling: Option<PoolingParams>,
    /// Completions' `use_beam_search`: each prompt's n best beams are its choices (`beam_search`),
    /// and its `params` serve only for max_tokens.
    pub beam_search: Option<BeamSearchParams>,
}

/// One prompt, its echo text and its engine parameters (with its own max_tokens).
#[derive(Debug, Clone, PartialEq)]
pub struct ValidPrompt {
    /// Non-empty, in the vocabulary, leaving room for `params.max_tokens`.
    pub token_ids: Vec<u32>,
    /// Completions' `echo`: the prompt's text, sent before the generated text.
    pub echo: Option<String>,
    pub params: SamplingParams,
    /// A cross-encoder's pair of texts, as one prompt: where token type 1 starts (see
    /// `AddRequest::second_text_start`). None for every other prompt.
    pub second_text_start: Option<u32>,
}

impl ValidRequest {
    /// A choice's whole output read as this request reads it: its thinking split out (with a
    /// reasoning parser), its calls read (with tools).
    pub fn answer_of(&self, output: String) -> WholeAnswer {
        whole_answer(
            self.reasoning_starts_thinking,
            self.tool_calls.clone(),
            output,
        )
    }

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

/// Checks every field of a chat request but its model, its messages, its tools and its priority;
/// with the max_tokens it asks for (max_completion_tokens wins over max_tokens).
pub fn check_chat_fields(
    request: &ChatCompletionRequest,
    vocab_size: u32,
) -> Result<(CheckedSampling<'_>, Option<u32>), ApiError> {
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
    let mut sampling = check_sampling(&request.sampling, max_tokens, logprobs, vocab_size)?;
    sampling.prompt_logprobs = request.prompt_logprobs;
    Ok((sampling, max_tokens))
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

/// When a search stops before every live beam has reached its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EarlyStopping {
    /// `true`: once beam_width beams have finished.
    Finished,
    /// `false` (the default): also once no live beam scores better than the worst of the
    /// beam_width best finished ones (Hugging Face's heuristic).
    Hopeless,
    /// `"never"`: every beam runs to its end or max_tokens.
    Never,
}

/// A request's beam search, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct BeamSearchParams {
    pub beam_width: u32,
    pub length_penalty: f64,
    pub early_stopping: EarlyStopping,
    pub ignore_eos: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::validate::tests::param_of;

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

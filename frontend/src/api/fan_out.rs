//! One fan-out for completions, chat and embeddings: a valid request's prompts × n choices
//! admitted (one waiting-queue permit each while it waits, or an immediate 429), sent to the engine
//! as one engine request each, and read back as choice streams, interleaved or collected whole.

use std::collections::BTreeMap;

use futures::stream::{self, BoxStream, StreamExt};
use tokio::sync::OwnedSemaphorePermit;

use crate::api::admission;
use crate::api::error::ApiError;
use crate::api::valid_request::ValidRequest;
use crate::engine::client::EngineClient;
use crate::engine::protocol::AddRequest;
use crate::metrics::RequestMetrics;
use crate::state::{unix_time, AppState, Arrival};
use crate::text::choice_stream::{
    ChoiceError, ChoiceSpec, ChoiceStream, ChoiceUpdate, TokenLogprob,
};
use crate::text::prompt_logprobs::PromptToken;
use sluice_common::schema::openai::Usage;

/// What every chunk and response of one request repeats: its id, creation time and model.
#[derive(Debug, Clone)]
pub struct ResponseHeader {
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// A whole choice, for non-streamed responses.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChoiceResult {
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish_reason: &'static str,
    pub completion_tokens: u32,
    /// Of those, the thinking's (with a reasoning parser).
    pub reasoning_tokens: Option<u32>,
    pub cumulative_logprob: f64,
    /// Characters of the echo prefix that `text` starts with.
    pub prefix_chars: u32,
    pub prompt_logprobs: Option<Vec<PromptToken>>,
    pub token_ids: Vec<u32>,
    pub num_cached_tokens: u32,
    /// The stop string that ended the choice, if one did.
    pub stop_string: Option<String>,
    /// A pooling request's embedding: the engine's little-endian float32 bytes.
    pub embedding: Option<Vec<u8>>,
}

/// The prompt tokens the prefix cache served, from each choice's count (by choice index; prompt p
/// has choices p * n .. p * n + n): per prompt, the least of its choices' counts. A prompt's
/// later choices find the blocks its first one computed; the least is what earlier requests left.
pub fn cached_prompt_tokens(by_choice: impl IntoIterator<Item = (u32, u32)>, n: u32) -> u32 {
    let mut by_prompt: BTreeMap<u32, u32> = BTreeMap::new();
    for (index, cached) in by_choice {
        by_prompt
            .entry(index / n)
            .and_modify(|least| *least = (*least).min(cached))
            .or_insert(cached);
    }
    by_prompt.values().sum()
}

/// The usage of a whole answer: every choice's tokens (and thinking tokens, with a reasoning
/// parser), and the prompts' cached tokens.
pub fn whole_usage(results: &[ChoiceResult], prompt_tokens: u32, n: u32) -> Usage {
    let completion_tokens = results.iter().map(|r| r.completion_tokens).sum();
    let reasoning_tokens = results.iter().map(|r| r.reasoning_tokens).sum();
    let cached = cached_prompt_tokens((0..).zip(results.iter().map(|r| r.num_cached_tokens)), n);
    Usage::new(prompt_tokens, completion_tokens)
        .with_cached_tokens(cached)
        .with_reasoning_tokens(reasoning_tokens)
}

/// A request's choices, started on the engine.
pub struct Choices {
    pub header: ResponseHeader,
    pub streams: Vec<ChoiceStream>,
    engine: EngineClient,
    /// The request field its structured output constraint came from, for the engine's rejections.
    structured_output_field: Option<&'static str>,
}

/// Admits the request's choices and sends one engine request per choice, with ids
/// `<response id>-<index>`; choice `p * best_of + i` is prompt p's i-th, seeded `seed + i`
/// (best_of is n unless the request asked for more candidates).
pub fn start(
    state: &AppState,
    id_kind: &str,
    request: &ValidRequest,
    arrival: Arrival,
) -> Result<Choices, ApiError> {
    let engine = state.engine()?;
    let n = request.best_of;
    let count = u32::try_from(request.prompts.len())
        .ok()
        .and_then(|prompts| prompts.checked_mul(n))
        .ok_or(ApiError::QueueFull)?;
    let mut permits = permits(state, count)?.into_iter();
    let id = state.request_id(id_kind);
    let mut streams = Vec::with_capacity(count as usize);
    for (prompt_index, prompt) in request.prompts.iter().enumerate() {
        // The prompt's n choices count it once.
        let prompt_share = state
            .metrics
            .prompt(prompt.token_ids.len() as u64, n as usize);
        for i in 0..n {
            let index = prompt_index as u32 * n + i;
            let mut params = prompt.params.clone();
            params.seed = params.seed.map(|seed| seed.wrapping_add(i64::from(i)));
            let outputs = engine.add_request(AddRequest {
                request_id: format!("{id}-{index}"),
                prompt_token_ids: prompt.token_ids.clone(),
                params,
                arrival_time: arrival.unix_seconds,
                priority: request.priority,
                cache_salt: request.cache_salt.clone(),
                pooling: request.pooling,
                second_text_start: prompt.second_text_start,
            })?;
            let spec = ChoiceSpec {
                index,
                stop: request.stop.clone(),
                prefix: prompt.echo.clone(),
                wants_logprobs: request.logprobs,
                include_stop_str_in_output: request.include_stop_str_in_output,
                skip_special_tokens: request.skip_special_tokens,
                prompt_token_ids: request
                    .shows_prompt_logprobs()
                    .then(|| prompt.token_ids.clone()),
                starts_thinking: request.reasoning_starts_thinking,
            };
            let metrics = RequestMetrics::new(
                state.metrics.clone(),
                prompt_share.clone(),
                arrival.instant,
                arrival.unix_seconds,
            );
            let permit = permits.next().expect("one permit per choice");
            streams.push(ChoiceStream::new(
                spec,
                outputs,
                state.pool.clone(),
                metrics,
                permit,
            ));
        }
    }
    Ok(Choices {
        header: ResponseHeader {
            id,
            created: unix_time(),
            model: request.model.clone(),
        },
        streams,
        engine: engine.clone(),
        structured_output_field: request.structured_output_field,
    })
}

/// `count` waiting-queue permits, one per choice (see `admission`).
fn permits(state: &AppState, count: u32) -> Result<Vec<OwnedSemaphorePermit>, ApiError> {
    let mut all = admission::admit(state, count as usize)?;
    let mut permits: Vec<OwnedSemaphorePermit> = (1..count)
        .map(|_| all.split(1).expect("one permit per choice"))
        .collect();
    permits.push(all);
    Ok(permits)
}

impl Choices {
    /// The updates of every choice, interleaved as they arrive. Dropping the stream drops the
    /// choices, which aborts their engine requests.
    pub fn merged(self) -> BoxStream<'static, Result<ChoiceUpdate, ApiError>> {
        let engine = self.engine;
        let structured_output_field = self.structured_output_field;
        stream::select_all(self.streams.into_iter().map(|choice| {
            stream::unfold(choice, |mut choice| async move {
                let update = choice.next().await?;
                Some((update, choice))
            })
            .boxed()
        }))
        .map(move |update| {
            update.map_err(|error| api_error(&engine, structured_output_field, error))
        })
        .boxed()
    }

    /// The merged updates of a streamed response. The engine compiles a structured output
    /// constraint and rejects one it cannot compile as the request's first answer; a constrained
    /// stream waits for that first answer before its 200 status line goes out, so that the
    /// rejection is the 400 it is for a whole response, not an error event in a 200 stream.
    pub async fn stream_updates(
        self,
    ) -> Result<BoxStream<'static, Result<ChoiceUpdate, ApiError>>, ApiError> {
        let constrained = self.structured_output_field.is_some();
        let mut updates = self.merged();
        if !constrained {
            return Ok(updates);
        }
        match updates.next().await {
            Some(Err(error)) if error.status().is_client_error() => Err(error),
            first => Ok(stream::iter(first).chain(updates).boxed()),
        }
    }

    /// Runs every choice to its end; the first error fails the whole response (the other engine
    /// requests are aborted as their streams drop).
    pub async fn collect(self) -> Result<Vec<ChoiceResult>, ApiError> {
        let mut results = vec![ChoiceResult::default(); self.streams.len()];
        let mut updates = self.merged();
        while let Some(update) = updates.next().await {
            let update = update?;
            let result = &mut results[update.index as usize];
            result.text.push_str(&update.text);
            result.logprobs.extend(update.logprobs);
            result.completion_tokens = update.completion_tokens;
            result.reasoning_tokens = update.reasoning_tokens;
            result.cumulative_logprob = update.cumulative_logprob;
            result.prefix_chars += update.prefix_chars;
            result.token_ids.extend(update.token_ids);
            result.num_cached_tokens = update.num_cached_tokens;
            if update.prompt_logprobs.is_some() {
                result.prompt_logprobs = update.prompt_logprobs;
            }
            if let Some(reason) = update.finish_reason {
                result.finish_reason = reason;
                result.stop_string = update.stop_string;
                result.embedding = update.embedding;
            }
        }
        Ok(results)
    }
}

/// Request fields that the engine core checks against the model (its EOS ids, its vocabulary) and
/// may name in a refusal; the 400 then names the field too.
const ENGINE_CHECKED_FIELDS: &[&str] = &[
    "allowed_token_ids",
    "bad_words",
    "logit_bias",
    "stop_token_ids",
    "prompt",
];

/// A failed choice's error: the engine's own failure is a 500 while the engine is healthy, a 503
/// once it is not (the failure was the engine going away).
pub(crate) fn api_error(
    engine: &EngineClient,
    structured_output_field: Option<&'static str>,
    error: ChoiceError,
) -> ApiError {
    match error {
        ChoiceError::Invalid { param, message } => match structured_output_field {
            Some(field) if param == "structured_output" => ApiError::InvalidParameter {
                param: field,
                message,
            },
            _ => match ENGINE_CHECKED_FIELDS.iter().find(|&&field| field == param) {
                Some(field) => ApiError::InvalidParameter {
                    param: field,
                    message,
                },
                None => ApiError::InvalidRequest(format!("{param}: {message}")),
            },
        },
        ChoiceError::Engine(reason) if engine.is_healthy() => {
            ApiError::Internal(format!("the engine failed the request: {reason}"))
        }
        ChoiceError::Engine(reason) => ApiError::EngineUnavailable(reason),
        ChoiceError::Text(reason) => ApiError::Internal(reason),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_tokens_count_each_prompt_once_at_its_least_cached_choice() {
        // Two prompts of two choices: prompt 0's second choice found its first one's blocks.
        let by_choice = [(0, 32), (1, 112), (2, 0), (3, 16)];
        assert_eq!(cached_prompt_tokens(by_choice, 2), 32);
        assert_eq!(cached_prompt_tokens(by_choice, 1), 160);
        assert_eq!(cached_prompt_tokens([], 3), 0);
    }
}

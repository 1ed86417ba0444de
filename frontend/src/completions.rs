//! `POST /v1/completions`: prompts (text or token ids) × n choices, streamed or not.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::future::try_join_all;

use crate::admission;
use crate::api_error::ApiError;
use crate::generation::{
    self, chunk_event, sse_events, unix_seconds, ChoiceResult, ChoiceSpec, ChoiceUpdate,
    ResponseHeader, TokenLogprob,
};
use crate::openai::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Prompt,
    StopSequences, Usage,
};
use crate::server::AppState;
use crate::sse::event_stream_response;
use crate::validation;

pub async fn create(
    State(state): State<Arc<AppState>>,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let arrival_time = unix_seconds();
    let Json(request) = body?;
    complete(&state, request, arrival, arrival_time).await
}

/// A prompt as token ids, with its text when the client sent text.
struct PromptInput {
    ids: Vec<u32>,
    text: Option<String>,
}

async fn prompt_inputs(state: &AppState, prompt: Prompt) -> Result<Vec<PromptInput>, ApiError> {
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
        let ids = state.pool.encode(text.clone(), true).await?;
        Ok::<_, ApiError>(PromptInput {
            ids,
            text: Some(text),
        })
    }))
    .await
}

/// Validates, fans the prompts out into choices, and answers streamed or whole.
async fn complete(
    state: &AppState,
    request: CompletionRequest,
    arrival: Instant,
    arrival_time: f64,
) -> Result<Response, ApiError> {
    state.check_model(&request.model)?;
    let sampling = &request.sampling;
    let echo = request.echo.unwrap_or(false);
    validation::check_echo(echo, request.logprobs)?;
    if let Some(logprobs) = request.logprobs {
        validation::check_logprobs("logprobs", logprobs)?;
    }
    let params = validation::sampling_params(
        sampling,
        sampling.max_tokens,
        request.logprobs,
        state.vocab_size,
    )?;
    let max_model_len = state.max_model_len()?;
    let n = sampling.n.unwrap_or(1);
    let stop = sampling
        .stop
        .clone()
        .map(StopSequences::into_vec)
        .unwrap_or_default();

    admission::check_fits(state, admission::prompt_count(&request.prompt) * n as usize)?;
    let prompts = prompt_inputs(state, request.prompt.clone()).await?;
    if prompts.is_empty() {
        validation::check_prompt_not_empty(&[])?;
    }
    let mut choices = Vec::with_capacity(prompts.len() * n as usize);
    let mut prompt_tokens = 0;
    for (prompt_index, prompt) in prompts.into_iter().enumerate() {
        validation::check_prompt_not_empty(&prompt.ids)?;
        validation::check_token_ids("prompt", &prompt.ids, state.vocab_size)?;
        let max_tokens = validation::effective_max_tokens(
            prompt.ids.len(),
            sampling.max_tokens,
            Some(validation::DEFAULT_COMPLETION_MAX_TOKENS),
            max_model_len,
        )?;
        prompt_tokens += prompt.ids.len() as u32;
        let prefix = match (echo, prompt.text) {
            (false, _) => None,
            (true, Some(text)) => Some(text),
            (true, None) => Some(state.pool.decode(prompt.ids.clone(), true).await?),
        };
        for i in 0..n {
            let mut params = params.clone();
            params.max_tokens = max_tokens;
            params.min_tokens = params.min_tokens.min(max_tokens);
            params.seed = params.seed.map(|seed| seed.wrapping_add(i64::from(i)));
            choices.push(ChoiceSpec {
                index: prompt_index as u32 * n + i,
                prompt_ids: prompt.ids.clone(),
                params,
                stop: stop.clone(),
                prefix: prefix.clone(),
            });
        }
    }

    let id = state.request_id("cmpl");
    let streams = generation::start(state, &id, choices, arrival, arrival_time)?;
    let header = ResponseHeader::new(id, request.model);
    if sampling.stream.unwrap_or(false) {
        let include_usage = sampling
            .stream_options
            .as_ref()
            .is_some_and(|options| options.include_usage);
        Ok(stream(header, streams, prompt_tokens, include_usage))
    } else {
        let results = generation::collect(streams, 0).await?;
        Ok(Json(whole(
            header,
            results,
            prompt_tokens,
            request.logprobs.is_some(),
        ))
        .into_response())
    }
}

impl ResponseHeader {
    fn response(&self, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> CompletionResponse {
        CompletionResponse {
            id: self.id.clone(),
            object: "text_completion".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }
}

fn whole(
    header: ResponseHeader,
    results: Vec<ChoiceResult>,
    prompt_tokens: u32,
    logprobs: bool,
) -> CompletionResponse {
    let completion_tokens = results.iter().map(|r| r.completion_tokens).sum();
    let choices = results
        .into_iter()
        .enumerate()
        .map(|(index, result)| CompletionChoice {
            index: index as u32,
            logprobs: logprobs.then(|| completion_logprobs(&result.logprobs, 0)),
            text: result.text,
            finish_reason: Some(result.finish_reason.to_owned()),
        })
        .collect();
    header.response(choices, Some(Usage::new(prompt_tokens, completion_tokens)))
}

fn stream(
    header: ResponseHeader,
    streams: Vec<generation::ChoiceStream>,
    prompt_tokens: u32,
    include_usage: bool,
) -> Response {
    let header = Arc::new(header);
    let frame_header = header.clone();
    // Each choice's text offset so far, for its logprobs' text_offset.
    let mut offsets: BTreeMap<u32, u32> = BTreeMap::new();
    let frame = move |update: ChoiceUpdate| {
        let offset = offsets.entry(update.index).or_default();
        let logprobs =
            (!update.logprobs.is_empty()).then(|| completion_logprobs(&update.logprobs, *offset));
        *offset += update.text.chars().count() as u32;
        chunk_event(&frame_header.response(
            vec![CompletionChoice {
                index: update.index,
                text: update.text,
                logprobs,
                finish_reason: update.finish_reason.map(str::to_owned),
            }],
            None,
        ))
    };
    let closing = move |completion_tokens| {
        include_usage.then(|| {
            chunk_event(&header.response(
                Vec::new(),
                Some(Usage::new(prompt_tokens, completion_tokens)),
            ))
        })
    };
    event_stream_response(sse_events(
        Vec::new(),
        generation::merged(streams),
        frame,
        closing,
    ))
}

/// Completions' logprobs: the sampled tokens, their logprobs, the top alternatives (with the
/// sampled token among them, as vLLM does) and each token's character offset in the text.
fn completion_logprobs(entries: &[TokenLogprob], start_offset: u32) -> CompletionLogprobs {
    let mut logprobs = CompletionLogprobs::default();
    let mut offset = start_offset;
    for entry in entries {
        let mut top: BTreeMap<String, f64> = entry.top.iter().cloned().collect();
        top.entry(entry.token.clone()).or_insert(entry.logprob);
        logprobs.tokens.push(entry.token.clone());
        logprobs.token_logprobs.push(Some(entry.logprob));
        logprobs.top_logprobs.push(Some(top));
        logprobs.text_offset.push(offset);
        offset += entry.token.chars().count() as u32;
    }
    logprobs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_offsets_accumulate_and_top_includes_the_sampled_token() {
        let entries = vec![
            TokenLogprob {
                token: "Hi".into(),
                logprob: -0.5,
                top: vec![("Hello".into(), -0.1)],
            },
            TokenLogprob {
                token: " there".into(),
                logprob: -0.2,
                top: vec![(" there".into(), -0.2)],
            },
        ];
        let logprobs = completion_logprobs(&entries, 3);
        assert_eq!(logprobs.tokens, ["Hi", " there"]);
        assert_eq!(logprobs.token_logprobs, [Some(-0.5), Some(-0.2)]);
        assert_eq!(logprobs.text_offset, [3, 5]);
        let first = logprobs.top_logprobs[0].as_ref().unwrap();
        assert_eq!(first.len(), 2);
        assert_eq!(first["Hi"], -0.5);
        assert_eq!(logprobs.top_logprobs[1].as_ref().unwrap().len(), 1);
    }
}

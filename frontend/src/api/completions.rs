//! `POST /v1/completions`: prompts (text or token ids) × n choices, streamed or not.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::http::HeaderMap;
use axum::response::Response;

use crate::api::error::ApiError;
use crate::api::fan_out::{ChoiceResult, Choices, ResponseHeader};
use crate::api::generation::GenerationEndpoint;
use crate::api::prepare;
use crate::api::prompt_logprobs::{echo_logprobs, joined, vllm_prompt_logprobs};
use crate::api::sse::{
    chunk_event, event_stream_response, sse_events, ChoiceTotals, OPENAI_STREAM,
};
use crate::api::token_label::TokenLabel;
use crate::api::valid_request::ValidRequest;
use crate::state::AppState;
use crate::text::choice_stream::{ChoiceUpdate, TokenLogprob};
use crate::text::prompt_logprobs::PromptToken;
use sluice_common::schema::openai::{
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage,
};

/// The endpoint for `generation::create`.
pub struct Completions;

impl GenerationEndpoint for Completions {
    type Request = CompletionRequest;
    type Answer = CompletionResponse;
    type Context = ();
    const ID_PREFIX: &'static str = "cmpl";

    async fn prepare(
        state: &AppState,
        request: CompletionRequest,
        _headers: &HeaderMap,
    ) -> Result<(ValidRequest, ()), ApiError> {
        prepare::completion(state, request)
            .await
            .map(|valid| (valid, ()))
    }

    fn whole(
        header: ResponseHeader,
        results: Vec<ChoiceResult>,
        usage: Usage,
        request: &ValidRequest,
        _context: (),
    ) -> CompletionResponse {
        let n = request.n as usize;
        let shown_ids = request.return_token_ids;
        let label = TokenLabel::new(request.return_tokens_as_token_ids);
        let choices = results
            .into_iter()
            .enumerate()
            .map(|(index, result)| CompletionChoice {
                index: index as u32,
                prompt_token_ids: shown_ids.then(|| request.prompts[index / n].token_ids.clone()),
                token_ids: shown_ids.then_some(result.token_ids),
                logprobs: request.logprobs.then(|| {
                    logprobs_with_echo(
                        result.prompt_logprobs.as_deref(),
                        &result.logprobs,
                        request.echo_logprobs,
                        result.prefix_chars,
                        label,
                    )
                }),
                prompt_logprobs: request.prompt_logprobs.and_then(|top_n| {
                    let tokens = result.prompt_logprobs.as_deref()?;
                    Some(vllm_prompt_logprobs(tokens, top_n))
                }),
                text: result.text,
                finish_reason: Some(result.finish_reason.to_owned()),
            })
            .collect();
        header.response(choices, Some(usage))
    }

    async fn stream(
        choices: Choices,
        prompt_tokens: u32,
        request: &ValidRequest,
        _context: (),
    ) -> Result<Response, ApiError> {
        let include_usage = request.include_usage;
        // vLLM's continuous usage: each chunk counts its own prompt and its choice's tokens so far.
        let prompt_lens: Vec<u32> = request
            .prompts
            .iter()
            .map(|prompt| prompt.token_ids.len() as u32)
            .collect();
        let (n, continuous) = (request.n, request.continuous_usage_stats);
        let echo_top_n = request.echo_logprobs;
        let label = TokenLabel::new(request.return_tokens_as_token_ids);
        let header = Arc::new(choices.header.clone());
        let frame_header = header.clone();
        // Each choice's text offset so far, for its logprobs' text_offset.
        let mut offsets: BTreeMap<u32, u32> = BTreeMap::new();
        // With return_token_ids, each prompt's ids, sent with its choices' first chunks.
        let prompt_ids: Option<Vec<Vec<u32>>> = request.return_token_ids.then(|| {
            request
                .prompts
                .iter()
                .map(|prompt| prompt.token_ids.clone())
                .collect()
        });
        let frame = move |update: ChoiceUpdate| {
            let first = !offsets.contains_key(&update.index);
            let offset = offsets.entry(update.index).or_default();
            let shown = !update.logprobs.is_empty() || update.prompt_logprobs.is_some();
            let logprobs = shown.then(|| {
                logprobs_with_echo(
                    update.prompt_logprobs.as_deref(),
                    &update.logprobs,
                    echo_top_n,
                    *offset + update.prefix_chars,
                    label,
                )
            });
            *offset += update.text.chars().count() as u32;
            let usage = continuous.then(|| {
                let prompt_len = prompt_lens[(update.index / n) as usize];
                Usage::new(prompt_len, update.completion_tokens)
            });
            chunk_event(&frame_header.response(
                vec![CompletionChoice {
                    index: update.index,
                    text: update.text,
                    logprobs,
                    finish_reason: update.finish_reason.map(str::to_owned),
                    prompt_logprobs: None,
                    prompt_token_ids: prompt_ids
                        .as_ref()
                        .filter(|_| first)
                        .map(|ids| ids[(update.index / n) as usize].clone()),
                    token_ids: prompt_ids.is_some().then_some(update.token_ids),
                }],
                usage,
            ))
        };
        let closing = move |totals: ChoiceTotals| {
            include_usage.then(|| {
                let usage = totals.usage(prompt_tokens, n);
                chunk_event(&header.response(Vec::new(), Some(usage)))
            })
        };
        let updates = choices.stream_updates().await?;
        Ok(event_stream_response(sse_events(
            OPENAI_STREAM,
            Vec::new(),
            updates,
            frame,
            closing,
        )))
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

/// The generated tokens' logprobs, from `start_offset` in the text, led by the prompt's when the
/// request echoes with logprobs (`echo_top_n`) and they are here.
fn logprobs_with_echo(
    prompt: Option<&[PromptToken]>,
    entries: &[TokenLogprob],
    echo_top_n: Option<u32>,
    start_offset: u32,
    label: TokenLabel,
) -> CompletionLogprobs {
    let generated = completion_logprobs(entries, start_offset, label);
    match (prompt, echo_top_n) {
        (Some(tokens), Some(top_n)) => joined(echo_logprobs(tokens, top_n, label), generated),
        _ => generated,
    }
}

/// Completions' logprobs: the sampled tokens, their logprobs, the top alternatives (with the
/// sampled token among them, as vLLM does) and each token's character offset in the text (counted
/// on its text however it is named).
fn completion_logprobs(
    entries: &[TokenLogprob],
    start_offset: u32,
    label: TokenLabel,
) -> CompletionLogprobs {
    let mut logprobs = CompletionLogprobs::default();
    let mut offset = start_offset;
    for entry in entries {
        let name = label.of(entry.token_id, &entry.token);
        let mut top: BTreeMap<String, f64> = entry
            .top
            .iter()
            .map(|(id, text, logprob)| (label.of(*id, text), *logprob))
            .collect();
        top.entry(name.clone()).or_insert(entry.logprob);
        logprobs.tokens.push(name);
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
                token_id: 1,
                token: "Hi".into(),
                logprob: -0.5,
                top: vec![(2, "Hello".into(), -0.1)],
            },
            TokenLogprob {
                token_id: 3,
                token: " there".into(),
                logprob: -0.2,
                top: vec![(3, " there".into(), -0.2)],
            },
        ];
        let logprobs = completion_logprobs(&entries, 3, TokenLabel::Text);
        assert_eq!(logprobs.tokens, ["Hi", " there"]);
        assert_eq!(logprobs.token_logprobs, [Some(-0.5), Some(-0.2)]);
        assert_eq!(logprobs.text_offset, [3, 5]);
        let first = logprobs.top_logprobs[0].as_ref().unwrap();
        assert_eq!(first.len(), 2);
        assert_eq!(first["Hi"], -0.5);
        assert_eq!(logprobs.top_logprobs[1].as_ref().unwrap().len(), 1);

        let by_id = completion_logprobs(&entries, 3, TokenLabel::Id);
        assert_eq!(by_id.tokens, ["token_id:1", "token_id:3"]);
        assert_eq!(by_id.text_offset, [3, 5]);
        let first = by_id.top_logprobs[0].as_ref().unwrap();
        assert_eq!((first["token_id:1"], first["token_id:2"]), (-0.5, -0.1));
    }
}

//! `POST /v1/chat/completions`: messages rendered with the model's chat template, n choices,
//! streamed as `chat.completion.chunk`s or answered whole; with `--reasoning-parser`, each
//! choice's thinking apart from its answer, and tool calls read from the answer.

use std::collections::HashMap;
use std::sync::Arc;

use axum::http::HeaderMap;
use axum::response::Response;
use bytes::BytesMut;

use crate::api::error::ApiError;
use crate::api::fan_out::{ChoiceResult, Choices, ResponseHeader};
use crate::api::generation::GenerationEndpoint;
use crate::api::prepare;
use crate::api::prompt_logprobs::vllm_prompt_logprobs;
use crate::api::sse::{
    chunk_event, event_stream_response, sse_events, ChoiceTotals, OPENAI_STREAM,
};
use crate::api::token_label::TokenLabel;
use crate::api::valid_request::ValidRequest;
use crate::state::AppState;
use crate::text::answer_parts::WholeAnswer;
use crate::text::choice_stream::{ChoiceUpdate, TokenLogprob};
use crate::text::reasoning::ReasoningStream;
use crate::text::tool_call_stream::ToolCallStream;
use sluice_common::schema::openai::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobToken, ChatLogprobs, TopLogprob, Usage,
};

/// The endpoint for `generation::create`.
pub struct Chat;

impl GenerationEndpoint for Chat {
    type Request = ChatCompletionRequest;
    type Answer = ChatCompletionResponse;
    type Context = ();
    const ID_PREFIX: &'static str = "chatcmpl";

    async fn prepare(
        state: &AppState,
        request: ChatCompletionRequest,
        _headers: &HeaderMap,
    ) -> Result<(ValidRequest, ()), ApiError> {
        prepare::chat(state, request).await.map(|valid| (valid, ()))
    }

    fn whole(
        header: ResponseHeader,
        results: Vec<ChoiceResult>,
        usage: Usage,
        request: &ValidRequest,
        _context: (),
    ) -> ChatCompletionResponse {
        // Every choice has the one prompt: the first one's logprobs stand for all.
        let prompt_logprobs = request.prompt_logprobs.and_then(|top_n| {
            let tokens = results.first()?.prompt_logprobs.as_deref()?;
            Some(vllm_prompt_logprobs(tokens, top_n))
        });
        let logprobs = request.logprobs;
        let label = TokenLabel::new(request.return_tokens_as_token_ids);
        let shown_ids = request.return_token_ids;
        let role = answer_role(request);
        let choices = results
            .into_iter()
            .enumerate()
            .map(|(index, result)| {
                let WholeAnswer {
                    thinking: reasoning_content,
                    text: content,
                    calls,
                } = request.answer_of(result.text);
                // An output that was all thinking has no answer.
                let content =
                    content.filter(|text| !text.is_empty() || reasoning_content.is_none());
                ChatChoice {
                    index: index as u32,
                    token_ids: shown_ids.then_some(result.token_ids),
                    logprobs: logprobs.then(|| chat_logprobs(&result.logprobs, label)),
                    finish_reason: Some(
                        finish_reason(result.finish_reason, !calls.is_empty()).to_owned(),
                    ),
                    message: AssistantMessage {
                        role: role.to_owned(),
                        content,
                        reasoning_content,
                        tool_calls: (!calls.is_empty()).then_some(calls),
                    },
                }
            })
            .collect();
        ChatCompletionResponse {
            id: header.id,
            object: "chat.completion".into(),
            created: header.created,
            model: header.model,
            choices,
            usage,
            prompt_logprobs,
            prompt_token_ids: shown_ids.then(|| request.prompts[0].token_ids.clone()),
        }
    }

    async fn stream(
        choices: Choices,
        prompt_tokens: u32,
        request: &ValidRequest,
        _context: (),
    ) -> Result<Response, ApiError> {
        let include_usage = request.include_usage;
        // vLLM's continuous usage: each chunk counts its choice's tokens so far.
        let continuous = request.continuous_usage_stats;
        let continuous_usage = move |completion_tokens| {
            continuous.then(|| Usage::new(prompt_tokens, completion_tokens))
        };
        let tool_calls = request.tool_calls.clone();
        let label = TokenLabel::new(request.return_tokens_as_token_ids);
        let header = choices.header.clone();
        let shown_ids = request.return_token_ids;
        let role = answer_role(request);
        // As OpenAI does, each choice opens with a delta that carries only the role (and, with
        // return_token_ids, the prompt's ids, as vLLM sends them).
        let opening = choices
            .streams
            .iter()
            .map(|choice| {
                let mut chunk = header.chunk(
                    vec![ChatChunkChoice {
                        index: choice.index(),
                        delta: ChatDelta {
                            role: Some(role.to_owned()),
                            content: Some(String::new()),
                            ..ChatDelta::default()
                        },
                        logprobs: None,
                        finish_reason: None,
                        token_ids: None,
                    }],
                    continuous_usage(0),
                );
                chunk.prompt_token_ids = shown_ids.then(|| request.prompts[0].token_ids.clone());
                chunk_event(&chunk)
            })
            .collect();
        let header = Arc::new(header);
        let frame_header = header.clone();
        // Each choice's output split into thinking and answer, with a reasoning parser, and its
        // answer read for calls as it grows, when the request has tools.
        let starts_thinking = request.reasoning_starts_thinking;
        let mut reasoners: HashMap<u32, ReasoningStream> = HashMap::new();
        let mut readers: HashMap<u32, ToolCallStream> = HashMap::new();
        let frame = move |update: ChoiceUpdate| {
            let logprobs =
                (!update.logprobs.is_empty()).then(|| chat_logprobs(&update.logprobs, label));
            let finished = update.finish_reason.is_some();
            let (reasoning, answer) = match starts_thinking {
                Some(starts_thinking) => {
                    let piece = reasoners
                        .entry(update.index)
                        .or_insert_with(|| ReasoningStream::new(starts_thinking))
                        .push(&update.text, finished);
                    (piece.reasoning, piece.content)
                }
                None => (String::new(), update.text),
            };
            let reasoning_content = (!reasoning.is_empty()).then_some(reasoning);
            let (text, calls, made_calls) = match &tool_calls {
                Some(reader) => {
                    let stream = readers
                        .entry(update.index)
                        .or_insert_with(|| ToolCallStream::new(reader.clone()));
                    let piece = stream.push(&answer, finished);
                    (piece.content, piece.calls, stream.made_calls())
                }
                None => (answer, Vec::new(), false),
            };
            // The update's token ids go with its first chunk.
            let mut token_ids = shown_ids.then_some(update.token_ids);
            let mut chunk = |delta: ChatDelta, logprobs, finish_reason: Option<&str>| {
                chunk_event(&frame_header.chunk(
                    vec![ChatChunkChoice {
                        index: update.index,
                        delta,
                        logprobs,
                        finish_reason: finish_reason.map(str::to_owned),
                        token_ids: token_ids.take(),
                    }],
                    continuous_usage(update.completion_tokens),
                ))
            };
            let finish = update
                .finish_reason
                .map(|reason| finish_reason(reason, made_calls));
            if calls.is_empty() {
                // An update that adds nothing visible still carries an empty content.
                let empty = reasoning_content.is_none() && !finished;
                let content = (!text.is_empty() || empty).then_some(text);
                let delta = ChatDelta {
                    content,
                    reasoning_content,
                    ..ChatDelta::default()
                };
                return chunk(delta, logprobs, finish);
            }
            // As OpenAI streams calls: a call's id and name in one delta, its arguments in the next.
            let mut events = BytesMut::new();
            let mut logprobs = logprobs;
            if !text.is_empty() || reasoning_content.is_some() {
                let delta = ChatDelta {
                    content: (!text.is_empty()).then_some(text),
                    reasoning_content,
                    ..ChatDelta::default()
                };
                events.extend_from_slice(&chunk(delta, logprobs.take(), None));
            }
            let last = calls.len() - 1;
            for (at, call) in calls.into_iter().enumerate() {
                let delta = ChatDelta {
                    tool_calls: Some(vec![call]),
                    ..ChatDelta::default()
                };
                let finish = if at == last { finish } else { None };
                events.extend_from_slice(&chunk(delta, logprobs.take(), finish));
            }
            events.freeze()
        };
        let n = request.n;
        let closing = move |totals: ChoiceTotals| {
            include_usage.then(|| {
                let usage = totals.usage(prompt_tokens, n);
                chunk_event(&header.chunk(Vec::new(), Some(usage)))
            })
        };
        let updates = choices.stream_updates().await?;
        Ok(event_stream_response(sse_events(
            OPENAI_STREAM,
            opening,
            updates,
            frame,
            closing,
        )))
    }
}

impl ResponseHeader {
    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<Usage>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            prompt_token_ids: None,
            id: self.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }
}

fn answer_role(request: &ValidRequest) -> &str {
    request
        .chat_role
        .as_deref()
        .expect("prepare::chat gives every chat request its answer's role")
}

/// The finish reason of a choice that made calls: an output that ended by itself ended in them.
fn finish_reason(engine_reason: &'static str, made_calls: bool) -> &'static str {
    match engine_reason {
        "stop" if made_calls => "tool_calls",
        reason => reason,
    }
}

/// Chat's logprobs; `bytes` are those of the token as named (vLLM's, with token ids too).
fn chat_logprobs(entries: &[TokenLogprob], label: TokenLabel) -> ChatLogprobs {
    ChatLogprobs {
        content: entries
            .iter()
            .map(|entry| {
                let token = label.of(entry.token_id, &entry.token);
                ChatLogprobToken {
                    bytes: token.as_bytes().to_vec(),
                    token,
                    logprob: entry.logprob,
                    top_logprobs: entry
                        .top
                        .iter()
                        .map(|(id, text, logprob)| {
                            let token = label.of(*id, text);
                            TopLogprob {
                                bytes: token.as_bytes().to_vec(),
                                token,
                                logprob: *logprob,
                            }
                        })
                        .collect(),
                }
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_logprobs_carry_bytes_and_alternatives() {
        let entries = [TokenLogprob {
            token_id: 7,
            token: "é".into(),
            logprob: -1.0,
            top: vec![(9, "e".into(), -0.5)],
        }];
        let logprobs = chat_logprobs(&entries, TokenLabel::Text);
        let token = &logprobs.content[0];
        assert_eq!(token.bytes, "é".as_bytes());
        assert_eq!(token.top_logprobs[0].token, "e");
        assert_eq!(token.top_logprobs[0].bytes, b"e");

        let by_id = &chat_logprobs(&entries, TokenLabel::Id).content[0];
        assert_eq!(
            (by_id.token.as_str(), by_id.bytes.as_slice()),
            ("token_id:7", &b"token_id:7"[..])
        );
        assert_eq!(by_id.logprob, -1.0);
        assert_eq!(by_id.top_logprobs[0].token, "token_id:9");
        assert_eq!(by_id.top_logprobs[0].bytes, b"token_id:9");
    }
}

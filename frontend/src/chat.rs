//! `POST /v1/chat/completions`: messages rendered with the model's chat template, n choices,
//! streamed as `chat.completion.chunk`s or answered whole.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::api_error::ApiError;
use crate::generation::{
    self, chunk_event, sse_events, unix_seconds, ChoiceResult, ChoiceSpec, ChoiceUpdate,
    ResponseHeader, TokenLogprob,
};
use crate::openai::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobToken, ChatLogprobs, ChatMessage, StopSequences,
    TopLogprob, Usage,
};
use crate::server::AppState;
use crate::sse::event_stream_response;
use crate::validation;

pub async fn create(
    State(state): State<Arc<AppState>>,
    body: Result<Json<ChatCompletionRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let arrival_time = unix_seconds();
    let Json(request) = body?;
    chat(&state, request, arrival, arrival_time).await
}

/// Renders `messages` with the model's chat template on the tokenizer pool.
pub async fn render(
    state: &AppState,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
) -> Result<String, ApiError> {
    let template = state.chat_template.clone().ok_or_else(|| {
        ApiError::InvalidRequest("this model has no chat template; use /v1/completions".into())
    })?;
    state
        .pool
        .run(move |_| template.render(&messages, add_generation_prompt))
        .await?
        .map_err(|error| {
            if error.is_request_error() {
                ApiError::InvalidParameter {
                    param: "messages",
                    message: error.to_string(),
                }
            } else {
                ApiError::Internal(error.to_string())
            }
        })
}

async fn chat(
    state: &AppState,
    request: ChatCompletionRequest,
    arrival: Instant,
    arrival_time: f64,
) -> Result<Response, ApiError> {
    state.check_model(&request.model)?;
    validation::check_messages(&request.messages)?;
    let sampling = &request.sampling;
    let max_tokens = request.max_completion_tokens.or(sampling.max_tokens);
    // max_completion_tokens wins, but a max_tokens beside it is still a value to check.
    if let Some(overridden) = sampling.max_tokens {
        validation::check_max_tokens(overridden)?;
    }
    // top_logprobs is checked even when logprobs is off and it goes unused.
    if let Some(top) = request.top_logprobs {
        validation::check_logprobs("top_logprobs", top)?;
    }
    let logprobs = match request.logprobs {
        Some(true) => Some(request.top_logprobs.unwrap_or(0)),
        _ => None,
    };
    let params = validation::sampling_params(sampling, max_tokens, logprobs, state.vocab_size)?;
    let max_model_len = state.max_model_len()?;

    let prompt = render(
        state,
        request.messages.clone(),
        request.add_generation_prompt.unwrap_or(true),
    )
    .await?;
    // The template already wrote the special tokens.
    let prompt_ids = state.pool.encode(prompt, false).await?;
    validation::check_prompt_not_empty(&prompt_ids)?;
    let max_tokens =
        validation::effective_max_tokens(prompt_ids.len(), max_tokens, None, max_model_len)?;
    let stop = sampling
        .stop
        .clone()
        .map(StopSequences::into_vec)
        .unwrap_or_default();
    let prompt_tokens = prompt_ids.len() as u32;
    let choices = (0..sampling.n.unwrap_or(1))
        .map(|i| {
            let mut params = params.clone();
            params.max_tokens = max_tokens;
            params.min_tokens = params.min_tokens.min(max_tokens);
            params.seed = params.seed.map(|seed| seed.wrapping_add(i64::from(i)));
            ChoiceSpec {
                index: i,
                prompt_ids: prompt_ids.clone(),
                params,
                stop: stop.clone(),
                prefix: None,
            }
        })
        .collect::<Vec<_>>();

    let id = state.request_id("chatcmpl");
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
        Ok(Json(whole(header, results, prompt_tokens, logprobs.is_some())).into_response())
    }
}

impl ResponseHeader {
    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<Usage>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk".into(),
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
) -> ChatCompletionResponse {
    let completion_tokens = results.iter().map(|r| r.completion_tokens).sum();
    let choices = results
        .into_iter()
        .enumerate()
        .map(|(index, result)| ChatChoice {
            index: index as u32,
            logprobs: logprobs.then(|| chat_logprobs(&result.logprobs)),
            message: AssistantMessage {
                role: "assistant".into(),
                content: result.text,
            },
            finish_reason: Some(result.finish_reason.to_owned()),
        })
        .collect();
    ChatCompletionResponse {
        id: header.id,
        object: "chat.completion".into(),
        created: header.created,
        model: header.model,
        choices,
        usage: Usage::new(prompt_tokens, completion_tokens),
    }
}

fn stream(
    header: ResponseHeader,
    streams: Vec<generation::ChoiceStream>,
    prompt_tokens: u32,
    include_usage: bool,
) -> Response {
    // As OpenAI does, each choice opens with a delta that carries only the role.
    let opening = streams
        .iter()
        .map(|choice| {
            chunk_event(&header.chunk(
                vec![ChatChunkChoice {
                    index: choice.index(),
                    delta: ChatDelta {
                        role: Some("assistant".into()),
                        content: Some(String::new()),
                    },
                    logprobs: None,
                    finish_reason: None,
                }],
                None,
            ))
        })
        .collect();
    let header = Arc::new(header);
    let frame_header = header.clone();
    let frame = move |update: ChoiceUpdate| {
        let logprobs = (!update.logprobs.is_empty()).then(|| chat_logprobs(&update.logprobs));
        let content =
            (!update.text.is_empty() || update.finish_reason.is_none()).then_some(update.text);
        chunk_event(&frame_header.chunk(
            vec![ChatChunkChoice {
                index: update.index,
                delta: ChatDelta {
                    role: None,
                    content,
                },
                logprobs,
                finish_reason: update.finish_reason.map(str::to_owned),
            }],
            None,
        ))
    };
    let closing = move |completion_tokens| {
        include_usage.then(|| {
            chunk_event(&header.chunk(
                Vec::new(),
                Some(Usage::new(prompt_tokens, completion_tokens)),
            ))
        })
    };
    event_stream_response(sse_events(
        opening,
        generation::merged(streams),
        frame,
        closing,
    ))
}

fn chat_logprobs(entries: &[TokenLogprob]) -> ChatLogprobs {
    ChatLogprobs {
        content: entries
            .iter()
            .map(|entry| ChatLogprobToken {
                token: entry.token.clone(),
                logprob: entry.logprob,
                bytes: entry.token.as_bytes().to_vec(),
                top_logprobs: entry
                    .top
                    .iter()
                    .map(|(token, logprob)| TopLogprob {
                        token: token.clone(),
                        logprob: *logprob,
                        bytes: token.as_bytes().to_vec(),
                    })
                    .collect(),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_logprobs_carry_bytes_and_alternatives() {
        let logprobs = chat_logprobs(&[TokenLogprob {
            token: "é".into(),
            logprob: -1.0,
            top: vec![("e".into(), -0.5)],
        }]);
        let token = &logprobs.content[0];
        assert_eq!(token.bytes, "é".as_bytes());
        assert_eq!(token.top_logprobs[0].token, "e");
        assert_eq!(token.top_logprobs[0].bytes, b"e");
    }
}

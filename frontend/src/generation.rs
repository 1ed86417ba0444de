//! One response's engine requests, turned into text: admission (the waiting-queue semaphore),
//! fan-out of choices into engine requests, incremental detokenization on the tokenizer pool,
//! stop strings, logprob token texts, and the request metrics.
//!
//! Completions and chat share this; they differ only in how updates are framed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::stream::{self, BoxStream, Stream, StreamExt};
use tokio::sync::OwnedSemaphorePermit;

use crate::admission;
use crate::api_error::ApiError;
use crate::detokenizer::IncrementalDetokenizer;
use crate::engine_client::{EngineClient, EngineError, OutputStream};
use crate::metrics::Metrics;
use crate::protocol::{AddRequest, FinishReason, RequestOutput, SamplingParams, TokenLogprobs};
use crate::server::AppState;
use crate::sse::{data_event, done_event, error_event};
use crate::stop_strings::{StopMatcher, StopStep};
use crate::tokenizer_pool::{TokenizerPool, TokenizerPoolError};

/// One choice to generate: its index in the response and its engine request's contents.
#[derive(Debug, Clone)]
pub struct ChoiceSpec {
    pub index: u32,
    pub prompt_ids: Vec<u32>,
    pub params: SamplingParams,
    pub stop: Vec<String>,
    /// Text sent before the generated text (completions' `echo`).
    pub prefix: Option<String>,
}

/// A generated token's logprob with its alternatives, as text.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f64,
    /// The top N alternatives, most likely first.
    pub top: Vec<(String, f64)>,
}

/// New text (and logprobs) of one choice; the last update of a choice carries its finish reason.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoiceUpdate {
    pub index: u32,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish_reason: Option<&'static str>,
    /// Tokens the engine generated for this choice so far.
    pub completion_tokens: u32,
}

/// A whole choice, for non-streamed responses.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChoiceResult {
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish_reason: &'static str,
    pub completion_tokens: u32,
}

/// What every chunk and response of one request repeats: its id, creation time and model.
pub struct ResponseHeader {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl ResponseHeader {
    pub fn new(id: String, model: String) -> Self {
        ResponseHeader {
            id,
            created: crate::server::unix_time(),
            model,
        }
    }
}

pub fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Admits the choices (one waiting-queue permit each, or an immediate 429) and sends one engine
/// request per choice, with ids `<request_id>-<index>`.
pub fn start(
    state: &AppState,
    request_id: &str,
    choices: Vec<ChoiceSpec>,
    arrival: Instant,
    arrival_time: f64,
) -> Result<Vec<ChoiceStream>, ApiError> {
    let engine = state.engine()?;
    let mut all = admission::admit(state, choices.len())?;
    let count = choices.len() as u32;
    let mut permits: Vec<OwnedSemaphorePermit> = (1..count)
        .map(|_| all.split(1).expect("one permit per choice"))
        .collect();
    permits.push(all);
    let mut streams = Vec::with_capacity(choices.len());
    for (choice, permit) in choices.into_iter().zip(permits) {
        let prompt_tokens = choice.prompt_ids.len() as u32;
        let outputs = engine
            .add_request(AddRequest {
                request_id: format!("{request_id}-{}", choice.index),
                prompt_token_ids: choice.prompt_ids,
                params: choice.params.clone(),
                arrival_time,
                priority: 0,
            })
            .map_err(engine_unavailable)?;
        streams.push(ChoiceStream {
            index: choice.index,
            outputs: Some(outputs),
            engine: engine.clone(),
            pool: state.pool.clone(),
            detokenizer: Some(IncrementalDetokenizer::new(
                state.pool.tokenizer().clone(),
                true,
            )),
            stop: StopMatcher::new(choice.stop),
            prefix: choice.prefix,
            wants_logprobs: choice.params.logprobs.is_some(),
            metrics: state.metrics.clone(),
            permit: Some(permit),
            arrival,
            last_token_at: None,
            prompt_tokens,
            completion_tokens: 0,
            finished: false,
        });
    }
    Ok(streams)
}

pub fn engine_unavailable(error: EngineError) -> ApiError {
    ApiError::EngineUnavailable(error.to_string())
}

impl From<TokenizerPoolError> for ApiError {
    fn from(error: TokenizerPoolError) -> Self {
        ApiError::Internal(error.to_string())
    }
}

/// The updates of every choice, interleaved as they arrive.
pub fn merged(choices: Vec<ChoiceStream>) -> BoxStream<'static, Result<ChoiceUpdate, ApiError>> {
    stream::select_all(choices.into_iter().map(|choice| {
        stream::unfold(choice, |mut choice| async move {
            let update = choice.next().await?;
            Some((update, choice))
        })
        .boxed()
    }))
    .boxed()
}

/// Runs every choice to its end; the first error fails the whole response (the other engine
/// requests are aborted as their streams drop).
pub async fn collect(
    choices: Vec<ChoiceStream>,
    first_index: u32,
) -> Result<Vec<ChoiceResult>, ApiError> {
    let mut results = vec![ChoiceResult::default(); choices.len()];
    let mut updates = merged(choices);
    while let Some(update) = updates.next().await {
        let update = update?;
        let result = &mut results[(update.index - first_index) as usize];
        result.text.push_str(&update.text);
        result.logprobs.extend(update.logprobs);
        result.completion_tokens = update.completion_tokens;
        if let Some(reason) = update.finish_reason {
            result.finish_reason = reason;
        }
    }
    Ok(results)
}

/// One choice's engine request, read as text updates. Dropping it aborts the engine request
/// (through its [`OutputStream`]) and frees its waiting-queue permit.
pub struct ChoiceStream {
    index: u32,
    outputs: Option<OutputStream>,
    engine: EngineClient,
    pool: TokenizerPool,
    detokenizer: Option<IncrementalDetokenizer>,
    stop: StopMatcher,
    prefix: Option<String>,
    wants_logprobs: bool,
    metrics: Arc<Metrics>,
    permit: Option<OwnedSemaphorePermit>,
    arrival: Instant,
    last_token_at: Option<Instant>,
    prompt_tokens: u32,
    completion_tokens: u32,
    finished: bool,
}

impl ChoiceStream {
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The next non-empty update; None after the last one.
    pub async fn next(&mut self) -> Option<Result<ChoiceUpdate, ApiError>> {
        loop {
            let outputs = self.outputs.as_mut()?;
            let Some(output) = outputs.recv().await else {
                return Some(Err(self.fail("the engine client stopped".into())));
            };
            match self.update(output).await {
                Ok(Some(update)) => return Some(Ok(update)),
                Ok(None) => continue,
                Err(error) => return Some(Err(error)),
            }
        }
    }

    async fn update(&mut self, output: RequestOutput) -> Result<Option<ChoiceUpdate>, ApiError> {
        // Its first output means the engine has scheduled it: it no longer waits.
        self.permit = None;
        self.observe_timing(output.new_token_ids.len());
        self.completion_tokens += output.new_token_ids.len() as u32;
        let logprobs = match (&output.new_logprobs, self.wants_logprobs) {
            (Some(entries), true) => self.logprob_texts(entries).await?,
            _ => Vec::new(),
        };
        let finish = match output.finish_reason {
            None => None,
            Some(FinishReason::Stop) => Some("stop"),
            Some(FinishReason::Length) => Some("length"),
            Some(FinishReason::Abort) => {
                return Err(self.fail("the engine aborted the request".into()))
            }
            Some(FinishReason::Error) => {
                let reason = output.error.unwrap_or_else(|| "unknown error".into());
                return Err(self.fail(reason));
            }
        };

        let delta = self
            .detokenize(output.new_token_ids, finish.is_some())
            .await?;
        let (mut text, finish_reason) = match self.stop.push(&delta) {
            StopStep::Stopped { text, .. } => (text, Some("stop")),
            StopStep::Continue { mut text } => {
                if finish.is_some() {
                    text.push_str(&self.stop.finish());
                }
                (text, finish)
            }
        };
        if let Some(reason) = finish_reason {
            self.finish(reason);
        }
        if text.is_empty() && logprobs.is_empty() && finish_reason.is_none() {
            return Ok(None);
        }
        if let Some(prefix) = self.prefix.take() {
            text.insert_str(0, &prefix);
        }
        Ok(Some(ChoiceUpdate {
            index: self.index,
            text,
            logprobs,
            finish_reason,
            completion_tokens: self.completion_tokens,
        }))
    }

    async fn detokenize(&mut self, ids: Vec<u32>, last: bool) -> Result<String, ApiError> {
        let detokenizer = self
            .detokenizer
            .take()
            .expect("the detokenizer is returned after every job");
        let (detokenizer, delta) = self
            .pool
            .run(move |_| {
                let mut detokenizer = detokenizer;
                let mut delta = detokenizer.push(&ids)?;
                if last {
                    delta.push_str(&detokenizer.finish()?);
                }
                Ok::<_, crate::detokenizer::DetokenizeError>((detokenizer, delta))
            })
            .await?
            .map_err(|error| ApiError::Internal(error.to_string()))?;
        self.detokenizer = Some(detokenizer);
        Ok(delta)
    }

    async fn logprob_texts(
        &self,
        entries: &[TokenLogprobs],
    ) -> Result<Vec<TokenLogprob>, ApiError> {
        let entries = entries.to_vec();
        Ok(self
            .pool
            .run(move |tokenizer| {
                let text = |id: u32| tokenizer.decode(&[id], false).unwrap_or_default();
                entries
                    .iter()
                    .filter(|entry| !entry.token_ids.is_empty())
                    .map(|entry| TokenLogprob {
                        token: text(entry.token_ids[0]),
                        logprob: entry.logprobs.first().copied().unwrap_or(f64::NAN),
                        top: entry
                            .token_ids
                            .iter()
                            .zip(&entry.logprobs)
                            .skip(1)
                            .map(|(&id, &logprob)| (text(id), logprob))
                            .collect(),
                    })
                    .collect()
            })
            .await?)
    }

    fn observe_timing(&mut self, new_tokens: usize) {
        if new_tokens == 0 {
            return;
        }
        let now = Instant::now();
        match self.last_token_at {
            None => {
                let since_arrival = (now - self.arrival).as_secs_f64();
                self.metrics.time_to_first_token.observe(since_arrival);
                self.metrics.request_queue_time.observe(since_arrival);
            }
            Some(last) => self
                .metrics
                .inter_token_latency
                .observe((now - last).as_secs_f64()),
        }
        self.last_token_at = Some(now);
    }

    /// Ends the choice: counts it, frees its permit, and drops its output stream, which aborts
    /// the engine request when the engine has not finished it (a stop string matched).
    fn finish(&mut self, reason: &'static str) {
        if self.finished {
            return;
        }
        self.finished = true;
        self.outputs = None;
        self.permit = None;
        self.metrics.record_finished(
            reason,
            u64::from(self.prompt_tokens),
            u64::from(self.completion_tokens),
        );
        self.metrics
            .e2e_request_latency
            .observe(self.arrival.elapsed().as_secs_f64());
    }

    fn fail(&mut self, reason: String) -> ApiError {
        self.finish("error");
        if self.engine.is_healthy() {
            ApiError::Internal(format!("the engine failed the request: {reason}"))
        } else {
            ApiError::EngineUnavailable(reason)
        }
    }
}

impl Drop for ChoiceStream {
    fn drop(&mut self) {
        // A stream dropped before its end is a client that went away.
        self.finish("abort");
    }
}

/// The SSE events of a streamed response: `opening` first, one event per update (framed by
/// `frame`), then on success `closing` (given the total completion tokens; the usage chunk) and
/// `[DONE]`, or on failure one error event. Dropping the stream (a client that went away) drops
/// the choices and so aborts their engine requests.
pub fn sse_events<F, C>(
    opening: Vec<Bytes>,
    updates: BoxStream<'static, Result<ChoiceUpdate, ApiError>>,
    frame: F,
    closing: C,
) -> impl Stream<Item = Bytes> + Send + 'static
where
    F: FnMut(ChoiceUpdate) -> Bytes + Send + 'static,
    C: FnOnce(u32) -> Option<Bytes> + Send + 'static,
{
    struct Events<F, C> {
        updates: BoxStream<'static, Result<ChoiceUpdate, ApiError>>,
        frame: F,
        closing: Option<C>,
        tokens: HashMap<u32, u32>,
    }
    let events = Events {
        updates,
        frame,
        closing: Some(closing),
        tokens: HashMap::new(),
    };
    let body = stream::unfold(events, |mut events| async move {
        let closing = events.closing.take()?;
        let batch = match events.updates.next().await {
            Some(Ok(update)) => {
                events.tokens.insert(update.index, update.completion_tokens);
                events.closing = Some(closing);
                vec![(events.frame)(update)]
            }
            Some(Err(error)) => vec![error_event(&error)],
            None => {
                let total = events.tokens.values().sum();
                closing(total).into_iter().chain([done_event()]).collect()
            }
        };
        Some((stream::iter(batch), events))
    })
    .flatten();
    stream::iter(opening).chain(body)
}

/// A data event for a chunk that always serializes.
pub fn chunk_event<T: serde::Serialize>(chunk: &T) -> Bytes {
    data_event(chunk).expect("response chunks always serialize")
}

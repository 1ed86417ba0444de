//! One choice's engine outputs turned into text updates: incremental detokenization on the
//! tokenizer pool, stop strings, logprob token texts, the echo prefix, the reasoning tokens (with
//! a reasoning parser), and the choice's timing and finish metrics.
//!
//! A choice holds one waiting-queue permit while it waits: it frees it at its first engine output
//! (it has been scheduled) or when it ends, by finishing, failing or being dropped; ending also
//! drops its engine outputs, which aborts an unfinished engine request.

use futures::{Stream, StreamExt};
use thiserror::Error;
use tokio::sync::OwnedSemaphorePermit;

use crate::engine::client::OutputStream;
use crate::engine::protocol::{EngineOutput, FinishReason, Logprobs};
use crate::metrics::RequestMetrics;
use crate::text::detokenizer::{DetokenizeError, IncrementalDetokenizer};
use crate::text::prompt_logprobs::{prompt_token_logprobs, PromptToken};
use crate::text::reasoning::ReasoningTokens;
use crate::text::stop_strings::{StopMatcher, StopStep};
use crate::text::tokenizer_pool::{TokenizerPool, TokenizerPoolError};

/// A generated token's logprob with its alternatives, as text.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub token: String,
    pub logprob: f64,
    /// The top N alternatives (id, text, logprob), most likely first.
    pub top: Vec<(u32, String, f64)>,
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
    /// Of those, the thinking's (with a reasoning parser; None without one).
    pub reasoning_tokens: Option<u32>,
    /// The sum of the generated tokens' logprobs so far (0 when the engine sent none).
    pub cumulative_logprob: f64,
    /// Characters of the echo prefix that `text` starts with (0 in all but the echo's update).
    pub prefix_chars: u32,
    /// The prompt's tokens with their logprobs, once, when the choice shows them.
    pub prompt_logprobs: Option<Vec<PromptToken>>,
    /// The tokens the engine generated in this update (a stop token too, whose text is left out).
    pub token_ids: Vec<u32>,
    /// Prompt tokens the engine found in the prefix cache for this choice.
    pub num_cached_tokens: u32,
    /// The stop string that ended the choice (Anthropic's `stop_sequence`), in its last update.
    pub stop_string: Option<String>,
    /// A pooling request's embedding (the engine's little-endian float32 bytes), in its one update.
    pub embedding: Option<Vec<u8>>,
}

/// Why a choice ended without a finish reason.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ChoiceError {
    /// The engine failed or aborted the request, or its outputs ended early.
    #[error("{0}")]
    Engine(String),
    /// The tokenizer pool or the detokenizer failed.
    #[error("{0}")]
    Text(String),
    /// The engine rejected the request as invalid before running it (a constraint that does not
    /// compile): the parameter at fault and why.
    #[error("{message}")]
    Invalid { param: String, message: String },
}

impl From<TokenizerPoolError> for ChoiceError {
    fn from(error: TokenizerPoolError) -> Self {
        ChoiceError::Text(error.to_string())
    }
}

impl From<DetokenizeError> for ChoiceError {
    fn from(error: DetokenizeError) -> Self {
        ChoiceError::Text(error.to_string())
    }
}

/// What a choice is, apart from its engine outputs.
#[derive(Debug, Clone)]
pub struct ChoiceSpec {
    /// The choice's index in the response.
    pub index: u32,
    pub stop: Vec<String>,
    /// Text sent before the generated text (completions' `echo`).
    pub prefix: Option<String>,
    pub wants_logprobs: bool,
    /// Keep the stop string, or the stop token's text, at the end of the text (vLLM's field).
    pub include_stop_str_in_output: bool,
    pub skip_special_tokens: bool,
    /// The prompt, when the choice shows its prompt logprobs.
    pub prompt_token_ids: Option<Vec<u32>>,
    /// With a reasoning parser: whether the output starts inside the thinking.
    pub starts_thinking: Option<bool>,
}

/// One choice's engine request, read as text updates. `O` is the engine's outputs for it.
pub struct ChoiceStream<O = OutputStream> {
    index: u32,
    outputs: Option<O>,
    pool: TokenizerPool,
    detokenizer: Option<IncrementalDetokenizer>,
    stop: StopMatcher,
    prefix: Option<String>,
    wants_logprobs: bool,
    include_stop_str_in_output: bool,
    prompt_token_ids: Option<Vec<u32>>,
    reasoning: Option<ReasoningTokens>,
    metrics: RequestMetrics,
    permit: Option<OwnedSemaphorePermit>,
    completion_tokens: u32,
    cumulative_logprob: f64,
    num_cached_tokens: u32,
    finished: bool,
}

impl<O: Stream<Item = EngineOutput> + Unpin> ChoiceStream<O> {
    pub fn new(
        spec: ChoiceSpec,
        outputs: O,
        pool: TokenizerPool,
        metrics: RequestMetrics,
        permit: OwnedSemaphorePermit,
    ) -> Self {
        ChoiceStream {
            index: spec.index,
            outputs: Some(outputs),
            detokenizer: Some(IncrementalDetokenizer::new(
                pool.tokenizer().clone(),
                spec.skip_special_tokens,
            )),
            pool,
            stop: StopMatcher::new(spec.stop),
            prefix: spec.prefix,
            wants_logprobs: spec.wants_logprobs,
            include_stop_str_in_output: spec.include_stop_str_in_output,
            prompt_token_ids: spec.prompt_token_ids,
            reasoning: spec.starts_thinking.map(ReasoningTokens::new),
            metrics,
            permit: Some(permit),
            completion_tokens: 0,
            num_cached_tokens: 0,
            cumulative_logprob: 0.0,
            finished: false,
        }
    }

    pub fn index(&self) -> u32 {
        self.index
    }

    /// The next non-empty update; None after the last one (or after an error).
    pub async fn next(&mut self) -> Option<Result<ChoiceUpdate, ChoiceError>> {
        loop {
            let outputs = self.outputs.as_mut()?;
            let Some(output) = outputs.next().await else {
                return Some(Err(self.fail("the engine client stopped".into())));
            };
            match self.update(output).await {
                Ok(Some(update)) => return Some(Ok(update)),
                Ok(None) => continue,
                Err(error) => {
                    self.finish(FinishReason::Error);
                    return Some(Err(error));
                }
            }
        }
    }

    async fn update(
        &mut self,
        mut output: EngineOutput,
    ) -> Result<Option<ChoiceUpdate>, ChoiceError> {
        // Its first output means the engine has scheduled it: it no longer waits.
        self.permit = None;
        self.metrics
            .on_output(output.new_token_ids.len(), output.first_scheduled_time);
        if output.embedding.is_some() {
            self.metrics.on_embedding();
        }
        self.completion_tokens += output.new_token_ids.len() as u32;
        self.num_cached_tokens = self.num_cached_tokens.max(output.num_cached_tokens);
        if let Some(entries) = &output.new_logprobs {
            self.cumulative_logprob += entries
                .iter()
                .filter_map(|entry| entry.logprobs.first())
                .sum::<f64>();
        }
        let logprobs = match (&output.new_logprobs, self.wants_logprobs) {
            (Some(entries), true) => self.logprob_texts(entries).await?,
            _ => Vec::new(),
        };
        let prompt_logprobs = match output.prompt_logprobs.take() {
            Some(entries) if self.prompt_token_ids.is_some() => {
                Some(self.prompt_logprob_texts(entries).await?)
            }
            _ => None,
        };
        let finish = match output.finish_reason {
            None => None,
            Some(reason @ (FinishReason::Stop | FinishReason::Length)) => Some(reason),
            Some(FinishReason::Abort) => {
                return Err(self.fail("the engine aborted the request".into()))
            }
            Some(FinishReason::Error) => {
                let reason = output.error.unwrap_or_else(|| "unknown error".into());
                if let Some(param) = output.invalid_param {
                    self.finish(FinishReason::Error);
                    return Err(ChoiceError::Invalid {
                        param,
                        message: reason,
                    });
                }
                return Err(self.fail(reason));
            }
        };

        let token_ids = output.new_token_ids.clone();
        let mut new_token_ids = output.new_token_ids;
        // A stop on a stop token (one of stop_token_ids, which the engine names in stop_reason, or a
        // special token such as EOS) ends with that token: as in vLLM, its text is not output unless
        // asked for. A stop because a structured output constraint is complete ends on content.
        if output.finish_reason == Some(FinishReason::Stop)
            && !self.include_stop_str_in_output
            && new_token_ids
                .last()
                .is_some_and(|&last| output.stop_reason.is_some() || self.is_special(last))
        {
            new_token_ids.pop();
        }
        let delta = self.detokenize(new_token_ids, finish.is_some()).await?;
        let mut stop_string = None;
        let (mut text, finish_reason) = match self.stop.push(&delta) {
            StopStep::Stopped {
                mut text,
                stop_index,
            } => {
                let matched = self.stop.stop_string(stop_index);
                if self.include_stop_str_in_output {
                    text.push_str(matched);
                }
                stop_string = Some(matched.to_owned());
                (text, Some(FinishReason::Stop))
            }
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
        let completion_tokens = self.completion_tokens;
        let reasoning_tokens = self
            .reasoning
            .as_mut()
            .map(|reasoning| reasoning.push(&text, completion_tokens, finish_reason.is_some()));
        if text.is_empty()
            && logprobs.is_empty()
            && prompt_logprobs.is_none()
            && finish_reason.is_none()
        {
            return Ok(None);
        }
        let mut prefix_chars = 0;
        if let Some(prefix) = self.prefix.take() {
            prefix_chars = prefix.chars().count() as u32;
            text.insert_str(0, &prefix);
        }
        Ok(Some(ChoiceUpdate {
            index: self.index,
            text,
            logprobs,
            finish_reason: finish_reason.map(FinishReason::as_str),
            completion_tokens,
            reasoning_tokens,
            cumulative_logprob: self.cumulative_logprob,
            prefix_chars,
            prompt_logprobs,
            token_ids,
            num_cached_tokens: self.num_cached_tokens,
            stop_string,
            embedding: output.embedding,
        }))
    }

    /// Whether `id` is one of the tokenizer's special tokens (EOS, end of turn, ...).
    fn is_special(&self, id: u32) -> bool {
        self.pool
            .tokenizer()
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|token| token.special)
    }

    async fn detokenize(&mut self, ids: Vec<u32>, last: bool) -> Result<String, ChoiceError> {
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
                Ok::<_, DetokenizeError>((detokenizer, delta))
            })
            .await??;
        self.detokenizer = Some(detokenizer);
        Ok(delta)
    }

    async fn logprob_texts(&self, entries: &[Logprobs]) -> Result<Vec<TokenLogprob>, ChoiceError> {
        let entries = entries.to_vec();
        Ok(self
            .pool
            .run(move |tokenizer| {
                let text = |id: u32| tokenizer.decode(&[id], false).unwrap_or_default();
                entries
                    .iter()
                    .filter(|entry| !entry.token_ids.is_empty())
                    .map(|entry| TokenLogprob {
                        token_id: entry.token_ids[0],
                        token: text(entry.token_ids[0]),
                        logprob: entry.own_logprob(),
                        top: entry.alternatives(text),
                    })
                    .collect()
            })
            .await?)
    }

    /// The prompt's tokens as text with the engine's entries; the choice's prompt is then dropped.
    async fn prompt_logprob_texts(
        &mut self,
        entries: Vec<Logprobs>,
    ) -> Result<Vec<PromptToken>, ChoiceError> {
        let prompt = self
            .prompt_token_ids
            .take()
            .expect("asked only for a choice that shows prompt logprobs");
        // The detokenizer that finds the offsets needs the shared tokenizer, not the worker's borrow.
        let tokenizer = self.pool.tokenizer().clone();
        Ok(self
            .pool
            .run(move |_| prompt_token_logprobs(&tokenizer, &prompt, &entries))
            .await??)
    }

    fn fail(&mut self, reason: String) -> ChoiceError {
        self.finish(FinishReason::Error);
        ChoiceError::Engine(reason)
    }
}

impl<O> ChoiceStream<O> {
    /// Ends the choice: counts it, frees its permit, and drops its engine outputs, which aborts
    /// the engine request when the engine has not finished it (a stop string matched).
    fn finish(&mut self, reason: FinishReason) {
        if self.finished {
            return;
        }
        self.finished = true;
        self.outputs = None;
        self.permit = None;
        self.metrics.on_finish(reason);
    }
}

impl<O> Drop for ChoiceStream<O> {
    fn drop(&mut self) {
        // A stream dropped before its end is a client that went away.
        self.finish(FinishReason::Abort);
    }
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::task::{Context, Poll};
    use std::time::Instant;

    use tokio::sync::Semaphore;

    use super::*;
    use crate::metrics::{Metrics, MetricsPrefix};
    use sluice_common::text::default_model::load_default_model_tokenizer;

    const TEXT: &str = "Hello world, this is a test of 日本語 👋🏽 text.";

    /// The engine's outputs for one request, from a script; records when the choice drops them
    /// (which is how an unfinished engine request is aborted).
    struct Scripted {
        outputs: std::vec::IntoIter<EngineOutput>,
        dropped: Arc<AtomicBool>,
    }

    impl Stream for Scripted {
        type Item = EngineOutput;

        fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<EngineOutput>> {
            Poll::Ready(self.outputs.next())
        }
    }

    impl Drop for Scripted {
        fn drop(&mut self) {
            self.dropped.store(true, Ordering::SeqCst);
        }
    }

    fn output(ids: &[u32], finish: Option<FinishReason>) -> EngineOutput {
        EngineOutput {
            request_id: "cmpl-1-0".into(),
            new_token_ids: ids.to_vec(),
            new_logprobs: None,
            finish_reason: finish,
            stop_reason: None,
            num_cached_tokens: 0,
            error: None,
            first_scheduled_time: None,
            invalid_param: None,
            prompt_logprobs: None,
            embedding: None,
        }
    }

    /// `ids` one token per output, the last finishing with `finish`.
    fn outputs_of(ids: &[u32], finish: FinishReason) -> Vec<EngineOutput> {
        let mut outputs: Vec<_> = ids.iter().map(|&id| output(&[id], None)).collect();
        outputs.push(output(&[], Some(finish)));
        outputs
    }

    struct Choice {
        stream: ChoiceStream<Scripted>,
        permits: Arc<Semaphore>,
        outputs_dropped: Arc<AtomicBool>,
        pool: TokenizerPool,
    }

    fn choice(
        outputs: Vec<EngineOutput>,
        stop: &[&str],
        prefix: Option<&str>,
        logprobs: bool,
    ) -> Choice {
        choice_of(
            outputs,
            ChoiceSpec {
                index: 3,
                stop: stop.iter().map(|s| s.to_string()).collect(),
                prefix: prefix.map(str::to_owned),
                wants_logprobs: logprobs,
                include_stop_str_in_output: false,
                skip_special_tokens: true,
                prompt_token_ids: None,
                starts_thinking: None,
            },
        )
    }

    fn choice_of(outputs: Vec<EngineOutput>, spec: ChoiceSpec) -> Choice {
        let pool = TokenizerPool::new(Arc::new(load_default_model_tokenizer()), 1, 16, 0);
        let permits = Arc::new(Semaphore::new(1));
        let permit = permits.clone().try_acquire_owned().unwrap();
        let outputs_dropped = Arc::new(AtomicBool::new(false));
        let scripted = Scripted {
            outputs: outputs.into_iter(),
            dropped: outputs_dropped.clone(),
        };
        let metrics = Arc::new(Metrics::new("smol", MetricsPrefix::Sluice));
        let metrics =
            RequestMetrics::new(metrics.clone(), metrics.prompt(5, 1), Instant::now(), 0.0);
        Choice {
            stream: ChoiceStream::new(spec, scripted, pool.clone(), metrics, permit),
            permits,
            outputs_dropped,
            pool,
        }
    }

    fn token_ids(text: &str) -> Vec<u32> {
        load_default_model_tokenizer()
            .encode(text, false)
            .unwrap()
            .get_ids()
            .to_vec()
    }

    /// Every update until the end, and the error that ended it, if any.
    async fn drain(
        stream: &mut ChoiceStream<Scripted>,
    ) -> (Vec<ChoiceUpdate>, Option<ChoiceError>) {
        let mut updates = Vec::new();
        while let Some(update) = stream.next().await {
            match update {
                Ok(update) => updates.push(update),
                Err(error) => {
                    assert!(stream.next().await.is_none(), "nothing after an error");
                    return (updates, Some(error));
                }
            }
        }
        (updates, None)
    }

    fn text_of(updates: &[ChoiceUpdate]) -> String {
        updates.iter().map(|update| update.text.as_str()).collect()
    }

    #[tokio::test]
    async fn tokens_become_the_text_and_the_last_update_finishes() {
        let ids = token_ids(TEXT);
        let mut choice = choice(outputs_of(&ids, FinishReason::Length), &[], None, false);
        let (updates, error) = drain(&mut choice.stream).await;
        assert_eq!(error, None);
        assert_eq!(text_of(&updates), TEXT);
        let last = updates.last().unwrap();
        assert_eq!(last.finish_reason, Some("length"));
        assert_eq!(last.stop_string, None);
        assert_eq!(last.completion_tokens, ids.len() as u32);
        assert!(updates.iter().all(|update| update.index == 3));
        assert!(updates[..updates.len() - 1]
            .iter()
            .all(|update| update.finish_reason.is_none()));
        assert_eq!(choice.permits.available_permits(), 1);
    }

    #[tokio::test]
    async fn the_thinking_tokens_are_counted_with_a_reasoning_parser_only() {
        let thinking = token_ids("<think>Hmm.</think>");
        let ids = [thinking.clone(), token_ids("\n\nParis.")].concat();
        for (starts_thinking, expected) in
            [(Some(false), Some(thinking.len() as u32)), (None, None)]
        {
            let spec = ChoiceSpec {
                starts_thinking,
                ..spec(&[], false, true)
            };
            let mut choice = choice_of(outputs_of(&ids, FinishReason::Stop), spec);
            let (updates, _) = drain(&mut choice.stream).await;
            let last = updates.last().unwrap();
            assert_eq!(last.reasoning_tokens, expected);
            assert_eq!(last.completion_tokens, ids.len() as u32);
        }
    }

    #[tokio::test]
    async fn a_stop_string_ends_the_choice_and_drops_the_engine_request() {
        let ids = token_ids(TEXT);
        let mut choice = choice(
            outputs_of(&ids, FinishReason::Length),
            &[", this"],
            None,
            false,
        );
        let (updates, error) = drain(&mut choice.stream).await;
        assert_eq!(error, None);
        assert_eq!(text_of(&updates), "Hello world");
        assert_eq!(updates.last().unwrap().finish_reason, Some("stop"));
        assert_eq!(
            updates.last().unwrap().stop_string.as_deref(),
            Some(", this")
        );
        assert!(updates.last().unwrap().completion_tokens < ids.len() as u32);
        assert!(choice.outputs_dropped.load(Ordering::SeqCst));
        assert_eq!(choice.permits.available_permits(), 1);
    }

    fn spec(
        stop: &[&str],
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
    ) -> ChoiceSpec {
        ChoiceSpec {
            index: 0,
            stop: stop.iter().map(|s| s.to_string()).collect(),
            prefix: None,
            wants_logprobs: false,
            include_stop_str_in_output,
            skip_special_tokens,
            prompt_token_ids: None,
            starts_thinking: None,
        }
    }

    /// `ids` one token per output, the engine stopping on the last (a stop token).
    fn stopped_on_last(ids: &[u32]) -> Vec<EngineOutput> {
        let mut outputs: Vec<_> = ids.iter().map(|&id| output(&[id], None)).collect();
        let last = outputs.last_mut().unwrap();
        last.finish_reason = Some(FinishReason::Stop);
        // As the engine does for one of stop_token_ids: it names the token.
        last.stop_reason = ids.last().copied();
        outputs
    }

    #[tokio::test]
    async fn a_stop_on_ordinary_content_keeps_its_last_token() {
        // A completed structured output constraint stops on content: no stop token to leave out.
        let ids = token_ids(TEXT);
        let mut outputs = stopped_on_last(&ids);
        outputs.last_mut().unwrap().stop_reason = None;
        let mut choice = choice_of(outputs, spec(&[], false, true));
        let (updates, error) = drain(&mut choice.stream).await;
        assert_eq!(error, None);
        assert_eq!(text_of(&updates), TEXT);
    }

    #[tokio::test]
    async fn include_stop_str_in_output_keeps_the_matched_stop_string() {
        let ids = token_ids(TEXT);
        for (include, expected) in [(false, "Hello world"), (true, "Hello world, this")] {
            let outputs = outputs_of(&ids, FinishReason::Length);
            let mut choice = choice_of(outputs, spec(&["nothing", ", this"], include, true));
            let (updates, error) = drain(&mut choice.stream).await;
            assert_eq!(error, None);
            assert_eq!(text_of(&updates), expected, "include={include}");
            assert_eq!(updates.last().unwrap().finish_reason, Some("stop"));
        }
    }

    #[tokio::test]
    async fn a_stop_token_has_no_text_unless_include_stop_str_in_output() {
        // " text." ends TEXT: its last token stands for one of stop_token_ids.
        let ids = token_ids(TEXT);
        let last = load_default_model_tokenizer()
            .decode(&ids[ids.len() - 1..], false)
            .unwrap();
        assert!(!last.is_empty());
        for (include, expected) in [
            (false, TEXT.strip_suffix(last.as_str()).unwrap()),
            (true, TEXT),
        ] {
            let mut choice = choice_of(stopped_on_last(&ids), spec(&[], include, true));
            let (updates, error) = drain(&mut choice.stream).await;
            assert_eq!(error, None);
            assert_eq!(text_of(&updates), expected, "include={include}");
            let last_update = updates.last().unwrap();
            assert_eq!(last_update.finish_reason, Some("stop"));
            // The stop token counts as generated either way, as in vLLM's usage.
            assert_eq!(last_update.completion_tokens, ids.len() as u32);
        }
    }

    #[tokio::test]
    async fn skip_special_tokens_false_keeps_special_tokens_in_the_text() {
        let tokenizer = load_default_model_tokenizer();
        let im_end = tokenizer.token_to_id("<|im_end|>").unwrap();
        let mut ids = token_ids("Hi");
        ids.push(im_end);
        ids.extend(token_ids(" there"));
        for (skip, expected) in [(true, "Hi there"), (false, "Hi<|im_end|> there")] {
            let outputs = outputs_of(&ids, FinishReason::Length);
            let mut choice = choice_of(outputs, spec(&[], false, skip));
            let (updates, _) = drain(&mut choice.stream).await;
            assert_eq!(text_of(&updates), expected, "skip_special_tokens={skip}");
        }
    }

    #[tokio::test]
    async fn the_echo_prefix_comes_once_before_the_text() {
        let ids = token_ids(" world");
        let mut choice = choice(
            outputs_of(&ids, FinishReason::Stop),
            &[],
            Some("Hello"),
            false,
        );
        let (updates, _) = drain(&mut choice.stream).await;
        assert!(updates[0].text.starts_with("Hello"));
        assert_eq!(text_of(&updates), "Hello world");
        assert_eq!(updates.last().unwrap().finish_reason, Some("stop"));
    }

    #[tokio::test]
    async fn logprobs_are_sent_as_token_texts_only_when_asked_for() {
        let ids = token_ids("Hi there");
        let mut first = output(&ids[..1], None);
        first.new_logprobs = Some(vec![Logprobs {
            token_ids: vec![ids[0], ids[1]],
            logprobs: vec![-0.5, -1.25],
            sampled_rank: 1,
        }]);
        let script = vec![first, output(&[], Some(FinishReason::Length))];

        let mut asked = choice(script.clone(), &[], None, true);
        let (updates, _) = drain(&mut asked.stream).await;
        let decode = |id| asked.pool.tokenizer().decode(&[id], false).unwrap();
        assert_eq!(
            updates[0].logprobs,
            [TokenLogprob {
                token_id: ids[0],
                token: decode(ids[0]),
                logprob: -0.5,
                top: vec![(ids[1], decode(ids[1]), -1.25)],
            }]
        );

        let mut not_asked = choice(script, &[], None, false);
        let (updates, _) = drain(&mut not_asked.stream).await;
        assert!(updates.iter().all(|update| update.logprobs.is_empty()));
    }

    #[tokio::test]
    async fn prompt_logprobs_come_once_with_the_echo_and_logprobs_add_up() {
        let prompt = token_ids("Hello there");
        let ids = token_ids(TEXT);
        let mut first = output(&ids[..1], None);
        first.new_logprobs = Some(vec![Logprobs {
            token_ids: vec![ids[0]],
            logprobs: vec![-0.5],
            sampled_rank: 1,
        }]);
        first.prompt_logprobs = Some(vec![Logprobs {
            token_ids: vec![prompt[1], prompt[0]],
            logprobs: vec![-2.0, -1.0],
            sampled_rank: 3,
        }]);
        let mut second = output(&ids[1..2], Some(FinishReason::Length));
        second.new_logprobs = Some(vec![Logprobs {
            token_ids: vec![ids[1]],
            logprobs: vec![-0.25],
            sampled_rank: 2,
        }]);
        let mut choice = choice(vec![first, second], &[], Some("Hello there"), false);
        choice.stream.prompt_token_ids = Some(prompt.clone());
        let (updates, error) = drain(&mut choice.stream).await;
        assert_eq!(error, None);
        assert_eq!(updates[0].prefix_chars, "Hello there".len() as u32);
        let tokens = updates[0].prompt_logprobs.as_ref().unwrap();
        assert_eq!(tokens.len(), prompt.len());
        assert_eq!(tokens[0].logprob, None);
        let second_token = tokens[1].logprob.as_ref().unwrap();
        assert_eq!((second_token.logprob, second_token.rank), (-2.0, 3));
        assert_eq!(tokens[1].text_offset, "Hello".len() as u32);
        assert!(updates[1..]
            .iter()
            .all(|update| update.prompt_logprobs.is_none() && update.prefix_chars == 0));
        // Counted although the choice shows no logprobs: best_of ranks by it.
        assert!(updates.iter().all(|update| update.logprobs.is_empty()));
        assert_eq!(updates.last().unwrap().cumulative_logprob, -0.75);
    }

    #[tokio::test]
    async fn an_engine_error_fails_the_choice_and_frees_its_permit() {
        let mut failed = output(&[], Some(FinishReason::Error));
        failed.error = Some("the worker died".into());
        let mut choice = choice(
            vec![output(&token_ids("Hi"), None), failed],
            &[],
            None,
            false,
        );
        let (updates, error) = drain(&mut choice.stream).await;
        assert_eq!(text_of(&updates), "Hi");
        assert_eq!(error, Some(ChoiceError::Engine("the worker died".into())));
        assert_eq!(choice.permits.available_permits(), 1);
    }

    #[tokio::test]
    async fn outputs_that_end_without_a_finish_reason_are_an_engine_error() {
        let mut choice = choice(vec![output(&token_ids("Hi"), None)], &[], None, false);
        let (_, error) = drain(&mut choice.stream).await;
        assert!(matches!(error, Some(ChoiceError::Engine(_))), "{error:?}");
    }

    #[tokio::test]
    async fn a_waiting_choice_holds_its_permit_until_its_first_output() {
        let ids = token_ids(TEXT);
        let mut choice = choice(outputs_of(&ids, FinishReason::Length), &[], None, false);
        assert_eq!(choice.permits.available_permits(), 0);
        assert!(choice.stream.next().await.unwrap().is_ok());
        // Scheduled: it no longer waits, although it has not finished.
        assert_eq!(choice.permits.available_permits(), 1);
    }

    #[tokio::test]
    async fn dropping_a_waiting_choice_frees_its_permit_and_its_engine_request() {
        let ids = token_ids(TEXT);
        let choice = choice(outputs_of(&ids, FinishReason::Length), &[], None, false);
        assert_eq!(choice.permits.available_permits(), 0);
        drop(choice.stream);
        assert!(choice.outputs_dropped.load(Ordering::SeqCst));
        assert_eq!(choice.permits.available_permits(), 1);
    }
}

//! vLLM's beam search on `/v1/completions` (`use_beam_search`, with `n` the beam width), run as the
//! offline `LLM.beam_search` runs it (python/engine/beam_search.py), so that both find the same
//! beams: one step at a time, every live beam is its own engine request (its prompt plus its tokens
//! so far, one greedy token, the top 2 x beam_width logprobs, EOS ignored), the prefix cache serving
//! the blocks the beams share. Each beam's candidates extend it; those that end in an
//! end-of-sequence token are finished, the best beam_width others live on. Scores are a beam's
//! cumulative logprob over its output length to the power `length_penalty`.

use std::cmp::Ordering;

use futures::future::try_join_all;

use crate::api::admission;
use crate::api::error::ApiError;
use crate::api::fan_out::{self, ChoiceResult, ResponseHeader};
use crate::api::valid_request::{BeamSearchParams, EarlyStopping, ValidRequest};
use crate::api::validate::{out_of_range, MAX_LOGPROBS};
use crate::engine::client::{EngineClient, OutputStream};
use crate::engine::protocol::{AddRequest, FinishReason, Logprobs, SamplingParams};
use crate::state::{unix_time, AppState, Arrival};
use crate::text::choice_stream::ChoiceError;
use sluice_common::schema::openai::{CompletionRequest, EarlyStopping as EarlyStoppingField};

/// What a beam's top logprobs cover: 2 x beam_width, as in vLLM, so that beam_width live beams
/// remain even when every beam's best tokens end it.
const CANDIDATES_PER_BEAM: u32 = 2;

/// Why a field beside `use_beam_search` would change nothing, for its 400.
const SAMPLES_NOTHING: &str = "beam search ranks each beam's candidates by the model's own \
                               logprobs and samples nothing";
const ENDS_AT_EOS: &str = "a beam ends only at an end-of-sequence token or at max_tokens, as in \
                           the offline LLM.beam_search";
const NO_LOGPROBS: &str = "beam search does not return logprobs";

/// The request's beam search, or None without `use_beam_search`. Every field beam search cannot
/// honour is a 400 naming it when it asks for something, and so are `length_penalty` and
/// `early_stopping` without beam search (they would change nothing).
pub fn check(
    request: &CompletionRequest,
    structured_output_field: Option<&'static str>,
) -> Result<Option<BeamSearchParams>, ApiError> {
    let early_stopping = early_stopping(request.early_stopping.as_ref())?;
    let length_penalty = request.length_penalty.unwrap_or(1.0);
    if !request.use_beam_search.unwrap_or(false) {
        let idle = [
            ("length_penalty", length_penalty != 1.0),
            ("early_stopping", early_stopping != EarlyStopping::Hopeless),
        ];
        return match idle.into_iter().find(|(_, asks)| *asks) {
            Some((param, _)) => Err(out_of_range(
                param,
                format!("{param} applies to beam search only: set use_beam_search to true"),
            )),
            None => Ok(None),
        };
    }
    let sampling = &request.sampling;
    let beam_width = sampling.n.unwrap_or(1);
    let most = MAX_LOGPROBS / CANDIDATES_PER_BEAM;
    if !(1..=most).contains(&beam_width) {
        return Err(out_of_range(
            "n",
            format!(
                "with use_beam_search, n is the beam width and must be in [1, {most}], got \
                 {beam_width}"
            ),
        ));
    }
    let nonempty = |items: Option<usize>| items.is_some_and(|len| len > 0);
    let refused = [
        (
            "stream",
            sampling.stream.unwrap_or(false),
            "beam search answers with its final beams only",
        ),
        (
            "best_of",
            request.best_of.is_some_and(|best_of| best_of != beam_width),
            "with beam search n is the beam width, and every beam found is returned",
        ),
        ("logprobs", request.logprobs.is_some(), NO_LOGPROBS),
        (
            "prompt_logprobs",
            request.prompt_logprobs.is_some(),
            NO_LOGPROBS,
        ),
        (
            "temperature",
            sampling.temperature.is_some_and(|t| t != 0.0),
            SAMPLES_NOTHING,
        ),
        (
            "top_p",
            sampling.top_p.is_some_and(|p| p != 1.0),
            SAMPLES_NOTHING,
        ),
        (
            "top_k",
            sampling.top_k.is_some_and(|k| k != -1 && k != 0),
            SAMPLES_NOTHING,
        ),
        (
            "min_p",
            sampling.min_p.is_some_and(|p| p != 0.0),
            SAMPLES_NOTHING,
        ),
        (
            "presence_penalty",
            sampling.presence_penalty.is_some_and(|p| p != 0.0),
            SAMPLES_NOTHING,
        ),
        (
            "frequency_penalty",
            sampling.frequency_penalty.is_some_and(|p| p != 0.0),
            SAMPLES_NOTHING,
        ),
        (
            "repetition_penalty",
            sampling.repetition_penalty.is_some_and(|p| p != 1.0),
            SAMPLES_NOTHING,
        ),
        (
            "logit_bias",
            nonempty(sampling.logit_bias.as_ref().map(|bias| bias.len())),
            SAMPLES_NOTHING,
        ),
        ("seed", sampling.seed.is_some(), SAMPLES_NOTHING),
        (
            "allowed_token_ids",
            sampling.allowed_token_ids.is_some(),
            SAMPLES_NOTHING,
        ),
        (
            "bad_words",
            nonempty(sampling.bad_words.as_ref().map(Vec::len)),
            SAMPLES_NOTHING,
        ),
        (
            "stop",
            sampling
                .stop
                .clone()
                .is_some_and(|stop| !stop.into_vec().is_empty()),
            ENDS_AT_EOS,
        ),
        (
            "stop_token_ids",
            nonempty(sampling.stop_token_ids.as_ref().map(Vec::len)),
            ENDS_AT_EOS,
        ),
        (
            "min_tokens",
            sampling.min_tokens.is_some_and(|min| min > 0),
            ENDS_AT_EOS,
        ),
        (
            structured_output_field.unwrap_or("structured_outputs"),
            structured_output_field.is_some(),
            "beam search does not constrain its beams",
        ),
    ];
    if let Some((param, _, why)) = refused.into_iter().find(|(_, asks, _)| *asks) {
        return Err(out_of_range(
            param,
            format!("{param} does not apply with use_beam_search: {why}"),
        ));
    }
    Ok(Some(BeamSearchParams {
        beam_width,
        length_penalty,
        early_stopping,
        ignore_eos: sampling.ignore_eos.unwrap_or(false),
    }))
}

fn early_stopping(field: Option<&EarlyStoppingField>) -> Result<EarlyStopping, ApiError> {
    match field {
        None | Some(EarlyStoppingField::Flag(false)) => Ok(EarlyStopping::Hopeless),
        Some(EarlyStoppingField::Flag(true)) => Ok(EarlyStopping::Finished),
        Some(EarlyStoppingField::Word(word)) if word == "never" => Ok(EarlyStopping::Never),
        Some(EarlyStoppingField::Word(word)) => Err(out_of_range(
            "early_stopping",
            format!("early_stopping must be true, false or \"never\", got {word:?}"),
        )),
    }
}

/// One beam: its prompt's and output's tokens, and each output token's logprob.
#[derive(Debug, Clone, PartialEq)]
pub struct Beam {
    tokens: Vec<u32>,
    num_prompt_tokens: usize,
    logprobs: Vec<f64>,
    cum_logprob: f64,
    /// "stop" (an end-of-sequence token) or "length" once finished; None while it lives.
    finish_reason: Option<&'static str>,
}

impl Beam {
    fn output_token_ids(&self) -> &[u32] {
        &self.tokens[self.num_prompt_tokens..]
    }

    fn score(&self, length_penalty: f64) -> f64 {
        self.cum_logprob / (self.logprobs.len().max(1) as f64).powf(length_penalty)
    }

    fn extended(&self, token_id: u32, logprob: f64, finish_reason: Option<&'static str>) -> Beam {
        let mut tokens = Vec::with_capacity(self.tokens.len() + 1);
        tokens.extend_from_slice(&self.tokens);
        tokens.push(token_id);
        let mut logprobs = self.logprobs.clone();
        logprobs.push(logprob);
        Beam {
            tokens,
            num_prompt_tokens: self.num_prompt_tokens,
            logprobs,
            cum_logprob: self.cum_logprob + logprob,
            finish_reason,
        }
    }
}

/// Best first; equal scores keep their order (a stable sort, as Python's).
fn by_score(beams: &mut [Beam], length_penalty: f64) {
    beams.sort_by(|a, b| {
        b.score(length_penalty)
            .partial_cmp(&a.score(length_penalty))
            .unwrap_or(Ordering::Equal)
    });
}

/// The search for one prompt: its live beams and its finished ones.
#[derive(Debug, Clone)]
pub struct PromptBeams {
    params: BeamSearchParams,
    /// The prompt's budget: the request's max_tokens within the context left.
    max_tokens: u32,
    eos_token_ids: Vec<u32>,
    live: Vec<Beam>,
    finished: Vec<Beam>,
}

impl PromptBeams {
    pub fn new(
        params: BeamSearchParams,
        max_tokens: u32,
        eos_token_ids: Vec<u32>,
        prompt: Vec<u32>,
    ) -> Self {
        let first = Beam {
            num_prompt_tokens: prompt.len(),
            tokens: prompt,
            logprobs: Vec::new(),
            cum_logprob: 0.0,
            finish_reason: None,
        };
        PromptBeams {
            params,
            max_tokens,
            eos_token_ids,
            live: vec![first],
            finished: Vec::new(),
        }
    }

    pub fn done(&self) -> bool {
        self.live.is_empty()
    }

    /// Folds in one step: `candidates_per_beam[i]` is live beam i's top next tokens and their
    /// logprobs, in the engine's order.
    pub fn advance(&mut self, candidates_per_beam: &[Vec<(u32, f64)>]) {
        assert_eq!(
            candidates_per_beam.len(),
            self.live.len(),
            "one set of candidates per live beam"
        );
        let params = &self.params;
        let candidates = self
            .live
            .iter()
            .zip(candidates_per_beam)
            .flat_map(|(beam, top)| {
                top.iter().map(|&(token_id, logprob)| {
                    let ends = !params.ignore_eos && self.eos_token_ids.contains(&token_id);
                    beam.extended(token_id, logprob, ends.then_some("stop"))
                })
            });
        // Every candidate that ends its beam is finished; the best beam_width others live on
        // (vLLM's rule: a beam's 2 x beam_width candidates always leave enough of them).
        let (finished, mut going_on): (Vec<Beam>, Vec<Beam>) =
            candidates.partition(|beam| beam.finish_reason.is_some());
        self.finished.extend(finished);
        by_score(&mut going_on, params.length_penalty);
        going_on.truncate(params.beam_width as usize);
        self.live = going_on;
        if self
            .live
            .first()
            .is_some_and(|beam| beam.logprobs.len() >= self.max_tokens as usize)
        {
            for beam in &mut self.live {
                beam.finish_reason = Some("length");
            }
            self.finished.append(&mut self.live);
        }
        if !self.live.is_empty() && self.stops_early() {
            self.live.clear();
        }
    }

    fn stops_early(&self) -> bool {
        let params = &self.params;
        let width = params.beam_width as usize;
        if params.early_stopping == EarlyStopping::Never || self.finished.len() < width {
            return false;
        }
        if params.early_stopping == EarlyStopping::Finished {
            return true;
        }
        let mut scores: Vec<f64> = self
            .finished
            .iter()
            .map(|beam| beam.score(params.length_penalty))
            .collect();
        scores.sort_by(|a, b| a.partial_cmp(b).unwrap_or(Ordering::Equal));
        let worst_kept = scores[scores.len() - width];
        self.live[0].score(params.length_penalty) < worst_kept
    }

    /// The best beam_width finished beams, best first.
    pub fn best(mut self) -> Vec<Beam> {
        by_score(&mut self.finished, self.params.length_penalty);
        self.finished.truncate(self.params.beam_width as usize);
        self.finished
    }
}

/// A step's candidates from the engine's logprobs of its one token (the sampled token, then the top
/// N): each token once, at its first place, as the offline path's logprob dict holds them.
fn candidates(entry: &Logprobs) -> Vec<(u32, f64)> {
    let mut top: Vec<(u32, f64)> = Vec::with_capacity(entry.token_ids.len());
    for (&token_id, &logprob) in entry.token_ids.iter().zip(&entry.logprobs) {
        if !top.iter().any(|&(seen, _)| seen == token_id) {
            top.push((token_id, logprob));
        }
    }
    top
}

/// What one beam's step brought back: its candidates, and the prompt tokens the cache served.
struct Step {
    candidates: Vec<(u32, f64)>,
    num_cached_tokens: u32,
}

/// Reads a beam step's one token; the engine's refusal or failure is the response's error.
async fn step(engine: &EngineClient, mut outputs: OutputStream) -> Result<Step, ApiError> {
    let mut found = None;
    let mut num_cached_tokens = 0;
    while let Some(output) = outputs.recv().await {
        num_cached_tokens = num_cached_tokens.max(output.num_cached_tokens);
        if let Some(entry) = output.new_logprobs.as_ref().and_then(|all| all.first()) {
            found = Some(candidates(entry));
        }
        let error = match output.finish_reason {
            None => continue,
            Some(FinishReason::Stop | FinishReason::Length) => break,
            Some(FinishReason::Abort) => {
                ChoiceError::Engine("the engine aborted the request".into())
            }
            Some(FinishReason::Error) => {
                let message = output.error.unwrap_or_else(|| "unknown error".into());
                match output.invalid_param {
                    Some(param) => ChoiceError::Invalid { param, message },
                    None => ChoiceError::Engine(message),
                }
            }
        };
        return Err(fan_out::api_error(engine, None, error));
    }
    match found {
        Some(candidates) => Ok(Step {
            candidates,
            num_cached_tokens,
        }),
        None => Err(fan_out::api_error(
            engine,
            None,
            ChoiceError::Engine("a beam step ended without its token's logprobs".into()),
        )),
    }
}

/// Searches each prompt of `request` and answers its beam_width best beams, best first, as its
/// choices (prompt p's are p * n .. p * n + n, as the fan-out numbers choices).
pub async fn run(
    state: &AppState,
    id_kind: &str,
    request: &ValidRequest,
    params: &BeamSearchParams,
    arrival: Arrival,
) -> Result<(ResponseHeader, Vec<ChoiceResult>), ApiError> {
    let engine = state.engine()?;
    // A prompt has at most beam_width live beams, one engine request each at a time.
    let _permits = admission::admit(state, request.prompts.len() * params.beam_width as usize)?;
    let id = state.request_id(id_kind);
    let step_params = SamplingParams {
        max_tokens: 1,
        temperature: 0.0,
        logprobs: Some(CANDIDATES_PER_BEAM * params.beam_width),
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let mut searches: Vec<PromptBeams> = request
        .prompts
        .iter()
        .map(|prompt| {
            PromptBeams::new(
                params.clone(),
                prompt.params.max_tokens,
                engine.ready().eos_token_ids.clone(),
                prompt.token_ids.clone(),
            )
        })
        .collect();
    // Per prompt, what the cache served its first step: its prompt's cached tokens.
    let mut cached: Vec<Option<u32>> = vec![None; searches.len()];
    for number in 0u64.. {
        let mut owners = Vec::new();
        let mut steps = Vec::new();
        for (index, search) in searches.iter().enumerate() {
            for (beam_index, beam) in search.live.iter().enumerate() {
                let outputs = engine.add_request(AddRequest {
                    request_id: format!("{id}-{index}-{number}-{beam_index}"),
                    prompt_token_ids: beam.tokens.clone(),
                    params: step_params.clone(),
                    arrival_time: arrival.unix_seconds,
                    priority: request.priority,
                    cache_salt: request.cache_salt.clone(),
                    pooling: None,
                    second_text_start: None,
                })?;
                owners.push(index);
                steps.push(step(engine, outputs));
            }
        }
        if steps.is_empty() {
            break;
        }
        let mut tops: Vec<Vec<Vec<(u32, f64)>>> = vec![Vec::new(); searches.len()];
        for (index, step) in owners.into_iter().zip(try_join_all(steps).await?) {
            cached[index].get_or_insert(step.num_cached_tokens);
            tops[index].push(step.candidates);
        }
        for (search, top) in searches.iter_mut().zip(tops) {
            if !search.done() {
                search.advance(&top);
            }
        }
    }
    let mut results = Vec::with_capacity(searches.len() * params.beam_width as usize);
    for ((search, prompt), cached) in searches.into_iter().zip(&request.prompts).zip(cached) {
        let prefix = prompt.echo.clone().unwrap_or_default();
        for beam in search.best() {
            let token_ids = beam.output_token_ids().to_vec();
            // As vLLM's beam search (and a completion's stop token): the end-of-sequence token's
            // text only with include_stop_str_in_output.
            let shown = match beam.finish_reason {
                Some("stop") if !request.include_stop_str_in_output => {
                    &token_ids[..token_ids.len() - 1]
                }
                _ => &token_ids[..],
            };
            let text = state
                .pool
                .decode(shown.to_vec(), request.skip_special_tokens)
                .await?;
            results.push(ChoiceResult {
                text: prefix.clone() + &text,
                prefix_chars: prefix.chars().count() as u32,
                finish_reason: beam.finish_reason.unwrap_or("length"),
                completion_tokens: token_ids.len() as u32,
                cumulative_logprob: beam.cum_logprob,
                token_ids,
                num_cached_tokens: cached.unwrap_or(0),
                ..ChoiceResult::default()
            });
        }
    }
    let header = ResponseHeader {
        id,
        created: unix_time(),
        model: request.model.clone(),
    };
    Ok((header, results))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EOS: u32 = 0;

    fn params(
        beam_width: u32,
        length_penalty: f64,
        early_stopping: EarlyStopping,
    ) -> BeamSearchParams {
        BeamSearchParams {
            beam_width,
            length_penalty,
            early_stopping,
            ignore_eos: false,
        }
    }

    fn search(params: BeamSearchParams, max_tokens: u32) -> PromptBeams {
        PromptBeams::new(params, max_tokens, vec![EOS], vec![100, 101])
    }

    fn outputs(beams: &[Beam]) -> Vec<Vec<u32>> {
        beams
            .iter()
            .map(|beam| beam.output_token_ids().to_vec())
            .collect()
    }

    #[test]
    fn the_best_width_candidates_live_on_and_eos_candidates_finish() {
        let mut beams = search(params(2, 1.0, EarlyStopping::Never), 8);
        beams.advance(&[vec![(5, -0.5), (EOS, -0.25), (6, -1.0), (7, -2.0)]]);
        assert_eq!(outputs(&beams.live), [vec![5], vec![6]]);
        assert_eq!(outputs(&beams.finished), [vec![EOS]]);
        assert_eq!(beams.finished[0].finish_reason, Some("stop"));
        // Step 2: [5] scores (-0.5 - 0.5) / 2 = -0.5 with 8 and (-0.5 - 3) / 2 with 9; [6] scores
        // (-1 - 0.1) / 2 = -0.55 with 10.
        beams.advance(&[vec![(8, -0.5), (9, -3.0)], vec![(10, -0.1), (11, -4.0)]]);
        assert_eq!(outputs(&beams.live), [vec![5, 8], vec![6, 10]]);
        assert_eq!(beams.live[0].cum_logprob, -1.0);
    }

    #[test]
    fn ties_keep_the_engines_order_of_beams_and_candidates() {
        let mut beams = search(params(2, 1.0, EarlyStopping::Never), 8);
        beams.advance(&[vec![(5, -1.0), (6, -1.0), (7, -1.0), (8, -3.0)]]);
        assert_eq!(outputs(&beams.live), [vec![5], vec![6]]);
        beams.advance(&[vec![(9, -1.0), (10, -2.0)], vec![(11, -1.0), (12, -2.0)]]);
        assert_eq!(outputs(&beams.live), [vec![5, 9], vec![6, 11]]);
    }

    #[test]
    fn max_tokens_finishes_the_live_beams_with_length() {
        let mut beams = search(params(2, 1.0, EarlyStopping::Hopeless), 1);
        beams.advance(&[vec![(5, -0.5), (6, -0.7), (EOS, -3.0), (7, -4.0)]]);
        assert!(beams.done());
        let best = beams.best();
        assert_eq!(outputs(&best), [vec![5], vec![6]]);
        assert_eq!(best[0].finish_reason, Some("length"));
    }

    #[test]
    fn ignore_eos_keeps_an_eos_candidate_alive() {
        let mut with = params(1, 1.0, EarlyStopping::Never);
        with.ignore_eos = true;
        let mut beams = search(with, 4);
        beams.advance(&[vec![(EOS, -0.1), (5, -1.0)]]);
        assert_eq!(outputs(&beams.live), [vec![EOS]]);
        assert!(beams.finished.is_empty());
    }

    /// A search of width 2 that has finished [EOS] (-0.2) and [5, EOS] (-1.5 / 2 = -0.75), with
    /// live beams [6, 7] (-1.2 / 2 = -0.6) and [6, 8] (-1.4 / 2 = -0.7) after step 2.
    fn two_finished(early_stopping: EarlyStopping) -> PromptBeams {
        let mut beams = search(params(2, 1.0, early_stopping), 8);
        beams.advance(&[vec![(EOS, -0.2), (5, -0.5), (6, -0.6), (9, -5.0)]]);
        beams.advance(&[vec![(EOS, -1.0), (10, -9.0)], vec![(7, -0.6), (8, -0.8)]]);
        beams
    }

    #[test]
    fn early_stopping_true_stops_once_width_beams_have_finished() {
        let beams = two_finished(EarlyStopping::Finished);
        assert!(beams.done());
        assert_eq!(outputs(&beams.best()), [vec![EOS], vec![5, EOS]]);
    }

    #[test]
    fn early_stopping_false_goes_on_while_a_live_beam_beats_the_worst_finished_one() {
        // The best live beam (-0.6) beats the worst kept finished one (-0.75): it goes on.
        let mut beams = two_finished(EarlyStopping::Hopeless);
        assert_eq!(outputs(&beams.live), [vec![6, 7], vec![6, 8]]);
        // Step 3: [6, 7, 11] scores -2.4 / 3 = -0.8 < -0.75, the best live one: the search stops.
        beams.advance(&[vec![(11, -1.2), (12, -3.0)], vec![(13, -2.0), (14, -3.0)]]);
        assert!(beams.done());
        assert_eq!(outputs(&beams.best()), [vec![EOS], vec![5, EOS]]);
    }

    #[test]
    fn early_stopping_never_runs_to_max_tokens() {
        let mut beams = two_finished(EarlyStopping::Never);
        beams.advance(&[vec![(11, -1.2), (12, -3.0)], vec![(13, -2.0), (14, -3.0)]]);
        assert!(!beams.done());
        assert_eq!(beams.finished.len(), 2);
    }

    #[test]
    fn the_length_penalty_divides_by_the_output_length_to_its_power() {
        let beam = Beam {
            tokens: vec![1, 2, 3, 4, 5],
            num_prompt_tokens: 1,
            logprobs: vec![-1.0; 4],
            cum_logprob: -4.0,
            finish_reason: None,
        };
        assert_eq!(beam.score(1.0), -1.0);
        assert_eq!(beam.score(0.5), -2.0);
        assert_eq!(beam.score(0.0), -4.0);
        // A longer beam with a lower total wins once the penalty favours length: -4 / 4^2 = -0.25.
        let short = search(params(1, 1.0, EarlyStopping::Never), 8).live[0].extended(5, -1.0, None);
        assert_eq!(short.score(2.0), -1.0);
        assert!(beam.score(2.0) > short.score(2.0));
        // An empty output (the search's start) divides by 1, not 0.
        assert_eq!(
            search(params(1, 1.0, EarlyStopping::Never), 8).live[0].score(0.5),
            0.0
        );
    }

    #[test]
    fn best_ranks_finished_beams_by_score_and_keeps_width() {
        // With length_penalty 0 the totals rank; with 1, the means.
        for (penalty, expected) in [
            (0.0, [vec![EOS], vec![5, 6, EOS]]),
            (1.0, [vec![5, 6, EOS], vec![EOS]]),
        ] {
            let mut beams = search(params(2, penalty, EarlyStopping::Never), 3);
            beams.advance(&[vec![(EOS, -1.0), (5, -0.3), (7, -3.0), (8, -9.0)]]);
            beams.advance(&[vec![(6, -0.3), (9, -5.0)], vec![(10, -5.0), (11, -6.0)]]);
            beams.advance(&[vec![(EOS, -0.6), (12, -4.0)], vec![(13, -9.0), (14, -9.5)]]);
            assert!(beams.done());
            assert_eq!(outputs(&beams.best()), expected, "length_penalty {penalty}");
        }
    }

    fn checked(fields: serde_json::Value) -> Result<Option<BeamSearchParams>, ApiError> {
        let mut body = serde_json::json!({"model": "m", "prompt": "p"});
        body.as_object_mut()
            .unwrap()
            .extend(fields.as_object().unwrap().clone());
        check(&serde_json::from_value(body).unwrap(), None)
    }

    fn refused(fields: serde_json::Value) -> &'static str {
        match checked(fields) {
            Err(ApiError::InvalidParameter { param, .. }) => param,
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn n_is_the_beam_width_and_the_search_fields_are_read() {
        let beam = serde_json::json!({"use_beam_search": true, "n": 3, "length_penalty": 0.5,
            "early_stopping": "never", "ignore_eos": true, "temperature": 0, "top_k": -1});
        assert_eq!(
            checked(beam).unwrap(),
            Some(BeamSearchParams {
                beam_width: 3,
                length_penalty: 0.5,
                early_stopping: EarlyStopping::Never,
                ignore_eos: true,
            })
        );
        let plain = checked(serde_json::json!({"use_beam_search": true})).unwrap();
        assert_eq!(plain, Some(params(1, 1.0, EarlyStopping::Hopeless)));
        let finished = serde_json::json!({"use_beam_search": true, "early_stopping": true});
        assert_eq!(
            checked(finished).unwrap().unwrap().early_stopping,
            EarlyStopping::Finished
        );
        // Without beam search, what asks for nothing is no search.
        let idle = serde_json::json!({"use_beam_search": false, "length_penalty": 1.0,
            "early_stopping": false});
        assert_eq!(checked(idle).unwrap(), None);
    }

    #[test]
    fn what_beam_search_cannot_honour_is_refused_by_name() {
        for (fields, param) in [
            (serde_json::json!({"n": 11}), "n"),
            (serde_json::json!({"n": 0}), "n"),
            (serde_json::json!({"stream": true}), "stream"),
            (serde_json::json!({"n": 2, "best_of": 3}), "best_of"),
            (serde_json::json!({"logprobs": 1}), "logprobs"),
            (serde_json::json!({"temperature": 0.7}), "temperature"),
            (serde_json::json!({"seed": 1}), "seed"),
            (serde_json::json!({"stop": ["."]}), "stop"),
            (serde_json::json!({"stop_token_ids": [5]}), "stop_token_ids"),
            (
                serde_json::json!({"early_stopping": "sometimes"}),
                "early_stopping",
            ),
        ] {
            let mut fields = fields;
            fields["use_beam_search"] = true.into();
            assert_eq!(refused(fields.clone()), param, "{fields}");
        }
        // An empty stop list asks for nothing.
        let empty = serde_json::json!({"use_beam_search": true, "stop": [], "best_of": 1});
        assert!(checked(empty).unwrap().is_some());
        assert_eq!(
            refused(serde_json::json!({"length_penalty": 2.0})),
            "length_penalty"
        );
        assert_eq!(
            refused(serde_json::json!({"early_stopping": true})),
            "early_stopping"
        );
    }

    #[test]
    fn candidates_keep_the_sampled_token_once_at_its_first_place() {
        let entry = Logprobs {
            token_ids: vec![7, 7, 3, 9],
            logprobs: vec![-0.1, -0.1, -2.0, -3.0],
            sampled_rank: 1,
        };
        assert_eq!(candidates(&entry), [(7, -0.1), (3, -2.0), (9, -3.0)]);
    }
}

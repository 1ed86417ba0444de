//! The frontend ↔ engine core seam, as specified in `docs/protocol.md`.
//!
//! Every message is a msgpack map whose first keys are `v` and `type`, then
//! the message's own fields in the documented order. Encoding is canonical
//! (the same value always gives the same bytes) so that the golden vectors
//! under `tests/golden/protocol/` round-trip byte for byte.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize, Serializer};
use thiserror::Error;

/// The only protocol version this build speaks.
pub const PROTOCOL_VERSION: u64 = 1;

/// Upper bounds of the `iteration_tokens` buckets (tokens one engine step computed), vLLM's
/// choice; [`EngineStats::iteration_tokens`] has one count per bound plus one above the largest.
pub const ITERATION_TOKENS_BOUNDS: [u64; 13] = [
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
];

/// Why a frame could not be turned into a [`Message`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ProtocolError {
    #[error("message is not a msgpack map")]
    NotAMap,
    #[error("unsupported protocol version {0}")]
    UnsupportedVersion(u64),
    #[error("unknown message type {0:?}")]
    UnknownType(String),
    #[error("malformed message: {0}")]
    Malformed(String),
}

impl From<rmp_serde::decode::Error> for ProtocolError {
    fn from(err: rmp_serde::decode::Error) -> Self {
        ProtocolError::Malformed(err.to_string())
    }
}

/// One message on either socket of the seam.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// Boxed: a request's parameters are far larger than any other message.
    AddRequest(Box<AddRequest>),
    Abort(Abort),
    UtilityCall(UtilityCall),
    Ready(Ready),
    Outputs(Outputs),
    UtilityResult(UtilityResult),
}

impl Message {
    /// The value of the message's `type` key.
    pub fn type_name(&self) -> &'static str {
        match self {
            Message::AddRequest(_) => "add_request",
            Message::Abort(_) => "abort",
            Message::UtilityCall(_) => "utility",
            Message::Ready(_) => "ready",
            Message::Outputs(_) => "outputs",
            Message::UtilityResult(_) => "utility_result",
        }
    }
}

/// `v` and `type` ahead of the body's own fields: a serde internal tag would
/// put `type` first and has no place for `v`.
#[derive(Serialize)]
struct Envelope<'a, T: Serialize> {
    v: u64,
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(flatten)]
    body: &'a T,
}

impl Serialize for Message {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let kind = self.type_name();
        match self {
            Message::AddRequest(body) => envelope(kind, body, serializer),
            Message::Abort(body) => envelope(kind, body, serializer),
            Message::UtilityCall(body) => envelope(kind, body, serializer),
            Message::Ready(body) => envelope(kind, body, serializer),
            Message::Outputs(body) => envelope(kind, body, serializer),
            Message::UtilityResult(body) => envelope(kind, body, serializer),
        }
    }
}

fn envelope<T: Serialize, S: Serializer>(
    kind: &'static str,
    body: &T,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    Envelope {
        v: PROTOCOL_VERSION,
        kind,
        body,
    }
    .serialize(serializer)
}

/// frontend → engine core: one sequence to generate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AddRequest {
    pub request_id: String,
    pub prompt_token_ids: Vec<u32>,
    pub params: SamplingParams,
    pub arrival_time: f64,
    pub priority: i64,
    /// vLLM's: the request shares cached KV blocks only with requests of the same salt.
    pub cache_salt: Option<String>,
    /// Present: a pooling request, answered with the prompt's embedding instead of tokens (its
    /// `params` are then the defaults with max_tokens 1, and unused).
    pub pooling: Option<PoolingParams>,
    /// A cross-encoder's pair of texts ([`Ready::cross_encoder`]), tokenized as one prompt by the
    /// tokenizer's pair template: where the second text's first token is, token type 1 from there
    /// on. None: type 0 throughout (XLM-RoBERTa's template types both texts 0).
    pub second_text_start: Option<u32>,
}

/// vLLM's `PoolingParams`: what a pooling request asks of its embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolingParams {
    /// Keep the embedding's first N values (before normalising); None: all of them.
    pub dimensions: Option<u32>,
    /// None: the model's own choice; true or false forces L2 normalisation.
    pub normalize: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    pub max_tokens: u32,
    pub temperature: f64,
    pub top_p: f64,
    /// -1 disables top-k.
    pub top_k: i32,
    pub min_p: f64,
    pub repetition_penalty: f64,
    pub presence_penalty: f64,
    pub frequency_penalty: f64,
    /// A BTreeMap so that keys are encoded in ascending order, as the spec requires.
    pub logit_bias: Option<BTreeMap<u32, f64>>,
    pub seed: Option<i64>,
    /// The sampled token plus the top N.
    pub logprobs: Option<u32>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub min_tokens: u32,
    /// A constraint on the output's text, compiled by the engine core.
    pub structured_output: Option<StructuredOutput>,
    /// For each prompt token after the first, its logprob plus the top N.
    pub prompt_logprobs: Option<u32>,
    /// vLLM's: the only tokens that may be sampled.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM's `bad_words`, tokenized: a sequence's last token is never sampled where the output
    /// so far ends with the rest of it.
    pub bad_words_token_ids: Option<Vec<Vec<u32>>>,
    /// A cap on a reasoning model's thinking: the engine core forces its end at the budget.
    pub thinking_budget: Option<ThinkingBudget>,
}

/// Once `max_tokens` tokens of thinking are out without its end, the engine core forces
/// `end_token_ids` (the closing tag), one token per step. `start_token_ids` is the tag the output
/// must open with for thinking to begin; empty when the prompt opened it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ThinkingBudget {
    pub max_tokens: u32,
    pub start_token_ids: Vec<u32>,
    pub end_token_ids: Vec<u32>,
}

/// `kind` is one of json_schema (spec: the schema as JSON text), json_object (spec: ""), regex
/// (the pattern), choice (a JSON array of strings as text) or grammar (the grammar's text).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StructuredOutput {
    pub kind: String,
    pub spec: String,
    /// Where the constraint starts: empty, at the output's start; else after the first occurrence
    /// of this text (`</think>`, with a reasoning parser: the thinking runs free).
    pub after: String,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 16,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: None,
            seed: None,
            logprobs: None,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            min_tokens: 0,
            structured_output: None,
            prompt_logprobs: None,
            allowed_token_ids: None,
            bad_words_token_ids: None,
            thinking_budget: None,
        }
    }
}

/// frontend → engine core: end these requests now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Abort {
    pub request_ids: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UtilityMethod {
    Health,
    Stats,
    /// The prefix cache's block hashes, for routers: a [`KvCacheSnapshot`].
    KvCache,
    /// A consistency audit of the KV block pool: a [`BlockPoolAudit`].
    BlockPoolAudit,
}

/// frontend → engine core: a call answered by a [`UtilityResult`] with the same `call_id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UtilityCall {
    pub call_id: u64,
    pub method: UtilityMethod,
}

/// engine core → frontend: sent once the model is loaded and the KV cache allocated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ready {
    pub max_model_len: u32,
    pub num_kv_blocks: u64,
    pub block_size: u32,
    pub runner: Runner,
    /// The length of a full embedding: the model's hidden size.
    pub embedding_size: u32,
    /// None: `dimensions` is refused; empty: any size from 1 to embedding_size; else exactly one
    /// of these sizes (a Matryoshka model's).
    pub matryoshka_dimensions: Option<Vec<u32>>,
    /// A cross-encoder (a `*ForSequenceClassification` encoder): it embeds nothing; each pooling
    /// request is a pair of texts (`second_text_start`), and its embedding is one float32, the
    /// pair's score. `embedding_size` is then 1.
    pub cross_encoder: bool,
    /// The ids that end a generation, as the engine core reads them: beam search finishes a beam
    /// on them. Empty for a model without one (an encoder).
    pub eos_token_ids: Vec<u32>,
}

/// What the served model does, and so which routes serve it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Runner {
    /// Generates tokens: completions, chat, messages and responses.
    Generate,
    /// Answers each prompt with its embedding: /v1/embeddings.
    Pooling,
}

/// engine core → frontend: everything one engine step produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outputs {
    pub outputs: Vec<EngineOutput>,
    pub stats: EngineStats,
    pub timestamp: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    Stop,
    Length,
    Abort,
    Error,
}

impl FinishReason {
    pub const ALL: [FinishReason; 4] = [Self::Stop, Self::Length, Self::Abort, Self::Error];

    /// The name on the wire, in responses and in metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
            Self::Error => "error",
        }
    }
}

/// One request's share of an engine step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineOutput {
    pub request_id: String,
    pub new_token_ids: Vec<u32>,
    pub new_logprobs: Option<Vec<Logprobs>>,
    pub finish_reason: Option<FinishReason>,
    pub stop_reason: Option<u32>,
    pub num_cached_tokens: u32,
    pub error: Option<String>,
    /// Seconds since the Unix epoch when the engine first scheduled the request; None if it never did.
    pub first_scheduled_time: Option<f64>,
    /// The parameter at fault when the engine rejected the request as invalid before running it.
    pub invalid_param: Option<String>,
    /// With `prompt_logprobs`: one entry per prompt token after the first (index 0 the actual
    /// token, `sampled_rank` its rank), in the output of the first generated token only.
    pub prompt_logprobs: Option<Vec<Logprobs>>,
    /// A pooling request's embedding, in its one output: little-endian float32 values, already
    /// truncated to its `dimensions` and normalised as asked. A msgpack bin.
    #[serde(with = "serde_bytes")]
    pub embedding: Option<Vec<u8>>,
}

impl EngineOutput {
    /// The final output of a request that failed for `reason`.
    pub fn failed(request_id: impl Into<String>, reason: impl Into<String>) -> Self {
        EngineOutput {
            request_id: request_id.into(),
            new_token_ids: Vec::new(),
            new_logprobs: None,
            finish_reason: Some(FinishReason::Error),
            stop_reason: None,
            num_cached_tokens: 0,
            error: Some(reason.into()),
            first_scheduled_time: None,
            invalid_param: None,
            prompt_logprobs: None,
            embedding: None,
        }
    }

    pub fn is_finished(&self) -> bool {
        self.finish_reason.is_some()
    }
}

/// Logprobs of one generated token: index 0 is the sampled token, then the top N.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Logprobs {
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<f64>,
    /// 1 = most likely.
    pub sampled_rank: u32,
}

impl Logprobs {
    /// The logprob of the position's own token (the first entry); NaN when the engine sent none.
    pub fn own_logprob(&self) -> f64 {
        self.logprobs.first().copied().unwrap_or(f64::NAN)
    }

    /// The alternatives after the position's own token, each with its text from `text`.
    pub fn alternatives(&self, text: impl Fn(u32) -> String) -> Vec<(u32, String, f64)> {
        self.token_ids
            .iter()
            .zip(&self.logprobs)
            .skip(1)
            .map(|(&id, &logprob)| (id, text(id), logprob))
            .collect()
    }
}

/// The engine's counters after a step, the one declaration of them on the Rust side: /metrics
/// renders this type directly. All but the first three are running totals.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    pub num_running: u64,
    pub num_waiting: u64,
    /// Fraction of KV blocks in use, in [0, 1].
    pub kv_cache_usage: f64,
    /// Prompt tokens looked up in, and served from, the prefix cache.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub num_preemptions: u64,
    /// Steps that graphs were on for but that ran eagerly: no captured shape fit them.
    pub num_eager_fallbacks: u64,
    /// Steps per bucket of computed tokens ([`ITERATION_TOKENS_BOUNDS`], then one above them).
    pub iteration_tokens: Vec<u64>,
    /// Tokens computed by all steps.
    pub iteration_tokens_sum: u64,
    /// Speculative decoding: requests' verification steps that had drafts, the draft tokens
    /// verified, and those accepted (acceptance rate = accepted / draft tokens).
    pub spec_decode_num_drafts: u64,
    pub spec_decode_num_draft_tokens: u64,
    pub spec_decode_num_accepted_tokens: u64,
}

impl EngineStats {
    /// These stats with the running totals of `lost`, an engine core that was replaced, added in:
    /// a restart starts its counters from zero, which Prometheus would read as a counter reset.
    /// The gauges are this engine core's own.
    pub fn plus_totals_of(mut self, lost: &EngineStats) -> EngineStats {
        self.prefix_cache_queries += lost.prefix_cache_queries;
        self.prefix_cache_hits += lost.prefix_cache_hits;
        self.num_preemptions += lost.num_preemptions;
        self.num_eager_fallbacks += lost.num_eager_fallbacks;
        if self.iteration_tokens.len() < lost.iteration_tokens.len() {
            self.iteration_tokens.resize(lost.iteration_tokens.len(), 0);
        }
        for (count, lost) in self.iteration_tokens.iter_mut().zip(&lost.iteration_tokens) {
            *count += lost;
        }
        self.iteration_tokens_sum += lost.iteration_tokens_sum;
        self.spec_decode_num_drafts += lost.spec_decode_num_drafts;
        self.spec_decode_num_draft_tokens += lost.spec_decode_num_draft_tokens;
        self.spec_decode_num_accepted_tokens += lost.spec_decode_num_accepted_tokens;
        self
    }
}

/// What a utility call returned: `{"ok": true}` for health, the stats map for stats, the
/// snapshot for kv_cache. Untagged: each shape has keys the others lack.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum UtilityValue {
    Health(HealthResult),
    Stats(EngineStats),
    KvCache(KvCacheSnapshot),
    BlockPoolAudit(BlockPoolAudit),
}

/// What the engine core's prefix cache holds, as `GET /sluice/kv_cache` serves it to routers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct KvCacheSnapshot {
    /// The last KV-events message the engine core published; every change it carries is in
    /// `block_hashes` (0 when it publishes none).
    pub seq: u64,
    pub block_size: u32,
    /// Where the engine core publishes KV events, or None when it does not.
    pub kv_events_port: Option<u16>,
    /// Lower-case hex of every block hash in the prefix cache.
    pub block_hashes: Vec<String>,
}

/// The `block_pool_audit` utility result (python/engine/block_pool_audit.py's `to_wire`), served at
/// `GET /sluice/block_pool_audit` for the disconnect-storm and soak checks that no block leaked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BlockPoolAudit {
    /// True when every block is free or held by a live request and the pool's books agree.
    pub consistent: bool,
    pub num_blocks: u64,
    pub num_free_blocks: u64,
    pub num_held_blocks: u64,
    pub num_cached_blocks: u64,
    pub num_live_requests: u64,
    pub num_holding_requests: u64,
    pub num_problems: u64,
    /// The first problems found, joined with "; " (empty when consistent).
    pub problems: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthResult {
    pub ok: bool,
}

/// engine core → frontend: the answer to a [`UtilityCall`] call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UtilityResult {
    pub call_id: u64,
    pub result: Option<UtilityValue>,
    pub error: Option<String>,
}

macro_rules! message_from {
    ($($body:ident),*) => {$(
        impl From<$body> for Message {
            fn from(body: $body) -> Self {
                Message::$body(body)
            }
        }
    )*};
}
impl From<AddRequest> for Message {
    fn from(body: AddRequest) -> Self {
        Message::AddRequest(Box::new(body))
    }
}
message_from!(Abort, UtilityCall, Ready, Outputs, UtilityResult);

/// The canonical msgpack body of `message`.
pub fn encode(message: &Message) -> Vec<u8> {
    // Writing into a Vec cannot fail and every field type has a msgpack form.
    rmp_serde::to_vec_named(message).expect("protocol messages always encode")
}

#[derive(Deserialize)]
struct Header {
    v: u64,
    #[serde(rename = "type")]
    kind: String,
}

/// Parses one frame; never panics, whatever the bytes.
pub fn decode(bytes: &[u8]) -> Result<Message, ProtocolError> {
    // rmp-serde would also accept a struct encoded as an array; the spec allows only maps.
    if !matches!(bytes.first(), Some(0x80..=0x8f | 0xde | 0xdf)) {
        return Err(ProtocolError::NotAMap);
    }
    // The body types ignore the `v` and `type` keys, so a second pass over the
    // same bytes decodes the body once the header has chosen its type.
    let header: Header = rmp_serde::from_slice(bytes)?;
    if header.v != PROTOCOL_VERSION {
        return Err(ProtocolError::UnsupportedVersion(header.v));
    }
    let message = match header.kind.as_str() {
        "add_request" => Message::AddRequest(Box::new(rmp_serde::from_slice(bytes)?)),
        "abort" => Message::Abort(rmp_serde::from_slice(bytes)?),
        "utility" => Message::UtilityCall(rmp_serde::from_slice(bytes)?),
        "ready" => Message::Ready(rmp_serde::from_slice(bytes)?),
        "outputs" => Message::Outputs(rmp_serde::from_slice(bytes)?),
        "utility_result" => Message::UtilityResult(rmp_serde::from_slice(bytes)?),
        _ => return Err(ProtocolError::UnknownType(header.kind)),
    };
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_add_request() -> AddRequest {
        AddRequest {
            request_id: "cmpl-1-0".into(),
            prompt_token_ids: vec![1, 200, 70000],
            params: SamplingParams {
                logit_bias: Some(BTreeMap::from([(500, -1.5), (7, 2.0), (300, 0.0)])),
                seed: Some(-3),
                logprobs: Some(2),
                stop_token_ids: vec![2],
                ..SamplingParams::default()
            },
            arrival_time: 1_700_000_000.25,
            priority: 0,
            cache_salt: Some("tenant".into()),
            pooling: None,
            second_text_start: None,
        }
    }

    fn sample_outputs() -> Outputs {
        Outputs {
            outputs: vec![
                EngineOutput {
                    request_id: "a".into(),
                    new_token_ids: vec![5],
                    new_logprobs: Some(vec![Logprobs {
                        token_ids: vec![5, 9],
                        logprobs: vec![-0.5, -1.25],
                        sampled_rank: 1,
                    }]),
                    finish_reason: None,
                    stop_reason: None,
                    num_cached_tokens: 16,
                    error: None,
                    first_scheduled_time: Some(1.25),
                    invalid_param: None,
                    prompt_logprobs: Some(vec![Logprobs {
                        token_ids: vec![200, 7],
                        logprobs: vec![-3.5, -0.25],
                        sampled_rank: 4,
                    }]),
                    embedding: None,
                },
                EngineOutput {
                    finish_reason: Some(FinishReason::Stop),
                    num_cached_tokens: 3,
                    error: None,
                    embedding: Some(
                        [0.5f32, -1.0]
                            .iter()
                            .flat_map(|v| v.to_le_bytes())
                            .collect(),
                    ),
                    ..EngineOutput::failed("embd-1-0", "")
                },
                EngineOutput {
                    finish_reason: Some(FinishReason::Stop),
                    stop_reason: Some(2),
                    ..EngineOutput::failed("b", "")
                },
            ],
            stats: EngineStats {
                num_running: 1,
                num_waiting: 0,
                kv_cache_usage: 0.5,
                prefix_cache_queries: 32,
                prefix_cache_hits: 16,
                num_preemptions: 0,
                num_eager_fallbacks: 3,
                iteration_tokens: vec![0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4],
                iteration_tokens_sum: 70000,
                spec_decode_num_drafts: 2,
                spec_decode_num_draft_tokens: 8,
                spec_decode_num_accepted_tokens: 5,
            },
            timestamp: 1.5,
        }
    }

    fn all_messages() -> Vec<Message> {
        vec![
            sample_add_request().into(),
            AddRequest {
                pooling: Some(PoolingParams {
                    dimensions: Some(64),
                    normalize: None,
                }),
                ..sample_add_request()
            }
            .into(),
            AddRequest {
                pooling: Some(PoolingParams {
                    dimensions: None,
                    normalize: None,
                }),
                second_text_start: Some(4),
                ..sample_add_request()
            }
            .into(),
            Abort {
                request_ids: vec!["a".into(), "b".into()],
            }
            .into(),
            UtilityCall {
                call_id: 7,
                method: UtilityMethod::Stats,
            }
            .into(),
            Ready {
                max_model_len: 8192,
                num_kv_blocks: 1000,
                block_size: 16,
                runner: Runner::Generate,
                embedding_size: 0,
                matryoshka_dimensions: None,
                cross_encoder: false,
                eos_token_ids: vec![2],
            }
            .into(),
            Ready {
                max_model_len: 512,
                num_kv_blocks: 1000,
                block_size: 16,
                runner: Runner::Pooling,
                embedding_size: 768,
                matryoshka_dimensions: Some(vec![64, 256, 768]),
                cross_encoder: false,
                eos_token_ids: vec![2],
            }
            .into(),
            Ready {
                max_model_len: 512,
                num_kv_blocks: 64,
                block_size: 16,
                runner: Runner::Pooling,
                embedding_size: 1,
                matryoshka_dimensions: None,
                cross_encoder: true,
                eos_token_ids: Vec::new(),
            }
            .into(),
            sample_outputs().into(),
            UtilityResult {
                call_id: 7,
                result: Some(UtilityValue::Stats(EngineStats::default())),
                error: None,
            }
            .into(),
            UtilityResult {
                call_id: 8,
                result: Some(UtilityValue::Health(HealthResult { ok: true })),
                error: None,
            }
            .into(),
            UtilityResult {
                call_id: 10,
                result: Some(UtilityValue::KvCache(KvCacheSnapshot {
                    seq: 3,
                    block_size: 16,
                    kv_events_port: Some(5557),
                    block_hashes: vec!["00ff".into()],
                })),
                error: None,
            }
            .into(),
            UtilityResult {
                call_id: 9,
                result: None,
                error: Some("no such method".into()),
            }
            .into(),
        ]
    }

    /// A msgpack fixstr.
    fn s(text: &str) -> Vec<u8> {
        let mut out = vec![0xa0 | text.len() as u8];
        out.extend_from_slice(text.as_bytes());
        out
    }

    #[test]
    fn every_message_round_trips() {
        for message in all_messages() {
            let bytes = encode(&message);
            assert_eq!(decode(&bytes).unwrap(), message);
            assert_eq!(encode(&decode(&bytes).unwrap()), bytes);
        }
    }

    #[test]
    fn abort_encodes_to_exact_bytes_with_v_and_type_first() {
        let bytes = encode(&Message::Abort(Abort {
            request_ids: vec!["a".into()],
        }));
        let mut expected = vec![0x83];
        expected.extend(s("v"));
        expected.push(0x01);
        expected.extend(s("type"));
        expected.extend(s("abort"));
        expected.extend(s("request_ids"));
        expected.push(0x91);
        expected.extend(s("a"));
        assert_eq!(bytes, expected);
    }

    #[test]
    fn ready_uses_smallest_integer_encodings() {
        let bytes = encode(&Message::Ready(Ready {
            max_model_len: 8192,
            num_kv_blocks: 70000,
            block_size: 16,
            runner: Runner::Pooling,
            embedding_size: 576,
            matryoshka_dimensions: Some(Vec::new()),
            cross_encoder: true,
            eos_token_ids: vec![2, 49152],
        }));
        let mut expected = vec![0x8a];
        expected.extend(s("v"));
        expected.push(0x01);
        expected.extend(s("type"));
        expected.extend(s("ready"));
        expected.extend(s("max_model_len"));
        expected.extend([0xcd, 0x20, 0x00]);
        expected.extend(s("num_kv_blocks"));
        expected.extend([0xce, 0x00, 0x01, 0x11, 0x70]);
        expected.extend(s("block_size"));
        expected.push(0x10);
        expected.extend(s("runner"));
        expected.extend(s("pooling"));
        expected.extend(s("embedding_size"));
        expected.extend([0xcd, 0x02, 0x40]);
        expected.extend(s("matryoshka_dimensions"));
        expected.push(0x90);
        expected.extend(s("cross_encoder"));
        expected.push(0xc3);
        expected.extend(s("eos_token_ids"));
        expected.extend([0x92, 0x02, 0xcd, 0xc0, 0x00]);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn pooling_then_second_text_start_end_add_request_as_a_map_and_an_int_or_nils() {
        let add_request = |pooling, second_text_start| {
            encode(&Message::AddRequest(Box::new(AddRequest {
                pooling,
                second_text_start,
                ..sample_add_request()
            })))
        };
        let mut absent = s("pooling");
        absent.push(0xc0);
        absent.extend(s("second_text_start"));
        absent.push(0xc0);
        assert!(add_request(None, None).ends_with(&absent));
        let mut given = s("pooling");
        given.push(0x82);
        given.extend(s("dimensions"));
        given.push(0xc0);
        given.extend(s("normalize"));
        given.push(0xc3);
        given.extend(s("second_text_start"));
        given.push(0x04);
        let asked = PoolingParams {
            dimensions: None,
            normalize: Some(true),
        };
        assert!(add_request(Some(asked), Some(4)).ends_with(&given));
    }

    #[test]
    fn an_embedding_is_a_bin_after_prompt_logprobs() {
        let floats = [1.0f32, -0.25];
        let embedding: Vec<u8> = floats.iter().flat_map(|v| v.to_le_bytes()).collect();
        let output = EngineOutput {
            finish_reason: Some(FinishReason::Stop),
            error: None,
            embedding: Some(embedding.clone()),
            ..EngineOutput::failed("embd-1-0", "")
        };
        let bytes = encode(
            &Outputs {
                outputs: vec![output],
                stats: EngineStats::default(),
                timestamp: 0.0,
            }
            .into(),
        );
        let mut expected = s("prompt_logprobs");
        expected.push(0xc0);
        expected.extend(s("embedding"));
        // bin 8: a one-byte length, then the bytes as they are.
        expected.extend([0xc4, 8]);
        expected.extend(&embedding);
        assert!(bytes
            .windows(expected.len())
            .any(|w| w == expected.as_slice()));
    }

    #[test]
    fn params_keep_documented_order_floats_as_f64_and_nil_for_none() {
        let message = Message::AddRequest(Box::new(AddRequest {
            params: SamplingParams {
                logit_bias: Some(BTreeMap::from([(300, 1.0), (7, -1.0)])),
                ..SamplingParams::default()
            },
            ..sample_add_request()
        }));
        let json = serde_json::to_string(&message).unwrap();
        let keys = [
            "\"v\"",
            "\"type\"",
            "\"request_id\"",
            "\"prompt_token_ids\"",
            "\"params\"",
            "\"max_tokens\"",
            "\"temperature\"",
            "\"top_p\"",
            "\"top_k\"",
            "\"min_p\"",
            "\"repetition_penalty\"",
            "\"presence_penalty\"",
            "\"frequency_penalty\"",
            "\"logit_bias\"",
            "\"seed\"",
            "\"logprobs\"",
            "\"stop_token_ids\"",
            "\"ignore_eos\"",
            "\"min_tokens\"",
            "\"prompt_logprobs\"",
            "\"allowed_token_ids\"",
            "\"bad_words_token_ids\"",
            "\"thinking_budget\"",
            "\"arrival_time\"",
            "\"priority\"",
            "\"cache_salt\"",
            "\"pooling\"",
            "\"second_text_start\"",
        ];
        let positions: Vec<usize> = keys.iter().map(|k| json.find(k).unwrap()).collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "{json}");

        let bytes = encode(&message);
        // logit_bias: a 2-entry map, key 7 before key 300, values float64.
        let mut bias = vec![0x82, 0x07, 0xcb];
        bias.extend((-1.0f64).to_be_bytes());
        bias.extend([0xcd, 0x01, 0x2c, 0xcb]);
        bias.extend(1.0f64.to_be_bytes());
        assert!(bytes.windows(bias.len()).any(|w| w == bias.as_slice()));
        // seed and logprobs are None: `seed` nil, `logprobs` nil.
        let mut nils = s("seed");
        nils.push(0xc0);
        nils.extend(s("logprobs"));
        nils.push(0xc0);
        assert!(bytes.windows(nils.len()).any(|w| w == nils.as_slice()));
        // temperature 1.0 is a float64, never an integer.
        let mut temperature = s("temperature");
        temperature.push(0xcb);
        temperature.extend(1.0f64.to_be_bytes());
        assert!(bytes
            .windows(temperature.len())
            .any(|w| w == temperature.as_slice()));
    }

    #[test]
    fn unknown_version_is_rejected() {
        let mut bytes = encode(&Message::Abort(Abort {
            request_ids: vec![],
        }));
        // The byte after "v" is the version's positive fixint.
        assert_eq!(bytes[3], 0x01);
        bytes[3] = 0x02;
        assert_eq!(decode(&bytes), Err(ProtocolError::UnsupportedVersion(2)));
    }

    #[test]
    fn unknown_type_is_rejected() {
        let mut bytes = vec![0x82];
        bytes.extend(s("v"));
        bytes.push(0x01);
        bytes.extend(s("type"));
        bytes.extend(s("pickle"));
        assert_eq!(
            decode(&bytes),
            Err(ProtocolError::UnknownType("pickle".into()))
        );
    }

    #[test]
    fn unknown_finish_reason_is_malformed() {
        let mut message = sample_outputs();
        message.outputs.truncate(1);
        let bytes = encode(&message.into());
        let needle = {
            let mut n = s("finish_reason");
            n.push(0xc0);
            n
        };
        let at = bytes
            .windows(needle.len())
            .position(|w| w == needle.as_slice())
            .unwrap();
        let mut corrupted = bytes[..at + needle.len() - 1].to_vec();
        corrupted.extend(s("bored"));
        corrupted.extend(&bytes[at + needle.len()..]);
        assert!(matches!(
            decode(&corrupted),
            Err(ProtocolError::Malformed(_))
        ));
    }

    #[test]
    fn garbage_never_panics() {
        assert_eq!(decode(&[]), Err(ProtocolError::NotAMap));
        assert_eq!(decode(&[0x91, 0x01]), Err(ProtocolError::NotAMap));
        for message in all_messages() {
            let bytes = encode(&message);
            for end in 0..bytes.len() {
                assert!(decode(&bytes[..end]).is_err());
            }
            for at in 0..bytes.len() {
                for flip in [0x01u8, 0x80, 0xff] {
                    let mut mutated = bytes.clone();
                    mutated[at] ^= flip;
                    let _ = decode(&mutated);
                }
            }
        }
        // A map claiming 2^32-1 entries must fail, not allocate.
        assert!(decode(&[0xdf, 0xff, 0xff, 0xff, 0xff]).is_err());
    }

    #[test]
    fn an_audit_result_decodes_as_an_audit_not_as_another_utility_value() {
        let audit = BlockPoolAudit {
            consistent: false,
            num_blocks: 8,
            num_free_blocks: 6,
            num_held_blocks: 1,
            num_cached_blocks: 2,
            num_live_requests: 0,
            num_holding_requests: 1,
            num_problems: 1,
            problems: "finished request 'a-0' still holds 2 blocks".into(),
        };
        let sent: Message = UtilityResult {
            call_id: 4,
            result: Some(UtilityValue::BlockPoolAudit(audit.clone())),
            error: None,
        }
        .into();
        match decode(&encode(&sent)).unwrap() {
            Message::UtilityResult(UtilityResult {
                result: Some(UtilityValue::BlockPoolAudit(got)),
                ..
            }) => assert_eq!(got, audit),
            other => panic!("decoded as {other:?}"),
        }
    }
}

"""Messages between the Rust frontend and the engine core, and their msgpack encoding.

docs/protocol.md is the contract; this module is its Python half. Each message is a slots
dataclass. `encode` writes the canonical bytes (`v` and `type` first, then the keys in the
table's order, floats as float64, logit_bias keys ascending, nil for absent values) so that
equal values give equal bytes in both languages. `decode` checks every key and type and
raises ProtocolError, never anything else, whatever the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.pooling import POOLING_PARAMS_RECORD, RUNNERS, PoolingParams
from sluice.sampling_params import PARAMS_RECORD, SamplingParams
from sluice.wire import (
    BOOL,
    BYTES,
    FLOAT,
    INT,
    INT_LIST,
    SCALAR_MAP,
    STR,
    Codec,
    Invalid,
    MessageSet,
    ProtocolError,
    Record,
    list_of,
    one_of,
    optional,
)
from sluice.worker_seam import LOGPROBS_RECORD, Logprobs

PROTOCOL_VERSION = 1
FINISH_REASONS = ("stop", "length", "abort", "error")
UTILITY_METHODS = ("health", "stats", "kv_cache", "block_pool_audit")
# Upper bounds of the `iteration_tokens` buckets (tokens one engine step computed), vLLM's choice;
# the stats carry one count per bound plus one for the steps above the largest.
ITERATION_TOKENS_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


# frontend -> engine core


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    # n is never on the wire (the frontend fans n > 1 out): encode refuses n != 1.
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    # Set for a pooling request: the engine computes the prompt and answers with its embedding
    # (params are then the defaults with max_tokens 1, and unused).
    pooling: PoolingParams | None = None
    # A cross-encoder's pair of texts (Ready.cross_encoder): the position of the second text's first
    # token, token type 1 from there on, as the tokenizer's pair template types it; None: type 0 throughout.
    second_text_start: int | None = None


@dataclass(slots=True)
class Abort:
    request_ids: list[str]


@dataclass(slots=True)
class UtilityCall:
    call_id: int
    # "health", "stats", "kv_cache" or "block_pool_audit"; an unknown method is decodable so that it can be answered with an error.
    method: str


# engine core -> frontend


@dataclass(slots=True)
class Ready:
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    # "generate" or "pooling" (sluice.pooling.Runner): which routes the model serves.
    runner: str = "generate"
    # The length of a full embedding: the model's hidden size.
    embedding_size: int = 0
    # None: `dimensions` is refused; []: any size up to embedding_size; else exactly one of these.
    matryoshka_dimensions: list[int] | None = None
    # A cross-encoder (a *ForSequenceClassification encoder): it embeds nothing, and scores a pair of
    # texts given as one prompt (AddRequest.second_text_start); its "embedding" is the one score.
    cross_encoder: bool = False
    # The ids that end a generation (the engine core's, from config.json): the frontend's beam search
    # finishes a beam on them.
    eos_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class EngineStats:
    """The engine's counters after a step: the one declaration of them on the Python side."""

    num_running: int = 0
    num_waiting: int = 0
    # Fraction of KV blocks held by requests, in [0, 1].
    kv_cache_usage: float = 0.0
    # Tokens, running totals since start, as vLLM counts them.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Steps that graphs were on for but that ran eagerly (no captured shape fit), as rank 0 last
    # reported it, running total.
    num_eager_fallbacks: int = 0
    # Steps per bucket of computed tokens (ITERATION_TOKENS_BOUNDS, then one above them), running totals.
    iteration_tokens: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKENS_BOUNDS) + 1))
    # Tokens computed by all steps, running total.
    iteration_tokens_sum: int = 0
    # Speculative decoding, running totals: requests' verification steps that had drafts, the draft
    # tokens verified, and those accepted (the acceptance rate is accepted / draft tokens).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


@dataclass(slots=True)
class EngineOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    # Set exactly when finish_reason is "error".
    error: str | None = None
    # Seconds since the Unix epoch when the engine first scheduled the request; None if it never did.
    first_scheduled_time: float | None = None
    # With finish_reason "error": the parameter at fault when the request was invalid (rejected
    # before it ran, or found to leave no token to sample while it ran).
    invalid_param: str | None = None
    # Requests with prompt_logprobs: one entry per prompt token after the first (the first has
    # none), all in the output that carries the first generated token; None in every other output.
    prompt_logprobs: list[Logprobs] | None = None
    # A pooling request's embedding, in its one output: little-endian float32 values, truncated to
    # its dimensions and normalised as asked.
    embedding: bytes | None = None


@dataclass(slots=True)
class Outputs:
    outputs: list[EngineOutput]
    stats: EngineStats
    timestamp: float


@dataclass(slots=True)
class UtilityResult:
    call_id: int
    # {"ok": True} for health; the stats map (stats_to_wire) for stats; the kv_cache map
    # (kv_cache_to_wire) for kv_cache; BlockPoolAudit.to_wire()'s scalar map for block_pool_audit.
    result: dict[str, Any] | None = None
    error: str | None = None


Message = AddRequest | Abort | UtilityCall | Ready | Outputs | UtilityResult


def _check_iteration_tokens(value: Any) -> list[int]:
    counts = INT_LIST.decode(value)
    if len(counts) != len(ITERATION_TOKENS_BOUNDS) + 1:
        raise Invalid(f"expected {len(ITERATION_TOKENS_BOUNDS) + 1} bucket counts, got {len(counts)}")
    return counts


_ITERATION_TOKENS = Codec(_check_iteration_tokens, _check_iteration_tokens)

_STATS = Record(
    EngineStats,
    (
        ("num_running", INT),
        ("num_waiting", INT),
        ("kv_cache_usage", FLOAT),
        ("prefix_cache_queries", INT),
        ("prefix_cache_hits", INT),
        ("num_preemptions", INT),
        ("num_eager_fallbacks", INT),
        ("iteration_tokens", _ITERATION_TOKENS),
        ("iteration_tokens_sum", INT),
        ("spec_decode_num_drafts", INT),
        ("spec_decode_num_draft_tokens", INT),
        ("spec_decode_num_accepted_tokens", INT),
    ),
)
# The same map as a stats utility call's `result`: a plain dict.
_STATS_MAP = Record(dict, _STATS.fields)

# The prefix cache as a router's snapshot: what GET /sluice/kv_cache serves.
_KV_CACHE = Record(
    dict,
    (
        ("seq", INT),
        ("block_size", INT),
        ("kv_events_port", optional(INT)),
        ("block_hashes", list_of(STR)),
    ),
)


def _result_record(value: Any) -> Codec:
    """The codec of a utility result: the kv_cache and stats maps by their keys, else a scalar map."""
    if type(value) is dict and "block_hashes" in value:
        return _KV_CACHE.codec
    if type(value) is dict and "iteration_tokens" in value:
        return _STATS_MAP.codec
    return SCALAR_MAP


_UTILITY_RESULT = Codec(
    lambda v: _result_record(v).encode(v),
    lambda v: _result_record(v).decode(v),
)

_OUTPUT = Record(
    EngineOutput,
    (
        ("request_id", STR),
        ("new_token_ids", INT_LIST),
        ("new_logprobs", optional(list_of(LOGPROBS_RECORD.codec))),
        ("finish_reason", optional(one_of(STR, FINISH_REASONS))),
        ("stop_reason", optional(INT)),
        ("num_cached_tokens", INT),
        ("error", optional(STR)),
        ("first_scheduled_time", optional(FLOAT)),
        ("invalid_param", optional(STR)),
        ("prompt_logprobs", optional(list_of(LOGPROBS_RECORD.codec))),
        ("embedding", optional(BYTES)),
    ),
)

_MESSAGES = MessageSet(
    PROTOCOL_VERSION,
    {
        AddRequest: (
            "add_request",
            Record(
                AddRequest,
                (
                    ("request_id", STR),
                    ("prompt_token_ids", INT_LIST),
                    ("params", PARAMS_RECORD.codec),
                    ("arrival_time", FLOAT),
                    ("priority", INT),
                    ("cache_salt", optional(STR)),
                    ("pooling", optional(POOLING_PARAMS_RECORD.codec)),
                    ("second_text_start", optional(INT)),
                ),
            ),
        ),
        Abort: ("abort", Record(Abort, (("request_ids", list_of(STR)),))),
        UtilityCall: ("utility", Record(UtilityCall, (("call_id", INT), ("method", STR)))),
        Ready: (
            "ready",
            Record(
                Ready,
                (
                    ("max_model_len", INT),
                    ("num_kv_blocks", INT),
                    ("block_size", INT),
                    ("runner", one_of(STR, RUNNERS)),
                    ("embedding_size", INT),
                    ("matryoshka_dimensions", optional(INT_LIST)),
                    ("cross_encoder", BOOL),
                    ("eos_token_ids", INT_LIST),
                ),
            ),
        ),
        Outputs: (
            "outputs",
            Record(
                Outputs, (("outputs", list_of(_OUTPUT.codec)), ("stats", _STATS.codec), ("timestamp", FLOAT))
            ),
        ),
        UtilityResult: (
            "utility_result",
            Record(
                UtilityResult,
                (("call_id", INT), ("result", optional(_UTILITY_RESULT)), ("error", optional(STR))),
            ),
        ),
    },
)


def encode(message: Message) -> bytes:
    """The canonical msgpack bytes of `message`; ProtocolError if it breaks the protocol's types."""
    if isinstance(message, AddRequest) and message.params.n != 1:
        raise ProtocolError(f"n is not on the wire: fan n={message.params.n} out into n requests")
    return _MESSAGES.encode(message)


def decode(data: bytes) -> Message:
    """The message in `data`; ProtocolError (or a subclass) for anything that is not one."""
    return _MESSAGES.decode(data)


def stats_to_wire(stats: EngineStats) -> dict[str, Any]:
    """The stats map, in wire order: the `result` of a stats utility call."""
    try:
        return _STATS.encode(stats)
    except Invalid as exc:
        raise ProtocolError(f"cannot encode: {exc}") from None


def stats_from_wire(data: dict[str, Any]) -> EngineStats:
    try:
        return _STATS.decode(data)
    except Invalid as exc:
        raise ProtocolError(f"malformed stats: {exc}") from None


def kv_cache_to_wire(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The kv_cache map, in wire order: the `result` of a kv_cache utility call."""
    try:
        return _KV_CACHE.encode(snapshot)
    except Invalid as exc:
        raise ProtocolError(f"cannot encode: {exc}") from None

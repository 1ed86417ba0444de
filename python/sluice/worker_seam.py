"""Messages between the engine core and its workers, and their msgpack encoding.

docs/protocol.md ("The engine core <-> worker seam") is the contract and this module is its one
implementation: both ends are Python and import it. The engine core broadcasts one
SchedulerOutput per step to every rank; rank 0 answers each with one ModelRunnerOutput. A new
request travels in full once; afterwards only its diff does (new block ids, the token count,
whether it resumes after a preemption). Every field is a plain int, float, str, bool, list or
map, so the messages cross the seam as msgpack with no pickle.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sluice.sampling_params import PARAMS_FIELDS
from sluice.wire import (
    BOOL,
    BYTES,
    FLOAT,
    INT,
    INT_LIST,
    STR,
    Codec,
    Invalid,
    MessageSet,
    Record,
    list_of,
    optional,
)

PROTOCOL_VERSION = 1


@dataclass(slots=True)
class Logprobs:
    """Per sampled token: column 0 is the sampled token, columns 1..N the top N."""

    token_ids: list[int]
    logprobs: list[float]
    # Rank of the sampled token in the distribution (1 = most likely).
    sampled_rank: int


LOGPROBS_RECORD = Record(
    Logprobs, (("token_ids", INT_LIST), ("logprobs", list_of(FLOAT)), ("sampled_rank", INT))
)


@dataclass(slots=True)
class PromptLogprobs:
    """One step's share of a request's prompt logprobs: one Logprobs per prompt token it predicted
    (column 0 the actual prompt token, its rank as sampled_rank), from prompt position `start` on."""

    # The prompt position of the first entry's token: at least 1, the first prompt token has none.
    start: int
    logprobs: list[Logprobs]


PROMPT_LOGPROBS_RECORD = Record(
    PromptLogprobs, (("start", INT), ("logprobs", list_of(LOGPROBS_RECORD.codec)))
)


# engine core -> workers


@dataclass(slots=True)
class InitKVCache:
    """Allocate this many KV blocks (the engine core sized them from the memory budget)."""

    num_blocks: int


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    # The `params` map of docs/protocol.md (sluice.sampling_params.PARAMS_FIELDS), plain values.
    params: dict[str, Any]
    # Its block table in each KV cache group (sluice/kv_cache_groups.py), RELEASED_BLOCK_ID (-1) where a
    # sliding window's block was released.
    block_ids: list[list[int]]
    num_computed_tokens: int
    # A cross-encoder's pair: where the second text's tokens begin (AddRequest.second_text_start).
    second_text_start: int | None = None


@dataclass(slots=True)
class CachedRequestData:
    """Diffs of requests the workers already know, in parallel lists."""

    req_ids: list[str] = field(default_factory=list)
    # True when the request resumes after a preemption: its new_block_ids then replace its blocks.
    resumed: list[bool] = field(default_factory=list)
    # Per request, per KV cache group: the blocks appended (or, resumed, its whole tables).
    new_block_ids: list[list[list[int]]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # The engine core's count of the request's output tokens. A resumed request's worker state
    # drops any beyond it: tokens sampled for it in flight when it was preempted were discarded.
    num_output_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def rows(self) -> Iterator[tuple[str, bool, list[list[int]], int, int]]:
        """Per request: (req_id, resumed, new_block_ids, num_computed_tokens, num_output_tokens)."""
        return zip(
            self.req_ids,
            self.resumed,
            self.new_block_ids,
            self.num_computed_tokens,
            self.num_output_tokens,
            strict=True,
        )


@dataclass(slots=True)
class SchedulerOutput:
    # Consecutive from 0; the ModelRunnerOutput for this step carries the same id.
    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute for it this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished or were aborted since the last step: workers drop their state.
    finished_req_ids: list[str]
    # Requests preempted since the last step: they leave the batch, and workers keep their tokens.
    preempted_req_ids: list[str]
    # Requests this step samples under a mask from the engine core (a structured output constraint,
    # or a thinking budget that may force the end of thinking): their next-token bitmask follows in
    # a GrammarBitmask, which the workers wait for only when they sample.
    structured_output_req_ids: list[str] = field(default_factory=list)
    # req_id -> draft tokens to verify after its last known token (speculative decoding; their count
    # is part of num_scheduled_tokens). The request's output is then 1 to len(drafts) + 1 tokens.
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class GrammarBitmask:
    """The allowed next tokens of a step's structured_output_req_ids, sent right after the step.

    One row per request, in structured_output_req_ids order; each row is ceil(vocab_size / 32)
    little-endian int32 words, and bit t % 32 of word t // 32 allows token t.
    """

    step_id: int
    bitmask: bytes


@dataclass(slots=True)
class Shutdown:
    """Exit cleanly."""


# workers -> engine core


@dataclass(slots=True)
class WorkerReady:
    """The model is loaded on this rank."""

    rank: int


@dataclass(slots=True)
class KVCacheReady:
    rank: int


@dataclass(slots=True)
class ModelRunnerOutput:
    step_id: int
    req_ids: list[str]
    # One list per request: empty while its prompt is still being chunked in.
    sampled_token_ids: list[list[int]]
    # Parallel to req_ids; None for requests that did not ask for logprobs.
    logprobs: list[Logprobs | None]
    # The rank's steps since start that graphs were on for but that ran eagerly: no captured shape fit.
    num_eager_fallbacks: int = 0
    # Parallel to req_ids; None for requests that did not ask for prompt logprobs or whose step
    # computed no prompt token's prediction. None for the whole list when no request of the step did.
    prompt_logprobs: list[PromptLogprobs | None] | None = None
    # A pooling runner's steps: parallel to req_ids, the pooled hidden state (little-endian float32
    # bytes, neither truncated nor normalised) of each request whose prompt this step finished, else
    # None. None for the whole list on a generate runner.
    pooled: list[bytes | None] | None = None


@dataclass(slots=True)
class WorkerError:
    """A rank failed; it exits after sending this."""

    rank: int
    message: str


Message = (
    InitKVCache
    | SchedulerOutput
    | GrammarBitmask
    | Shutdown
    | WorkerReady
    | KVCacheReady
    | ModelRunnerOutput
    | WorkerError
)


def _check_str_int_list_map(value: Any) -> dict[str, list[int]]:
    if type(value) is not dict:
        raise Invalid(f"expected a map, got {type(value).__name__}")
    for key, token_ids in value.items():
        if type(key) is not str:
            raise Invalid(f"expected str keys, got {type(key).__name__}").at(".<key>")
        try:
            INT_LIST.decode(token_ids)
        except Invalid as exc:
            raise exc.at(f".{key}") from None
    return value


def _check_str_int_map(value: Any) -> dict[str, int]:
    if type(value) is not dict:
        raise Invalid(f"expected a map, got {type(value).__name__}")
    for key, count in value.items():
        if type(key) is not str:
            raise Invalid(f"expected str keys, got {type(key).__name__}").at(".<key>")
        if type(count) is not int:
            raise Invalid(f"expected an int, got {type(count).__name__}").at(f".{key}")
    return value


_NEW_REQUEST = Record(
    NewRequestData,
    (
        ("req_id", STR),
        ("prompt_token_ids", INT_LIST),
        ("params", Record(dict, PARAMS_FIELDS).codec),
        ("block_ids", list_of(INT_LIST)),
        ("num_computed_tokens", INT),
        ("second_text_start", optional(INT)),
    ),
)
_CACHED_REQUESTS = Record(
    CachedRequestData,
    (
        ("req_ids", list_of(STR)),
        ("resumed", list_of(BOOL)),
        ("new_block_ids", list_of(list_of(INT_LIST))),
        ("num_computed_tokens", INT_LIST),
        ("num_output_tokens", INT_LIST),
    ),
)

_MESSAGES = MessageSet(
    PROTOCOL_VERSION,
    {
        InitKVCache: ("init_kv_cache", Record(InitKVCache, (("num_blocks", INT),))),
        SchedulerOutput: (
            "scheduler_output",
            Record(
                SchedulerOutput,
                (
                    ("step_id", INT),
                    ("scheduled_new_reqs", list_of(_NEW_REQUEST.codec)),
                    ("scheduled_cached_reqs", _CACHED_REQUESTS.codec),
                    ("num_scheduled_tokens", Codec(_check_str_int_map, _check_str_int_map)),
                    ("total_num_scheduled_tokens", INT),
                    ("finished_req_ids", list_of(STR)),
                    ("preempted_req_ids", list_of(STR)),
                    ("structured_output_req_ids", list_of(STR)),
                    (
                        "scheduled_spec_token_ids",
                        Codec(_check_str_int_list_map, _check_str_int_list_map),
                    ),
                ),
            ),
        ),
        GrammarBitmask: (
            "grammar_bitmask",
            Record(GrammarBitmask, (("step_id", INT), ("bitmask", BYTES))),
        ),
        Shutdown: ("shutdown", Record(Shutdown, ())),
        WorkerReady: ("worker_ready", Record(WorkerReady, (("rank", INT),))),
        KVCacheReady: ("kv_cache_ready", Record(KVCacheReady, (("rank", INT),))),
        ModelRunnerOutput: (
            "model_runner_output",
            Record(
                ModelRunnerOutput,
                (
                    ("step_id", INT),
                    ("req_ids", list_of(STR)),
                    ("sampled_token_ids", list_of(INT_LIST)),
                    ("logprobs", list_of(optional(LOGPROBS_RECORD.codec))),
                    ("num_eager_fallbacks", INT),
                    ("prompt_logprobs", optional(list_of(optional(PROMPT_LOGPROBS_RECORD.codec)))),
                    ("pooled", optional(list_of(optional(BYTES)))),
                ),
            ),
        ),
        WorkerError: ("worker_error", Record(WorkerError, (("rank", INT), ("message", STR)))),
    },
)


def encode(message: Message) -> bytes:
    """The canonical msgpack bytes of `message`; ProtocolError if it breaks the seam's types."""
    return _MESSAGES.encode(message)


def decode(data: bytes) -> Message:
    """The message in `data`; ProtocolError (or a subclass) for anything that is not one."""
    return _MESSAGES.decode(data)

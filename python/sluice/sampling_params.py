"""Per-request sampling parameters, validated once at the boundary."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sluice.errors import InvalidRequestError
from sluice.wire import (
    BOOL,
    FLOAT,
    INT,
    INT_LIST,
    STR,
    Codec,
    Invalid,
    ProtocolError,
    Record,
    list_of,
    one_of,
    optional,
    token_map,
)

# The most alternatives a token's logprobs may carry, as in vLLM's default max_logprobs.
MAX_LOGPROBS = 20
# What a structured output constraint may be; `spec` is, in order: the schema as JSON text, "",
# the regex, a JSON array of the choices as text, the grammar (llguidance's Lark dialect).
STRUCTURED_OUTPUT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the output's text; the engine core compiles it when the request is added.

    `after`, when not empty, is where the constraint starts: the output is free text up to and
    including its first occurrence (a reasoning model's `</think>`: the thinking runs free, the
    answer is constrained)."""

    kind: str
    spec: str
    after: str = ""


@dataclass(slots=True)
class ThinkingBudget:
    """A cap on a reasoning model's thinking (chat's `thinking_token_budget`, Anthropic's
    `budget_tokens`): once `max_tokens` tokens of thinking are out and it has not ended, the engine
    core forces `end_token_ids` (its closing tag) one token at a time, and the answer follows.

    `start_token_ids` is the tag that opens the thinking when the output must open with it; empty
    when the prompt already opened it. An output that opens with anything else does not think."""

    max_tokens: int
    start_token_ids: list[int]
    end_token_ids: list[int]


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    # -1 or 0 disables top-k, as in vLLM.
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    # None: no logprobs. N >= 0: the sampled token's logprob plus the top N.
    logprobs: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    structured_output: StructuredOutput | None = None
    # None: no prompt logprobs. N >= 0: for each prompt token after the first, its logprob plus the top N.
    prompt_logprobs: int | None = None
    # vLLM's: None, or the only tokens that may be sampled (every other logit is -inf).
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words as token sequences (the frontend, or LLM.generate, tokenizes the words): a
    # sequence's last token is never sampled where the output so far ends with the rest of it.
    bad_words_token_ids: list[list[int]] | None = None
    thinking_budget: ThinkingBudget | None = None
    # The offline API's text options (LLM.generate detokenizes); they never cross a seam, since
    # the frontend applies its own over HTTP. A stop string ends the output before it.
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: words the output must not contain; LLM.generate tokenizes them into bad_words_token_ids.
    bad_words: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # vLLM's SamplingParams also takes one string, or None, as `stop`.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first parameter out of range.

        The limits are vLLM's; a float must also hold as the 32-bit float the sampler uses.
        tests/golden/sampling_limits.json holds the cases that the frontend's rules share.
        """
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (self.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"),
            (
                _holds(self.temperature, lambda t: 0.0 <= t <= 2.0),
                "temperature",
                f"temperature must be in [0, 2], got {self.temperature}",
            ),
            (
                _holds(self.top_p, lambda p: 0.0 < p <= 1.0),
                "top_p",
                f"top_p must be in (0, 1], got {self.top_p}",
            ),
            (
                self.top_k >= -1,
                "top_k",
                f"top_k must be -1 or 0 (disabled), or at least 1, got {self.top_k}",
            ),
            (
                _holds(self.min_p, lambda p: 0.0 <= p <= 1.0),
                "min_p",
                f"min_p must be in [0, 1], got {self.min_p}",
            ),
            (
                _holds(self.repetition_penalty, lambda p: p > 0.0),
                "repetition_penalty",
                f"repetition_penalty must be greater than 0 and a finite 32-bit float, got {self.repetition_penalty}",
            ),
            (
                _holds(self.presence_penalty, lambda p: -2.0 <= p <= 2.0),
                "presence_penalty",
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                _holds(self.frequency_penalty, lambda p: -2.0 <= p <= 2.0),
                "frequency_penalty",
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                all(
                    _holds(bias, lambda b: -100.0 <= b <= 100.0) for bias in (self.logit_bias or {}).values()
                ),
                "logit_bias",
                f"logit_bias values must be in [-100, 100], got {self.logit_bias}",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
            ),
            (
                self.seed is None or -(2**63) <= self.seed < 2**63,
                "seed",
                f"seed must fit in a signed 64-bit integer, got {self.seed}",
            ),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}"),
            (
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
                "allowed_token_ids",
                "allowed_token_ids must name at least one token, got an empty list",
            ),
            (
                all(isinstance(text, str) and text for text in self.stop),
                "stop",
                f"stop must be a list of non-empty strings, got {self.stop!r}",
            ),
            (
                all(isinstance(word, str) and word.strip() for word in self.bad_words),
                "bad_words",
                f"bad_words must be a list of strings that are not blank, got {self.bad_words!r}",
            ),
            (
                all(len(ids) > 0 for ids in self.bad_words_token_ids or ()),
                "bad_words",
                "every bad word must be at least one token, got an empty token sequence",
            ),
            (
                self.thinking_budget is None or self.thinking_budget.max_tokens >= 0,
                "thinking_token_budget",
                f"thinking_token_budget must be non-negative, got {self.thinking_budget}",
            ),
            (
                self.thinking_budget is None or len(self.thinking_budget.end_token_ids) > 0,
                "thinking_token_budget",
                "a thinking budget needs the tokens that end the thinking, got none",
            ),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)


def _as_float32(value: float) -> float:
    """`value` as the sampler's 32-bit float: too large becomes infinity, too small 0."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _holds(value: float, in_range: Callable[[float], bool]) -> bool:
    """Whether `value` is in range both as sent and as the sampler's 32-bit float (never NaN or inf)."""
    as_float32 = _as_float32(value)
    return in_range(value) and math.isfinite(as_float32) and in_range(as_float32)


def _params_from_fields(**fields: Any) -> SamplingParams:
    return SamplingParams(n=1, **fields)


_STRUCTURED_OUTPUT_RECORD = Record(
    StructuredOutput, (("kind", one_of(STR, STRUCTURED_OUTPUT_KINDS)), ("spec", STR), ("after", STR))
)


_THINKING_BUDGET_RECORD = Record(
    ThinkingBudget, (("max_tokens", INT), ("start_token_ids", INT_LIST), ("end_token_ids", INT_LIST))
)


def _nested_record(record: Record, cls: type) -> Codec:
    """A record inside `params`: the worker seam carries params as a checked map, so a value may
    come as either form."""

    def encode(value: Any) -> dict[str, Any]:
        return record.encode(record.decode(value) if type(value) is dict else value)

    def decode(value: Any) -> Any:
        return value if type(value) is cls else record.decode(value)

    return Codec(encode, decode)


# The `params` map that both seams carry (frontend -> engine core in add_request, engine core ->
# workers in a new request), in wire order. n never crosses a seam: n > 1 is fanned out first.
PARAMS_FIELDS = (
    ("max_tokens", INT),
    ("temperature", FLOAT),
    ("top_p", FLOAT),
    ("top_k", INT),
    ("min_p", FLOAT),
    ("repetition_penalty", FLOAT),
    ("presence_penalty", FLOAT),
    ("frequency_penalty", FLOAT),
    ("logit_bias", optional(token_map(FLOAT))),
    ("seed", optional(INT)),
    ("logprobs", optional(INT)),
    ("stop_token_ids", INT_LIST),
    ("ignore_eos", BOOL),
    ("min_tokens", INT),
    ("structured_output", optional(_nested_record(_STRUCTURED_OUTPUT_RECORD, StructuredOutput))),
    ("prompt_logprobs", optional(INT)),
    ("allowed_token_ids", optional(INT_LIST)),
    ("bad_words_token_ids", optional(list_of(INT_LIST))),
    ("thinking_budget", optional(_nested_record(_THINKING_BUDGET_RECORD, ThinkingBudget))),
)
PARAMS_RECORD = Record(_params_from_fields, PARAMS_FIELDS)


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """The `params` map, in wire order: plain values only; n must be 1."""
    if params.n != 1:
        raise ProtocolError(f"n is not on the wire: fan n={params.n} out into n requests")
    try:
        return PARAMS_RECORD.encode(params)
    except Invalid as exc:
        raise ProtocolError(f"cannot encode: {exc}") from None


def params_from_wire(data: dict[str, Any]) -> SamplingParams:
    """SamplingParams (n=1) from a `params` map; ProtocolError if it is malformed."""
    try:
        return PARAMS_RECORD.decode(data)
    except Invalid as exc:
        raise ProtocolError(f"malformed params: {exc}") from None

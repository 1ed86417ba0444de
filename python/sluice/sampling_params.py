"""Per-request sampling parameters, validated once at the boundary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.errors import InvalidRequestError
from sluice.wire import BOOL, FLOAT, INT, INT_LIST, Invalid, ProtocolError, Record, optional, token_map


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    # -1 (or 0) disables top-k, as in vLLM.
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first parameter out of range."""
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (self.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"),
            (
                self.temperature >= 0.0,
                "temperature",
                f"temperature must be non-negative, got {self.temperature}",
            ),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, "top_k", f"top_k must be -1 (disabled) or at least 0, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (
                self.repetition_penalty > 0.0,
                "repetition_penalty",
                f"repetition_penalty must be positive, got {self.repetition_penalty}",
            ),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                "presence_penalty",
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty",
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.logprobs is None or self.logprobs >= 0,
                "logprobs",
                f"logprobs must be non-negative, got {self.logprobs}",
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
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)


def _params_from_fields(**fields: Any) -> SamplingParams:
    return SamplingParams(n=1, **fields)


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

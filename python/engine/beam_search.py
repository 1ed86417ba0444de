"""Beam search over the engine, as vLLM's V1 runs it: one token per step for every live beam.

Each step asks the engine for one greedy token of every live beam with its top 2 x beam_width
logprobs; every candidate that ends in an end-of-sequence token is finished, and of the others the
best beam_width go on. In the end the best beam_width of the finished ones (and of the beams that
reached max_tokens) are the answer. A beam is its prompt plus its tokens, sent again each step: the
prefix cache serves every full block the beams share (the prompt's, and each beam's own as it grows),
so a step computes little more than each beam's last, partial block.

Scores are a beam's cumulative logprob over its output length to the power length_penalty
(Hugging Face's and vLLM's rule, on the output tokens alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.errors import InvalidRequestError
from sluice.sampling_params import MAX_LOGPROBS

# What a candidate's top logprobs cover: 2 x beam_width, as in vLLM, so that beam_width live beams
# remain even when every beam's best tokens end it.
CANDIDATES_PER_BEAM = 2
EARLY_STOPPING = (True, False, "never")


@dataclass(slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    # > 0 favours longer outputs, < 0 shorter ones.
    length_penalty: float = 1.0
    # True: stop once beam_width beams have finished; False: also once no live beam scores better than
    # the worst of them (Hugging Face's heuristic); "never": run every beam to max_tokens or its end.
    early_stopping: bool | str = False

    def validate(self) -> None:
        most = MAX_LOGPROBS // CANDIDATES_PER_BEAM
        checks = [
            (
                1 <= self.beam_width <= most,
                "beam_width",
                f"beam_width must be in [1, {most}], got {self.beam_width}",
            ),
            (self.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"),
            (
                self.early_stopping in EARLY_STOPPING and type(self.early_stopping) in (bool, str),
                "early_stopping",
                f'early_stopping must be true, false or "never", got {self.early_stopping!r}',
            ),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: its prompt's and output's tokens, and each output token's logprob."""

    tokens: list[int]
    num_prompt_tokens: int
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    # "stop" (an end-of-sequence token) or "length" once finished; None while it lives.
    finish_reason: str | None = None
    text: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / max(len(self.logprobs), 1) ** length_penalty

    def extended(self, token_id: int, logprob: float, finish_reason: str | None) -> BeamSearchSequence:
        return BeamSearchSequence(
            [*self.tokens, token_id],
            self.num_prompt_tokens,
            [*self.logprobs, logprob],
            self.cum_logprob + logprob,
            finish_reason,
        )


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


@dataclass(slots=True)
class PromptBeams:
    """The search for one prompt: its live beams and its finished ones."""

    params: BeamSearchParams
    eos_token_ids: tuple[int, ...]
    live: list[BeamSearchSequence]
    finished: list[BeamSearchSequence] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return not self.live

    def advance(self, candidates_per_beam: list[dict[int, float]]) -> None:
        """Fold in one step: candidates_per_beam[i] is live beam i's top next tokens -> logprobs."""
        params = self.params
        candidates = [
            beam.extended(
                token_id,
                logprob,
                "stop" if token_id in self.eos_token_ids and not params.ignore_eos else None,
            )
            for beam, top in zip(self.live, candidates_per_beam, strict=True)
            for token_id, logprob in top.items()
        ]
        # Every candidate that ends its beam is finished; the best beam_width others live on (vLLM's rule:
        # a beam's 2 x beam_width candidates always leave enough of them).
        self.finished += [beam for beam in candidates if beam.finish_reason is not None]
        going_on = [beam for beam in candidates if beam.finish_reason is None]
        going_on.sort(key=lambda beam: beam.score(params.length_penalty), reverse=True)
        self.live = going_on[: params.beam_width]
        if self.live and len(self.live[0].logprobs) >= params.max_tokens:
            for beam in self.live:
                beam.finish_reason = "length"
            self.finished += self.live
            self.live = []
        if self.live and self._stops_early():
            self.live = []

    def _stops_early(self) -> bool:
        params = self.params
        if params.early_stopping == "never" or len(self.finished) < params.beam_width:
            return False
        if params.early_stopping is True:
            return True
        worst_kept = sorted(beam.score(params.length_penalty) for beam in self.finished)[-params.beam_width]
        return self.live[0].score(params.length_penalty) < worst_kept

    def best(self) -> list[BeamSearchSequence]:
        ranked = sorted(self.finished, key=lambda beam: beam.score(self.params.length_penalty), reverse=True)
        return ranked[: self.params.beam_width]

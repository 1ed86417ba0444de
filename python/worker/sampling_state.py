"""Per-row sampling state of the persistent batch, and the metadata the sampler reads each step.

Rows mirror the input batch: a request lives in one row from add() until remove() or move().
Every per-row parameter sits in an array allocated once. Sets of live rows per feature let
metadata() skip all work for a feature no live row uses, so an all-greedy batch without
penalties, bias or logprobs costs a handful of set checks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from sluice.sampling_params import SamplingParams

# Below this a temperature is treated as greedy, as in vLLM, so that logits / T cannot overflow.
GREEDY_TEMPERATURE_EPS = 1e-5

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, position: int) -> int:
    """Generator seed for a seeded row's draw at `position` (its number of output tokens so far)."""
    # splitmix64 of (seed, position): nearby seeds and positions give unrelated streams.
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


@dataclass(slots=True)
class SamplingMetadata:
    """What the sampler needs for rows 0..num_rows-1; valid until the state next changes."""

    num_rows: int
    all_greedy: bool = True
    # Rows that sample randomly, or None when every row does (or none does).
    random_rows: torch.Tensor | None = None
    # Aligned with the random rows (all rows when random_rows is None).
    temperature: torch.Tensor | None = None
    # top_k equals the vocab size on rows without top-k; max_top_k is the largest enabled k.
    top_k: torch.Tensor | None = None
    max_top_k: int = 0
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    # (index among the random rows, step seed that alone fixes this step's draw).
    seeded: list[tuple[int, int]] = field(default_factory=list)
    # Aligned with rows 0..num_rows-1.
    repetition_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None
    bias_token_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # Tokens forced to -inf: stop ids and EOS while a row is under min_tokens, and each bad word's
    # last token where the row's output ends with the rest of that word.
    suppress_rows: torch.Tensor | None = None
    suppress_token_ids: torch.Tensor | None = None
    # Rows with allowed_token_ids, and their [len(rows), vocab] masks (True: may be sampled).
    allowed_rows: torch.Tensor | None = None
    allowed_mask: torch.Tensor | None = None
    # Rows that want logprobs, and how many top entries each wants.
    logprob_rows: list[int] = field(default_factory=list)
    num_logprobs: list[int] = field(default_factory=list)

    @property
    def needs_processing(self) -> bool:
        return (
            self.bias_rows is not None
            or self.allowed_rows is not None
            or self.suppress_rows is not None
            or self.output_counts is not None
            or bool(self.logprob_rows)
        )


class SamplingState:
    def __init__(
        self,
        max_num_rows: int,
        vocab_size: int,
        device: torch.device,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.max_num_rows = max_num_rows
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = eos_token_ids

        n = max_num_rows
        self._occupied = np.zeros(n, dtype=bool)
        self._temperature = np.zeros(n, dtype=np.float32)
        self._top_k = np.full(n, vocab_size, dtype=np.int64)
        self._top_p = np.ones(n, dtype=np.float32)
        self._min_p = np.zeros(n, dtype=np.float32)
        self._repetition = np.ones(n, dtype=np.float32)
        self._presence = np.zeros(n, dtype=np.float32)
        self._frequency = np.zeros(n, dtype=np.float32)
        self._seed = np.zeros(n, dtype=np.int64)
        self._min_tokens = np.zeros(n, dtype=np.int64)
        self._num_output = np.zeros(n, dtype=np.int64)
        self._num_logprobs = np.full(n, -1, dtype=np.int64)
        self._logit_bias: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        self._suppress_ids: list[list[int]] = [[] for _ in range(n)]
        # Each bad word as (the tokens before its last, its last token), and the row's newest output
        # tokens, as many as the longest such prefix (kept on the host, for rows with bad words only).
        self._bad_words: list[list[tuple[tuple[int, ...], int]]] = [[] for _ in range(n)]
        self._recent_output: list[deque[int]] = [deque(maxlen=0) for _ in range(n)]

        # Live rows that use each feature.
        self._random: set[int] = set()
        self._seeded: set[int] = set()
        self._top_k_rows: set[int] = set()
        self._top_p_rows: set[int] = set()
        self._min_p_rows: set[int] = set()
        self._repetition_rows: set[int] = set()
        self._presence_frequency_rows: set[int] = set()
        self._bias_rows: set[int] = set()
        self._allowed_rows: set[int] = set()
        self._bad_word_rows: set[int] = set()
        # Rows still under min_tokens that have something to suppress.
        self._min_tokens_rows: set[int] = set()
        self._logprob_rows: set[int] = set()
        self._feature_sets = (
            self._random,
            self._seeded,
            self._top_k_rows,
            self._top_p_rows,
            self._min_p_rows,
            self._repetition_rows,
            self._presence_frequency_rows,
            self._bias_rows,
            self._allowed_rows,
            self._bad_word_rows,
            self._min_tokens_rows,
            self._logprob_rows,
        )

        # Allocated the first time a penalised request arrives.
        self._output_counts: torch.Tensor | None = None
        self._prompt_mask: torch.Tensor | None = None
        # Allocated the first time a request with allowed_token_ids arrives.
        self._allowed_mask: torch.Tensor | None = None

    def add(
        self,
        row: int,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
    ) -> None:
        assert 0 <= row < self.max_num_rows and not self._occupied[row], f"row {row} is not free"
        self._occupied[row] = True
        greedy = params.temperature < GREEDY_TEMPERATURE_EPS
        self._temperature[row] = 0.0 if greedy else params.temperature
        top_k = params.top_k if 0 < params.top_k < self.vocab_size else self.vocab_size
        self._top_k[row] = top_k
        self._top_p[row] = params.top_p
        self._min_p[row] = params.min_p
        self._repetition[row] = params.repetition_penalty
        self._presence[row] = params.presence_penalty
        self._frequency[row] = params.frequency_penalty
        self._seed[row] = 0 if params.seed is None else params.seed
        self._min_tokens[row] = params.min_tokens
        self._num_output[row] = len(output_token_ids)
        self._num_logprobs[row] = -1 if params.logprobs is None else min(params.logprobs, self.vocab_size)
        # Ids outside the logits (the tokenizer's vocab can be smaller or larger) cannot be biased.
        self._logit_bias[row] = [
            (int(t), float(v)) for t, v in (params.logit_bias or {}).items() if 0 <= int(t) < self.vocab_size
        ]
        suppress = set(params.stop_token_ids)
        if not params.ignore_eos:
            suppress.update(self.eos_token_ids)
        self._suppress_ids[row] = sorted(t for t in suppress if 0 <= t < self.vocab_size)

        if not greedy:
            self._random.add(row)
            if params.seed is not None:
                self._seeded.add(row)
            if top_k < self.vocab_size:
                self._top_k_rows.add(row)
            if params.top_p < 1.0:
                self._top_p_rows.add(row)
            if params.min_p > 0.0:
                self._min_p_rows.add(row)
        if params.repetition_penalty != 1.0:
            self._repetition_rows.add(row)
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            self._presence_frequency_rows.add(row)
        if self._logit_bias[row]:
            self._bias_rows.add(row)
        if params.allowed_token_ids is not None:
            self._allowed_rows.add(row)
            allowed = self._ensure_allowed_mask()
            allowed[row].zero_()
            allowed[row, torch.tensor(params.allowed_token_ids, dtype=torch.int64, device=self.device)] = True
        # A word whose last token is outside the logits can never be completed.
        self._bad_words[row] = [
            (tuple(ids[:-1]), ids[-1])
            for ids in params.bad_words_token_ids or ()
            if 0 <= ids[-1] < self.vocab_size
        ]
        if self._bad_words[row]:
            self._bad_word_rows.add(row)
            longest = max(len(prefix) for prefix, _ in self._bad_words[row])
            self._recent_output[row] = deque(output_token_ids[-longest:] if longest else (), maxlen=longest)
        if self._suppress_ids[row] and len(output_token_ids) < params.min_tokens:
            self._min_tokens_rows.add(row)
        if params.logprobs is not None:
            self._logprob_rows.add(row)

        if self._is_penalised(row):
            counts = self._ensure_output_counts()
            counts[row].zero_()
            if output_token_ids:
                ids = torch.tensor(output_token_ids, dtype=torch.int64, device=self.device)
                counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        if row in self._repetition_rows:
            mask = self._ensure_prompt_mask()
            mask[row].zero_()
            if prompt_token_ids:
                mask[row, torch.tensor(prompt_token_ids, dtype=torch.int64, device=self.device)] = True

    def remove(self, row: int) -> None:
        assert self._occupied[row], f"row {row} is empty"
        self._occupied[row] = False
        for rows in self._feature_sets:
            rows.discard(row)
        self._logit_bias[row] = []
        self._suppress_ids[row] = []
        self._bad_words[row] = []
        self._recent_output[row] = deque(maxlen=0)

    def move(self, src_row: int, dst_row: int) -> None:
        assert self._occupied[src_row] and not self._occupied[dst_row], (src_row, dst_row)
        for array in (
            self._temperature,
            self._top_k,
            self._top_p,
            self._min_p,
            self._repetition,
            self._presence,
            self._frequency,
            self._seed,
            self._min_tokens,
            self._num_output,
            self._num_logprobs,
        ):
            array[dst_row] = array[src_row]
        self._logit_bias[dst_row] = self._logit_bias[src_row]
        self._suppress_ids[dst_row] = self._suppress_ids[src_row]
        self._bad_words[dst_row] = self._bad_words[src_row]
        self._recent_output[dst_row] = self._recent_output[src_row]
        if self._is_penalised(src_row):
            assert self._output_counts is not None
            self._output_counts[dst_row] = self._output_counts[src_row]
        if src_row in self._repetition_rows:
            assert self._prompt_mask is not None
            self._prompt_mask[dst_row] = self._prompt_mask[src_row]
        if src_row in self._allowed_rows:
            assert self._allowed_mask is not None
            self._allowed_mask[dst_row] = self._allowed_mask[src_row]
        for rows in self._feature_sets:
            if src_row in rows:
                rows.add(dst_row)
        self._occupied[dst_row] = True
        self.remove(src_row)

    def append_output_token(self, row: int, token_id: int) -> None:
        self.append_output_tokens([row], torch.tensor([token_id], dtype=torch.int64, device=self.device))

    def append_output_tokens(self, rows: list[int], token_ids: torch.Tensor) -> None:
        """Count one new output token per row; token_ids [len(rows)] stay on the device."""
        penalised = []
        for i, row in enumerate(rows):
            assert self._occupied[row], f"row {row} is empty"
            self._num_output[row] += 1
            if self._min_tokens_rows and self._num_output[row] >= self._min_tokens[row]:
                self._min_tokens_rows.discard(row)
            if self._output_counts is not None and self._is_penalised(row):
                penalised.append(i)
            recent = self._recent_output[row]
            if recent.maxlen:
                # A host read, only for rows with a bad word of more than one token.
                recent.append(int(token_ids[i]))
        if penalised:
            assert self._output_counts is not None
            index = torch.tensor(penalised, dtype=torch.int64, device=self.device)
            counted_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)[index]
            ones = torch.ones(len(penalised), dtype=torch.int32, device=self.device)
            self._output_counts.index_put_((counted_rows, token_ids[index]), ones, accumulate=True)

    def is_plain_greedy(self, row: int) -> bool:
        """The row's next token is the argmax of its raw logits: greedy, and no feature touches them."""
        return self._occupied[row] and not any(row in rows for rows in self._feature_sets)

    def num_output_tokens(self, row: int) -> int:
        return int(self._num_output[row])

    def metadata(self, num_rows: int) -> SamplingMetadata:
        assert 0 <= num_rows <= self.max_num_rows
        md = SamplingMetadata(num_rows=num_rows)
        if self._random:
            self._fill_random(md, num_rows)
        if self._repetition_rows or self._presence_frequency_rows:
            self._fill_penalties(md, num_rows)
        if self._bias_rows:
            self._fill_bias(md, num_rows)
        if self._allowed_rows:
            rows = sorted(r for r in self._allowed_rows if r < num_rows)
            if rows:
                assert self._allowed_mask is not None
                md.allowed_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
                md.allowed_mask = self._allowed_mask[md.allowed_rows]
        if self._min_tokens_rows or self._bad_word_rows:
            self._fill_suppression(md, num_rows)
        if self._logprob_rows:
            md.logprob_rows = sorted(r for r in self._logprob_rows if r < num_rows)
            md.num_logprobs = [int(self._num_logprobs[r]) for r in md.logprob_rows]
        return md

    def _fill_random(self, md: SamplingMetadata, num_rows: int) -> None:
        rows = sorted(r for r in self._random if r < num_rows)
        if not rows:
            return
        md.all_greedy = False
        if len(rows) == num_rows:
            index: np.ndarray | slice = slice(0, num_rows)
        else:
            index = np.asarray(rows, dtype=np.int64)
            md.random_rows = torch.from_numpy(index).to(self.device)
        md.temperature = self._to_device(self._temperature[index])
        top_k_rows = [r for r in self._top_k_rows if r < num_rows]
        if top_k_rows:
            md.top_k = self._to_device(self._top_k[index])
            md.max_top_k = int(self._top_k[top_k_rows].max())
        if any(r < num_rows for r in self._top_p_rows):
            md.top_p = self._to_device(self._top_p[index])
        if any(r < num_rows for r in self._min_p_rows):
            md.min_p = self._to_device(self._min_p[index])
        if self._seeded:
            md.seeded = [
                (i, step_seed(int(self._seed[r]), int(self._num_output[r])))
                for i, r in enumerate(rows)
                if r in self._seeded
            ]

    def _fill_penalties(self, md: SamplingMetadata, num_rows: int) -> None:
        if not any(r < num_rows for r in self._repetition_rows | self._presence_frequency_rows):
            return
        assert self._output_counts is not None
        md.output_counts = self._output_counts[:num_rows]
        if any(r < num_rows for r in self._repetition_rows):
            assert self._prompt_mask is not None
            md.prompt_mask = self._prompt_mask[:num_rows]
            # Rows added without a penalty keep stale mask rows; a penalty of 1 makes them inert.
            md.repetition_penalty = self._to_device(
                self._masked(self._repetition, self._repetition_rows, num_rows, 1.0)
            )
        if any(r < num_rows for r in self._presence_frequency_rows):
            rows = self._presence_frequency_rows
            md.presence_penalty = self._to_device(self._masked(self._presence, rows, num_rows, 0.0))
            md.frequency_penalty = self._to_device(self._masked(self._frequency, rows, num_rows, 0.0))

    def _fill_bias(self, md: SamplingMetadata, num_rows: int) -> None:
        rows, ids, values = [], [], []
        for r in sorted(self._bias_rows):
            if r >= num_rows:
                continue
            for token_id, value in self._logit_bias[r]:
                rows.append(r)
                ids.append(token_id)
                values.append(value)
        if rows:
            md.bias_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
            md.bias_token_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
            md.bias_values = torch.tensor(values, dtype=torch.float32, device=self.device)

    def _fill_suppression(self, md: SamplingMetadata, num_rows: int) -> None:
        rows, ids = [], []
        for r in sorted(r for r in self._min_tokens_rows | self._bad_word_rows if r < num_rows):
            banned = set(self._suppress_ids[r]) if r in self._min_tokens_rows else set()
            banned.update(self._completing_bad_words(r))
            rows.extend([r] * len(banned))
            ids.extend(sorted(banned))
        if rows:
            md.suppress_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
            md.suppress_token_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)

    def _completing_bad_words(self, row: int) -> list[int]:
        """The last token of each of the row's bad words whose prefix the output now ends with."""
        recent = tuple(self._recent_output[row])
        return [
            last
            for prefix, last in self._bad_words[row]
            if len(prefix) <= len(recent) and tuple(recent[len(recent) - len(prefix) :]) == prefix
        ]

    def _is_penalised(self, row: int) -> bool:
        return row in self._repetition_rows or row in self._presence_frequency_rows

    def _masked(self, values: np.ndarray, rows: set[int], num_rows: int, neutral: float) -> np.ndarray:
        """values[:num_rows] with rows outside `rows` set to the neutral value (their arrays go stale)."""
        out = np.full(num_rows, neutral, dtype=values.dtype)
        live = [r for r in rows if r < num_rows]
        out[live] = values[live]
        return out

    def _to_device(self, values: np.ndarray) -> torch.Tensor:
        # Copy so that later row edits cannot reach a tensor the sampler still holds.
        return torch.from_numpy(np.array(values, copy=True)).to(self.device)

    def _ensure_output_counts(self) -> torch.Tensor:
        if self._output_counts is None:
            shape = (self.max_num_rows, self.vocab_size)
            self._output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        return self._output_counts

    def _ensure_allowed_mask(self) -> torch.Tensor:
        if self._allowed_mask is None:
            shape = (self.max_num_rows, self.vocab_size)
            self._allowed_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self._allowed_mask

    def _ensure_prompt_mask(self) -> torch.Tensor:
        if self._prompt_mask is None:
            shape = (self.max_num_rows, self.vocab_size)
            self._prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self._prompt_mask

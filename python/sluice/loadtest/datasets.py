"""The requests a run sends: random prompts of exact token lengths, ShareGPT, or shared prefixes."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sluice.loadtest.errors import DatasetError
from sluice.loadtest.token_codec import TokenCodec

# Random prompts draw their token ids from this text's tokens, so that they avoid special and unused ids.
VOCABULARY_TEXT = (
    "the of and to in is was for on that with as by at from his her are were an which this be or have "
    "had not but one all their there been has when who will more no if out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such "
    "like our over man me even most made after also did many before must through back years where much "
    "your way well down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same another know "
    "while last might us great old year off come since against go came right used take three"
)
ADJUST_ROUNDS = 16
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass(slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    output_len: int


def _sampled_lengths(rng: np.random.Generator, mean: int, range_ratio: float, count: int) -> list[int]:
    """Uniform in [mean * (1 - r), mean * (1 + r)], as vLLM's random dataset draws them."""
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low, high = max(int(mean * (1 - range_ratio)), 1), max(int(mean * (1 + range_ratio)), 1)
    return rng.integers(low, high + 1, size=count).tolist()


class ExactTextMaker:
    """Texts that re-tokenize to an exact number of tokens, even after a given head text."""

    def __init__(self, codec: TokenCodec, rng: np.random.Generator) -> None:
        self.codec = codec
        self.rng = rng
        self.pool = sorted(set(codec.encode(VOCABULARY_TEXT)))
        if not self.pool:
            raise DatasetError("the tokenizer turned the vocabulary text into no tokens")

    def _random_ids(self, count: int) -> list[int]:
        return [self.pool[i] for i in self.rng.integers(0, len(self.pool), size=count)]

    def text(self, length: int, head: str = "", head_len: int = 0) -> tuple[str, int]:
        """A text of `length` tokens after `head`, and the length actually reached.

        Decoding and re-encoding can merge or split tokens, so the ids are cut or topped up and
        tried again; a tokenizer that never settles leaves the nearest length, which is reported.
        """
        ids = self._random_ids(length)
        best_text, best_len = "", -1
        for _ in range(ADJUST_ROUNDS):
            text = self.codec.decode(ids)
            reached = len(self.codec.encode(head + text)) - head_len if head else len(self.codec.encode(text))
            if best_len < 0 or abs(reached - length) < abs(best_len - length):
                best_text, best_len = text, reached
            if reached == length:
                break
            own = self.codec.encode(text)
            ids = (
                own[: max(len(own) - (reached - length), 1)]
                if reached > length
                else own + self._random_ids(length - reached)
            )
        return best_text, best_len


def random_requests(
    codec: TokenCodec, count: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    input_lens = _sampled_lengths(rng, input_len, range_ratio, count)
    output_lens = _sampled_lengths(rng, output_len, range_ratio, count)
    maker = ExactTextMaker(codec, rng)
    samples = []
    for prompt_len, out_len in zip(input_lens, output_lens, strict=True):
        text, reached = maker.text(prompt_len)
        samples.append(SampleRequest(text, reached, out_len))
    return samples


def prefix_requests(
    codec: TokenCodec,
    count: int,
    prefix_len: int,
    num_prefixes: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
) -> list[SampleRequest]:
    """Request i shares prefix i % num_prefixes, of prefix_len tokens, and has its own random suffix."""
    if prefix_len <= 0 or num_prefixes <= 0:
        raise DatasetError("the prefix dataset needs --prefix-len > 0 and --num-prefixes > 0")
    rng = np.random.default_rng(seed)
    maker = ExactTextMaker(codec, rng)
    prefixes = [maker.text(prefix_len) for _ in range(num_prefixes)]
    suffix_lens = _sampled_lengths(rng, input_len, range_ratio, count)
    output_lens = _sampled_lengths(rng, output_len, range_ratio, count)
    samples = []
    for i in range(count):
        prefix, reached_prefix = prefixes[i % num_prefixes]
        suffix, reached_suffix = maker.text(suffix_lens[i], head=prefix, head_len=reached_prefix)
        samples.append(SampleRequest(prefix + suffix, reached_prefix + reached_suffix, output_lens[i]))
    return samples


def shuffled(samples: list[SampleRequest], seed: int) -> list[SampleRequest]:
    """The same requests in a seeded random order: the prefix dataset's requests otherwise cycle
    through the prefixes, which a round-robin router over an even number of replicas turns into a
    perfect prefix affinity."""
    order = list(samples)
    random.Random(seed).shuffle(order)
    return order


def _sharegpt_pairs(path: Path) -> list[tuple[str, str]]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise DatasetError(f"cannot read ShareGPT file {path}: {exc}") from exc
    except ValueError as exc:
        raise DatasetError(f"ShareGPT file {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, list):
        raise DatasetError(f"ShareGPT file {path} must hold a JSON list of conversations")
    pairs = []
    for i, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise DatasetError(f"ShareGPT file {path}: entry {i} has no `conversations` list")
        if len(turns) < 2:
            continue
        try:
            pairs.append((str(turns[0]["value"]), str(turns[1]["value"])))
        except (TypeError, KeyError) as exc:
            raise DatasetError(f"ShareGPT file {path}: entry {i}: a turn lacks `value`") from exc
    return pairs


def sharegpt_requests(
    codec: TokenCodec, path: Path, count: int, seed: int, output_len: int | None = None
) -> list[SampleRequest]:
    """vLLM's filter: first human turn as prompt, the reply's length as output length, sizes bounded."""
    pairs = _sharegpt_pairs(path)
    random.Random(seed).shuffle(pairs)
    samples: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(samples) == count:
            break
        prompt_len = len(codec.encode(prompt))
        out_len = output_len if output_len is not None else len(codec.encode(reply))
        too_short = prompt_len < SHAREGPT_MIN_LEN or (output_len is None and out_len < SHAREGPT_MIN_LEN)
        too_long = prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + out_len > SHAREGPT_MAX_TOTAL_LEN
        if not (too_short or too_long):
            samples.append(SampleRequest(prompt, prompt_len, out_len))
    if not samples:
        raise DatasetError(f"ShareGPT file {path} has no conversation that passes the length filter")
    return samples

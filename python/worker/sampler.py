"""Turns a step's logits into one token per row.

Order (as in vLLM V1): logprobs are taken first, from the raw logits (vLLM's default
`logprobs_mode=raw_logprobs`: log_softmax of what the model produced, before any bias, masking,
penalty or temperature); then allowed_token_ids, logit bias, and the suppression of min_tokens'
stop/EOS tokens and of bad words' completions, then penalties; greedy rows take the argmax of
those processed logits; random rows then go through temperature, min_p, top_k and top_p, and draw
by inverting their CDF at one uniform number per row. A seeded row's number comes from its seed
and position alone, so its token does not depend on the rest of the batch.

sample() may modify `logits` in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from sluice.worker_seam import Logprobs
from worker.sampling_state import SamplingMetadata


@dataclass(slots=True)
class SamplerOutput:
    # [num_rows] int64 on the logits' device, so the next step can read it without a host round trip.
    token_ids: torch.Tensor
    # One entry per row; None for rows that did not ask for logprobs.
    logprobs: list[Logprobs | None]


# Each row's argmax over the last dimension, as torch.argmax(dim=-1) gives it.
Argmax = Callable[[torch.Tensor], torch.Tensor]


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def native_argmax(ops: ModuleType) -> Argmax:
    """The C++ kernels' one-pass argmax for CPU float32 logits (KernelConfig.native_argmax): about 10x
    torch's on 64 rows of 49,152; torch's for anything else."""

    def argmax(logits: torch.Tensor) -> torch.Tensor:
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1:
            return ops.argmax_rows(logits)
        return logits.argmax(dim=-1)

    return argmax


class Sampler:
    def __init__(self, generator: torch.Generator | None = None, argmax: Argmax = torch_argmax) -> None:
        # Draws for unseeded random rows; tensor-parallel ranks pass one seeded alike so that they all
        # sample the same tokens. None: torch's default generator.
        self.generator = generator
        # The greedy rows' pick.
        self.argmax = argmax

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == md.num_rows, (tuple(logits.shape), md.num_rows)
        if md.all_greedy and not md.needs_processing:
            return SamplerOutput(self.argmax(logits), [None] * md.num_rows)
        if logits.dtype != torch.float32:
            logits = logits.float()

        raw_logprobs = None
        if md.logprob_rows:
            rows = md.logprob_rows
            raw = logits if len(rows) == md.num_rows else logits[torch.tensor(rows, device=logits.device)]
            raw_logprobs = torch.log_softmax(raw, dim=-1)

        logits = process_logits(logits, md)
        token_ids = self._choose_tokens(logits, md)
        logprobs: list[Logprobs | None] = [None] * md.num_rows
        if raw_logprobs is not None:
            for row, entry in zip(md.logprob_rows, gather_logprobs(raw_logprobs, token_ids, md), strict=True):
                logprobs[row] = entry
        return SamplerOutput(token_ids, logprobs)

    def _choose_tokens(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.all_greedy:
            return self.argmax(logits)
        all_random = md.random_rows is None
        random_logits = logits if all_random else logits[md.random_rows]
        probs = random_probs(random_logits, md)
        uniforms = row_uniforms(probs.shape[0], md.seeded, probs.device, self.generator)
        sampled = inverse_cdf_sample(probs, uniforms)
        if all_random:
            return sampled
        token_ids = self.argmax(logits)
        token_ids[md.random_rows] = sampled
        return token_ids


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids, logit bias, suppression (min_tokens, bad words), then penalties: what greedy
    rows take the argmax of."""
    if md.allowed_rows is not None:
        assert md.allowed_mask is not None
        rows = logits[md.allowed_rows]
        logits[md.allowed_rows] = rows.masked_fill(~md.allowed_mask, float("-inf"))
    if md.bias_rows is not None:
        assert md.bias_token_ids is not None and md.bias_values is not None
        logits.index_put_((md.bias_rows, md.bias_token_ids), md.bias_values, accumulate=True)
    if md.suppress_rows is not None:
        assert md.suppress_token_ids is not None
        neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
        logits.index_put_((md.suppress_rows, md.suppress_token_ids), neg_inf)
    if md.output_counts is not None:
        logits = apply_penalties(logits, md)
    return logits


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens; presence and frequency over output tokens."""
    counts = md.output_counts
    assert counts is not None
    if md.repetition_penalty is not None:
        assert md.prompt_mask is not None
        seen = md.prompt_mask | (counts > 0)
        penalty = md.repetition_penalty.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if md.presence_penalty is not None:
        assert md.frequency_penalty is not None
        logits = logits - md.frequency_penalty.unsqueeze(1) * counts
        logits = logits - md.presence_penalty.unsqueeze(1) * (counts > 0)
    return logits


def random_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution each random row draws from: temperature, then min_p, top_k and top_p."""
    assert md.temperature is not None
    logits = logits / md.temperature.unsqueeze(1)
    if md.min_p is not None:
        logits = apply_min_p(logits, md.min_p)
    if md.top_k is not None:
        logits = apply_top_k(logits, md.top_k, md.max_top_k)
    if md.top_p is not None:
        logits = apply_top_p(logits, md.top_p)
    return logits.softmax(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th are kept); k == vocab size means no limit."""
    vocab = logits.shape[-1]
    assert 0 < max_top_k < vocab
    enabled = top_k < vocab
    largest = logits.topk(max_top_k, dim=-1).values
    kth = largest.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    kth = kth.masked_fill(~enabled.unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor, num_candidates: int = 512) -> torch.Tensor:
    """Keep the nucleus: the fewest most likely tokens whose probability reaches top_p (1 keeps all)."""
    vocab = logits.shape[-1]
    if logits.is_cuda or num_candidates >= vocab:
        return apply_top_p_sorted(logits, top_p)
    # A full sort costs milliseconds per row on CPU; the nucleus almost always lies in the top few hundred.
    probs = logits.softmax(dim=-1)
    top_probs = probs.topk(num_candidates, dim=-1).values
    above = top_probs.cumsum(dim=-1) - top_probs
    off = top_p >= 1.0
    covered = off | (above[:, -1] + top_probs[:, -1] >= top_p)
    keep = (above < top_p.unsqueeze(1)) | off.unsqueeze(1)
    smallest_kept = top_probs.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
    smallest_kept = smallest_kept.masked_fill(off.unsqueeze(1), 0.0)
    out = logits.masked_fill(probs < smallest_kept, float("-inf"))
    if not bool(covered.all()):
        wide = (~covered).nonzero().squeeze(1)
        out[wide] = apply_top_p_sorted(logits[wide], top_p[wide])
    return out


def apply_top_p_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    ascending, order = logits.sort(dim=-1)
    # A token goes when the tokens above it already hold at least top_p of the mass.
    below_or_at = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = below_or_at <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    ascending = ascending.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ascending)


def row_uniforms(
    num_rows: int,
    seeded: list[tuple[int, int]],
    device: torch.device,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One number in (0, 1] per row: from `generator` (a CPU one; None: torch's default), or from a
    seeded row's step seed."""
    if len(seeded) == num_rows:
        uniforms = torch.empty(num_rows, dtype=torch.float64)
    else:
        uniforms = 1.0 - torch.rand(num_rows, dtype=torch.float64, generator=generator)
    if seeded:
        index = torch.tensor([i for i, _ in seeded], dtype=torch.int64)
        uniforms[index] = torch.tensor(
            [((seed >> 10) + 1) / 2.0**53 for _, seed in seeded], dtype=torch.float64
        )
    return uniforms.to(device=device, dtype=torch.float32)


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability reaches uniform * total.

    The target is above zero and at most the total, so a token of probability zero is never the
    first to reach it.
    """
    cdf = probs.cumsum(dim=-1)
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, targets).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def gather_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, md: SamplingMetadata) -> list[Logprobs]:
    """Per logprob row (raw holds their raw logprobs): the sampled token's logprob and rank, then the top N."""
    rows = md.logprob_rows
    if len(rows) < md.num_rows:
        token_ids = token_ids[torch.tensor(rows, device=token_ids.device)]
    sampled_logprobs = raw.gather(1, token_ids.unsqueeze(1))
    ranks = ((raw > sampled_logprobs).sum(dim=-1) + 1).tolist()
    sampled = zip(token_ids.tolist(), sampled_logprobs.squeeze(1).tolist(), ranks, strict=True)
    max_n = max(md.num_logprobs)
    top_logprobs: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if max_n > 0:
        top = raw.topk(max_n, dim=-1)
        top_logprobs, top_ids = top.values.tolist(), top.indices.tolist()
    return [
        Logprobs([token, *top_ids[i][:n]], [logprob, *top_logprobs[i][:n]], rank)
        for i, ((token, logprob, rank), n) in enumerate(zip(sampled, md.num_logprobs, strict=True))
    ]

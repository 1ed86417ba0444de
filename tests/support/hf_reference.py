"""Reference generations from Hugging Face transformers, one prompt at a time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

# New tokens in conftest.py's fp32_mixed_reference: a test that needs fewer compares a prefix (greedy tokens
# do not depend on how many follow).
MIXED_REFERENCE_TOKENS = 32


@dataclass
class ReferenceOutput:
    token_ids: list[int]
    # Per generated position: the top-5 token ids of transformers' distribution.
    top5: list[list[int]]


def load_hf_model(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    # Soft-capped attention (Gemma 2) runs eagerly: transformers 5.17 still sent Gemma 2 through sdpa,
    # which leaves the cap out, and so disagreed with every path of ours (seen on a lent GPU machine).
    softcapped = getattr(AutoConfig.from_pretrained(path), "attn_logit_softcapping", None)
    options = {"attn_implementation": "eager"} if softcapped else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **options).eval()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> ReferenceOutput:
    """Greedy decoding that never stops early, as our requests run with ignore_eos."""
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    assert len(tokens) == max_new_tokens
    top5 = [step_logits[0].topk(5).indices.tolist() for step_logits in out.logits]
    return ReferenceOutput(tokens, top5)


def mixed_length_prompts(w1_prompts: list[list[int]], count: int = 16) -> list[list[int]]:
    """Slices of the W1 prompts with lengths from 3 to 128 tokens, all different."""
    lengths = [3, 128, 17, 64, 5, 96, 33, 120, 9, 48, 72, 21, 110, 40, 7, 85]
    return [w1_prompts[i][: lengths[i % len(lengths)]] for i in range(count)]

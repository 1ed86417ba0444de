"""W1 (offline throughput) and W2 (single stream) on the default model, ours against transformers.

Both systems run in this one process, alternating, so the machine's noise hits
both alike. Prints medians over --runs and the ratios the issue sets targets on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from sluice.default_model import prepare_default_model

SHARED_BENCH = Path(__file__).resolve().parent / "workloads"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ours_seconds(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    assert all(len(r.outputs[0].token_ids) == max_tokens for r in results)
    return elapsed


@torch.inference_mode()
def transformers_seconds(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> float:
    input_ids = torch.tensor(prompts)
    start = time.perf_counter()
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    elapsed = time.perf_counter() - start
    assert out.shape[1] == input_ids.shape[1] + max_tokens
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--w1-output", type=int, default=128)
    parser.add_argument("--w2-output", type=int, default=256)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()

    w1 = json.loads((SHARED_BENCH / "w1_prompts.json").read_text())["prompts"]
    w2 = [json.loads((SHARED_BENCH / "w2_prompt.json").read_text())["prompt"]]
    path = prepare_default_model()
    log(f"loading the default model from {path} (bf16), ours and transformers'")
    llm = LLM(model=str(path), dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=2048)
    hf = None if args.skip_transformers else AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)

    log("warming up")
    ours_seconds(llm, w1[:4], 4)
    if hf is not None:
        transformers_seconds(hf.eval(), w1[:4], 4)

    times: dict[str, list[float]] = {k: [] for k in ("ours_w1", "ours_w2", "hf_w1", "hf_w2")}
    for run in range(1, args.runs + 1):
        log(f"run {run}/{args.runs}: ours W1")
        times["ours_w1"].append(ours_seconds(llm, w1, args.w1_output))
        log(f"run {run}/{args.runs}: ours W2")
        times["ours_w2"].append(ours_seconds(llm, w2, args.w2_output))
        if hf is not None:
            log(f"run {run}/{args.runs}: transformers W1 (static batch of 64)")
            times["hf_w1"].append(transformers_seconds(hf, w1, args.w1_output))
            log(f"run {run}/{args.runs}: transformers W2")
            times["hf_w2"].append(transformers_seconds(hf, w2, args.w2_output))

    w1_tokens = len(w1) * args.w1_output
    ours_w1 = w1_tokens / statistics.median(times["ours_w1"])
    ours_w2 = 1000 * statistics.median(times["ours_w2"]) / args.w2_output
    print(f"threads: {torch.get_num_threads()}  runs: {args.runs} (medians)")
    print(f"W1 ours:         {ours_w1:8.1f} output tok/s")
    print(f"W2 ours:         {ours_w2:8.2f} ms/token")
    if hf is not None:
        hf_w1 = w1_tokens / statistics.median(times["hf_w1"])
        hf_w2 = 1000 * statistics.median(times["hf_w2"]) / args.w2_output
        print(f"W1 transformers: {hf_w1:8.1f} output tok/s")
        print(f"W2 transformers: {hf_w2:8.2f} ms/token")
        print(f"W1 ratio ours/transformers throughput: {ours_w1 / hf_w1:.2f}x (target >= 2.5x)")
        print(f"W2 ratio ours/transformers time per token: {ours_w2 / hf_w2:.2f}x (target <= 0.6x)")


if __name__ == "__main__":
    main()

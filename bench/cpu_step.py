"""Times decode steps of the eager forward against the C++ model step (FULL and PIECEWISE).

Run under the exclusive lock, e.g.:
  flock -x /tmp/sluice-bench.lock .venv/bin/python bench/cpu_step.py --model DIR --batch 1 --batch 64
Each round runs every mode on the same state (a random KV cache of --context tokens per sequence),
alternating, and prints per-round and median milliseconds per decode step and their ratios to eager.
The modes full_whole_k, full_unfused_gate_up and full_unsplit_keys are FULL on a second copy of the
model, loaded with --no-gemm-k-blocks (the packed GEMM reads each column group whole),
--no-fused-gate-up, or --no-cpu-decode-split-keys (a few sequences' attention keys stay whole).
A step is the forward pass plus the LM head on each sequence's last token and a greedy pick.
--bind-threads pins torch's threads one per core; --busy-core starts a competing busy process there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from paged_sequences import PagedSequences
from sluice.cpu_tiers import CPU_ISA_CHOICES
from sluice.model_spec import read_model_spec
from worker.attention.cpu_backend import CpuAttentionBackend
from worker.cpu_model_step import CpuModelStep
from worker.model_loader import load_model
from worker.native_ops import use_cpu_isa

Forward = Callable[..., torch.Tensor]


# Modes that run FULL on a second copy of the model, loaded with one kernel switch off: load_model's
# keywords, then the attention backend's.
SECOND_COPY_MODES: dict[str, tuple[dict[str, bool], dict[str, bool]]] = {
    "full_whole_k": ({"gemm_k_blocks": False}, {}),
    "full_unfused_gate_up": ({"fused_gate_up": False}, {}),
    "full_unsplit_keys": ({}, {"split_keys": False}),
}


def decode_run(
    forward: Forward, batch: PagedSequences, kv_caches: list, context: int, steps: int
) -> tuple[float, list[int]]:
    """Mean seconds per decode step of `steps` steps from `context` tokens, and the last step's picks."""
    batch.computed = [context] * len(batch.seqs)
    model = batch.model
    ones = [1] * len(batch.seqs)
    start = time.perf_counter()
    for _ in range(steps):
        ids, positions, metadata = batch.next_inputs(ones)
        hidden = forward(ids, positions, kv_caches, metadata)
        picks = model.compute_logits(hidden).argmax(-1)
    elapsed = time.perf_counter() - start
    return elapsed / steps, picks.tolist()


def bench_batch(
    model: torch.nn.Module,
    step: CpuModelStep,
    args: argparse.Namespace,
    num_seqs: int,
    other_models: dict[str, Forward],
) -> None:
    vocab = model.embed_tokens.weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    seqs = [
        torch.randint(3, vocab, (args.context + args.steps,), generator=gen).tolist() for _ in range(num_seqs)
    ]
    batch = PagedSequences(model, seqs)
    # Attention reads the context whatever it holds: random rows stand in for a prefill.
    kv_caches = [(torch.randn_like(k), torch.randn_like(v)) for k, v in batch.new_kv_caches()]
    every_mode: dict[str, Forward] = {
        "eager": model.forward,
        "full": step.forward_full,
        "piecewise": step.forward_piecewise,
        **other_models,
    }
    names = args.modes.split(",")
    modes = {name: every_mode[name] for name in names}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    with torch.inference_mode():
        for forward in modes.values():
            decode_run(forward, batch, kv_caches, args.context, 2)
        for _ in range(args.rounds):
            picks = {}
            for mode, forward in modes.items():
                seconds, picks[mode] = decode_run(forward, batch, kv_caches, args.context, args.steps)
                times[mode].append(seconds * 1e3)
            assert all(p == picks[names[0]] for p in picks.values()), "the modes disagree"
    baseline = statistics.median(times[names[0]])
    print(f"batch {num_seqs} x {args.context} context, {args.steps} decode steps, ms per step:")
    for mode, values in times.items():
        median = statistics.median(values)
        rounds = " ".join(f"{v:.2f}" for v in values)
        ratio = median / baseline
        print(f"  {mode:10s} median {median:8.2f}  ratio to {names[0]} {ratio:.3f}  rounds [{rounds}]")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=Path(os.environ.get("SLUICE_MODEL_DIR", "")))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--cpu-isa", default="auto", choices=CPU_ISA_CHOICES, help="the kernels' tier")
    parser.add_argument("--batch", type=int, action="append", help="decode sequences per step (repeatable)")
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--modes", default="eager,full,piecewise", help="comma-separated; the first is the baseline"
    )
    parser.add_argument(
        "--bind-threads", action="store_true", help="pin torch's threads, one per allowed core"
    )
    parser.add_argument("--busy-core", type=int, help="keep this core busy with another process meanwhile")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    spec = read_model_spec(args.model)
    ops = use_cpu_isa(args.cpu_isa)
    if ops is None:
        raise SystemExit("cpu_step times Sluice's kernels: --cpu-isa none has none")
    model = load_model(spec, dtype, torch.device("cpu"), CpuAttentionBackend(ops))
    batches = args.batch or [1]
    step = CpuModelStep(ops, model, max(batches))
    other_models: dict[str, Forward] = {}
    for mode, (switches, attention_switches) in SECOND_COPY_MODES.items():
        if mode in args.modes.split(","):
            attention = CpuAttentionBackend(ops, **attention_switches)
            copy = load_model(spec, dtype, torch.device("cpu"), attention, **switches)
            other_models[mode] = CpuModelStep(ops, copy, max(batches)).forward_full
    if args.bind_threads:
        cores = sorted(os.sched_getaffinity(0))[: torch.get_num_threads()]
        print("bound threads to cores", ops.bind_threads(cores))
    busy = None
    if args.busy_core is not None:
        spin = f"import os; os.sched_setaffinity(0, {{{args.busy_core}}})\nwhile True: pass"
        busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        print(f"{args.model.name} {args.dtype}, {torch.get_num_threads()} threads, {ops.tier} kernels")
        for num_seqs in batches:
            bench_batch(model, step, args, num_seqs, other_models)
    finally:
        if busy is not None:
            busy.kill()


if __name__ == "__main__":
    main()

"""Two builds of the CPU kernels in one process, timed in turn: a kernel change's gain on a machine whose speed
drifts by more than the change between two runs.

  python bench/kernel_ab.py --baseline-rev HEAD~1 [--tier avx2] [--cases attention,rotary,linear,quantized]
                            [--rounds 7]

Checks --baseline-rev (a revision of this repository) out into a temporary worktree, builds its kernels of
--tier there with its own csrc/build_kernels.py, and loads that library beside this checkout's
(python/worker/kernel_libs, which scripts/setup builds). Each case then runs on both, alternating, for
--rounds rounds; it prints the median ms per call of each, the baseline's over this checkout's (above 1:
this checkout is faster), and whether the two gave the same bits.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from attention_kernel import SCALE, batch
from linear_kernel import SHAPES, random_quantized
from sluice.cpu_tiers import KERNEL_DIR
from worker.native_abi import QUANT_Q4_SYM, QUANT_Q8
from worker.native_ops import NativeOps

REPO = Path(__file__).resolve().parents[1]
# A case: (label, a function that runs it once on the given ops and returns its output).
Case = tuple[str, Callable[[NativeOps], torch.Tensor]]


def build_baseline(rev: str, tier: str, folder: Path) -> Path:
    """The kernel library of `tier` built from revision `rev`, in a worktree under `folder`."""
    tree = folder / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev], check=True)
    try:
        out = folder / "libs"
        build = [sys.executable, str(tree / "csrc" / "build_kernels.py"), "--out", str(out), "--tier", tier]
        subprocess.run(build, check=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=True)
    return out / f"libsluice_kernels_{tier}.so"


def attention_cases() -> list[Case]:
    """Paged attention on the default model's heads: decode batches and prefills, their caches cycled
    over enough layers to come from memory as a forward pass's do."""
    cases = []
    for num_seqs, context, q_len in (
        (64, 256, 1),
        (8, 2048, 1),
        (1, 2048, 1),
        (64, 128, 128),
        (1, 2048, 2048),
    ):
        layers = max(1, min(16, 24_000_000 // (num_seqs * context * 3 * 64 * 4)))
        batches = [batch(num_seqs, context, q_len) for _ in range(layers)]
        out = torch.empty_like(batches[0][0])

        def run(ops: NativeOps, batches: list = batches, out: torch.Tensor = out) -> torch.Tensor:
            for query, _, _, key_cache, value_cache, block_table, qsl, seq_lens, _ in batches:
                ops.paged_attention(
                    out, query, key_cache, value_cache, block_table, qsl, seq_lens, SCALE, 0, 0.0, True, True
                )
            return out

        kind = "decode" if q_len == 1 else "prefill"
        cases.append((f"attention {kind} {num_seqs} x {context}, {layers} layers' caches", run))
    return cases


def rotary_cases() -> list[Case]:
    cases = []
    for tokens in (64, 2048):
        qk = torch.randn(tokens, 12, 64).to(torch.bfloat16)
        cos, sin = (torch.randn(tokens, 64).to(torch.bfloat16) for _ in range(2))

        def run(
            ops: NativeOps, qk: torch.Tensor = qk, cos: torch.Tensor = cos, sin: torch.Tensor = sin
        ) -> torch.Tensor:
            x = qk.clone()
            ops.rotary_embedding(x, cos, sin)
            return x

        cases.append((f"rotary {tokens} tokens x 12 heads", run))
    return cases


def linear_cases(ops_by_name: dict[str, NativeOps]) -> list[Case]:
    """A decode step's linears on the default model's shapes (qkv, o, gate_up gated, down), 30 layers of
    weights, at 1 and 64 rows."""
    shapes = ((576, 960, False), (576, 576, False), (576, 3072, True), (1536, 576, False))
    weights = [[torch.randn(n, k).to(torch.bfloat16) for k, n, _ in shapes] for _ in range(30)]
    packed = {
        name: [
            [
                ops.pack_gated_linear_weight(w) if gated else ops.pack_linear_weight(w)
                for w, (_, _, gated) in zip(layer, shapes, strict=True)
            ]
            for layer in weights
        ]
        for name, ops in ops_by_name.items()
    }
    by_ops = {id(ops): packed[name] for name, ops in ops_by_name.items()}
    cases = []
    for rows in (1, 64):
        xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (576, 1536)}

        def run(ops: NativeOps, xs: dict[int, torch.Tensor] = xs) -> torch.Tensor:
            out = torch.empty(0)
            for layer in by_ops[id(ops)]:
                for w, (k, _, gated) in zip(layer, shapes, strict=True):
                    out = (ops.gated_linear if gated else ops.linear)(xs[k], w, None)
            return out

        cases.append((f"linears of a decode step, {rows} rows, 30 layers", run))
    return cases


def quantized_cases(ops_by_name: dict[str, NativeOps]) -> list[Case]:
    """The 1.1B model's quantized linears (qkv, o, gate_up, down; random Q4_0 and Q8_0 blocks), two layers of
    weights so that one row reads them from memory, at a decode step's 1 and 16 rows and a prefill chunk's
    512 and 2,048."""
    rng = np.random.default_rng(0)
    shapes = [(k, n) for name, k, n in SHAPES["1.1b"] if name != "lm_head"]
    cases = []
    for kind, kind_name in ((QUANT_Q4_SYM, "Q4_0"), (QUANT_Q8, "Q8_0")):
        layers = [[random_quantized(kind, n, k, rng) for k, n in shapes] for _ in range(2)]
        by_ops = {
            id(ops): [[ops.pack_quantized_weight([w], torch.bfloat16) for w in layer] for layer in layers]
            for ops in ops_by_name.values()
        }
        for rows in (1, 16, 512, 2048):
            xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k, _ in shapes}

            def run(ops: NativeOps, xs: dict[int, torch.Tensor] = xs, by_ops: dict = by_ops) -> torch.Tensor:
                out = torch.empty(0)
                for layer in by_ops[id(ops)]:
                    for w, (k, _) in zip(layer, shapes, strict=True):
                        out = ops.linear(xs[k], w, None)
                return out

            cases.append((f"{kind_name} linears of the 1.1B model, {rows} rows, 2 layers", run))
    return cases


def time_case(
    run: Callable[[NativeOps], torch.Tensor], libraries: dict[str, NativeOps], rounds: int
) -> dict[str, float]:
    """Median seconds per call of each library, alternating, each round about a quarter second."""
    start = time.perf_counter()
    for ops in libraries.values():
        run(ops)
    calls = max(1, int(0.25 / max((time.perf_counter() - start) / len(libraries), 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in libraries}
    for _ in range(rounds):
        for name, ops in libraries.items():
            began = time.perf_counter()
            for _ in range(calls):
                run(ops)
            times[name].append((time.perf_counter() - began) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--baseline-rev", required=True, help="the git revision to compare this checkout with"
    )
    parser.add_argument("--tier", default="avx2", help="the kernel tier of both builds (one this CPU runs)")
    parser.add_argument("--cases", default="attention,rotary,linear")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sluice-kernel-ab-") as folder:
        baseline_path = build_baseline(args.baseline_rev, args.tier, Path(folder))
        libraries = {
            args.baseline_rev: NativeOps(args.tier, baseline_path),
            "this checkout": NativeOps(args.tier, KERNEL_DIR / f"libsluice_kernels_{args.tier}.so"),
        }
        chosen = args.cases.split(",")
        cases = [
            *(attention_cases() if "attention" in chosen else []),
            *(rotary_cases() if "rotary" in chosen else []),
            *(linear_cases(libraries) if "linear" in chosen else []),
            *(quantized_cases(libraries) if "quantized" in chosen else []),
        ]
        print(
            f"{args.tier} kernels, torch threads {torch.get_num_threads()}, medians of {args.rounds} rounds"
        )
        for label, run in cases:
            base, ours = libraries.values()
            same = torch.equal(run(base).clone(), run(ours))
            medians = time_case(run, libraries, args.rounds)
            base_s, ours_s = medians[args.baseline_rev], medians["this checkout"]
            print(
                f"{label:<52} {args.baseline_rev} {base_s * 1e3:9.3f} ms   this checkout {ours_s * 1e3:9.3f} ms"
                f"   {base_s / ours_s:5.2f}x   same bits: {'yes' if same else 'no'}",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""Issue 29's MoE figures: the MoE bench model (make_moe_model.py: Qwen3-MoE, 1.9B parameters, 0.4B active)
in Sluice with its MoE kernel (csrc/cpu/moe.cpp, inside the C++ model step) against --no-fused-moe, the off
switch (the same GEMMs one expert at a time from Python, eagerly), and, given --llamacpp-dir, llama.cpp on the
same weights as f16 and bf16 GGUF files (converted by its own convert_hf_to_gguf.py; its better format is its
figure), alternating in one run. The issue's targets against llama.cpp: W4 at least 1.5x its output tok/s,
W5 at most 0.85x its ms per token.

W4 (16 prompts, 64 tokens out) is a batch whose tokens choose most experts at each step; W5 (one stream,
128 out) reads one token's experts a step. The one-stream floor is the bytes that step must read (every
weight but the experts its token did not choose: attention, routers, top_k experts a layer, the tied
embedding as LM head) over the read bandwidth measured before each run (bench/limits.py). Prints medians
of --runs and each system's distance to the floor.

  python bench/make_moe_model.py     # once
  python bench/compare_moe.py [--moe-model DIR] [--cpu-isa auto] [--runs 3] [--lock FILE] [--json F]
         [--llamacpp-dir DIR [--mode native|avx2]]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from compare_llamacpp import FORMATS, TARGETS
from compare_offline import System, run_phase, sluice_argv
from compare_quantized import print_medians
from harness import BENCH_DIR, LOCK_ENV, make_output_folders
from limits import weight_bytes
from llamacpp_peer import add_llamacpp_arguments, llamacpp_dir
from make_moe_model import default_moe_dir

FUSED = "sluice"
UNFUSED = "sluice, --no-fused-moe"


def active_bytes(model: Path) -> int:
    """Bytes one token's decode step reads: the folder's weights less the experts it does not choose."""
    config = json.loads((model / "config.json").read_text())
    experts = int(config.get("num_experts") or config["num_local_experts"])
    chosen = int(config["num_experts_per_tok"])
    expert_bytes = 3 * config["hidden_size"] * config["moe_intermediate_size"] * 2
    skipped = (experts - chosen) * expert_bytes * config["num_hidden_layers"]
    return weight_bytes(model) - skipped


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--moe-model", type=Path, default=None, help="default: make_moe_model.py's folder")
    parser.add_argument("--cpu-isa", default="auto", help="Sluice's kernel tier")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--lock", default=os.environ.get(LOCK_ENV), help="flock file: shared to load, exclusive to time"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    add_llamacpp_arguments(parser)
    args = parser.parse_args()
    make_output_folders(args.json, None)
    model = (args.moe_model or default_moe_dir()).resolve()
    if not (model / "config.json").is_file():
        raise SystemExit(f"{model} is not a model folder; build it: python bench/make_moe_model.py")
    sluice = sluice_argv(model, "--cpu-isa", args.cpu_isa)
    systems = [System(FUSED, sluice, None), System(UNFUSED, [*sluice, "--no-fused-moe"], None)]
    peer = llamacpp_dir(args.llamacpp_dir)
    if peer is not None:
        driver = [sys.executable, str(BENCH_DIR / "llamacpp_driver.py"), "--llamacpp-dir", str(peer)]
        systems += [
            System(
                f"llama.cpp {outtype}",
                [*driver, "--model", str(model), "--outtype", outtype, "--mode", args.mode],
                None,
            )
            for outtype in FORMATS
        ]
    results = run_phase(model, ["W4", "W5"], systems, args)
    per_token = active_bytes(model)
    w4 = print_medians(
        f"W4, {model.name}: output tok/s, medians of {args.runs} runs", results["figures"]["W4"], "tok_s"
    )
    print(f"  MoE kernel vs --no-fused-moe: {w4[FUSED] / w4[UNFUSED]:.2f}x")
    against_llamacpp("W4", w4)
    w5_runs = results["figures"]["W5"]
    w5 = print_medians(f"W5, {model.name}: ms/token, medians of {args.runs} runs", w5_runs, "ms_per_token")
    print(f"  MoE kernel vs --no-fused-moe: {w5[UNFUSED] / w5[FUSED]:.2f}x")
    against_llamacpp("W5", w5)
    floors = [per_token / (f["read_gbs"] * 1e9) * 1e3 for f in results["floors"]]
    bandwidth = statistics.median(f["read_gbs"] for f in results["floors"])
    print(
        f"  read floor: {statistics.median(floors):.2f} ms/token ({per_token / 1e9:.3f} GB a token at "
        f"{bandwidth:.1f} GB/s)"
    )
    for name, runs in w5_runs.items():
        distance = statistics.median(r["ms_per_token"] / floor for r, floor in zip(runs, floors, strict=True))
        print(f"  {name}: {distance:.2f}x the floor")
    if args.json:
        args.json.write_text(json.dumps({"runs": args.runs, "active_bytes": per_token, **results}, indent=1))


def against_llamacpp(workload: str, medians: dict[str, float]) -> None:
    """Sluice's median over llama.cpp's better format's, against the issue's target (when llama.cpp ran)."""
    peers = {name: value for name, value in medians.items() if name.startswith("llama.cpp")}
    if not peers:
        return
    target = TARGETS[workload]
    best = (max if target.higher_is_better else min)(peers, key=peers.__getitem__)
    ratio = medians[FUSED] / peers[best]
    print(
        f"  Sluice / {best} (llama.cpp's better): {ratio:.2f}x (target {target.describe()}: "
        f"{'met' if target.met(ratio) else 'NOT met'})"
    )


if __name__ == "__main__":
    main()

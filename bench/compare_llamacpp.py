"""Issue 26's offline figures: Sluice at one kernel tier against llama.cpp, in the same run (W1, W2, W4, W5).

Systems, each loaded in a process of its own while the runs alternate between them (compare_offline's
run_phase): Sluice (bench/sluice_driver.py --cpu-isa TIER) and llama.cpp with the same weights as f16 and
as bf16 GGUF files (bench/llamacpp_driver.py); llama.cpp's better format is its figure. Before each run
the bounds are measured (bench/limits.py): the read bandwidth, hence the one-stream floor of W2 and W5,
and the tier's fp32 FMA peak, hence the roofline of W1 and W4: the peak over the useful FLOPs per output
token (every linear of every token that passes the layers, the LM head where a token is sampled, and
causal attention). Prints medians of --runs, the ratios against the issue's targets and the distances
to the bounds; --switches NAMES also runs Sluice with those optimisations off.

  python bench/compare_llamacpp.py --llamacpp-dir DIR [--mode native|avx2] [--cpu-isa avx2] [--runs 3]
         [--workloads W1,W2,W4,W5] [--w4-model DIR] [--switches NAMES] [--lock FILE] [--json F] [--plot F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from compare_offline import (
    System,
    add_phase_arguments,
    headline,
    phase_models,
    run_phase,
    sluice_argv,
    write_outputs,
)
from harness import (
    BENCH_DIR,
    KERNEL_SWITCHES_OFF,
    SWITCHES_OFF,
    Target,
    chosen_switches,
    log,
    make_output_folders,
    offline_workload,
    spread,
)
from llamacpp_peer import add_llamacpp_arguments, required_llamacpp_dir, version
from plot_ratios import RatioBar

SLUICE = "sluice"
FORMATS = ("f16", "bf16")
# Issue 26's targets, against llama.cpp's better format in the same run.
TARGETS = {
    "W1": Target("output tok/s", 1.5, higher_is_better=True),
    "W2": Target("ms per token", 0.85, higher_is_better=False),
    "W4": Target("output tok/s", 1.5, higher_is_better=True),
    "W5": Target("ms per token", 0.85, higher_is_better=False),
}
# W1 must also reach this share of the FMA roofline; W2 and W5 come within this factor of their floor.
ROOFLINE_SHARE = 0.7
FLOOR_BOUND = 1.3


def flops_per_output_token(config: dict[str, Any], prompt_tokens: int, output_tokens: int) -> float:
    """Useful FLOPs of one sequence over its output tokens: the layers' linears for every token that passes
    them (the prompt, then each output but the last), the LM head for every sampled token, and causal
    attention (QK and PV) at each of those positions."""
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    layer_params = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    passes = prompt_tokens + output_tokens - 1
    linears = 2 * layer_params * layers * passes + 2 * hidden * config["vocab_size"] * output_tokens
    attention = 4 * heads * head_dim * layers * sum(range(1, passes + 1))
    return (linears + attention) / output_tokens


def systems_for(
    model: Path, folder: Path, mode: str, cpu_isa: str, switches: dict[str, list[str]]
) -> list[System]:
    sluice = sluice_argv(model, "--cpu-isa", cpu_isa)
    systems = [System(SLUICE, sluice, None)]
    for outtype in FORMATS:
        argv = [sys.executable, str(BENCH_DIR / "llamacpp_driver.py"), "--llamacpp-dir", str(folder)]
        systems.append(
            System(
                f"llama.cpp {outtype}",
                argv + ["--model", str(model), "--outtype", outtype, "--mode", mode],
                None,
            )
        )
    systems += [System(f"{SLUICE}, {name}", sluice + off, None) for name, off in switches.items()]
    return systems


def report(results: dict[str, Any], model: Path, runs: int, bars: list[RatioBar]) -> None:
    config = json.loads((model / "config.json").read_text())
    floors = results["floors"]
    for workload, per_system in results["figures"].items():
        key, unit = headline(workload)
        medians = {name: statistics.median(r[key] for r in rs) for name, rs in per_system.items()}
        print(f"\n{workload}: {unit}, medians of {runs} runs")
        for name, rs in per_system.items():
            values = [r[key] for r in rs]
            print(
                f"  {name:32} {medians[name]:9.2f}  (spread {100 * spread(values):4.1f}%: "
                + " ".join(f"{v:.2f}" for v in values)
                + ")"
            )
        peers = {name: value for name, value in medians.items() if name.startswith("llama.cpp")}
        best_name = (max if key == "tok_s" else min)(peers, key=peers.__getitem__)
        target = TARGETS[workload]
        ratio = medians[SLUICE] / peers[best_name]
        print(
            f"  Sluice / {best_name} (llama.cpp's better): {ratio:.2f}x  (target {target.describe()}: {'met' if target.met(ratio) else 'NOT met'})"
        )
        bars.append(RatioBar(f"{workload} {target.metric}", ratio, target))
        for name, off in medians.items():
            if name.startswith(f"{SLUICE}, "):
                gain = medians[SLUICE] / off if key == "tok_s" else off / medians[SLUICE]
                print(f"  on vs off ({name.removeprefix(f'{SLUICE}, ')}): {gain:.2f}x")
        if key == "ms_per_token":
            floor = statistics.median(f["floor_ms"] for f in floors)
            gbs = statistics.median(f["read_gbs"] for f in floors)
            print(
                f"  read-bandwidth floor: {floor:.2f} ms/token ({gbs:.1f} GB/s, median of the runs' measurements)"
            )
            for name in medians:
                distance = statistics.median(
                    r[key] / f["floor_ms"] for r, f in zip(per_system[name], floors, strict=True)
                )
                bound = f" (target within {FLOOR_BOUND:g}x)" if name == SLUICE else ""
                print(f"  {name}: {distance:.2f}x the floor{bound}")
        else:
            workload_def = offline_workload(workload)
            per_token = flops_per_output_token(
                config, len(workload_def.prompts[0]), workload_def.output_tokens
            )
            peak = statistics.median(f["fma_peak_gflops"] for f in floors)
            roofline = peak * 1e9 / per_token
            print(
                f"  FMA roofline: {roofline:.1f} tok/s ({peak:.1f} GFLOP/s over {per_token / 1e9:.3f} GFLOP a token)"
            )
            for name in medians:
                share = statistics.median(
                    r[key] * per_token / (f["fma_peak_gflops"] * 1e9)
                    for r, f in zip(per_system[name], floors, strict=True)
                )
                bound = (
                    f" (target at least {ROOFLINE_SHARE:.0%} for W1)"
                    if name == SLUICE and workload == "W1"
                    else ""
                )
                print(f"  {name}: {share:.0%} of the roofline{bound}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_llamacpp_arguments(parser)
    parser.add_argument("--cpu-isa", default="auto", help="Sluice's kernel tier (and the FMA roofline's)")
    add_phase_arguments(parser)
    parser.add_argument(
        "--switches", default=None, help="also run Sluice with these optimisations off (comma-separated)"
    )
    args = parser.parse_args()
    make_output_folders(args.json, args.plot)
    folder = required_llamacpp_dir(args.llamacpp_dir)

    from sluice.kernel_libraries import choose_kernels

    tier = choose_kernels(args.cpu_isa).tier
    if tier == "none":
        raise SystemExit("--cpu-isa none has no FMA roofline to hold Sluice to: name a tier")
    log(f"Sluice at the {tier} tier; llama.cpp {version(folder, args.mode)} ({args.mode} build)")
    switches = chosen_switches(args.switches, SWITCHES_OFF | KERNEL_SWITCHES_OFF)
    every: dict[str, Any] = {"runs": args.runs, "tier": tier, "llamacpp_mode": args.mode, "phases": {}}
    bars: list[RatioBar] = []
    for phase, workloads, model in phase_models(args):
        results = run_phase(
            model, workloads, systems_for(model, folder, args.mode, tier, switches), args, fma_tier=tier
        )
        every["phases"][phase] = {"model": str(model), **results}
        report(results, model, args.runs, bars)
    write_outputs(
        args,
        every,
        bars,
        f"Sluice ({tier}) vs llama.cpp ({args.mode}), offline (medians, same run)",
        peer="llama.cpp's better format",
    )


if __name__ == "__main__":
    main()

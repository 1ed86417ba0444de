"""Issue 27's offline figures: Sluice on quantized GGUF files against llama.cpp on the same files, in the
same run (W1, W2 on the default model; W4, W5 on the 1.1B model).

Each file is made once from the model's f16 GGUF by llama.cpp's own llama-quantize
(bench/llamacpp_peer.py). For every file the systems are loaded in processes of their own while the runs
alternate between them (compare_offline's run_phase): Sluice serving the file on its integer GEMM
(bench/sluice_driver.py --model FILE), llama.cpp's tools on it (bench/llamacpp_driver.py --gguf FILE),
and Sluice with --gguf-dequantize (the off switch: the weights widened to bf16 at load). Before each
run the read bandwidth is measured (bench/limits.py); the one-stream floor of W2 and W5 is the bytes a
decode step must read from the file (every tensor but the embedding table, which a step looks up a
row of; a tied model's table is its LM head, read whole) over that bandwidth. Prints medians of --runs,
the ratios against the issue's targets and the distances to the floor.

--at-load int8,int4 measures quantization at load instead: Sluice on the Hugging Face folder in bf16
against the same folder with --quantization int8 and int4, on W4 and W5 (issue 27: int8's W5 <= 0.6x
the bf16 ms per token, its W4 >= 1.3x the bf16 tok/s).

  python bench/compare_quantized.py --llamacpp-dir DIR [--formats Q8_0,Q4_0,Q4_K_M] [--cpu-isa avx2]
         [--runs 3] [--workloads W1,W2,W4,W5] [--w4-model DIR] [--lock FILE] [--json F] [--plot F]
  python bench/compare_quantized.py --at-load int8,int4 [--cpu-isa avx2] [--runs 3] [--w4-model DIR]
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
from harness import BENCH_DIR, Target, log, make_output_folders, spread
from llamacpp_peer import add_llamacpp_arguments, quantized_gguf, required_llamacpp_dir, version
from make_w4_model import default_w4_dir
from plot_ratios import RatioBar, plot_ratios

SLUICE = "sluice"
LLAMACPP = "llama.cpp"
DEQUANTIZED = "sluice, gguf dequantize"
# Issue 27's targets against llama.cpp on the same file (W2 and W5 also within FLOOR_BOUND of the floor).
TARGETS = {
    "W1": Target("output tok/s", 2.0, higher_is_better=True),
    "W2": Target("ms per token", 0.8, higher_is_better=False),
    "W4": Target("output tok/s", 2.0, higher_is_better=True),
    "W5": Target("ms per token", 0.8, higher_is_better=False),
}
FLOOR_BOUND = 1.4
BF16 = "sluice bf16"
# --quantization int8 against the bf16 folder (issue 27).
AT_LOAD_TARGETS = {
    "W4": Target("output tok/s", 1.3, higher_is_better=True),
    "W5": Target("ms per token", 0.6, higher_is_better=False),
}


def decode_bytes(gguf: Path, tied: bool) -> int:
    """Bytes of the file that one decode step reads: every tensor but the embedding table, unless the
    table is also the LM head."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    return sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight" or tied)


def systems_for(gguf: Path, folder: Path, mode: str, cpu_isa: str) -> list[System]:
    sluice = sluice_argv(gguf, "--cpu-isa", cpu_isa)
    llamacpp = [sys.executable, str(BENCH_DIR / "llamacpp_driver.py"), "--llamacpp-dir", str(folder)]
    return [
        System(SLUICE, sluice, None),
        System(LLAMACPP, [*llamacpp, "--gguf", str(gguf), "--mode", mode], None),
        System(DEQUANTIZED, [*sluice, "--gguf-dequantize"], None),
    ]


def print_medians(title: str, per_system: dict[str, list[dict[str, float]]], key: str) -> dict[str, float]:
    """Prints each system's median of `key`, its spread and its runs under `title`; returns the medians."""
    medians = {name: statistics.median(r[key] for r in rs) for name, rs in per_system.items()}
    print(f"\n{title}")
    for name, rs in per_system.items():
        values = [r[key] for r in rs]
        runs = " ".join(f"{v:.2f}" for v in values)
        print(f"  {name:28} {medians[name]:9.2f}  (spread {100 * spread(values):4.1f}%: {runs})")
    return medians


def report(results: dict[str, Any], label: str, floor_bytes: int, runs: int, bars: list[RatioBar]) -> None:
    for workload, per_system in results["figures"].items():
        key, unit = headline(workload)
        medians = print_medians(f"{workload}, {label}: {unit}, medians of {runs} runs", per_system, key)
        target = TARGETS[workload]
        ratio = medians[SLUICE] / medians[LLAMACPP]
        verdict = "met" if target.met(ratio) else "NOT met"
        print(f"  Sluice / llama.cpp: {ratio:.2f}x  (target {target.describe()}: {verdict})")
        bars.append(RatioBar(f"{workload} {label}", ratio, target))
        off = medians[DEQUANTIZED]
        gain = medians[SLUICE] / off if key == "tok_s" else off / medians[SLUICE]
        print(f"  integer GEMM vs --gguf-dequantize: {gain:.2f}x")
        if key == "ms_per_token":
            floors = [floor_bytes / (f["read_gbs"] * 1e9) * 1e3 for f in results["floors"]]
            print(
                f"  read floor: {statistics.median(floors):.2f} ms/token ({floor_bytes / 1e9:.3f} GB a token at "
                f"{statistics.median(f['read_gbs'] for f in results['floors']):.1f} GB/s)"
            )
            for name in medians:
                distance = statistics.median(
                    r[key] / floor for r, floor in zip(per_system[name], floors, strict=True)
                )
                bound = f" (target within {FLOOR_BOUND:g}x)" if name == SLUICE else ""
                print(f"  {name}: {distance:.2f}x the floor{bound}")


def at_load(
    model: Path, quantizations: list[str], tier: str, args: argparse.Namespace, bars: list[RatioBar]
) -> dict:
    """W4 and W5 on the folder in bf16 and with each --quantization, alternating."""
    sluice = sluice_argv(model, "--cpu-isa", tier)
    systems = [System(BF16, sluice, None)]
    systems += [System(f"sluice {q}", [*sluice, "--quantization", q], None) for q in quantizations]
    results = run_phase(model, ["W4", "W5"], systems, args)
    for workload, per_system in results["figures"].items():
        key, unit = headline(workload)
        medians = print_medians(
            f"{workload}, {model.name}: {unit}, medians of {args.runs} runs", per_system, key
        )
        target = AT_LOAD_TARGETS[workload]
        for q in quantizations:
            ratio = medians[f"sluice {q}"] / medians[BF16]
            verdict = (
                f"target {target.describe()}: {'met' if target.met(ratio) else 'NOT met'}"
                if q == "int8"
                else ""
            )
            print(f"  {q} / bf16: {ratio:.2f}x  {verdict}")
            bars.append(RatioBar(f"{workload} {q} at load", ratio, target))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_llamacpp_arguments(parser)
    parser.add_argument("--cpu-isa", default="auto", help="Sluice's kernel tier")
    parser.add_argument("--formats", default="Q8_0,Q4_0,Q4_K_M", help="llama-quantize types, comma-separated")
    parser.add_argument(
        "--at-load", default=None, help="measure --quantization (int8,int4) against bf16 instead"
    )
    add_phase_arguments(parser)
    args = parser.parse_args()
    make_output_folders(args.json, args.plot)

    from sluice.kernel_libraries import choose_kernels

    tier = choose_kernels(args.cpu_isa).tier
    if tier == "none":
        raise SystemExit("--cpu-isa none runs no integer GEMM: name a tier")
    bars: list[RatioBar] = []
    if args.at_load:
        results = at_load(
            (args.w4_model or default_w4_dir()).resolve(), args.at_load.split(","), tier, args, bars
        )
        if args.json:
            args.json.write_text(json.dumps({"runs": args.runs, "tier": tier, **results}, indent=1))
        if args.plot:
            plot_ratios(bars, args.plot, f"Sluice ({tier}): --quantization against bf16", peer="bf16")
        return
    folder = required_llamacpp_dir(args.llamacpp_dir)
    log(f"Sluice at the {tier} tier; llama.cpp {version(folder, args.mode)} ({args.mode} build)")
    every: dict[str, Any] = {"runs": args.runs, "tier": tier, "llamacpp_mode": args.mode, "phases": {}}
    for phase, workloads, model in phase_models(args):
        tied = bool(json.loads((model / "config.json").read_text()).get("tie_word_embeddings", False))
        for qtype in args.formats.split(","):
            gguf = quantized_gguf(folder, model, qtype)
            log(f"{model.name} {qtype}: {gguf} ({gguf.stat().st_size / 1e6:.0f} MB)")
            results = run_phase(model, workloads, systems_for(gguf, folder, args.mode, tier), args)
            floor_bytes = decode_bytes(gguf, tied)
            every["phases"][f"{phase} {qtype}"] = {"gguf": str(gguf), "decode_bytes": floor_bytes, **results}
            report(results, qtype, floor_bytes, args.runs, bars)
    write_outputs(
        args,
        every,
        bars,
        f"Sluice ({tier}) vs llama.cpp ({args.mode}) on the same GGUF files",
        peer="llama.cpp",
    )


if __name__ == "__main__":
    main()

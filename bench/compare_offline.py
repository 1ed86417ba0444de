"""Issue 8's offline figures, Sluice against vLLM's CPU build in the same run: W1, W2, W4, W5.

Every system stays loaded in its own process (bench/sluice_driver.py, bench/vllm_driver.py under
vLLM's venv) while the runs alternate between them, run after run, so the machine's drift hits
all alike. Before each run the read bandwidth is measured (bench/limits.py), for the floor of the
single-stream workloads. Prints medians of --runs, the ratio to vLLM and the issue's target, the
distance to the read-bandwidth floor (W2, W5), and, with --switches, each optimisation on against
off (async scheduling, the graph dispatcher, the multiprocess executor, the packed linear, its K
blocks, the native argmax), or with --switches NAME[,NAME] only those (names as printed). Without --vllm-venv (or
$SLUICE_BENCH_VLLM_VENV) Sluice runs alone, and says so.

  python bench/compare_offline.py [--vllm-venv DIR] [--runs 3] [--workloads W1,W2,W4,W5]
         [--switches [NAMES]] [--w4-model DIR] [--lock FILE] [--json FILE] [--plot FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import (
    BENCH_DIR,
    KERNEL_SWITCHES_OFF,
    LOCK_ENV,
    SWITCHES_OFF,
    TARGETS,
    W5_FLOOR_BOUND,
    JsonLineChild,
    bench_lock,
    chosen_switches,
    log,
    make_output_folders,
    offline_workload,
    spread,
    wait_until_quiet,
)
from make_w4_model import default_w4_dir
from plot_ratios import RatioBar, plot_ratios
from vllm_peer import vllm_env, vllm_python, vllm_venv

SLUICE = "sluice"
VLLM = "vllm"
# Which model each workload runs on: the default model's, or the 1.1B W4 model's phase.
PHASES = {"default": ("W1", "W2"), "w4": ("W4", "W5")}


@dataclass(frozen=True, slots=True)
class System:
    name: str
    argv: list[str]
    env: dict[str, str] | None


def sluice_argv(model: Path, *options: str) -> list[str]:
    """The command that serves `model` through bench/sluice_driver.py with these engine options."""
    return [sys.executable, str(BENCH_DIR / "sluice_driver.py"), "--model", str(model), *options]


def systems_for(
    model: Path, venv: Path | None, switches: dict[str, list[str]], sluice_args: list[str]
) -> list[System]:
    sluice = sluice_argv(model, *sluice_args)
    systems = [System(SLUICE, sluice, None)]
    if venv is not None:
        argv = [vllm_python(venv), str(BENCH_DIR / "vllm_driver.py"), "--model", str(model)]
        systems.append(System(VLLM, argv, vllm_env(venv)))
    systems += [System(f"{SLUICE}, {name}", sluice + off, None) for name, off in switches.items()]
    return systems


def read_floor_ms(model: Path, fma_tier: str | None = None) -> dict[str, float]:
    """Read bandwidth now, the model's one-stream decode floor at that bandwidth, and with fma_tier
    that kernel tier's fp32 FMA peak (GFLOP/s)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        argv = [sys.executable, str(BENCH_DIR / "limits.py"), "--no-matmul", "--model", str(model)]
        argv += [] if fma_tier is None else ["--fma-tier", fma_tier]
        subprocess.run([*argv, "--json", out.name], check=True, stdout=subprocess.DEVNULL)
        figures = json.loads(Path(out.name).read_text())
    bounds = {"read_gbs": figures["read_gbs"], "floor_ms": figures["models"][str(model)]["decode_floor_ms"]}
    if fma_tier is not None:
        bounds["fma_peak_gflops"] = figures["fma_peak_gflops"]
    return bounds


def run_phase(
    model: Path,
    workloads: list[str],
    systems: list[System],
    args: argparse.Namespace,
    fma_tier: str | None = None,
) -> dict[str, Any]:
    """Every run of every workload on every system, alternating; the systems' order rotates per run.
    Before each run the bounds are measured (read_floor_ms, with fma_tier's FMA peak)."""
    figures: dict[str, dict[str, list[dict[str, float]]]] = {
        w: {s.name: [] for s in systems} for w in workloads
    }
    floors: list[dict[str, float]] = []
    children: list[JsonLineChild] = []
    try:
        with bench_lock(args.lock, exclusive=False):
            for system in systems:
                log(f"starting {system.name} on {model.name}")
                children.append(JsonLineChild(system.name, system.argv, system.env))
                children[-1].read_reply()
            for workload in workloads:
                for child in children:
                    log(f"warming up {child.name} on {workload}")
                    child.ask({"workload": workload, "warmup": True})
        for run in range(args.runs):
            with bench_lock(args.lock, exclusive=True):
                floors.append(read_floor_ms(model, fma_tier))
                log(f"run {run + 1}/{args.runs}: read bandwidth {floors[-1]['read_gbs']:.1f} GB/s")
                order = children[run % len(children) :] + children[: run % len(children)]
                for workload in workloads:
                    for child in order:
                        wait_until_quiet()
                        reply = child.ask({"workload": workload})
                        log(f"run {run + 1}/{args.runs}: {workload} {child.name}: {reply}")
                        figures[workload][child.name].append(reply)
    finally:
        for child in children:
            child.close()
    return {"figures": figures, "floors": floors}


def headline(workload: str) -> tuple[str, str]:
    """The figure a workload is judged by, and its unit."""
    return ("ms_per_token", "ms/token") if offline_workload(workload).single_stream else ("tok_s", "tok/s")


def report(results: dict[str, Any], runs: int, bars: list[RatioBar]) -> None:
    """Print each workload's table and append its ratio to vLLM (if any) to `bars`."""
    for workload, per_system in results["figures"].items():
        key, unit = headline(workload)
        target = TARGETS[workload]
        medians = {name: statistics.median(r[key] for r in rs) for name, rs in per_system.items()}
        print(f"\n{workload}: {unit}, medians of {runs} runs")
        for name, rs in per_system.items():
            values = [r[key] for r in rs]
            line = f"  {name:32} {medians[name]:9.2f}  (spread {100 * spread(values):4.1f}%: "
            print(line + " ".join(f"{v:.2f}" for v in values) + ")")
        if VLLM in medians:
            ratio = medians[SLUICE] / medians[VLLM]
            verdict = "met" if target.met(ratio) else "NOT met"
            print(f"  Sluice / vLLM: {ratio:.2f}x  (target {target.describe()}: {verdict})")
            bars.append(RatioBar(f"{workload} {target.metric}", ratio, target))
        else:
            print("  no vLLM in this run (--vllm-venv): Sluice alone, no ratio")
        for name, off in medians.items():
            if name.startswith(f"{SLUICE}, "):
                # Gain of the switch: how much better Sluice is with the optimisation on than off.
                on = medians[SLUICE]
                gain = on / off if key == "tok_s" else off / on
                print(f"  on vs off ({name.removeprefix(f'{SLUICE}, ')}): {gain:.2f}x")
        if key == "ms_per_token":
            floor = statistics.median(f["floor_ms"] for f in results["floors"])
            gbs = statistics.median(f["read_gbs"] for f in results["floors"])
            print(
                f"  read-bandwidth floor: {floor:.2f} ms/token ({gbs:.1f} GB/s, median of the runs' measurements)"
            )
            for name in medians:
                # Paired per run: each run's time over the floor measured just before it.
                distance = statistics.median(
                    r[key] / f["floor_ms"] for r, f in zip(per_system[name], results["floors"])
                )
                bound = f" (target within {W5_FLOOR_BOUND:g}x)" if workload == "W5" and name == SLUICE else ""
                print(f"  {name}: {distance:.2f}x the floor{bound}")


def add_phase_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of every offline comparison: the runs, the workloads, their two models, the lock, the outputs."""
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workloads", default="W1,W2,W4,W5")
    parser.add_argument("--model", type=Path, default=None, help="W1/W2 model (default: the default model)")
    parser.add_argument("--w4-model", type=Path, default=None, help="W4/W5 model (bench/make_w4_model.py)")
    parser.add_argument(
        "--lock", default=os.environ.get(LOCK_ENV), help="flock file: shared to load, exclusive to time"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of the ratios against the targets")


def phase_models(args: argparse.Namespace) -> Iterator[tuple[str, list[str], Path]]:
    """Each phase with a workload that --workloads asks for: its name, those workloads, its model folder."""
    from sluice.default_model import prepare_default_model

    wanted = args.workloads.split(",")
    for phase, phase_workloads in PHASES.items():
        workloads = [w for w in phase_workloads if w in wanted]
        if not workloads:
            continue
        named = args.model if phase == "default" else args.w4_model
        model = (named or (prepare_default_model() if phase == "default" else default_w4_dir())).resolve()
        if not (model / "config.json").is_file():
            raise SystemExit(
                f"{model} is not a model folder; for W4/W5 build it: python bench/make_w4_model.py"
            )
        yield phase, workloads, model


def write_outputs(
    args: argparse.Namespace, every: dict[str, Any], bars: list[RatioBar], title: str, peer: str = "vLLM"
) -> None:
    """Every figure to --json, and the ratios' plot to --plot."""
    if args.json:
        args.json.write_text(json.dumps(every, indent=1))
    if args.plot and bars:
        plot_ratios(bars, args.plot, title, peer=peer)
        print(f"\nplot: {args.plot}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-venv", default=None, help="vLLM's venv (or $SLUICE_BENCH_VLLM_VENV)")
    add_phase_arguments(parser)
    parser.add_argument(
        "--switches",
        nargs="?",
        const="all",
        default=None,
        help="also run Sluice with each optimisation off, or only the named ones (comma-separated)",
    )
    parser.add_argument("--sluice-arg", action="append", default=[], help="extra sluice_driver.py option")
    args = parser.parse_args()
    make_output_folders(args.json, args.plot)
    if args.runs < 3:
        log(f"--runs {args.runs}: the issue's figures are medians of at least 3")
    venv = vllm_venv(args.vllm_venv)
    if venv is None:
        log("no vLLM venv given (--vllm-venv or $SLUICE_BENCH_VLLM_VENV): running Sluice alone, no ratios")
    for workload in args.workloads.split(","):
        offline_workload(workload)
    every: dict[str, Any] = {"runs": args.runs, "vllm_venv": str(venv) if venv else None, "phases": {}}
    bars: list[RatioBar] = []
    for phase, workloads, model in phase_models(args):
        systems = systems_for(
            model, venv, chosen_switches(args.switches, SWITCHES_OFF | KERNEL_SWITCHES_OFF), args.sluice_arg
        )
        results = run_phase(model, workloads, systems, args)
        every["phases"][phase] = {"model": str(model), **results}
        report(results, args.runs, bars)
    write_outputs(args, every, bars, "Sluice vs vLLM CPU, offline (medians, same run)")


if __name__ == "__main__":
    main()

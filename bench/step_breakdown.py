"""Where a step's time goes: scheduler, input prep, forward, sampling, IPC, per step, for one workload.

Runs the workload in a child process with SLUICE_STEP_TIMING=1 (python/sluice/step_timing.py),
then reads the totals that the engine core and each worker print when they exit, and prints
milliseconds per step by phase. "IPC and waiting" is the engine core's wait for the workers less
the worker's own phases: the messages' travel and decoding, and any idle gap.

  python bench/step_breakdown.py --workload W2 [--no-async-scheduling] [--enforce-eager]
                                 [--executor mp|inproc] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from harness import log, offline_workload

REPORT_PREFIX = "sluice step timing: "
WORKER_PHASES = ("prepare_inputs", "forward", "sample", "bookkeeping", "send_output")
ENGINE_PHASES = ("schedule", "submit", "update")


def run_child(args: argparse.Namespace) -> None:
    from engine import LLM, SamplingParams

    workload = offline_workload(args.workload)
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        max_model_len=2048,
        enable_prefix_caching=False,
        async_scheduling=args.async_scheduling,
        enforce_eager=args.enforce_eager,
        executor=args.executor,
    )
    params = SamplingParams(temperature=0.0, max_tokens=workload.output_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params)
    llm.engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="W2", choices=["W1", "W2", "W4", "W5"])
    parser.add_argument("--model", default=None, help="model folder (default: the default model)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--executor", default="mp", choices=["mp", "inproc"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args)
        return

    argv = [sys.executable, __file__, "--child", *sys.argv[1:]]
    log(f"running {args.workload} with step timing on")
    done = subprocess.run(
        argv, env={**os.environ, "SLUICE_STEP_TIMING": "1"}, stderr=subprocess.PIPE, text=True, check=True
    )
    reports = [
        json.loads(line.removeprefix(REPORT_PREFIX))
        for line in done.stderr.splitlines()
        if line.startswith(REPORT_PREFIX)
    ]
    engine = next(r for r in reports if r["owner"] == "engine core")
    worker = next(r for r in reports if r["owner"] == "worker")
    steps = engine["steps"]
    per_step = {phase: 1e3 * engine["seconds"].get(phase, 0.0) / steps for phase in ENGINE_PHASES}
    worker_ms = {phase: 1e3 * worker["seconds"].get(phase, 0.0) / steps for phase in WORKER_PHASES}
    wait = 1e3 * engine["seconds"].get("wait_for_workers", 0.0) / steps
    switches = f"async {args.async_scheduling}, eager {args.enforce_eager}, executor {args.executor}"
    print(f"{args.workload}: {steps} steps ({switches}); ms per step")
    for phase, ms in {**per_step, **worker_ms}.items():
        print(f"  {phase:<26}{ms:8.3f}")
    if args.executor == "mp":
        # Worker phases overlap the engine core's own under async scheduling; the rest of the wait is transit.
        print(f"  {'IPC and waiting':<26}{max(0.0, wait - sum(worker_ms.values())):8.3f}")
    print(f"  {'engine core wait (total)':<26}{wait:8.3f}")


if __name__ == "__main__":
    main()

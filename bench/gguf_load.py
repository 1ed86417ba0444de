"""Model load time: the default model from its GGUF file (dequantized at load) against the bfloat16
folder converted from it. Each run is a fresh process that builds `LLM(...)` (in-process worker,
eager, a small KV cache) and reports the seconds until it returns; the runs alternate, and the
medians and their ratio are printed and written as JSON.

    flock -x /tmp/sluice-bench.lock .venv/bin/python bench/gguf_load.py [--runs 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from sluice.default_model import gguf_path, prepare_default_model

_PROBE = """
import sys, time
start = time.perf_counter()
from sluice import LLM
LLM(sys.argv[1], executor="inproc", enforce_eager=True, max_model_len=256, kv_cache_memory=0.1)
print(time.perf_counter() - start)
"""


def load_seconds(model: Path) -> float:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(model)], check=True, capture_output=True, text=True
    )
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    models = {"folder_bf16": prepare_default_model(), "gguf_q4_1": gguf_path()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for run in range(args.runs):
        for name, model in models.items():
            times[name].append(load_seconds(model))
            print(f"run {run + 1}: {name} {times[name][-1]:.2f} s", flush=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "runs": times,
        "median_s": medians,
        "gguf_over_folder": medians["gguf_q4_1"] / medians["folder_bf16"],
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

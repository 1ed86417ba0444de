"""W3 (online) against vLLM's api_server and llama-server, the on/off switches, and a sweep over the engine's
threads and binding.

Starts `sluice serve` (one server per configuration), vLLM's api_server (bf16, max_model_len 2048)
and llama-server (16 slots, a GGUF file of the same weights; --llamacpp-dir), prefix caching off on
every one, and keeps them all up while the runs alternate between them. A run is the 64 W1 prompts as streaming /v1/completions requests (token ids, 128 tokens,
ignore_eos, concurrency 16) through the `openai` client. Prints medians of --runs: output tok/s,
TTFT p50/p99, TPOT p50/p99, the servers' CPU seconds per 1,000 tokens, the ratios to vLLM against
the issue's targets, each switch on against off (--switches), and one row per --num-threads x
--cpu-bind pair (the sweep). --busy N adds N spinning processes during every timed run: a busy
frontend host.

  python bench/compare_w3.py [--vllm-venv DIR] [--llamacpp-dir DIR [--llamacpp-outtype f16]] [--runs 3]
         [--switches] [--num-threads N ...] [--cpu-bind auto|none|LIST ...] [--busy N] [--json F] [--plot F]
  python bench/compare_w3.py --llamacpp-dir DIR --gguf-type Q4_K_M [--runs 3] [sluice serve options ...]

The ratios to vLLM are held to issue 8's targets, those to llama.cpp to issue 26's. --gguf-type serves one
llama-quantize file of the model on both Sluice and llama-server instead (issue 27's W3, the same targets;
no vLLM, which reads no GGUF file); options after the known ones go to every `sluice serve`, such as
--kv-cache-dtype int8.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import (
    LOCK_ENV,
    SWITCHES_OFF,
    TARGETS,
    Target,
    bench_lock,
    busy_share,
    chosen_switches,
    log,
    make_output_folders,
    spread,
    w1_prompts,
    wait_until_quiet,
)
from llamacpp_peer import gguf_file, llamacpp_dir, quantized_gguf
from plot_ratios import RatioBar, plot_ratios
from servers import Server, start_llamacpp, start_sluice, start_vllm
from vllm_peer import vllm_venv
from w3_client import run_w3

SLUICE = "sluice"
VLLM = "vllm"
LLAMACPP = "llama.cpp"
# Issue 26's W3 targets against llama-server with 16 slots.
LLAMACPP_TARGETS = {
    "W3 throughput": Target("output tok/s", 2.0, higher_is_better=True),
    "W3 TTFT p99": Target("TTFT p99", 0.7, higher_is_better=False),
}
# The figures of a run, the way they are printed and judged: (field, label, target key).
METRICS = (
    ("out_tok_s", "tok/s", "W3 throughput"),
    ("ttft_p50_ms", "TTFT p50 ms", None),
    ("ttft_p99_ms", "TTFT p99 ms", "W3 TTFT p99"),
    ("tpot_p50_ms", "TPOT p50 ms", "W3 TPOT p50"),
    ("tpot_p99_ms", "TPOT p99 ms", None),
)
IDLE_WINDOW_S = 3.0


def sluice_configurations(args: argparse.Namespace) -> dict[str, list[str]]:
    """Server name -> extra `sluice serve` options: the default, the switches off, the sweep."""
    configurations = {SLUICE: list(args.sluice_options)}
    switches = chosen_switches(args.switches, SWITCHES_OFF)
    configurations |= {f"{SLUICE}, {name}": off for name, off in switches.items()}
    threads = args.num_threads or [None]
    binds = args.cpu_bind or [None]
    if args.num_threads or args.cpu_bind:
        for count, bind in itertools.product(threads, binds):
            options = ([] if count is None else ["--num-threads", str(count)]) + (
                [] if bind is None else ["--cpu-bind", bind]
            )
            configurations[f"{SLUICE} threads={count or 'default'} bind={bind or 'default'}"] = options
    return configurations


def timed_run(server: Server, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, float]:
    wait_until_quiet()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        cpu_before = server.cpu_seconds()
        figures = run_w3(server.url, prompts, args.concurrency, args.output_tokens, server.request_extra)
        cpu = server.cpu_seconds() - cpu_before
    finally:
        for process in busy:
            process.kill()
            process.wait()
    return {**dataclasses.asdict(figures), "server_cpu_s_per_1k": 1e3 * cpu / figures.output_tokens}


def run_all(servers: list[Server], args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    prompts = w1_prompts()[: args.num_prompts]
    runs: dict[str, list[dict[str, float]]] = {s.name: [] for s in servers}
    with bench_lock(args.lock, exclusive=False):
        for server in servers:
            log(f"waiting for {server.name} ({server.url})")
            server.wait_ready()
        for server in servers:
            log(f"warming up {server.name}")
            run_w3(server.url, prompts[: args.concurrency], args.concurrency, 8, server.request_extra)
    for run in range(args.runs):
        with bench_lock(args.lock, exclusive=True):
            if run == 0:
                log(f"machine busy while every server idles: {100 * busy_share(IDLE_WINDOW_S):.0f}%")
            order = servers[run % len(servers) :] + servers[: run % len(servers)]
            for server in order:
                runs[server.name].append(timed_run(server, prompts, args))
                shown = {k: round(v, 1) for k, v in runs[server.name][-1].items()}
                log(f"run {run + 1}/{args.runs}: {server.name}: {shown}")
    return runs


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def report(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace, bars: list[RatioBar]) -> None:
    table = {name: medians(rs) for name, rs in runs.items()}
    width = max(len(name) for name in table) + 2
    header = "".join(f"{label:>13}" for _, label, _ in METRICS)
    print(
        f"\nW3: {args.num_prompts} prompts, concurrency {args.concurrency}, {args.output_tokens} tokens, "
        f"busy processes {args.busy}; medians of {args.runs} runs"
    )
    print(f"{'server':{width}}{header}{'CPU s/1k tok':>14}{'tok/s spread':>14}")
    for name, row in table.items():
        cells = "".join(f"{row[field]:13.1f}" for field, _, _ in METRICS)
        tok_spread = 100 * spread([r["out_tok_s"] for r in runs[name]])
        print(f"{name:{width}}{cells}{row['server_cpu_s_per_1k']:14.3f}{tok_spread:13.1f}%")
    peers = [(VLLM, "vLLM", TARGETS)] + [
        (name, name, LLAMACPP_TARGETS) for name in table if name.startswith(LLAMACPP)
    ]
    for peer, label_of_peer, targets in peers:
        if peer not in table:
            print(f"\nno {label_of_peer} in this run: no ratios to it")
            continue
        print(f"\nSluice / {label_of_peer}:")
        for name in (n for n in table if n.startswith(SLUICE)):
            for field, label, target_key in METRICS:
                ratio = table[name][field] / table[peer][field]
                target = targets.get(target_key) if target_key else None
                verdict = (
                    ""
                    if target is None
                    else f"  (target {target.describe()}: {'met' if target.met(ratio) else 'NOT met'})"
                )
                print(f"  {name:{width}} {label:12} {ratio:5.2f}x{verdict}")
                if name == SLUICE and target is not None:
                    bars.append(RatioBar(f"{target_key} vs {label_of_peer}", ratio, target))
    for name, off in table.items():
        if name.startswith(f"{SLUICE}, "):
            on = table[SLUICE]
            gains = ", ".join(
                f"{label} {on[field] / off[field] if field == 'out_tok_s' else off[field] / on[field]:.2f}x"
                for field, label, _ in METRICS
            )
            print(f"on vs off ({name.removeprefix(f'{SLUICE}, ')}): {gains} (above 1: on is better)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vllm-venv", default=None, help="vLLM's venv (or $SLUICE_BENCH_VLLM_VENV)")
    parser.add_argument(
        "--llamacpp-dir", default=None, help="install_llamacpp.sh's folder (or $SLUICE_BENCH_LLAMACPP_DIR)"
    )
    parser.add_argument(
        "--llamacpp-mode", choices=["native", "avx2"], default="native", help="which llama.cpp build"
    )
    parser.add_argument(
        "--llamacpp-outtype", choices=["f16", "bf16"], default="f16", help="llama-server's GGUF format"
    )
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: the default model)")
    parser.add_argument(
        "--gguf-type",
        default=None,
        help="serve this llama-quantize type of the model on Sluice and llama-server",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument(
        "--switches",
        nargs="?",
        const="all",
        default=None,
        help="also serve with each optimisation off (the kernels' only by name), or only the named "
        "ones (comma-separated)",
    )
    parser.add_argument("--num-threads", type=int, action="append", help="sweep: engine threads (repeatable)")
    parser.add_argument("--cpu-bind", action="append", help="sweep: auto, none or a core list (repeatable)")
    parser.add_argument("--busy", type=int, default=0, help="spinning processes during each timed run")
    parser.add_argument(
        "--lock", default=os.environ.get(LOCK_ENV), help="flock file: shared to load, exclusive to time"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of the ratios against the targets")
    args, args.sluice_options = parser.parse_known_args()
    make_output_folders(args.json, args.plot)
    folder = llamacpp_dir(args.llamacpp_dir)
    venv = None if args.gguf_type else vllm_venv(args.vllm_venv)
    if venv is None and not args.gguf_type:
        log("no vLLM venv given (--vllm-venv or $SLUICE_BENCH_VLLM_VENV): no ratios to vLLM")

    from sluice.default_model import prepare_default_model

    model = (args.model or prepare_default_model()).resolve()
    if args.gguf_type and folder is None:
        raise SystemExit("--gguf-type needs llama.cpp (--llamacpp-dir or $SLUICE_BENCH_LLAMACPP_DIR)")
    served = quantized_gguf(folder, model, args.gguf_type) if args.gguf_type else model
    servers: list[Server] = []
    with tempfile.TemporaryDirectory(prefix="sluice-w3-logs-") as log_dir:
        try:
            with bench_lock(args.lock, exclusive=False):
                for name, options in sluice_configurations(args).items():
                    log(f"starting {name}: sluice serve {' '.join(options)}")
                    servers.append(start_sluice(name, served, options, Path(log_dir)))
                if venv is not None:
                    log("starting vLLM's api_server")
                    servers.append(start_vllm(venv, model, Path(log_dir)))
                if folder is not None:
                    file_type = args.gguf_type or args.llamacpp_outtype
                    gguf = served if args.gguf_type else gguf_file(folder, model, args.llamacpp_outtype)
                    log(f"starting llama-server ({args.llamacpp_mode} build, {file_type}: {gguf})")
                    servers.append(
                        start_llamacpp(folder, args.llamacpp_mode, gguf, file_type, model.name, Path(log_dir))
                    )
            runs = run_all(servers, args)
        finally:
            for server in servers:
                server.stop()
    bars: list[RatioBar] = []
    report(runs, args, bars)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: v for k, v in vars(args).items() if k != "json"}, "runs": runs},
                indent=1,
                default=str,
            )
        )
    if args.plot and bars:
        plot_ratios(
            bars, args.plot, "Sluice vs its peers, W3 online (medians, same run)", peer="the peer named"
        )
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()

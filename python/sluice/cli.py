"""The `sluice` command."""

from __future__ import annotations

import argparse
import os
import sys

from sluice.engine_args import add_engine_arguments, config_from_args
from sluice.errors import SluiceError


def _generate(args: argparse.Namespace) -> None:
    from sluice import LLM, SamplingParams

    llm = LLM.from_config(config_from_args(args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    if args.chat:
        (result,) = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        (result,) = llm.generate([args.prompt], params)
    print(result.outputs[0].text)


def _model_prepare(args: argparse.Namespace) -> None:
    from sluice.default_model import prepare_default_model

    print(prepare_default_model(args.cache_dir))


def _info(args: argparse.Namespace) -> None:
    from sluice.config import DeviceConfig
    from sluice.system_info import run

    sys.exit(
        run(args.cpu_isa, DeviceConfig(cpu_bind=args.cpu_bind, omp_spin_count=args.omp_spin_count), args.json)
    )


def _serve(args: argparse.Namespace) -> None:
    from sluice.serve.run import serve

    sys.exit(serve(args))


def _router(args: argparse.Namespace) -> None:
    from sluice.binaries import ROUTER, rust_binary

    binary = rust_binary(ROUTER)
    os.execv(binary, [str(binary), *args.router_args])


def _bench_serve(args: argparse.Namespace) -> None:
    from sluice.loadtest.command import run_serve

    sys.exit(run_serve(args))


def _bench_sweep(args: argparse.Namespace) -> None:
    from sluice.loadtest.command import run_sweep

    sys.exit(run_sweep(args))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `sluice` parser. Serve's options are read from the frontend binary (its --flag-schema), so they
    are added only when `command` is "serve": generate, info, model and bench run without that binary."""
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice: serve and run LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="print a completion of PROMPT")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template")
    add_engine_arguments(generate)
    generate.set_defaults(run=_generate)

    serve = commands.add_parser(
        "serve", help="serve MODEL over an OpenAI-compatible HTTP API (the Rust frontend and the engine core)"
    )
    if command == "serve":
        from sluice.serve.flags import add_serve_arguments

        add_serve_arguments(serve)
    serve.set_defaults(run=_serve)

    # Every flag goes to the sluice-router binary as it is (its --help lists them).
    router = commands.add_parser(
        "router", help="route requests over Sluice replicas (runs sluice-router)", add_help=False
    )
    router.set_defaults(run=_router, router_args=[])

    bench = commands.add_parser("bench", help="load-test any OpenAI-compatible server")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    from sluice.loadtest.options import add_serve_arguments as add_bench_serve_arguments
    from sluice.loadtest.options import add_sweep_arguments

    bench_serve = bench_commands.add_parser("serve", help="one run: latency, throughput and goodput")
    add_bench_serve_arguments(bench_serve)
    bench_serve.set_defaults(run=_bench_serve)
    bench_sweep = bench_commands.add_parser(
        "sweep", help="one run per request rate: throughput vs p99 latency"
    )
    add_sweep_arguments(bench_sweep)
    bench_sweep.set_defaults(run=_bench_sweep)

    info = commands.add_parser(
        "info",
        help="this machine's CPU features, the kernel tiers built and the one chosen, threads, versions",
    )
    from sluice.cpu_tiers import CPU_ISA_CHOICES

    info.add_argument("--cpu-isa", default="auto", choices=CPU_ISA_CHOICES, help="what --cpu-isa to resolve")
    info.add_argument("--cpu-bind", default="auto", help="what --cpu-bind to resolve")
    info.add_argument("--omp-spin-count", default="auto", help="what --omp-spin-count to resolve")
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    info.set_defaults(run=_info)

    model = commands.add_parser("model", help="manage models")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    prepare = model_commands.add_parser("prepare", help="write the default model as a Hugging Face folder")
    prepare.add_argument("--cache-dir", default=None, help="where to write it (default: ~/.cache/sluice)")
    prepare.set_defaults(run=_model_prepare)
    return parser


def main(argv: list[str] | None = None) -> None:
    try:
        argv = sys.argv[1:] if argv is None else argv
        # The root parser takes no option of its own but -h: its first other word names the command.
        parser = build_parser(next((word for word in argv if not word.startswith("-")), None))
        args, unknown = parser.parse_known_args(argv)
        if args.command == "router":
            args.router_args = unknown
        elif unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.run(args)
    except SluiceError as exc:
        print(f"sluice: error: {exc}", file=sys.stderr)
        sys.exit(2)

"""What `sluice bench serve` and `sluice bench sweep` do with their options."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from sluice.loadtest.client import RequestSpec
from sluice.loadtest.datasets import (
    SampleRequest,
    prefix_requests,
    random_requests,
    sharegpt_requests,
    shuffled,
)
from sluice.loadtest.errors import BenchError
from sluice.loadtest.metrics import parse_goodput
from sluice.loadtest.report import render_report
from sluice.loadtest.serve_run import ServeSettings, measured_run
from sluice.loadtest.sweep import parse_rates, sweep
from sluice.loadtest.token_codec import token_codec


def _headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def served_model(base_url: str, headers: dict[str, str]) -> str:
    """The first model the server lists under /v1/models."""
    request = urllib.request.Request(base_url + "/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return str(json.loads(response.read())["data"][0]["id"])
    except urllib.error.HTTPError as exc:
        raise BenchError(f"{base_url}/v1/models answered HTTP {exc.code}; pass --model") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise BenchError(f"cannot reach {base_url}: {getattr(exc, 'reason', exc)}") from exc
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchError(f"{base_url}/v1/models lists no model; pass --model") from exc


def _samples(args: argparse.Namespace, model: str) -> list[SampleRequest]:
    samples = _dataset(args, model)
    return shuffled(samples, args.seed) if args.shuffle else samples


def _dataset(args: argparse.Namespace, model: str) -> list[SampleRequest]:
    if args.num_prompts <= 0:
        raise BenchError("--num-prompts must be positive")
    codec = token_codec(args.base_url, model, _headers(args), args.tokenizer)
    if args.dataset == "sharegpt":
        if args.dataset_path is None:
            raise BenchError("--dataset sharegpt needs --dataset-path FILE")
        samples = sharegpt_requests(
            codec, args.dataset_path, args.num_prompts, args.seed, args.sharegpt_output_len
        )
        if len(samples) < args.num_prompts:
            print(f"warning: only {len(samples)} ShareGPT conversations pass the filter", file=sys.stderr)
        return samples
    lengths = (args.random_input_len, args.random_output_len, args.random_range_ratio, args.seed)
    if args.dataset == "prefix":
        return prefix_requests(codec, args.num_prompts, args.prefix_len, args.num_prefixes, *lengths)
    return random_requests(codec, args.num_prompts, *lengths)


def _prepare(args: argparse.Namespace) -> tuple[RequestSpec, list[SampleRequest], ServeSettings]:
    try:
        slos = parse_goodput(args.goodput)
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise BenchError("--max-concurrency must be positive")
    if args.burstiness <= 0:
        raise BenchError("--burstiness must be positive")
    base_url = args.base_url.rstrip("/")
    args.base_url = base_url
    model = args.model or served_model(base_url, _headers(args))
    spec = RequestSpec(base_url, args.endpoint, model, _headers(args), ignore_eos=args.ignore_eos)
    samples = _samples(args, model)
    settings = ServeSettings(
        args.burstiness, args.max_concurrency, args.seed, args.num_warmups, not args.no_progress, slos
    )
    return spec, samples, settings


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def _exit_status(results: list[dict[str, Any]]) -> int:
    """1 when some rate completed nothing: every request failed, so the figures mean nothing."""
    status = 0
    for result in results:
        if result["completed"] == 0:
            reasons = ", ".join(f"{r} ({n})" for r, n in result["failures_by_reason"].items())
            first = next(e for e in result["errors"] if e)
            print(f"sluice bench: every request failed: {reasons}; first error: {first}", file=sys.stderr)
            status = 1
    return status


def run_serve(args: argparse.Namespace) -> int:
    from sluice.loadtest.plots import plot_run

    spec, samples, settings = _prepare(args)
    result = measured_run(spec, samples, settings, args.request_rate)
    print(render_report(result))
    if args.save_result:
        _write_json(args.save_result, result)
    if args.plot:
        plot_run(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return _exit_status([result])


def run_sweep(args: argparse.Namespace) -> int:
    from sluice.loadtest.plots import plot_sweep

    try:
        rates = parse_rates(args.request_rates)
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    spec, samples, settings = _prepare(args)
    runs = sweep(spec, samples, settings, rates)
    for run in runs:
        print(f"request rate {run['request_rate']} req/s")
        print(render_report(run))
    if args.save_result:
        _write_json(args.save_result, {"request_rates": rates, "runs": runs})
    if args.plot:
        plot_sweep(runs, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return _exit_status(runs)

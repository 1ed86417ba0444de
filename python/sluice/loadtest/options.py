"""The options of `sluice bench serve` and `sluice bench sweep`; standard library only, so `sluice` starts fast."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

COMPLETIONS_ENDPOINT = "/v1/completions"
CHAT_ENDPOINT = "/v1/chat/completions"


def _rate(text: str) -> float:
    rate = float(text)
    if rate <= 0 or math.isnan(rate):
        raise argparse.ArgumentTypeError(f"must be positive or inf, got {text}")
    return rate


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", default=None, help="model name (default: the first from /v1/models)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token")
    target.add_argument(
        "--endpoint", default=COMPLETIONS_ENDPOINT, choices=[COMPLETIONS_ENDPOINT, CHAT_ENDPOINT]
    )
    target.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM, Sluice, SGLang)")

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset", default="random", choices=["random", "sharegpt", "prefix"])
    data.add_argument("--dataset-path", type=Path, default=None, help="the ShareGPT JSON file")
    data.add_argument(
        "--tokenizer", type=Path, default=None, help="a tokenizer.json, if the server has no /tokenize"
    )
    data.add_argument("--num-prompts", type=int, default=100)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument("--prefix-len", type=int, default=256, help="tokens of shared prefix (prefix dataset)")
    data.add_argument("--num-prefixes", type=int, default=1, help="distinct shared prefixes (prefix dataset)")
    data.add_argument("--sharegpt-output-len", type=int, default=None, help="override the replies' lengths")
    data.add_argument(
        "--shuffle", action="store_true", help="send the requests in a random order, seeded by --seed"
    )

    load = parser.add_argument_group("load")
    load.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; < 1 burstier; > 1 more even")
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--num-warmups", type=int, default=0, help="untimed requests sent first")
    load.add_argument(
        "--goodput", nargs="+", default=[], metavar="METRIC:MS", help="SLOs: ttft:MS tpot:MS e2el:MS"
    )
    load.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    output = parser.add_argument_group("output")
    output.add_argument("--save-result", type=Path, default=None, metavar="FILE.json")
    output.add_argument("--plot", type=Path, default=None, metavar="FILE.png")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common_arguments(parser)
    parser.add_argument("--request-rate", type=_rate, default=math.inf, help="requests per second, or inf")


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common_arguments(parser)
    parser.add_argument("--request-rates", required=True, help="comma-separated rates, e.g. 1,2,4,inf")

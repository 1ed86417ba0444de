"""`sluice serve`'s own options (the engine's are engine_args.add_engine_arguments) and the engine
restart settings they give."""

from __future__ import annotations

import argparse
from typing import get_args

from sluice.config import EngineRestartConfig, MetricsPrefix
from sluice.engine_args import add_engine_arguments, at_least, positive_float


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    group.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and /v1/models lists (default: the model folder's name)",
    )
    key = group.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every route but /health (default: $SLUICE_API_KEY, "
        "else none); prefer $SLUICE_API_KEY or --api-key-file, as a command line is visible to all users",
    )
    key.add_argument(
        "--api-key-file", default=None, help="a file holding the API key (one trailing newline ignored)"
    )
    group.add_argument(
        "--metrics-without-auth", action="store_true", help="serve /metrics without the API key"
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let chat and /tokenize requests bring their own chat_template (vLLM's flag); a template "
        "is code that runs on the server, so only for trusted clients",
    )
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="engine requests (one per choice: prompts x n) and tokenizer calls that may wait for the engine "
        "at once; a request waits until its first token, running ones do not count. Beyond it 429, and a "
        "request with more choices than it 400 (default: the frontend's, 512)",
    )
    group.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body, 413 beyond (default: the frontend's)",
    )
    group.add_argument(
        "--max-body-bytes-in-flight",
        type=int,
        default=None,
        help="body bytes all requests being read or handled may hold together; more wait (default: the frontend's)",
    )
    group.add_argument(
        "--header-read-timeout-s",
        type=float,
        default=None,
        help="seconds a client may take to send a request's headers, and an idle keep-alive connection "
        "stays open (default: the frontend's)",
    )
    group.add_argument(
        "--body-read-timeout-s",
        type=float,
        default=None,
        help="seconds a client may take to send a request's body, 408 beyond (default: the frontend's)",
    )
    group.add_argument(
        "--drain-timeout-s",
        type=float,
        default=None,
        help="seconds requests in flight get to finish on SIGINT or SIGTERM (default: the frontend's)",
    )
    group.add_argument(
        "--tokenizer-workers", type=int, default=None, help="tokenizer threads (default: the frontend's)"
    )
    group.add_argument(
        "--tokenize-piece-bytes",
        type=int,
        default=None,
        help="texts longer than this are encoded in pieces of this size (the same ids, a bounded peak of "
        "memory) where the tokenizer allows it exactly; 0: every text whole (default: the frontend's, 16384)",
    )
    group.add_argument(
        "--exit-grace-seconds",
        type=float,
        default=None,
        help="how long the frontend keeps answering after the engine core died (default: the frontend's)",
    )
    restart = EngineRestartConfig()
    group.add_argument(
        "--restart-engine",
        action=argparse.BooleanOptionalAction,
        default=restart.enabled,
        help="restart an engine core that died (or whose worker died), with backoff, while its frontend "
        "stays up; --no-restart-engine exits with status 3 instead",
    )
    group.add_argument(
        "--max-engine-restarts",
        type=at_least(0),
        default=restart.max_restarts,
        metavar="N",
        help="give up (exit 3) when an engine core dies after N restarts within --engine-restart-window-s",
    )
    group.add_argument(
        "--engine-restart-window-s",
        type=positive_float,
        default=restart.window_s,
        metavar="S",
        help="the window, in seconds, over which --max-engine-restarts counts",
    )
    group.add_argument(
        "--metrics-prefix",
        choices=get_args(MetricsPrefix),
        default=None,
        help="the namespace of /metrics' names; vllm renders vLLM's exact names, so that its Grafana "
        "dashboards work unchanged (default: the frontend's, sluice)",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=("auto", "hermes", "llama3_json", "mistral"),
        default=None,
        help="how tool_choice auto finds calls in outputs; auto picks by the model's vocabulary, and a chat "
        "template without tools gets a Hermes-style tool prompt, so hermes (default: the frontend's, auto)",
    )
    group.add_argument(
        "--data-parallel-size",
        "-dp",
        type=at_least(1),
        default=1,
        help="replicas, each pinned to its share of the cores, behind sluice-router on --port (default: 1)",
    )
    add_engine_arguments(parser, model_positional=True)


def restart_config_from_args(args: argparse.Namespace) -> EngineRestartConfig:
    return EngineRestartConfig(
        enabled=args.restart_engine,
        max_restarts=args.max_engine_restarts,
        window_s=args.engine_restart_window_s,
    )

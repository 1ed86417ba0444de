"""`sluice serve` offers the frontend's flags as the frontend's own binary describes them (`--flag-schema`), and
forwards each one given to every child that declares it: the frontend, and the router for the settings they share."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from sluice.binaries import FRONTEND, ROUTER, rust_binary
from sluice.cli import build_parser
from sluice.errors import SluiceError
from sluice.serve.argv import frontend_argv, router_argv
from sluice.serve.child_flags import child_flags
from sluice.serve.flags import WIRED_FRONTEND_FLAGS, frontend_options

# The settings of sluice_common's ServerArgs, which both binaries flatten.
SHARED = {
    "api_key",
    "api_key_file",
    "metrics_without_auth",
    "max_body_bytes",
    "header_read_timeout_s",
    "body_read_timeout_s",
    "drain_timeout_s",
}


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser("serve").parse_args(["serve", *argv])


def value_after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_both_binaries_describe_the_shared_settings_alike() -> None:
    frontend = {flag.name: flag for flag in child_flags(FRONTEND)}
    router = {flag.name: flag for flag in child_flags(ROUTER)}
    assert set(frontend) & set(router) >= SHARED
    for name in SHARED:
        assert frontend[name] == router[name], name
    assert frontend["max_body_bytes"].kind == "int" and frontend["max_body_bytes"].default == "8388608"
    assert frontend["drain_timeout_s"].kind == "float"
    assert frontend["metrics_without_auth"].kind == "flag"
    assert frontend["api_key"].env == "SLUICE_API_KEY"
    assert frontend["metrics_prefix"].choices == ("sluice", "vllm")


def test_the_schema_is_json_on_stdout_and_the_flag_alone_asks_for_it() -> None:
    done = subprocess.run([rust_binary(ROUTER), "--flag-schema"], capture_output=True, text=True, check=True)
    assert {flag["flag"] for flag in json.loads(done.stdout)} >= {"--replica", "--policy", "--max-body-bytes"}
    # With other arguments it is no request for the schema: clap refuses the unknown flag.
    refused = subprocess.run(
        [rust_binary(ROUTER), "--flag-schema", "--port", "1"], capture_output=True, text=True, check=False
    )
    assert refused.returncode == 2 and "--flag-schema" in refused.stderr


def test_serve_offers_each_frontend_flag_but_those_it_sets_itself() -> None:
    offered = {flag.name for flag in frontend_options()}
    assert offered == {flag.name for flag in child_flags(FRONTEND)} - WIRED_FRONTEND_FLAGS
    assert offered >= SHARED | {"max_waiting_requests", "tool_call_parser", "trust_request_chat_template"}
    with pytest.raises(SystemExit):
        serve_args("--engine-input", "ipc:///tmp/x")


def test_flags_given_reach_each_child_that_declares_them(tmp_path: Path) -> None:
    args = serve_args(
        "--max-body-bytes",
        "1000",
        "--metrics-without-auth",
        "--max-waiting-requests",
        "3",
        "--tool-call-parser",
        "mistral",
    )
    frontend = frontend_argv(args, tmp_path, "m", tmp_path, "127.0.0.1", 8000)
    router = router_argv(args, tmp_path, ["http://127.0.0.1:9000"])
    for argv in (frontend, router):
        assert value_after(argv, "--max-body-bytes") == "1000"
        assert "--metrics-without-auth" in argv
    assert value_after(frontend, "--max-waiting-requests") == "3"
    assert value_after(frontend, "--tool-call-parser") == "mistral"
    assert "--max-waiting-requests" not in router and "--tool-call-parser" not in router


def test_flags_not_given_are_left_to_the_childs_default(tmp_path: Path) -> None:
    args = serve_args()
    frontend = frontend_argv(args, tmp_path, "m", tmp_path, "127.0.0.1", 8000)
    for flag in frontend_options():
        assert flag.flag not in frontend, flag.flag


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-body-bytes", "-5"],
        ["--max-body-bytes", "1.5"],
        ["--drain-timeout-s", "soon"],
        ["--metrics-prefix", "prom"],
        ["--tool-call-parser", "qwen"],
    ],
)
def test_bad_values_are_refused_before_any_child_starts(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        serve_args(*argv)


def test_commands_but_serve_run_without_the_frontend_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    """generate, info, model and bench never start the frontend, so a missing binary does not stop them
    (a GPU machine given the Python packages alone ran `sluice generate` into this)."""

    def missing(name: str) -> Path:
        raise SluiceError(f"the {name} binary is missing")

    monkeypatch.setattr("sluice.serve.child_flags.rust_binary", missing)
    child_flags.cache_clear()
    try:
        args = build_parser("generate").parse_args(["generate", "Hello", "--max-tokens", "4"])
        assert (args.prompt, args.max_tokens) == ("Hello", 4)
        assert build_parser("info").parse_args(["info", "--json"]).json
        with pytest.raises(SluiceError, match="binary is missing"):
            build_parser("serve")
    finally:
        child_flags.cache_clear()

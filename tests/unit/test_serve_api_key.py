"""How `sluice serve` hands the API key on: through its children's environment (or the path of the
key file), never on a command line, and to the frontends and the router only; and that the
slow-client timeouts reach both."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sluice.cli import build_parser
from sluice.serve.argv import API_KEY_ENV, child_environment, frontend_argv, router_argv

KEY = "sk-never-on-argv-7c1e"


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser("serve").parse_args(["serve", *argv])


def command_lines(args: argparse.Namespace, tmp_path: Path) -> list[list[str]]:
    model = tmp_path / "model"
    return [
        frontend_argv(args, model, "m", tmp_path, "127.0.0.1", 8000),
        router_argv(args, model, ["http://127.0.0.1:9000"]),
    ]


def test_a_key_from_the_flag_goes_by_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = serve_args("--api-key", KEY)
    for argv in command_lines(args, tmp_path):
        assert not [word for word in argv if KEY in word], argv
    assert child_environment(args, with_key=True)[API_KEY_ENV] == KEY
    assert API_KEY_ENV not in child_environment(args, with_key=False)


def test_a_key_from_our_environment_reaches_only_the_frontends_and_router(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    args = serve_args()
    for argv in command_lines(args, tmp_path):
        assert not [word for word in argv if KEY in word], argv
    assert child_environment(args, with_key=True)[API_KEY_ENV] == KEY
    assert API_KEY_ENV not in child_environment(args, with_key=False)


def test_a_key_file_is_passed_by_its_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "sk-other")
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    args = serve_args("--api-key-file", str(key_file))
    for argv in command_lines(args, tmp_path):
        assert argv[argv.index("--api-key-file") + 1] == str(key_file)
        assert not [word for word in argv if KEY in word], argv
    # The file wins: the environment's key is not passed on beside it.
    assert API_KEY_ENV not in child_environment(args, with_key=True)


def test_the_flag_and_the_file_exclude_each_other(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        serve_args("--api-key", KEY, "--api-key-file", str(tmp_path / "key"))


def test_the_slow_client_timeouts_reach_the_frontend_and_the_router(tmp_path: Path) -> None:
    args = serve_args("--header-read-timeout-s", "3", "--body-read-timeout-s", "7", "--drain-timeout-s", "9")
    for argv in command_lines(args, tmp_path):
        for flag, value in (("--header-read-timeout-s", "3"), ("--body-read-timeout-s", "7")):
            assert float(argv[argv.index(flag) + 1]) == float(value), argv
        assert float(argv[argv.index("--drain-timeout-s") + 1]) == 9.0, argv

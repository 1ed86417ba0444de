"""schemathesis against a running Sluice server's own /openapi.json.

Every operation the document lists (but NOT_FUZZED's) is fuzzed with a fixed seed of its own, made from the base seed,
the operation and the mode (`run_seed`): bodies that fit the schema (positive) and, for operations that take a body,
bodies that break it (negative). Each case is one real HTTP request with a
timeout. A case fails on a 5xx, a hang, a reset connection, any of schemathesis's conformance checks (status
documented, content type, response schema, negative data rejected), a 4xx that is not the route's error
shape (OpenAI's; Anthropic's on /v1/messages...), or an event stream that does not end as its API ends one
(`[DONE]`; Anthropic's `message_stop`, the Responses API's `response.completed` or `response.incomplete`,
or either one's `error` event). An event stream is read to its end, however many events it has; one that has not
ended within the timeout is a hang.

Generation is kept cheap, not narrowed, so that most cases reach the engine instead of stopping at the
first check: every generation request gets a small max_tokens (max_output_tokens on /v1/responses) and n
(an absent max_tokens means the whole context in chat), a string `model` becomes the served one, a chat role outside the accepted ones becomes
one of them (and null content ""; user or assistant on /v1/messages), token ids fall inside the default model's vocabulary, /tokenize gets a
prompt or messages but not both, and integral floats (5.0 is an integer to JSON Schema) become ints.

Shared by tests/e2e/test_openapi_fuzz.py (the CI budget) and scripts/fuzz_api (longer runs).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import sys
import zlib
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, Verbosity
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.specs.openapi.schemas import OpenApiSchema

REQUEST_TIMEOUT_S = 30.0
MAX_TOKENS_CAP = 2
N_CAP = 2
# Below the vocabulary of the default model (49,152), so that most generated token ids are real ones.
TOKEN_ID_LIMIT = 49_152
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages")
# The server fuzzed serves a generative model, where the pooling routes answer every body with the same 400
# (its runner's refusal, before the body is read); fuzzing them would need a second, pooling server.
POOLING_ROUTES = {"POST /v1/embeddings", "POST /score", "POST /rerank", "POST /v1/rerank", "POST /v2/rerank"}
NOT_FUZZED = POOLING_ROUTES
# schemathesis stops reading an event stream after 20 events by default and hands back those alone, so a
# longer stream (11 prompts of 2 tokens each, say) would seem to end without its last event. The end check
# needs the whole stream: only REQUEST_TIMEOUT_S bounds one.
MAX_STREAM_EVENTS = sys.maxsize
RESPONSES_PATH = "/v1/responses"
# How each API's streams end, success or failure.
LAST_EVENTS = {
    "anthropic": ("event: message_stop\n", "event: error\n"),
    "responses": ("event: response.completed\n", "event: response.incomplete\n", "event: error\n"),
}
CHAT_ROLES = ("user", "assistant", "system")
MESSAGES_ROLES = ("user", "assistant")
ERROR_FIELDS = {"message", "type", "param", "code"}
FAILURE_EXAMPLES_KEPT = 20
# Operations fuzzed at once: the server overlaps tokenization, validation and engine steps across them.
CONCURRENT_RUNS = 8
MAX_ROUNDS = 3


@dataclass
class FuzzReport:
    cases: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    cases_by_operation: Counter[str] = field(default_factory=Counter)
    server_errors: int = 0
    hangs: int = 0
    resets: int = 0
    failures: list[str] = field(default_factory=list)

    def record_failure(self, case: Case, base_url: str, what: str) -> None:
        if len(self.failures) < FAILURE_EXAMPLES_KEPT:
            self.failures.append(f"{what}\n    {case.as_curl_command(base_url=base_url)}")
        else:
            self.failures.append(what.splitlines()[0] if what else what)

    def merge(self, other: FuzzReport) -> None:
        self.cases += other.cases
        self.statuses.update(other.statuses)
        self.cases_by_operation.update(other.cases_by_operation)
        self.server_errors += other.server_errors
        self.hangs += other.hangs
        self.resets += other.resets
        self.failures += other.failures

    def summary(self) -> str:
        statuses = ", ".join(f"{status}: {count}" for status, count in sorted(self.statuses.items()))
        operations = ", ".join(f"{name}: {count}" for name, count in sorted(self.cases_by_operation.items()))
        return (
            f"schemathesis: {self.cases} cases; statuses {{{statuses}}}; {self.server_errors} 5xx, "
            f"{self.hangs} hangs, {self.resets} connection resets, {len(self.failures)} failed cases\n"
            f"  per operation: {operations}"
        )


def _capped(value: Any, cap: int) -> Any:
    """An int above `cap` (or absent) becomes `cap`; anything else (a wrong type included) stays."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > cap):
        return cap
    return value


def _integers_as_ints(value: Any) -> Any:
    """JSON Schema counts 5.0 as an integer and hypothesis generates it; serde (like OpenAI's API) wants 5."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integers_as_ints(item) for item in value]
    if isinstance(value, dict):
        return {key: _integers_as_ints(item) for key, item in value.items()}
    return value


def _token_ids_in_vocabulary(value: Any) -> Any:
    """Token ids (lists of ints, or lists of them) folded below TOKEN_ID_LIMIT; anything else stays."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value % TOKEN_ID_LIMIT
    if isinstance(value, list):
        return [_token_ids_in_vocabulary(item) for item in value]
    return value


def _cheapen(case: Case, served_model: str) -> None:
    if not isinstance(case.body, dict):
        return
    case.body = body = _integers_as_ints(case.body)
    if isinstance(body.get("model"), str):
        body["model"] = served_model
    messages = body.get("messages")
    roles = MESSAGES_ROLES if is_anthropic_path(case.operation.path) else CHAT_ROLES
    for message in messages if isinstance(messages, list) else []:
        if isinstance(message, dict) and isinstance(message.get("role"), str):
            role = message["role"]
            if role not in roles:
                message["role"] = roles[zlib.crc32(role.encode()) % len(roles)]
            # The default template concatenates content, so a null one is a 400 on every message.
            if message.get("content", None) is None:
                message["content"] = ""
    for key in ("prompt", "tokens", "stop_token_ids"):
        if key in body:
            body[key] = _token_ids_in_vocabulary(body[key])
    if case.operation.path == "/tokenize" and "prompt" in body and "messages" in body:
        del body["messages"]
    if case.operation.path in GENERATION_PATHS:
        body["max_tokens"] = _capped(body.get("max_tokens"), MAX_TOKENS_CAP)
        if case.operation.path == "/v1/chat/completions" or "max_completion_tokens" in body:
            body["max_completion_tokens"] = _capped(body.get("max_completion_tokens"), MAX_TOKENS_CAP)
        if "n" in body:
            body["n"] = _capped(body["n"], N_CAP)
    if case.operation.path == RESPONSES_PATH:
        body["max_output_tokens"] = _capped(body.get("max_output_tokens"), MAX_TOKENS_CAP)


def is_anthropic_path(path: str) -> bool:
    """Anthropic's routes, whose errors and streams are in Anthropic's shapes."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error_shape_problem(status: int, text: str) -> str | None:
    """Why a 4xx body is not `{"type": "error", "error": {"type", "message"}}`, or None when it is."""
    try:
        body = json.loads(text)
    except ValueError:
        return f"{status} with a body that is not JSON: {text[:200]!r}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(body, dict) or body.get("type") != "error" or not isinstance(error, dict):
        return f"{status} body is not {{'type': 'error', 'error': {{...}}}}: {text[:200]!r}"
    if set(error) != {"type", "message"} or not all(
        isinstance(error[key], str) and error[key] for key in error
    ):
        return f"{status} error is not a non-empty type and message: {text[:200]!r}"
    return None


def openai_error_shape_problem(status: int, text: str) -> str | None:
    """Why a 4xx body is not `{"error": {"message", "type", "param", "code"}}`, or None when it is."""
    try:
        body = json.loads(text)
    except ValueError:
        return f"{status} with a body that is not JSON: {text[:200]!r}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(error, dict):
        return f"{status} body is not {{'error': {{...}}}}: {text[:200]!r}"
    if set(error) != ERROR_FIELDS:
        return f"{status} error has fields {sorted(error)}, not {sorted(ERROR_FIELDS)}"
    if not isinstance(error["message"], str) or not error["message"] or not isinstance(error["type"], str):
        return f"{status} error lacks a message or a type: {text[:200]!r}"
    if not all(error[key] is None or isinstance(error[key], str) for key in ("param", "code")):
        return f"{status} error's param or code is neither a string nor null: {text[:200]!r}"
    return None


def _stream_problem(path: str, content_type: str, text: str) -> str | None:
    if not content_type.startswith("text/event-stream"):
        return None
    dialect = "anthropic" if is_anthropic_path(path) else "responses" if path == RESPONSES_PATH else None
    if dialect is not None:
        last_event = text.rstrip().rsplit("\n\n", 1)[-1]
        if not last_event.startswith(LAST_EVENTS[dialect]):
            return f"a {dialect} stream that does not end as it should: ...{text[-200:]!r}"
    elif not text.rstrip().endswith("data: [DONE]"):
        return f"an event stream that does not end with [DONE]: ...{text[-200:]!r}"
    return None


def check_case(
    case: Case,
    base_url: str,
    served_model: str,
    mode: GenerationMode,
    report: FuzzReport,
) -> None:
    _cheapen(case, served_model)
    label = f"{case.operation.method.upper()} {case.operation.path}"
    report.cases += 1
    report.cases_by_operation[label] += 1
    try:
        response = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT_S)
    except requests.Timeout:
        report.hangs += 1
        report.record_failure(case, base_url, f"{label}: no answer within {REQUEST_TIMEOUT_S} s")
        return
    except requests.ConnectionError as error:
        report.resets += 1
        report.record_failure(case, base_url, f"{label}: connection error {error}")
        return
    if response.stream_cut_short:
        report.hangs += 1
        report.record_failure(
            case, base_url, f"{label}: an event stream not ended within {REQUEST_TIMEOUT_S} s"
        )
        return
    report.statuses[response.status_code] += 1
    report.server_errors += response.status_code >= 500
    problems = []
    checks = [not_a_server_error, status_code_conformance, content_type_conformance]
    checks += [response_schema_conformance]
    if mode is GenerationMode.NEGATIVE:
        checks.append(negative_data_rejection)
    try:
        case.validate_response(response, checks=checks)
    except FailureGroup as failure:
        problems.append(str(failure).strip())
    text = response.content.decode(errors="replace")
    if 400 <= response.status_code < 500:
        shape = (
            anthropic_error_shape_problem
            if is_anthropic_path(case.operation.path)
            else openai_error_shape_problem
        )
        problems.append(shape(response.status_code, text) or "")
    content_type = (response.headers.get("content-type") or [""])[0]
    problems.append(_stream_problem(case.operation.path, content_type, text) or "")
    problems = [problem for problem in problems if problem]
    if problems:
        report.record_failure(case, base_url, f"{label} -> {response.status_code}: " + "\n".join(problems))


def _run(strategy: Any, examples: int, seed: int, on_case: Callable[[Case], None]) -> None:
    @hypothesis.seed(seed)
    @hypothesis.settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
    )
    @hypothesis.given(strategy)
    def run(case: Case) -> None:
        on_case(case)

    run()


def _fuzz_operation(
    base_url: str, served_model: str, label: str, mode: GenerationMode, examples: int, seed: int
) -> FuzzReport:
    """One operation in one mode, in a process of its own (hypothesis and schemathesis are not
    thread-safe), loading the document itself."""
    schema = fuzzed_schema(base_url)
    (operation,) = [
        result.ok()
        for result in schema.get_all_operations()
        if f"{result.ok().method.upper()} {result.ok().path}" == label
    ]
    report = FuzzReport()
    _run(
        operation.as_strategy(mode),
        examples,
        seed,
        lambda case: check_case(case, base_url, served_model, mode, report),
    )
    return report


def fuzzed_schema(base_url: str) -> OpenApiSchema:
    """The server's document, as the fuzz calls its operations."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    # Reproducing curl lines must show max_tokens, which the default sanitization takes for a secret.
    schema.config.output.sanitization.enabled = False
    schema.config.max_stream_events = MAX_STREAM_EVENTS
    return schema


def run_seed(seed: int, label: str, mode: GenerationMode, round_: int) -> int:
    """The seed of one operation's run in one mode and round: from the operation itself, not its place
    among the fuzzed ones, so that a route added to the document leaves the others' cases as they were."""
    return seed + zlib.crc32(f"{label} {mode.value} {round_}".encode())


def fuzz(base_url: str, cases: int, seed: int) -> FuzzReport:
    """At least `cases` requests against the server at `base_url`, spread over its documented operations
    (those without a body have few distinct inputs, so the budget goes to those with one), several
    operations at a time. Hypothesis may stop an operation early when it runs out of distinct inputs; further
    rounds with the next seeds make up the count."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    models = requests.get(f"{base_url}/v1/models", timeout=REQUEST_TIMEOUT_S)
    assert models.status_code == 200, models.text
    served_model = models.json()["data"][0]["id"]
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {operation: f"{operation.method.upper()} {operation.path}" for operation in operations}
    operations = [operation for operation in operations if labels[operation] not in NOT_FUZZED]
    runs = [(labels[op], GenerationMode.POSITIVE, 1) for op in operations if not op.body]
    with_body = [(labels[op], mode) for op in operations if op.body for mode in GenerationMode]
    report = FuzzReport()
    with ProcessPoolExecutor(CONCURRENT_RUNS, mp_context=multiprocessing.get_context("spawn")) as pool:
        for round_ in range(MAX_ROUNDS):
            missing = cases - report.cases - sum(examples for _, _, examples in runs)
            runs += [(label, mode, math.ceil(missing / len(with_body))) for label, mode in with_body]
            futures = [
                pool.submit(
                    _fuzz_operation,
                    base_url,
                    served_model,
                    label,
                    mode,
                    examples,
                    run_seed(seed, label, mode, round_),
                )
                for label, mode, examples in runs
            ]
            for future in futures:
                report.merge(future.result())
            runs = []
            if report.cases >= cases:
                break
    return report


def main() -> int:
    import argparse
    import tempfile
    from pathlib import Path

    from serve_fixtures import running_server

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=20_000, help="how many requests, about")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="a running server's base URL; by default one is started here")
    args = parser.parse_args()
    if args.url:
        report = fuzz(args.url.rstrip("/"), args.cases, args.seed)
    else:
        with tempfile.TemporaryDirectory() as folder:
            serve_args = ["--max-model-len", "2048", "--kv-cache-memory", "1"]
            with running_server(serve_args, Path(folder) / "serve.log") as server:
                report = fuzz(server.url, args.cases, args.seed)
    print(report.summary())
    for failure in report.failures:
        print(failure)
    return 0 if not report.failures else 1


if __name__ == "__main__":
    raise SystemExit(main())

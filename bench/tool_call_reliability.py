"""How often `tool_choice: "auto"` yields a call that does not parse or does not match its tool's
schema, with the lazy tool-call grammar on (the default) and off (`--no-tool-call-grammar`).

`sluice serve` on the default model (its template has no tools, so the tools reach it as a Hermes
prompt and outputs are read with the hermes parser, whose lazy grammar this measures), once per
mode. The same requests go to both: streamed chat completions with tools, seeded sampling at
temperature 1.0, several at a time, through the `openai` client. Each answer is joined as a client
joins a stream, then counted (each conversation shows earlier turns answered with calls, so that
the small model opens calls often enough to count):

- a call whose name is not a tool's, whose arguments are not JSON, or whose arguments fail the
  tool's JSON schema (jsonschema) is `invalid`;
- an opened call that the parser could not read, so that `<tool_call>` stayed in the content, is
  `unparsed`;
- a request that failed is an `error`;
- an output that `max_tokens` cut off inside its last call is `cut_off`, not a failure to parse: the
  grammar keeps a call well formed, but cannot make it fit.

The target is 0 invalid and 0 unparsed calls with the grammar on. These are counts over all the
requests of one run, not timings, so there is nothing to take a median of; the wall time of each
mode is printed beside them. Results go to --out as JSON.

    .venv/bin/python bench/tool_call_reliability.py --requests 1000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai

from harness import log, make_output_folders
from servers import Server, start_sluice

MODEL = "SmolLM2-135M-Instruct"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "minLength": 1, "maxLength": 30},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert_currency",
            "description": "Converts an amount of money from one currency to another",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number", "minimum": 0},
                    "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                },
                "required": ["amount", "from", "to"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time now in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 40}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


def shown_call(index: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    call = {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}


# Earlier turns answered with calls, one per tool, so that the small model opens calls often enough
# to count them.
SHOWN_CALLS: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the weather in Rome?"},
    shown_call(0, "get_weather", {"city": "Rome"}),
    {"role": "user", "content": "How much is 10 EUR in USD?"},
    shown_call(1, "convert_currency", {"amount": 10, "from": "EUR", "to": "USD"}),
    {"role": "user", "content": "What time is it in Asia/Tokyo?"},
    shown_call(2, "get_time", {"zone": "Asia/Tokyo"}),
]
QUESTIONS = [
    "What is the weather in Paris?",
    "Is it raining in Tokyo right now? Use fahrenheit.",
    "How much is 250 US dollars in euros?",
    "Convert 1200 JPY to GBP please.",
    "What time is it in New York?",
    "Tell me the current time in Europe/Berlin and the weather in Berlin.",
    "I am flying to Sydney tomorrow. What should I pack?",
    "Say hello.",
]


def ask(server: Server, index: int, max_tokens: int) -> dict[str, Any]:
    """One streamed request, joined as a client joins it: its content and its calls."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    content, calls, finish = "", [], None
    try:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[*SHOWN_CALLS, {"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}],
            tools=TOOLS,
            temperature=1.0,
            seed=index,
            max_tokens=max_tokens,
            stream=True,
        )
        for chunk in stream:
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                content += choice.delta.content or ""
                for delta in choice.delta.tool_calls or []:
                    if delta.id is not None:
                        calls.append([delta.function.name, ""])
                    calls[delta.index][1] += delta.function.arguments or ""
    except openai.APIError as error:
        return {"error": str(error)}
    finally:
        client.close()
    return {"content": content, "calls": calls, "finish_reason": finish}


def invalid_call(name: str, arguments: str) -> str | None:
    """Why a call does not match its tool, or None."""
    if name not in SCHEMAS:
        return f"no tool {name!r}"
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError as error:
        return f"arguments are not JSON: {error}"
    try:
        jsonschema.validate(value, SCHEMAS[name])
    except jsonschema.ValidationError as error:
        return f"arguments fail the schema: {error.message}"
    return None


def run_mode(name: str, extra_args: list[str], args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    server = start_sluice(name, None, ["--enable-prefix-caching", *extra_args], log_dir)
    try:
        server.wait_ready()
        counts = {"requests": 0, "calls": 0, "invalid": 0, "unparsed": 0, "cut_off": 0, "errors": 0}
        examples: list[str] = []
        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            answers = pool.map(lambda i: ask(server, i, args.max_tokens), range(args.requests))
            for answer in answers:
                counts["requests"] += 1
                if "error" in answer:
                    counts["errors"] += 1
                    examples.append(f"error: {answer['error']}")
                    continue
                cut = answer["finish_reason"] == "length"
                if "<tool_call>" in answer["content"]:
                    # A call still open when max_tokens ended the output stays in the content.
                    still_open = "</tool_call>" not in answer["content"].rsplit("<tool_call>", 1)[1]
                    kind = "cut_off" if cut and still_open else "unparsed"
                    counts[kind] += 1
                    examples.append(f"{kind}: {answer['content'][-200:]!r}")
                for at, (call_name, arguments) in enumerate(answer["calls"]):
                    counts["calls"] += 1
                    why = invalid_call(call_name, arguments)
                    if why is None:
                        continue
                    # A streamed call is announced before its arguments; max_tokens may end them.
                    kind = "cut_off" if cut and at == len(answer["calls"]) - 1 else "invalid"
                    counts[kind] += 1
                    examples.append(f"{kind} {call_name}({arguments}): {why}")
                if counts["requests"] % 100 == 0:
                    log(f"{name}: {counts['requests']}/{args.requests} {counts}")
        return {**counts, "wall_s": round(time.monotonic() - started, 1), "examples": examples[:20]}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench/results/tool_call_reliability.json"))
    args = parser.parse_args()
    make_output_folders(args.out)
    modes = {"grammar on": [], "grammar off": ["--no-tool-call-grammar"]}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="sluice-tool-calls-") as log_dir:
        for name, extra_args in modes.items():
            log(f"{name}: {args.requests} streamed tool_choice auto requests at temperature 1.0")
            results[name] = run_mode(name, extra_args, args, Path(log_dir))
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(
        f"{'mode':<12} {'requests':>8} {'calls':>6} {'invalid':>7} {'unparsed':>8} {'cut_off':>7} "
        f"{'errors':>6} {'wall s':>7}"
    )
    for name, result in results.items():
        print(
            f"{name:<12} {result['requests']:>8} {result['calls']:>6} {result['invalid']:>7} "
            f"{result['unparsed']:>8} {result['cut_off']:>7} {result['errors']:>6} {result['wall_s']:>7}"
        )
    for name, result in results.items():
        for example in result["examples"][:5]:
            print(f"  {name}: {example}")


if __name__ == "__main__":
    main()

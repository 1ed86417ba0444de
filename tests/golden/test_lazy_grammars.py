"""The lazy tool-call grammars of `tool_choice: "auto"` (tests/golden/lazy_grammars.json, which the
frontend's parsers write: frontend/src/text/tool_parsers/mod.rs checks that they still do), compiled
by the engine core's llguidance on the default model's vocabulary and run on outputs: prose and
well-formed calls of the golden tools pass; a call of an unknown tool, with arguments its schema
refuses, or malformed, does not; the `one` grammar (`parallel_tool_calls: false`) takes one call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.structured_output import GrammarTokenizer
from sluice.sampling_params import StructuredOutput

GOLDEN = json.loads((Path(__file__).parent / "lazy_grammars.json").read_text())
EOS = 2

# Call objects as hermes and mistral write them.
JSON_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
JSON_TIME = '{"name": "get_time", "arguments": {}}'
HERMES_CALL = f"<tool_call>\n{JSON_CALL}\n</tool_call>"
HERMES_TIME = f"<tool_call>\n{JSON_TIME}\n</tool_call>"
LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA3_TIME = '{"name": "get_time", "parameters": {}}'
QWEN3_CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
QWEN3_CODER_TIME = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
QWEN3_CODER_SEARCH = (
    "<tool_call>\n<function=search>\n<parameter=query>\nrust\n</parameter>\n<parameter=kind>\nnews\n"
    '</parameter>\n<parameter=where>\n{"lat": 1.5}\n</parameter>\n<parameter=tags>\n["a", "b"]\n'
    "</parameter>\n<parameter=extra>\nanything\n</parameter>\n</function>\n</tool_call>"
)
PYTHONIC_CALL = 'get_weather(city="Paris", days=3, metric=True)'
PYTHONIC_SEARCH = (
    'search(query="rust", kind="news", where={"lat": 1.5}, tags=["a", "b"], extra={"x": [1, None]})'
)

# (parser, grammar, output, whether the grammar takes it whole)
CASES = [
    ("hermes", "many", "The weather is fine today.", True),
    ("hermes", "many", "Let me check.\n" + HERMES_CALL, True),
    ("hermes", "many", HERMES_CALL + "\n" + HERMES_TIME, True),
    ("hermes", "one", HERMES_CALL, True),
    ("hermes", "one", HERMES_CALL + "\n" + HERMES_TIME, False),
    ("hermes", "many", HERMES_CALL.replace("get_weather", "get_wether"), False),
    ("hermes", "many", HERMES_CALL.replace('"city"', '"town"'), False),
    ("hermes", "many", "<tool_call>not json</tool_call>", False),
    ("llama3_json", "many", "The weather is fine today.", True),
    ("llama3_json", "many", LLAMA3_CALL, True),
    ("llama3_json", "many", f" {LLAMA3_CALL}; {LLAMA3_TIME}\n", True),
    ("llama3_json", "one", LLAMA3_CALL, True),
    ("llama3_json", "one", f"{LLAMA3_CALL}; {LLAMA3_TIME}", False),
    ("llama3_json", "many", LLAMA3_CALL.replace("parameters", "arguments"), False),
    ("llama3_json", "many", LLAMA3_CALL.replace("Paris", "P" * 21), False),
    ("llama3_json", "many", '{"x": 1} and more', False),
    ("llama3_json", "many", "{{", False),
    ("mistral", "many", "The weather is fine today.", True),
    ("mistral", "many", "[1] is a citation.", True),
    ("mistral", "many", f"[{JSON_CALL}]", True),
    ("mistral", "many", f" [{JSON_CALL}, {JSON_TIME}]\n", True),
    ("mistral", "many", f"Let me check.[TOOL_CALLS] [{JSON_CALL}]", True),
    ("mistral", "one", f"[{JSON_CALL}]", True),
    ("mistral", "one", f"[{JSON_CALL}, {JSON_TIME}]", False),
    ("mistral", "many", f"[{JSON_CALL.replace('get_weather', 'get_wether')}]", False),
    ("mistral", "many", f"[{JSON_CALL.replace('Paris', 'P' * 21)}]", False),
    ("mistral", "many", f"[{JSON_CALL}] and more", False),
    ("mistral", "many", "[TOOL_CALLS] not an array", False),
    ("mistral", "many", f"[TOOL_CALLS][{JSON_CALL}] and more", False),
    ("mistral", "many", "[] is empty.", True),
    ("qwen3_coder", "many", "The weather is fine today, a < b.", True),
    ("qwen3_coder", "many", "Let me check.\n" + QWEN3_CODER_CALL, True),
    ("qwen3_coder", "many", QWEN3_CODER_CALL + "\n" + QWEN3_CODER_TIME + "\nDone.", True),
    ("qwen3_coder", "many", QWEN3_CODER_CALL.replace("New York", "two\nlines, a < b\n"), True),
    (
        "qwen3_coder",
        "many",
        QWEN3_CODER_CALL.replace("3\n", "7\n</parameter>\n<parameter=metric>\ntrue\n"),
        True,
    ),
    ("qwen3_coder", "one", QWEN3_CODER_CALL, True),
    ("qwen3_coder", "one", QWEN3_CODER_CALL + "\n" + QWEN3_CODER_TIME, False),
    ("qwen3_coder", "many", QWEN3_CODER_CALL.replace("get_weather", "get_wether"), False),
    ("qwen3_coder", "many", QWEN3_CODER_CALL.replace("=days", "=weeks"), False),
    ("qwen3_coder", "many", QWEN3_CODER_CALL.replace("3\n", "8\n"), False),
    ("qwen3_coder", "many", QWEN3_CODER_CALL.replace("3\n", "soon\n"), False),
    (
        "qwen3_coder",
        "many",
        QWEN3_CODER_CALL.replace("<parameter=city>\nNew York\n</parameter>\n", ""),
        False,
    ),
    ("qwen3_coder", "many", QWEN3_CODER_CALL.replace("New York", "a</parameter>b"), False),
    ("qwen3_coder", "many", '<tool_call>\n{"name": "get_time"}\n</tool_call>', False),
    ("qwen3_coder", "one", QWEN3_CODER_TIME + "\nThat is all.", True),
    ("qwen3_coder", "many", QWEN3_CODER_SEARCH, True),
    ("qwen3_coder", "many", QWEN3_CODER_SEARCH.replace("news", "blog"), False),
    ("qwen3_coder", "many", QWEN3_CODER_SEARCH.replace('"lat"', '"lon"'), False),
    ("qwen3_coder", "many", QWEN3_CODER_SEARCH.replace('"a", "b"', '"a", 2'), False),
    ("pythonic", "many", "The weather is fine today.", True),
    ("pythonic", "many", f"[{PYTHONIC_CALL}]", True),
    ("pythonic", "many", f' [get_weather( city = "Rome" ), get_time(), {PYTHONIC_CALL}]\n', True),
    ("pythonic", "many", '[get_weather(city="a\\tb\\u0001 \\"c\\"")]', True),
    ("pythonic", "one", f"[{PYTHONIC_CALL}]", True),
    ("pythonic", "one", f"[{PYTHONIC_CALL}, get_time()]", False),
    ("pythonic", "many", "[get_wether()]", False),
    ("pythonic", "many", '[get_weather(town="Paris")]', False),
    ("pythonic", "many", "[get_weather(days=3)]", False),
    ("pythonic", "many", "[get_weather(city=3)]", False),
    ("pythonic", "many", f"[{PYTHONIC_CALL.replace('True', 'true')}]", False),
    ("pythonic", "many", f"[{PYTHONIC_CALL.replace('days=3', 'days=9')}]", False),
    ("pythonic", "many", f"[{PYTHONIC_CALL}] and more", False),
    ("pythonic", "many", "[1, 2, 3] are numbers.", True),
    ("pythonic", "many", "[] is empty.", True),
    ("pythonic", "many", f"[{PYTHONIC_SEARCH}]", True),
    ("pythonic", "many", f"[{PYTHONIC_SEARCH.replace('news', 'blog')}]", False),
    ("pythonic", "many", f"[{PYTHONIC_SEARCH.replace('lat', 'lon')}]", False),
    ("pythonic", "many", "[" + PYTHONIC_SEARCH.replace('"b"', "2") + "]", False),
    ("pythonic", "many", "<|python_start|>[get_time()]", False),
    # Keyword arguments (and qwen3_coder's parameters) come in their schema's order.
    ("pythonic", "many", '[get_weather(days=3, city="Paris")]', False),
]


@pytest.fixture(scope="module")
def grammar_tokenizer(default_model_path: Path) -> GrammarTokenizer:
    vocab_size = json.loads((default_model_path / "config.json").read_text())["vocab_size"]
    return GrammarTokenizer(default_model_path, vocab_size, (EOS,))


def test_every_parser_with_a_lazy_grammar_has_cases() -> None:
    assert set(GOLDEN["grammars"]) == {parser for parser, *_ in CASES}


@pytest.mark.parametrize(("parser", "variant", "output", "taken"), CASES)
def test_the_grammar_takes_prose_and_well_formed_calls_only(
    grammar_tokenizer: GrammarTokenizer, parser: str, variant: str, output: str, taken: bool
) -> None:
    grammar = grammar_tokenizer.compile(StructuredOutput("grammar", GOLDEN["grammars"][parser][variant]))
    tokens = [*grammar_tokenizer.get().tokenize_str(output), EOS]
    assert all(grammar.accept_token(token) for token in tokens) == taken

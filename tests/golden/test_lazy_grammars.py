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

HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA3_TIME = '{"name": "get_time", "parameters": {}}'

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

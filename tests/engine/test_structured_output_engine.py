"""Structured output inside the engine core, without a server: compiling constraints (llguidance on
the default model's vocabulary), the bitmask the workers apply, and async scheduling: a structured
request is planned while its last token is in flight (its mask follows once the token is in), or
waits for that token with --no-structured-output-overlap; the tokens are the same either way."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import pytest
import torch

from engine import LLM
from engine.request import Request
from engine.scheduler import Scheduler
from engine.structured_output import GrammarTokenizer, RequestGrammar, batch_bitmask, mask_words
from sluice.config import CacheConfig, SchedulerConfig
from sluice.errors import InvalidRequestError
from sluice.sampling_params import SamplingParams, StructuredOutput
from sluice.worker_seam import GrammarBitmask, ModelRunnerOutput
from worker.grammar_bitmask import allowed_tokens, apply_grammar_bitmask

EOS = 2


@pytest.fixture(scope="module")
def grammar_tokenizer(default_model_path: Path) -> GrammarTokenizer:
    vocab_size = json.loads((default_model_path / "config.json").read_text())["vocab_size"]
    return GrammarTokenizer(default_model_path, vocab_size, (EOS,))


def allowed_ids(grammar: RequestGrammar, vocab_size: int) -> set[int]:
    bitmask = GrammarBitmask(0, batch_bitmask([grammar], mask_words(vocab_size)))
    return set(allowed_tokens(bitmask, 1, vocab_size)[0].nonzero().flatten().tolist())


def test_choice_mask_allows_only_prefixes_of_the_choices(grammar_tokenizer: GrammarTokenizer) -> None:
    tokenizer = grammar_tokenizer.get()
    grammar = grammar_tokenizer.compile(StructuredOutput("choice", json.dumps(["yes", "no"])))
    allowed = allowed_ids(grammar, grammar_tokenizer.vocab_size)
    assert allowed, "something must be allowed"
    texts = {tokenizer.decode_str([t]) for t in allowed}
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    refusing = grammar_tokenizer.compile(StructuredOutput("choice", json.dumps(["yes", "no"])))
    assert not refusing.accept_token(tokenizer.tokenize_str("maybe")[0])
    assert refusing.error, "the matcher says why"
    for token in tokenizer.tokenize_str("no"):
        assert grammar.accept_token(token)
    assert grammar.is_terminated
    assert allowed_ids(grammar, grammar_tokenizer.vocab_size) == {EOS}


def accepts(grammar: RequestGrammar, tokenizer: llguidance.LLTokenizer, text: str) -> bool:
    return all(grammar.accept_token(token) for token in tokenizer.tokenize_str(text))


SCHEMA_A = json.dumps(
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
)


@pytest.mark.parametrize(
    ("kind", "spec", "answer"),
    [
        ("json_schema", SCHEMA_A, '{"a":12}'),
        ("regex", "[0-9]{3}/x", "123/x"),
        ("choice", json.dumps(["yes", "no"]), "no"),
        ("grammar", 'start: "yes" | "no"', "yes"),
    ],
)
def test_after_lets_the_output_run_free_up_to_its_marker(
    grammar_tokenizer: GrammarTokenizer, kind: str, spec: str, answer: str
) -> None:
    # A reasoning model's thinking, then the constrained answer.
    tokenizer = grammar_tokenizer.get()
    thinking = "Let me think: {not json}, maybe 42.\n</think>"
    grammar = grammar_tokenizer.compile(StructuredOutput(kind, spec, after="</think>"))
    assert accepts(grammar, tokenizer, thinking + answer)
    assert grammar.is_terminated
    off_schema = grammar_tokenizer.compile(StructuredOutput(kind, spec, after="</think>"))
    assert not accepts(off_schema, tokenizer, thinking + "zz" + answer)
    # Without `after` the thinking itself breaks the constraint.
    whole = grammar_tokenizer.compile(StructuredOutput(kind, spec))
    assert not accepts(whole, tokenizer, thinking + answer)


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("regex", "a("),
        ("json_schema", '{"type": "nope"}'),
        ("json_schema", "{not json"),
        ("grammar", "start: missing_rule"),
        ("choice", "[]"),
    ],
)
def test_uncompilable_constraints_raise_naming_structured_output(
    grammar_tokenizer: GrammarTokenizer, kind: str, spec: str
) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        grammar_tokenizer.compile(StructuredOutput(kind, spec))
    assert raised.value.param == "structured_output"


def test_bitmask_sets_disallowed_logits_to_minus_infinity() -> None:
    vocab = 40
    words = torch.zeros((2, 2), dtype=torch.int32)
    words[0, 0] = 1 << 3  # row 0 allows token 3
    words[1, 1] = 1 << 2  # row 1 allows token 34
    bitmask = GrammarBitmask(5, words.numpy().astype("<i4").tobytes())
    logits = torch.zeros((3, vocab))
    apply_grammar_bitmask(logits, [2, 0], bitmask)
    assert logits[1].eq(0).all(), "a row without a constraint is untouched"
    assert logits[2].isfinite().nonzero().flatten().tolist() == [3]
    assert logits[0].isfinite().nonzero().flatten().tolist() == [34]


def structured_and_plain_requests(
    grammar_tokenizer: GrammarTokenizer, overlap: bool
) -> tuple[Scheduler, Request]:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, structured_output_overlap=overlap),
        CacheConfig(block_size=4),
        num_blocks=64,
        max_model_len=256,
    )
    constraint = StructuredOutput("regex", "[0-9]{6}")
    grammar = grammar_tokenizer.compile(constraint)
    params = SamplingParams(max_tokens=16, structured_output=constraint)
    structured = Request("s", [100, 101, 102], params, eos_token_ids=(EOS,), grammar=grammar)
    plain = Request("p", [100, 101, 102], SamplingParams(max_tokens=16), eos_token_ids=(EOS,))
    scheduler.add_request(structured)
    scheduler.add_request(plain)
    return scheduler, structured


def test_a_structured_request_is_planned_while_its_token_is_in_flight(
    grammar_tokenizer: GrammarTokenizer,
) -> None:
    scheduler, _ = structured_and_plain_requests(grammar_tokenizer, overlap=True)
    first = scheduler.schedule()
    assert first.structured_output_req_ids == ["s"]
    # Planned before the first step's tokens are known: the engine core sends its mask after them.
    second = scheduler.schedule()
    assert sorted(second.num_scheduled_tokens) == ["p", "s"]
    assert second.structured_output_req_ids == ["s"]


def test_without_the_overlap_a_structured_request_waits_for_its_token(
    grammar_tokenizer: GrammarTokenizer,
) -> None:
    scheduler, structured = structured_and_plain_requests(grammar_tokenizer, overlap=False)
    first = scheduler.schedule()
    assert first.structured_output_req_ids == ["s"]
    # Planned before the first step's tokens are known: only the plain request goes on.
    second = scheduler.schedule()
    assert list(second.num_scheduled_tokens) == ["p"]
    assert second.structured_output_req_ids == []
    digit = grammar_tokenizer.get().tokenize_str("4")
    assert len(digit) == 1
    scheduler.update_from_output(
        first, ModelRunnerOutput(first.step_id, ["s", "p"], [digit, [7]], [None, None])
    )
    # The matcher consumed the token; the request is planned again.
    third = scheduler.schedule()
    assert "s" in third.num_scheduled_tokens and third.structured_output_req_ids == ["s"]
    assert structured.output_token_ids == digit


def test_a_row_without_a_grammar_allows_every_token(grammar_tokenizer: GrammarTokenizer) -> None:
    vocab_size = grammar_tokenizer.vocab_size
    grammar = grammar_tokenizer.compile(StructuredOutput("choice", json.dumps(["yes"])))
    bitmask = GrammarBitmask(0, batch_bitmask([None, grammar], mask_words(vocab_size)))
    allowed = allowed_tokens(bitmask, 2, vocab_size)
    assert allowed[0].all(), "a request that ended has no constraint left"
    assert 0 < int(allowed[1].sum()) < vocab_size


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def test_structured_tokens_are_the_same_with_async_scheduling_on_and_off(default_model_path: Path) -> None:
    # Worker processes, where a mask that follows its step must not wait on the step before's output.
    # Seeded sampling; requests end while their next step is in flight, and a small pool preempts.
    prompts = [f"Describe person number {i} as JSON with a name and an age:" for i in range(6)]
    params = SamplingParams(
        max_tokens=40,
        temperature=0.8,
        seed=5,
        structured_output=StructuredOutput("json_schema", json.dumps(SCHEMA)),
    )
    outputs = {}
    for async_scheduling in (True, False):
        llm = LLM(
            model=str(default_model_path),
            dtype="float32",
            executor="mp",
            async_scheduling=async_scheduling,
            max_model_len=256,
            num_kv_blocks=16,
            max_num_seqs=4,
        )
        outputs[async_scheduling] = [r.outputs[0] for r in llm.generate(prompts, params)]
        llm.engine.shutdown()
    assert [o.token_ids for o in outputs[True]] == [o.token_ids for o in outputs[False]]
    for output in outputs[True]:
        if output.finish_reason == "stop":
            value = json.loads(output.text)
            assert set(value) == {"name", "age"} and isinstance(value["age"], int), output.text


def test_masks_that_leave_no_token_fail_that_request_alone(default_model_path: Path) -> None:
    # allowed_token_ids that a JSON object never starts with: the worker's row is all -inf, the grammar
    # refuses what it picked, and the request ends with an error naming the field, while the engine
    # core (worker processes, async scheduling: its next step is in flight) goes on serving.
    llm = LLM(model=str(default_model_path), executor="mp", max_model_len=256, num_kv_blocks=32)
    hello = llm.tokenizer.encode("hello")[0]
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        structured_output=StructuredOutput("json_object", ""),
        allowed_token_ids=[hello],
    )
    # A bad word that bans the one text a regex admits.
    banned = SamplingParams(
        temperature=0.0, max_tokens=4, structured_output=StructuredOutput("regex", "a"), bad_words=["a"]
    )
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    failed, failed_too, served = llm.generate(
        ["Give me JSON:", "Say a:", "The capital of France is"], [constrained, banned, plain]
    )
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    assert failed_too.outputs[0].finish_reason == "error" and failed_too.outputs[0].token_ids == []
    assert (
        failed.outputs[0].error_param == "allowed_token_ids"
        and "no token satisfies" in failed.outputs[0].error
    )
    assert (
        failed_too.outputs[0].error_param == "bad_words"
        and "no token satisfies" in failed_too.outputs[0].error
    )
    assert served.outputs[0].error is None and served.outputs[0].error_param is None
    assert served.outputs[0].finish_reason == "length" and len(served.outputs[0].token_ids) == 4
    again = llm.generate(["The capital of France is"], plain)[0].outputs[0]
    assert again.token_ids == served.outputs[0].token_ids
    llm.engine.shutdown()

"""Beam search on POST /v1/completions (`use_beam_search`, `n` the beam width): the `openai` client's
answers are exactly the beams of the offline `LLM.beam_search` on the same model (fp32), best first,
and what beam search cannot honour is a 400 naming the field.

The server runs first and is stopped before the offline engine starts, so that the two never hold
the model at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from openai_errors import refused_param as openai_400_param
from serve_fixtures import Server, running_server

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
MAX_TOKENS = 12
# A chat turn, so that the model's end-of-sequence token (<|im_end|>) ends beams early; and plain text.
CHAT_PROMPT = "<|im_start|>user\nWhat is 2+2? Answer with just the number.<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [CHAT_PROMPT, "The capital of France is"]


@dataclass(frozen=True)
class Case:
    prompts: tuple[str, ...]
    width: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False


CASES = [
    # Two prompts in one request: each one's beams, in prompt order.
    Case(tuple(PROMPTS), 2),
    Case((CHAT_PROMPT,), 4),
    Case((PROMPTS[1],), 4, length_penalty=0.5, early_stopping=True),
    Case((CHAT_PROMPT,), 2, length_penalty=0.5, early_stopping="never"),
    Case((CHAT_PROMPT,), 4, early_stopping=True),
    Case((PROMPTS[1],), 2, ignore_eos=True),
]


@dataclass
class Served:
    """What the server answered, gathered before it stops."""

    # Per case: each choice's (index, token ids, text, finish_reason), and the usage.
    choices: list[list[tuple[int, list[int], str, str]]]
    usages: list[Any]
    # Each prompt's token ids, as the server tokenized it.
    prompt_ids: dict[str, list[int]]
    # Per refused request: the `param` its 400 named.
    refusals: dict[str, str | None]


def beam_request(client: openai.OpenAI, case: Case) -> Any:
    return client.completions.create(
        model=MODEL,
        prompt=list(case.prompts),
        n=case.width,
        max_tokens=MAX_TOKENS,
        extra_body={
            "use_beam_search": True,
            "length_penalty": case.length_penalty,
            "early_stopping": case.early_stopping,
            "ignore_eos": case.ignore_eos,
            "return_token_ids": True,
        },
    )


def refused_param(call: Any, **kwargs: Any) -> str | None:
    """The `param` of the 400 that `call(**kwargs)` must get, in OpenAI's error shape."""
    return openai_400_param(call, model=MODEL, **kwargs)


def refusals(client: openai.OpenAI) -> dict[str, str | None]:
    beam = {"use_beam_search": True}
    complete = client.completions.create
    return {
        "stream": refused_param(complete, prompt=PROMPTS[1], n=2, stream=True, extra_body=beam),
        "width 0": refused_param(complete, prompt=PROMPTS[1], n=0, extra_body=beam),
        "width 11": refused_param(complete, prompt=PROMPTS[1], n=11, extra_body=beam),
        "early_stopping": refused_param(
            complete, prompt=PROMPTS[1], n=2, extra_body={**beam, "early_stopping": "sometimes"}
        ),
        "temperature": refused_param(complete, prompt=PROMPTS[1], n=2, temperature=0.7, extra_body=beam),
        "logprobs": refused_param(complete, prompt=PROMPTS[1], n=2, logprobs=2, extra_body=beam),
        "stop": refused_param(complete, prompt=PROMPTS[1], n=2, stop=["."], extra_body=beam),
        "length_penalty alone": refused_param(
            complete, prompt=PROMPTS[1], extra_body={"length_penalty": 0.5}
        ),
        "chat": refused_param(
            client.chat.completions.create, messages=[{"role": "user", "content": "hi"}], n=2, extra_body=beam
        ),
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "1"]
    with (
        running_server(args, log) as server,
        openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300) as client,
    ):
        answers = [beam_request(client, case) for case in CASES]
        prompt_ids = {p: tokenize(server, p) for p in PROMPTS}
        refused = refusals(client)
    return Served(
        choices=[
            [(c.index, (c.model_extra or {})["token_ids"], c.text, c.finish_reason) for c in answer.choices]
            for answer in answers
        ],
        usages=[answer.usage for answer in answers],
        prompt_ids=prompt_ids,
        refusals=refused,
    )


def tokenize(server: Server, prompt: str) -> list[int]:
    response = server.request("POST", "/tokenize", {"model": MODEL, "prompt": prompt})
    assert response.status == 200, response
    return response.body["tokens"]


@pytest.fixture(scope="module")
def offline(served: Served, default_model_path: Path) -> Iterator[Any]:
    """The offline engine, started once the server has stopped (`served` ran first)."""
    from engine import LLM

    llm = LLM(
        model=str(default_model_path), dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=0.25
    )
    try:
        yield llm
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("number", range(len(CASES)))
def test_served_beams_are_the_offline_beam_searchs(served: Served, offline: Any, number: int) -> None:
    from engine import BeamSearchParams

    case = CASES[number]
    params = BeamSearchParams(
        beam_width=case.width,
        max_tokens=MAX_TOKENS,
        ignore_eos=case.ignore_eos,
        length_penalty=case.length_penalty,
        early_stopping=case.early_stopping,
    )
    results = offline.beam_search([{"prompt_token_ids": served.prompt_ids[p]} for p in case.prompts], params)
    expected = [
        (index, beam.output_token_ids, beam.text, beam.finish_reason)
        for index, beam in enumerate(beam for result in results for beam in result.sequences)
    ]
    assert served.choices[number] == expected, case
    usage = served.usages[number]
    assert usage.prompt_tokens == sum(len(served.prompt_ids[p]) for p in case.prompts)
    assert usage.completion_tokens == sum(len(tokens) for _, tokens, _, _ in expected)


def test_the_chat_prompt_has_beams_that_end_at_eos(served: Served) -> None:
    # A guard that the cases exercise what they are for: the chat turn's beams end at <|im_end|>, and
    # early_stopping true stops before false would (their second-best beams differ).
    assert {reason for _, _, _, reason in served.choices[1]} == {"stop"}, served.choices[1]
    assert served.choices[1] != served.choices[4]


def test_what_beam_search_cannot_honour_is_a_400_naming_it(served: Served) -> None:
    assert served.refusals == {
        "stream": "stream",
        "width 0": "n",
        "width 11": "n",
        "early_stopping": "early_stopping",
        "temperature": "temperature",
        "logprobs": "logprobs",
        "stop": "stop",
        "length_penalty alone": "length_penalty",
        "chat": "use_beam_search",
    }

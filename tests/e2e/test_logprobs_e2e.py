"""Prompt logprobs, echo with logprobs, and best_of through `sluice serve` (fp32) and the `openai` client.

The prompt's logprobs are checked against transformers' log_softmax on the same model in fp32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from hf_reference import load_hf_model
from serve_fixtures import Server, running_server

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The quick brown fox jumps over the lazy dog because"
# fp32 on both sides, different kernels.
TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with running_server(["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "1"], log) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def hf_model(default_model_path: Path) -> torch.nn.Module:
    return load_hf_model(default_model_path, torch.float32)


def tokenize(server: Server, **body: Any) -> list[int]:
    response = server.request("POST", "/tokenize", {"model": MODEL, **body})
    assert response.status == 200, response
    return response.body["tokens"]


def reference_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """transformers' logprob of each prompt token after the first."""
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()


def test_echo_with_logprobs_leads_with_the_prompt_tokens(
    server: Server, client: openai.OpenAI, hf_model: torch.nn.Module
) -> None:
    ids = tokenize(server, prompt=PROMPT)
    choice = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=2
    ).choices[0]
    logprobs = choice.logprobs
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert len(logprobs.tokens) == len(ids) + 5
    assert "".join(logprobs.tokens[: len(ids)]) == PROMPT
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1 : len(ids)] == pytest.approx(
        reference_logprobs(hf_model, ids), abs=TOLERANCE
    )
    for i, token in enumerate(logprobs.tokens):
        # Every offset points at its token in the returned text, the prompt's and the completion's alike.
        assert choice.text[logprobs.text_offset[i] :].startswith(token), (i, token)
        if i > 0:
            top = logprobs.top_logprobs[i]
            assert token in top and len(top) in (2, 3), (i, top)
    assert logprobs.text_offset[len(ids)] == len(PROMPT)

    # Streamed, the same tokens, logprobs and offsets arrive over the chunks.
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=2, stream=True
    )
    tokens, offsets, values, text = [], [], [], ""
    for chunk in stream:
        part = chunk.choices[0]
        text += part.text
        if part.logprobs is not None:
            tokens += part.logprobs.tokens
            offsets += part.logprobs.text_offset
            values += part.logprobs.token_logprobs
    assert (text, tokens, offsets) == (choice.text, logprobs.tokens, logprobs.text_offset)
    assert values[0] is None and values[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-6)


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server: Server, client: openai.OpenAI) -> None:
    # vLLM's extension: every token in the logprobs, sampled, alternative or echoed, is "token_id:N",
    # the ids being those the tokenizer gives the text; text offsets still index the text.
    ids = tokenize(server, prompt=PROMPT)
    by_text = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2
    ).choices[0]
    by_id = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    ).choices[0]
    assert by_id.text == by_text.text
    generated: list[int] = by_id.model_extra["token_ids"]
    assert by_id.logprobs.tokens == [f"token_id:{i}" for i in ids + generated]
    assert by_id.logprobs.text_offset == by_text.logprobs.text_offset
    assert by_id.logprobs.token_logprobs[1:] == pytest.approx(by_text.logprobs.token_logprobs[1:], abs=1e-6)
    for token, top in zip(by_id.logprobs.tokens[1:], by_id.logprobs.top_logprobs[1:], strict=True):
        assert token in top and all(key.startswith("token_id:") for key in top), top

    for stream in (False, True):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=stream,
            extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
        )
        chunks = list(reply) if stream else [reply]
        content = [
            t for c in chunks for choice in c.choices if choice.logprobs for t in choice.logprobs.content
        ]
        token_ids = [
            i for c in chunks for choice in c.choices for i in (choice.model_extra.get("token_ids") or [])
        ]
        assert len(token_ids) == 4
        assert [t.token for t in content] == [f"token_id:{i}" for i in token_ids]
        assert all(bytes(t.bytes) == t.token.encode() for t in content)
        assert all(t.token in {top.token for top in t.top_logprobs} for t in content)


def test_prompt_logprobs_on_completions_and_chat(
    server: Server, client: openai.OpenAI, hf_model: torch.nn.Module
) -> None:
    ids = tokenize(server, prompt=PROMPT)
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    entries = completion.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    got = [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], ids[1:], strict=True)]
    assert got == pytest.approx(reference_logprobs(hf_model, ids), abs=TOLERANCE)
    for entry, token in zip(entries[1:], ids[1:], strict=True):
        ranks = sorted(
            value["rank"] for key, value in entry.items() if key != str(token) or value["rank"] <= 3
        )
        assert ranks[:3] == [1, 2, 3], entry
    # Without the field, none.
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})

    messages = [{"role": "user", "content": "Name a colour."}]
    chat_ids = tokenize(server, messages=messages, add_generation_prompt=True)
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    entries = chat.model_extra["prompt_logprobs"]
    assert chat.usage.prompt_tokens == len(chat_ids) == len(entries) and entries[0] is None
    got = [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], chat_ids[1:], strict=True)]
    assert got == pytest.approx(reference_logprobs(hf_model, chat_ids), abs=TOLERANCE)


def test_best_of_returns_the_most_likely_candidates(client: openai.OpenAI) -> None:
    def total(choice: Any) -> float:
        return sum(choice.logprobs.token_logprobs)

    fields = {
        "model": MODEL,
        "prompt": "My favourite animal is",
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 11,
    }
    # best_of's candidates are seeded as n's choices are: seed + i.
    candidates = client.completions.create(n=5, logprobs=0, **fields).choices
    ranked = sorted(candidates, key=total, reverse=True)
    assert len({c.text for c in candidates}) > 2, "the candidates should differ"
    best = client.completions.create(n=2, best_of=5, logprobs=0, **fields).choices
    assert [c.text for c in best] == [c.text for c in ranked[:2]]
    assert [c.index for c in best] == [0, 1]
    # best_of works without logprobs shown, too.
    (alone,) = client.completions.create(best_of=5, **fields).choices
    assert alone.text == ranked[0].text and alone.logprobs is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 129}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)
def test_bad_best_of_and_prompt_logprobs_are_400s_naming_them(
    server: Server, body: dict[str, Any], param: str
) -> None:
    response = server.request(
        "POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **body}
    )
    assert response.status == 400, response
    assert response.body["error"]["param"] == param

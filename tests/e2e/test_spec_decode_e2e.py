"""N-gram speculative decoding on the default model: the same greedy tokens, fewer steps, no leaked block.

Offline, an engine with `--speculative ngram` and one without run the same batch in fp32 (real
worker processes); then `sluice serve --speculative ngram` answers the official openai client.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engine.llm import LLM
from serve_fixtures import Server, running_server
from sluice.config import ModelConfig, SluiceConfig, SpeculativeConfig
from sluice.sampling_params import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
PROMPTS = [
    f"Rename every function below to start with math_ and repeat the code.\n\n{CODE}\n",
    "Quote the sentence twice: 'The quick brown fox jumps over the lazy dog.' 'The quick brown fox",
    "List the days of the week: Monday, Tuesday, Wednesday,",
]
MAX_TOKENS = 48


def greedy_tokens(config: SluiceConfig) -> tuple[list[list[int]], LLM]:
    llm = LLM.from_config(config)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # A sampled request in the same batch: rows with and without drafts share each step.
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS)
    outputs = llm.generate([*PROMPTS, PROMPTS[0]], [greedy] * len(PROMPTS) + [sampled])
    return [list(out.outputs[0].token_ids) for out in outputs[: len(PROMPTS)]], llm


def test_greedy_tokens_are_identical_with_and_without_speculation_in_fp32(default_model_path: Path):
    model = ModelConfig(path=str(default_model_path), dtype="float32", max_model_len=512)
    plain, llm = greedy_tokens(SluiceConfig(model=model))
    llm.engine.shutdown()
    # Async scheduling stays on in the config: speculation runs one step in flight regardless.
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    speculated, llm = greedy_tokens(SluiceConfig(model=model, speculative=speculative))
    try:
        assert llm.engine.max_in_flight == 1
        stats = llm.engine.stats()
        audit = llm.engine.audit_block_pool()
    finally:
        llm.engine.shutdown()
    assert speculated == plain
    assert all(len(tokens) == MAX_TOKENS for tokens in plain)
    assert stats.spec_decode_num_drafts > 0
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert audit.consistent and audit.num_held_blocks == 0, audit.problems


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("spec") / "serve.log"
    args = ["--speculative", "ngram", "--num-speculative-tokens", "5", "--dtype", "float32"]
    args += ["--max-model-len", "512", "--kv-cache-memory", "0.25"]
    with running_server(args, log) as running:
        yield running


def test_served_speculation_matches_plain_decoding_and_counts_acceptance(server: Server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300) as client:
        texts = []
        # logprobs makes a request ineligible for drafts: it decodes one token per step.
        for logprobs in (None, 0):
            completion = client.completions.create(
                model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, logprobs=logprobs
            )
            texts.append(completion.choices[0].text)
        metrics = server.metrics()
        streamed = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPTS[1]}],
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            stream=True,
        )
        chunks = [chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices]
    assert texts[0] == texts[1] and texts[0]
    assert "".join(chunks)
    drafts = metrics["sluice:spec_decode_num_draft_tokens_total"]
    accepted = metrics["sluice:spec_decode_num_accepted_tokens_total"]
    assert metrics["sluice:spec_decode_num_drafts_total"] > 0 and 0 < accepted <= drafts
    audit = server.request("GET", "/sluice/block_pool_audit")
    assert audit.status == 200 and audit.body["consistent"], audit.body

"""The offline API's shape, n > 1, and its answers to bad input."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from sluice.errors import (
    InvalidRequestError,
    KVCacheTooSmallError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)


@pytest.fixture(scope="module")
def llm(default_model_path: Path) -> LLM:
    return LLM(model=str(default_model_path), dtype="bfloat16", max_model_len=512)


def test_text_prompt_gives_text_tokens_and_finish_reason(llm):
    params = SamplingParams(max_tokens=8, temperature=0.0)
    (result,) = llm.generate("The capital of France is", params)
    out = result.outputs[0]
    assert result.prompt_token_ids == llm.tokenizer.encode("The capital of France is")
    assert 1 <= len(out.token_ids) <= 8
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.finish_reason in ("stop", "length")
    assert out.logprobs is None


def test_logprobs_hold_the_sampled_token_and_the_top_n(llm):
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    (result,) = llm.generate({"prompt_token_ids": [504, 476, 3391, 18]}, params)
    out = result.outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry[token].rank == 1  # greedy picks the most likely token
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
        assert all(lp.logprob <= 0.0 for lp in entry.values())


def test_max_tokens_gives_length_finish(llm):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    (result,) = llm.generate({"prompt_token_ids": [504, 476, 3391]}, params)
    assert len(result.outputs[0].token_ids) == 5
    assert result.outputs[0].finish_reason == "length"


def test_stop_token_ids_end_generation(llm):
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (free_run,) = llm.generate({"prompt_token_ids": [504, 476, 3391, 18]}, free)
    stop_at = free_run.outputs[0].token_ids[3]
    stopped = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at])
    (result,) = llm.generate({"prompt_token_ids": [504, 476, 3391, 18]}, stopped)
    out = result.outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_at
    assert out.token_ids == free_run.outputs[0].token_ids[: out.token_ids.index(stop_at) + 1]


def test_n_samples_share_the_prompt_blocks(llm, w1_prompts):
    before = llm.engine.stats().prefix_cache_hits
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    (result,) = llm.generate({"prompt_token_ids": w1_prompts[5]}, params)
    assert [o.index for o in result.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 8 for o in result.outputs)
    assert len({tuple(o.token_ids) for o in result.outputs}) > 1
    # 128 prompt tokens = 8 full blocks; the three later samples reuse the first's blocks.
    assert llm.engine.stats().prefix_cache_hits - before >= 3 * 7 * 16


def test_cache_salt_keeps_prompts_of_other_salts_out_of_the_prefix_cache(llm, w1_prompts):
    params = SamplingParams(max_tokens=1)
    ids = w1_prompts[6]

    def cached(**salt: str) -> int:
        return llm.generate({"prompt_token_ids": ids, **salt}, params)[0].num_cached_tokens

    assert cached(cache_salt="tenant-a") == 0
    # 128 tokens: 7 of the 8 full blocks are hits (the last token is always recomputed).
    assert cached(cache_salt="tenant-a") == 112
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0
    # A text prompt takes a salt too.
    text = "Salted offline prompt: " + " ".join(f"w{i}" for i in range(40))
    first, again = (llm.generate({"prompt": text, "cache_salt": "t"}, params)[0] for _ in range(2))
    assert first.prompt == text and first.num_cached_tokens == 0 and again.num_cached_tokens > 0


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
        ({"prompt_token_ids": [1] * 513}, SamplingParams(), "prompt"),
        ({"prompt_token_ids": [10**7]}, SamplingParams(), "prompt"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=0), "max_tokens"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(temperature=-0.5), "temperature"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(top_p=0.0), "top_p"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(top_p=1.5), "top_p"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(top_k=-2), "top_k"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(n=0), "n"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(seed=2**63), "seed"),
        ({"prompt_token_ids": [1, 2], "cache_salt": ""}, SamplingParams(), "cache_salt"),
        ({"text": "no such key"}, SamplingParams(), "prompt"),
    ],
)
def test_bad_request_raises_before_scheduling(llm, prompt, params, param):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(prompt, params)
    assert info.value.param == param
    assert not llm.engine.has_unfinished_requests()


def test_bad_request_leaves_running_requests_alone(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (expected,) = llm.generate({"prompt_token_ids": [504, 476, 3391]}, params)
    engine.add_request("running", [504, 476, 3391], params, time.monotonic())
    tokens = [t for o in engine.step() for t in o.new_token_ids]
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", [], params, time.monotonic())
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == expected.outputs[0].token_ids


def test_missing_model_folder(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "nowhere"))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        LLM(model=str(tmp_path))


def test_kv_budget_too_small_for_one_request_says_so(default_model_path):
    with pytest.raises(KVCacheTooSmallError, match="max_model_len 8192"):
        LLM(model=str(default_model_path), kv_cache_memory=0.01)


def test_sluice_exports_the_offline_api_without_importing_the_engine_early():
    import subprocess
    import sys

    import sluice
    from engine.llm import LLM as EngineLLM

    assert sluice.LLM is EngineLLM and sluice.SamplingParams is SamplingParams
    # The shared modules stay importable on their own: importing sluice.config loads no engine.
    probe = "import sys, sluice.config; assert 'engine' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", probe], check=True)


def test_chat_renders_the_chat_template(llm):
    params = SamplingParams(max_tokens=12, temperature=0.0)
    (result,) = llm.chat([{"role": "user", "content": "Name a river."}], params)
    # SmolLM2's template, with its default system prompt, written out by hand.
    expected_prompt = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nName a river.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert result.prompt == expected_prompt
    assert result.prompt_token_ids == llm.tokenizer.encode(expected_prompt)
    (plain,) = llm.generate({"prompt_token_ids": result.prompt_token_ids}, params)
    assert result.outputs[0].token_ids == plain.outputs[0].token_ids
    assert result.outputs[0].text


def test_chat_takes_several_conversations_in_order(llm):
    params = SamplingParams(max_tokens=6, temperature=0.0)
    conversations = [[{"role": "user", "content": q}] for q in ("Hi!", "What is 2+2?")]
    results = llm.chat(conversations, params)
    singles = [llm.chat(c, params)[0] for c in conversations]
    assert [r.outputs[0].token_ids for r in results] == [s.outputs[0].token_ids for s in singles]
    assert results[0].prompt != results[1].prompt


def _free_run(llm):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    (result,) = llm.generate("The three primary colors are", params)
    return result.outputs[0]


def test_stop_string_ends_the_text_before_it(llm):
    free = _free_run(llm)
    stop = free.text[10:14]
    assert stop.strip() and free.text.find(stop) == 10
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=["no such text", stop])
    (result,) = llm.generate("The three primary colors are", params)
    out = result.outputs[0]
    assert out.text == free.text[:10]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < len(free.token_ids)
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
    assert not llm.engine.has_unfinished_requests()


def test_stop_string_keeps_one_logprob_per_kept_token(llm):
    free = _free_run(llm)
    stop = free.text[10:14]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop], logprobs=1)
    (result,) = llm.generate("The three primary colors are", params)
    out = result.outputs[0]
    assert out.finish_reason == "stop" and len(out.logprobs) == len(out.token_ids)
    assert all(entry[token].rank == 1 for token, entry in zip(out.token_ids, out.logprobs))


def test_stop_string_kept_with_include_stop_str_in_output(llm):
    free = _free_run(llm)
    stop = free.text[10:14]
    params = SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, stop=stop, include_stop_str_in_output=True
    )
    (result,) = llm.generate("The three primary colors are", params)
    assert result.outputs[0].text == free.text[:14]
    assert result.outputs[0].finish_reason == "stop"


def test_stop_string_not_checked_before_min_tokens(llm):
    free = _free_run(llm)
    stop = free.text[:3]
    early = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    (stopped,) = llm.generate("The three primary colors are", early)
    assert stopped.outputs[0].text == ""
    late = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop], min_tokens=24)
    (result,) = llm.generate("The three primary colors are", late)
    assert result.outputs[0].text == free.text
    assert result.outputs[0].finish_reason == "length"


def test_skip_special_tokens_false_keeps_the_end_token_text(llm):
    chat = [{"role": "user", "content": "Say hello."}]
    kept = llm.chat(chat, SamplingParams(max_tokens=64, temperature=0.0, skip_special_tokens=False))[0]
    skipped = llm.chat(chat, SamplingParams(max_tokens=64, temperature=0.0))[0]
    assert kept.outputs[0].finish_reason == "stop"
    assert kept.outputs[0].token_ids[-1] == llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert kept.outputs[0].text == skipped.outputs[0].text + "<|im_end|>"


@pytest.mark.parametrize("stop", [[""], ["ok", 3]])
def test_bad_stop_strings_are_refused(llm, stop):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("Hello", SamplingParams(stop=stop))
    assert info.value.param == "stop"


def test_bad_words_are_tokenized_and_never_sampled(llm):
    free = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0.0))
    paris = llm.tokenizer.encode(" Paris", add_special_tokens=False)
    assert free[0].outputs[0].token_ids[: len(paris)] == paris
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, bad_words=["Paris"])
    (result,) = llm.generate("The capital of France is", params)
    out = result.outputs[0]
    assert len(out.token_ids) == 8 and "Paris" not in out.text
    for word in ("Paris", " Paris"):
        ids = llm.tokenizer.encode(word, add_special_tokens=False)
        assert not any(out.token_ids[i : i + len(ids)] == ids for i in range(len(out.token_ids)))
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate("x", SamplingParams(max_tokens=2, bad_words=["  "]))
    assert refused.value.param == "bad_words"


def test_bad_words_join_the_token_sequences_given_with_them(llm):
    encode = llm.tokenizer.encode
    params = SamplingParams(bad_words=["  Paris", "Paris"], bad_words_token_ids=[[5, 6]])
    assert llm._with_bad_word_ids(params).bad_words_token_ids == [
        [5, 6],
        encode("Paris", add_special_tokens=False),
        encode(" Paris", add_special_tokens=False),
    ]

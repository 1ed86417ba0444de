"""Tensor parallelism on CPU: ranks in real processes over gloo give the single-rank model's greedy tokens.

The single-rank run (this process, no process group) is the reference. A rank's greedy token may
differ from it only where the reference's top two logits are within NEAR_TIE, and the rest of that
sequence is then not compared, since its context differs.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

import sluice.parallel_validation
from sluice.errors import DeviceUnavailableError, TensorParallelSizeError
from sluice.model_spec import read_model_spec
from sluice.parallel_validation import check_tensor_parallel
from sluice.sampling_params import SamplingParams
from tiny_models import tiny_model_dir, write_tiny_model
from tp_harness import greedy_generate, load_float32, run_tensor_parallel
from worker.distributed import init_tensor_parallel, tensor_parallel_group
from worker.model_loader import weight_files
from worker.sampler import Sampler
from worker.sampling_state import SamplingState

NEAR_TIE = 1e-3
MAX_NEW_TOKENS = 8
# The tiny models: Llama (tied embeddings), Qwen2 (qkv bias), Qwen3 (q/k norms, head_dim 32), Phi-3 (q, k
# and v fused in the checkpoint, and gate and up), Qwen3-MoE and Qwen2-MoE (every expert's intermediate
# size split, and Qwen2-MoE's shared expert), Gemma 3 (its post-norms after the all-reduce), a Llama
# with biases on every projection (row-parallel ones included), and a Llama whose vocab (321) does not
# divide by 2, so the last rank's vocab shard is padded.
TINY = [
    "llama",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma3_text",
    "qwen3_moe",
    "qwen2_moe",
    "llama-biases",
    "llama-odd-vocab",
]
# Layer 0's weights of the default model, checked slice by slice on each of the three ranks.
DEFAULT_MODEL_PARAMS = (
    "embed_tokens.weight",
    "layers.0.self_attn.qkv_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "layers.0.input_layernorm.weight",
)


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _run_on_rank(
    folders: list[Path], prompts: list[list[int]], param_names: tuple[str, ...] | None
) -> list[Any]:
    """On one rank, per folder: its parameters (`param_names`, or all), greedy tokens and logits, and
    tokens sampled with the group's shared generator after this rank's default generator was set apart."""
    results = []
    tp = tensor_parallel_group()
    for folder in folders:
        # The shards as loaded: the CPU kernels' packed form of a weight is its tier's, not [out, in].
        params = {
            name: param.clone()
            for name, param in load_float32(folder, packed_linear=False).named_parameters()
            if param_names is None or name in param_names
        }
        tokens, logits = greedy_generate(load_float32(folder), prompts, MAX_NEW_TOKENS)
        torch.manual_seed(1000 + tp.rank)
        sampler = Sampler(tp.shared_generator())
        rows = torch.cat(logits)
        state = SamplingState(len(rows), rows.shape[1], torch.device("cpu"))
        for row in range(len(rows)):
            state.add(row, SamplingParams(temperature=3.0), [], [])
        sampled = sampler.sample(rows.clone(), state.metadata(len(rows))).token_ids.tolist()
        results.append({"params": params, "tokens": tokens, "logits": logits, "sampled": sampled})
    return results


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folders = {
        arch: tiny_model_dir(arch)
        for arch in ("llama", "qwen2", "qwen3", "phi3", "gemma3_text", "qwen3_moe", "qwen2_moe")
    }
    variants = {
        "llama-biases": {"attention_bias": True, "mlp_bias": True},
        "llama-odd-vocab": {"vocab_size": 321},
    }
    for seed, (name, overrides) in enumerate(variants.items(), start=1):
        folders[name] = write_tiny_model(
            "llama", tmp_path_factory.mktemp(name), seed=seed, overrides=overrides
        )
    return folders


@pytest.fixture(scope="module")
def tiny_prompts() -> list[list[int]]:
    return _prompts(320, [5, 11, 3, 17], seed=0)


@pytest.fixture(scope="module")
def two_rank_runs(tiny_folders: dict[str, Path], tiny_prompts: list[list[int]]) -> dict[str, list[dict]]:
    """arch -> each rank's results; all four tiny models in one pair of processes."""
    per_rank = run_tensor_parallel(_run_on_rank, 2, ([tiny_folders[a] for a in TINY], tiny_prompts, None))
    return {arch: [rank[i] for rank in per_rank] for i, arch in enumerate(TINY)}


@pytest.fixture(scope="module")
def default_prompts() -> list[list[int]]:
    return _prompts(49152, [7, 13, 4], seed=1)


@pytest.fixture(scope="module")
def three_rank_default_run(default_model_path: Path, default_prompts: list[list[int]]) -> list[dict]:
    per_rank = run_tensor_parallel(
        _run_on_rank, 3, ([default_model_path], default_prompts, DEFAULT_MODEL_PARAMS)
    )
    return [rank[0] for rank in per_rank]


def _assert_same_greedy_tokens(ranks: list[dict], folder: Path, prompts: list[list[int]]) -> None:
    ref_tokens, ref_logits = greedy_generate(load_float32(folder), prompts, MAX_NEW_TOKENS)
    for rank in ranks[1:]:
        assert rank["tokens"] == ranks[0]["tokens"], "the ranks disagree on the tokens they picked"
    compared = 0
    for p, (ours, ref) in enumerate(zip(ranks[0]["tokens"], ref_tokens, strict=True)):
        for step, (token, ref_token) in enumerate(zip(ours, ref, strict=True)):
            logits, reference = ranks[0]["logits"][p][step], ref_logits[p][step]
            if token != ref_token:
                top2 = reference.topk(2).values
                gap = (top2[0] - top2[1]).item()
                assert gap < NEAR_TIE, (
                    f"prompt {p}, step {step}: TP picked {token}, TP=1 picked {ref_token} (logit gap {gap:.2e})"
                )
                break
            scale = max(reference.abs().max().item(), 1.0)
            assert (logits - reference).abs().max().item() <= 1e-4 * scale, (p, step)
            compared += 1
    # Near-ties are rare: a run that diverged early everywhere would show nothing.
    assert compared >= len(prompts) * MAX_NEW_TOKENS // 2, compared


@pytest.mark.parametrize("arch", TINY)
def test_two_ranks_generate_the_single_rank_tokens(
    arch: str, two_rank_runs: dict, tiny_folders: dict, tiny_prompts: list
) -> None:
    _assert_same_greedy_tokens(two_rank_runs[arch], tiny_folders[arch], tiny_prompts)


def test_three_ranks_generate_the_single_rank_tokens_on_the_default_model(
    three_rank_default_run: list[dict], default_model_path: Path, default_prompts: list
) -> None:
    _assert_same_greedy_tokens(three_rank_default_run, default_model_path, default_prompts)


def _checkpoint(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name in names:
                    tensors[name] = reader.get_tensor(name).float()
    return tensors


def _part_rows(folder: Path, module: str) -> list[int]:
    config = json.loads((folder / "config.json").read_text())
    if module == "gate_up_proj":
        return [config["intermediate_size"]] * 2
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_rows = config["num_key_value_heads"] * head_dim
    return [config["num_attention_heads"] * head_dim, kv_rows, kv_rows]


def _expected_shard(folder: Path, name: str, rank: int, size: int) -> torch.Tensor:
    """Our parameter `name` on `rank` of `size`, cut from the checkpoint by Megatron's layout."""
    prefix, _, kind = name.rpartition(".")
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    module = prefix.rpartition(".")[2]
    if module in fused:
        parts = [f"model.{prefix.removesuffix(module)}{part}.{kind}" for part in fused[module]]
        tensors = _checkpoint(folder, parts)
        if not tensors:
            # Phi-3 keeps them fused in the checkpoint: cut the fused tensor into its parts.
            whole = _checkpoint(folder, [f"model.{name}"])[f"model.{name}"]
            tensors = dict(zip(parts, whole.split(_part_rows(folder, module)), strict=True))
        return torch.cat([tensors[part].chunk(size)[rank] for part in parts])
    hf_name = name if name.startswith("lm_head.") else f"model.{name}"
    tensor = _checkpoint(folder, [hf_name])[hf_name]
    if module in ("o_proj", "down_proj") and kind == "weight":
        return tensor.chunk(size, dim=1)[rank]
    if module in ("embed_tokens", "lm_head"):
        shard = -(-tensor.shape[0] // size)
        padded = F.pad(tensor, (0, 0, 0, shard * size - tensor.shape[0]))
        return padded[rank * shard : (rank + 1) * shard]
    return tensor


@pytest.mark.parametrize("arch", TINY)
def test_each_rank_loads_its_slice_of_the_checkpoint(
    arch: str, two_rank_runs: dict, tiny_folders: dict
) -> None:
    folder = tiny_folders[arch]
    names = [name for name, _ in load_float32(folder).named_parameters()]
    for rank, result in enumerate(two_rank_runs[arch]):
        assert sorted(result["params"]) == sorted(names)
        for name, param in result["params"].items():
            assert torch.equal(param, _expected_shard(folder, name, rank, 2)), (rank, name)


def test_each_of_three_ranks_loads_its_slice_of_the_default_model(
    three_rank_default_run: list[dict], default_model_path: Path
) -> None:
    for rank, result in enumerate(three_rank_default_run):
        assert sorted(result["params"]) == sorted(DEFAULT_MODEL_PARAMS)
        for name, param in result["params"].items():
            assert torch.equal(param, _expected_shard(default_model_path, name, rank, 3)), (rank, name)
    # 3 KV heads over 3 ranks: one each, between 3 query heads.
    assert three_rank_default_run[0]["params"]["layers.0.self_attn.qkv_proj.weight"].shape == (5 * 64, 576)


def test_ranks_sample_the_same_tokens_from_the_shared_generator(two_rank_runs: dict) -> None:
    for arch in TINY:
        first, second = two_rank_runs[arch]
        assert first["sampled"] == second["sampled"], arch
    # Temperature 3 over these logits is far from greedy: the draws did come from the generator.
    run = two_rank_runs["qwen2"][0]
    assert run["sampled"] != torch.cat(run["logits"]).argmax(-1).tolist()


def test_single_rank_sets_up_nothing() -> None:
    group = init_tensor_parallel(0, 1, "tcp://127.0.0.1:1", "cpu")
    assert group is tensor_parallel_group()
    assert (group.rank, group.size, group.group) == (0, 1, None)
    assert not torch.distributed.is_initialized()
    x = torch.ones(3, 4)
    assert group.all_reduce(x) is x and group.all_gather_last_dim(x) is x
    assert group.shared_generator() is None


def test_indivisible_heads_are_refused_before_any_process_starts(default_model_path: Path) -> None:
    # A fresh interpreter: the check must not need torch, let alone start a worker.
    script = (
        "import sys\n"
        "from sluice.errors import TensorParallelSizeError\n"
        "from sluice.model_spec import read_model_spec\n"
        "from sluice.parallel_validation import check_tensor_parallel\n"
        f"spec = read_model_spec({str(default_model_path)!r})\n"
        "check_tensor_parallel(spec, 3)\n"
        "try:\n"
        "    check_tensor_parallel(spec, 2)\n"
        "except TensorParallelSizeError as error:\n"
        "    print(error)\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    message = result.stdout
    assert "tensor_parallel_size 2" in message and "9 attention heads" in message, message
    assert "sizes that fit" in message and "1, 3" in message, message


@pytest.mark.parametrize(
    ("overrides", "tp_size", "named"),
    [
        ({"num_key_value_heads": 2}, 4, "2 KV heads"),
        ({"intermediate_size": 129}, 2, "129 intermediate_size"),
        ({}, 0, "at least 1, got 0"),
    ],
)
def test_other_misfits_name_their_counts(overrides: dict, tp_size: int, named: str, tmp_path: Path) -> None:
    folder = write_tiny_model("llama", tmp_path, overrides={"num_attention_heads": 8, **overrides})
    with pytest.raises(TensorParallelSizeError, match=named):
        check_tensor_parallel(read_model_spec(folder), tp_size)


def test_cuda_needs_a_gpu_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = read_model_spec(tiny_model_dir("llama"))
    monkeypatch.setattr(sluice.parallel_validation, "_visible_cuda_devices", lambda: 1)
    check_tensor_parallel(spec, 2, "cpu")
    with pytest.raises(DeviceUnavailableError, match="needs 2 GPUs .* sees 1"):
        check_tensor_parallel(spec, 2, "cuda")


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="NCCL needs two CUDA devices"
)
def test_two_ranks_over_nccl_generate_the_single_rank_tokens(tiny_prompts: list) -> None:
    folder = tiny_model_dir("qwen2")
    ranks = run_tensor_parallel(_run_cuda_on_rank, 2, (folder, tiny_prompts), device="cuda")
    ref_tokens, _ = greedy_generate(load_float32(folder, "cuda"), tiny_prompts, MAX_NEW_TOKENS)
    assert ranks[0] == ranks[1] == ref_tokens


def _run_cuda_on_rank(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    tokens, _ = greedy_generate(load_float32(folder, "cuda"), prompts, MAX_NEW_TOKENS)
    return tokens


def _engine_greedy(folder: Path, prompts: list[list[int]], tp_size: int, logprobs: int | None = None) -> list:
    from engine import LLM

    llm = LLM(model=str(folder), dtype="float32", tensor_parallel_size=tp_size, max_model_len=256)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    outputs = [r.outputs[0] for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    llm.engine.shutdown()
    return outputs


def _assert_engine_tokens_match(folder: Path, prompts: list[list[int]], tp_size: int) -> None:
    reference = _engine_greedy(folder, prompts, 1, logprobs=2)
    ours = _engine_greedy(folder, prompts, tp_size)
    for p, (got, ref) in enumerate(zip(ours, reference, strict=True)):
        for step, (token, ref_token) in enumerate(zip(got.token_ids, ref.token_ids, strict=True)):
            if token != ref_token:
                # Logprob differences are logit differences: the TP=1 run's own top-two gap.
                top = sorted((lp.logprob for lp in ref.logprobs[step].values()), reverse=True)
                assert top[0] - top[1] < NEAR_TIE, f"prompt {p}, step {step}: not a near-tie"
                break


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_engine_with_two_worker_ranks_matches_one(arch: str, tiny_folders: dict, tiny_prompts: list) -> None:
    _assert_engine_tokens_match(tiny_folders[arch], tiny_prompts, 2)


def test_engine_with_three_worker_ranks_matches_one_on_the_default_model(
    default_model_path: Path, default_prompts: list
) -> None:
    _assert_engine_tokens_match(default_model_path, default_prompts, 3)

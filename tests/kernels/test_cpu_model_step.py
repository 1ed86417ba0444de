"""The kernels' model step (FULL) and its per-layer stages (PIECEWISE) against the eager Python forward,
at every tier this CPU runs.

They run the same kernels in the same order, so every hidden state and every KV-cache entry must be
bitwise equal, in float32 and in bfloat16, through prefill chunks, pure decodes and mixed steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from paged_sequences import PagedSequences
from sluice.config import GraphConfig
from sluice.model_spec import read_model_spec
from tiny_models import tiny_model_dir, write_tiny_model
from worker.attention.cpu_backend import CpuAttentionBackend
from worker.cpu_model_step import CpuModelStep, cpu_model_step_for
from worker.model_loader import load_model
from worker.models.llama import LlamaForCausalLM
from worker.native_ops import NativeOps

# With experts: Qwen3-MoE (a dense layer between two MoE ones) and Qwen2-MoE (the shared expert); Mistral
# with a 16-key sliding window under sequences of 12 to 40 tokens.
ARCHS = ["llama", "qwen2", "qwen3", "mistral", "mistral-window", "qwen3_moe", "qwen2_moe", "default"]
DTYPES = [torch.float32, torch.bfloat16]
MAX_TOKENS = 64
# A prefill chunk of every sequence, a pure decode, a mixed step (decodes around a 4-token chunk), a decode.
SCHEDULE = [[32, 15, 5], [1, 1, 1], [1, 1, 4], [1, 1, 1]]


@pytest.fixture(scope="module")
def folders(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    named = {"default": default_model_path}
    named["mistral-window"] = write_tiny_model(
        "mistral", tmp_path_factory.mktemp("mistral-window"), overrides={"sliding_window": 16}
    )
    # Layer 0 full, layer 1 windowed: two KV cache groups, two block tables.
    named["qwen2-hybrid"] = write_tiny_model(
        "qwen2",
        tmp_path_factory.mktemp("qwen2-hybrid"),
        overrides={"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
    )
    return {arch: named.get(arch) or tiny_model_dir(arch) for arch in [*ARCHS, "qwen2-hybrid"]}


@pytest.fixture(scope="module")
def ops(native) -> NativeOps:
    return native


def _load(
    ops: NativeOps, folder: Path, dtype: torch.dtype, decode_path: bool = True, **kwargs
) -> LlamaForCausalLM:
    attention = CpuAttentionBackend(ops, decode_path=decode_path)
    return load_model(read_model_spec(folder), dtype, torch.device("cpu"), attention, **kwargs)


Forward = Callable[..., torch.Tensor]


# Off (--no-cpu-decode-attention), FULL's C++ attention must take the tile path for decodes as eager does.
@pytest.mark.parametrize(
    ("arch", "dtype", "decode_path"),
    [(arch, dtype, True) for arch in ARCHS for dtype in DTYPES] + [("default", torch.bfloat16, False)],
    ids=str,
)
def test_full_and_piecewise_are_bitwise_the_eager_forward(
    ops: NativeOps, arch: str, dtype: torch.dtype, decode_path: bool, folders: dict[str, Path]
) -> None:
    model = _load(ops, folders[arch], dtype, decode_path)
    step = CpuModelStep(ops, model, MAX_TOKENS)
    assert step.supports_full
    vocab = model.embed_tokens.weight.shape[0]
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (40, 20, 12)]
    batch = PagedSequences(model, seqs, seed=5)
    paths: dict[str, Forward] = {
        "eager": model.forward,
        "full": step.forward_full,
        "piecewise": step.forward_piecewise,
    }
    caches = {name: batch.new_kv_caches() for name in paths}
    with torch.inference_mode():
        for query_lens in SCHEDULE:
            ids, positions, metadata = batch.next_inputs(query_lens)
            # Copies: FULL's result is a view of its workspace, overwritten by the next step.
            hidden = {
                name: forward(ids, positions, caches[name], metadata).clone()
                for name, forward in paths.items()
            }
            assert hidden["eager"].shape == (sum(query_lens), model.norm.weight.numel())
            assert hidden["eager"].isfinite().all()
            for name in ("full", "piecewise"):
                assert torch.equal(hidden[name], hidden["eager"]), f"{name} differs at step {query_lens}"
    for name in ("full", "piecewise"):
        for (key, value), (eager_key, eager_value) in zip(caches[name], caches["eager"], strict=True):
            assert torch.equal(key, eager_key) and torch.equal(value, eager_value), f"{name} KV cache differs"


def test_a_hybrid_kv_cache_runs_piecewise_bitwise_the_eager_forward(
    ops: NativeOps, folders: dict[str, Path]
) -> None:
    """FULL reads one block table; a model whose layers read a table per group runs PIECEWISE (the C++
    dense stages, each layer's attention with its group's metadata)."""
    model = _load(ops, folders["qwen2-hybrid"], torch.float32)
    assert model.kv_cache_groups.num_groups == 2
    step = cpu_model_step_for(model, GraphConfig(), MAX_TOKENS, 1)
    assert step is not None and not step.supports_full
    seqs = [list(range(3, 3 + n)) for n in (48, 24)]
    batch = PagedSequences(model, seqs, seed=5)
    eager_caches, piecewise_caches = batch.new_kv_caches(), batch.new_kv_caches()
    with torch.inference_mode():
        for query_lens in ([32, 15], [1, 1], [8, 5], [1, 1]):
            ids, positions, metadata = batch.next_inputs(query_lens)
            want = model.forward(ids, positions, eager_caches, metadata)
            got = step.forward_piecewise(ids, positions, piecewise_caches, metadata)
            assert torch.equal(got, want), query_lens


def test_buffers_keep_their_addresses_across_steps_of_any_size(
    ops: NativeOps, folders: dict[str, Path]
) -> None:
    model = _load(ops, folders["qwen3"], torch.float32)
    step = CpuModelStep(ops, model, MAX_TOKENS)
    buffers = step.workspace_data_ptrs()
    seqs = [list(range(3, 3 + n)) for n in (45, 15)]
    batch = PagedSequences(model, seqs)
    kv_caches = batch.new_kv_caches()
    full_outputs, stage_outputs = set(), set()
    with torch.inference_mode():
        for query_lens in ([30, 9], [1, 1], [1, 1], [9, 1]):
            ids, positions, metadata = batch.next_inputs(query_lens)
            full_outputs.add(step.forward_full(ids, positions, kv_caches, metadata).data_ptr())
            residual = torch.randn(len(ids), model.norm.weight.numel())
            cos, sin = model.rotary.lookup(positions)
            stages = step.stages[1]
            q, k, v = stages.attention_input(None, residual, cos, sin)
            attn = torch.randn(q.shape)
            o = stages.attention_output(attn)
            mlp = stages.feed_forward(o, residual)
            stage_outputs.add((q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), mlp.data_ptr()))
    assert len(full_outputs) == 1 and full_outputs <= set(buffers)
    assert len(stage_outputs) == 1
    assert step.workspace_data_ptrs() == buffers


def test_a_step_larger_than_the_workspace_is_refused(ops: NativeOps, folders: dict[str, Path]) -> None:
    model = _load(ops, folders["llama"], torch.float32)
    step = CpuModelStep(ops, model, 8)
    assert step.fits(8) and not step.fits(9) and not step.fits(0)
    batch = PagedSequences(model, [list(range(3, 20))])
    ids, positions, metadata = batch.next_inputs([9])
    with torch.inference_mode(), pytest.raises(RuntimeError, match="does not fit the workspace of 8 tokens"):
        step.forward_full(ids, positions, batch.kv_caches, metadata)


def test_full_needs_a_single_rank_and_enforce_eager_turns_the_step_off(
    ops: NativeOps, folders: dict[str, Path]
) -> None:
    model = _load(ops, folders["llama"], torch.float32)
    assert not CpuModelStep(ops, model, MAX_TOKENS, tensor_parallel_size=2).supports_full
    assert cpu_model_step_for(model, GraphConfig(enforce_eager=True), MAX_TOKENS, 1) is None
    assert cpu_model_step_for(model, GraphConfig(mode="none"), MAX_TOKENS, 1) is None
    assert isinstance(cpu_model_step_for(model, GraphConfig(), MAX_TOKENS, 1), CpuModelStep)
    # The step multiplies packed weights only: --no-packed-linear runs every step eagerly.
    unpacked = _load(ops, folders["llama"], torch.float32, packed_linear=False)
    assert cpu_model_step_for(unpacked, GraphConfig(), MAX_TOKENS, 1) is None
    # The step runs MoE layers in the kernels' one call: --no-fused-moe runs them expert by expert, eagerly.
    assert isinstance(
        cpu_model_step_for(_load(ops, folders["qwen3_moe"], torch.float32), GraphConfig(), 8, 1), CpuModelStep
    )
    unfused = _load(ops, folders["qwen3_moe"], torch.float32, fused_moe=False)
    assert cpu_model_step_for(unfused, GraphConfig(), MAX_TOKENS, 1) is None


def test_bind_threads_pins_each_thread_of_torchs_pool_to_its_core(ops: NativeOps) -> None:
    # Reversed, so that thread i landing on core cpu_ids[i] is told apart from thread i on core i.
    cores = sorted(os.sched_getaffinity(0))[:2][::-1]
    # In a child process: pinning is permanent for the threads it touches.
    script = textwrap.dedent(
        f"""
        import json, os, torch
        from worker.native_ops import native_ops_for
        torch.set_num_threads({len(cores)})
        bound = native_ops_for("{ops.tier}").bind_threads({cores})
        torch.ones(1 << 22).sum()
        allowed = []
        for tid in os.listdir("/proc/self/task"):
            for line in open(f"/proc/self/task/{{tid}}/status"):
                if line.startswith("Cpus_allowed_list"):
                    allowed.append(line.split()[1])
        print(json.dumps({{"bound": bound, "main": sorted(os.sched_getaffinity(0)), "threads": allowed}}))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bound"] == cores
    # Thread 0 of the pool is the calling thread.
    assert result["main"] == [cores[0]]
    for core in cores:
        assert str(core) in result["threads"]

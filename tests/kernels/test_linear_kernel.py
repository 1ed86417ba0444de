"""The packed GEMMs (csrc/cpu/gemm_fma.cpp at every tier, gemm_bf16.cpp at avx512bf16) against a float64
reference, at every kernel tier this CPU runs, and the model on them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_reference import mixed_length_prompts
from sluice.model_spec import read_model_spec
from worker.attention.cpu_backend import CpuAttentionBackend
from worker.model_loader import load_model

FP32_UNIT = 2.0**-24
# Half an ulp of a result rounded to the model dtype, relative.
HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 0.0}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(scope="module")
def ops(native):
    return native


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ w.T + b in float64, and the sum of |x||w| that bounds the rounding error of float32 sums."""
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    if b is not None:
        exact = exact + b.double()
        magnitude = magnitude + b.double().abs()
    return exact, magnitude


def assert_within_rounding(got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, k: int) -> None:
    """float32 accumulation error (a few sqrt(K) units of |x||w|), plus half an ulp if rounded to the dtype."""
    tolerance = 8 * k**0.5 * FP32_UNIT * magnitude + 1e-30 + HALF_ULP[got.dtype] * exact.abs()
    diff = (got.double() - exact).abs()
    assert bool((diff <= tolerance).all()), f"max excess {(diff - tolerance).max().item()}"


SHAPES = [(1, 1), (17, 3), (64, 64), (100, 77), (130, 2049), (960, 576)]
ROWS = [1, 2, 3, 5, 6, 7, 12, 13, 17, 64, 127, 300]


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_matches_float64(ops, dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    torch.manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    b = torch.randn(n, dtype=dtype)
    packed = ops.pack_linear_weight(w)
    assert packed.dtype == torch.int32 and packed.dim() == 1
    for bias in (None, b):
        exact, magnitude = reference(x, w, bias)
        got = ops.linear(x, packed, bias)
        assert got.dtype == dtype and got.shape == (rows, n)
        assert_within_rounding(got, exact, magnitude, k)
        got32 = ops.linear_float32(x, packed, bias)
        assert got32.dtype == torch.float32 and got32.shape == (rows, n)
        assert_within_rounding(got32, exact, magnitude, k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(ops, dtype: torch.dtype) -> None:
    """Batch invariance: every output is one float32 sum over k in order, whatever tile its row lands in."""
    torch.manual_seed(3)
    x = torch.randn(70, 300, dtype=dtype)
    packed = ops.pack_linear_weight(torch.randn(200, 300, dtype=dtype))
    whole = ops.linear_float32(x, packed, None)
    for rows in (1, 2, 3, 5, 7, 13, 33):
        for start in (0, 37):
            assert torch.equal(
                ops.linear_float32(x[start : start + rows], packed, None), whole[start : start + rows]
            )


# K long enough for several blocks of 96 k pairs (odd, so the last k has no partner), and one with
# 33 column groups, so that an item spans two groups and prefetches the second's first block.
@pytest.mark.parametrize(("n", "k"), [(130, 2049), (2100, 1000)])
@pytest.mark.parametrize("rows", [7, 16, 64, 65])
def test_k_blocks_change_no_bit_and_stay_within_rounding(ops, rows: int, n: int, k: int) -> None:
    torch.manual_seed(rows + n + k)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16)
    results = {}
    for k_blocks in (False, True):
        packed = ops.pack_linear_weight(w, k_blocks=k_blocks)
        # Header word 5 of a packed weight says whether its GEMM may take K in blocks.
        assert packed[5].item() == int(k_blocks)
        results[k_blocks] = (ops.linear(x, packed, b), ops.linear_float32(x, packed, b))
    exact, magnitude = reference(x, w, b)
    for whole, blocked in zip(results[False], results[True], strict=True):
        assert_within_rounding(blocked, exact, magnitude, k)
        # Each sum runs over k in the same order either way; only where it waits between blocks differs.
        assert torch.equal(blocked, whole)


# 1536: the default model's MLP; 40 and 33 leave the last column group short of a vector of features;
# K = 2049 takes K blocks at 7-64 rows, with an odd last k.
@pytest.mark.parametrize(("width", "k"), [(1536, 576), (40, 2049), (33, 17)])
@pytest.mark.parametrize("rows", [1, 7, 16, 65, 300])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_weight_writes_silu_and_mul_of_the_plain_gemm_bit_for_bit(
    ops, dtype: torch.dtype, rows: int, width: int, k: int
) -> None:
    torch.manual_seed(rows + width + k)
    x = torch.randn(rows, k, dtype=dtype)
    w = (torch.randn(2 * width, k) * k**-0.5).to(dtype)
    b = torch.randn(2 * width, dtype=dtype)
    gated, plain = ops.pack_gated_linear_weight(w), ops.pack_linear_weight(w)
    for bias in (None, b):
        got = ops.gated_linear(x, gated, bias)
        assert got.dtype == dtype and got.shape == (rows, width)
        # The plain GEMM (checked against float64 above), then silu_and_mul (test_layer_ops.py).
        gate_up = ops.linear(x, plain, bias)
        assert torch.equal(got, ops.silu_and_mul(gate_up))
        assert torch.equal(got, ops.gated_linear(x, plain, bias))
        gate, up = gate_up.float().chunk(2, dim=-1)
        torch.testing.assert_close(got.float(), F.silu(gate) * up, rtol=2**-7, atol=1e-5)


def test_a_gated_weight_is_refused_where_a_plain_product_is_asked(ops) -> None:
    gated = ops.pack_gated_linear_weight(torch.randn(40, 16, dtype=torch.bfloat16))
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    for linear in (ops.linear, ops.linear_float32):
        with pytest.raises(RuntimeError, match="gated_linear"):
            linear(x, gated, None)
    with pytest.raises(RuntimeError, match="halves"):
        ops.pack_gated_linear_weight(torch.randn(41, 16, dtype=torch.bfloat16))
    assert ops.gated_linear(torch.empty(0, 16, dtype=torch.bfloat16), gated, None).shape == (0, 20)


def test_three_dim_and_strided_inputs(ops) -> None:
    torch.manual_seed(7)
    w = torch.randn(80, 35, dtype=torch.bfloat16)
    packed = ops.pack_linear_weight(w)
    wide = torch.randn(2, 9, 50, dtype=torch.bfloat16)
    # Rows 50 elements apart, then a transposed view whose columns are not contiguous.
    for x in (wide[..., :35], wide[0, :, :35], torch.randn(35, 6, dtype=torch.bfloat16).T):
        exact, magnitude = reference(x.reshape(-1, 35), w, None)
        got = ops.linear(x, packed, None)
        assert got.shape == (*x.shape[:-1], 80)
        assert_within_rounding(got.reshape(-1, 80), exact, magnitude, 35)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packing_ignores_the_weights_strides(ops, dtype: torch.dtype) -> None:
    w = torch.randn(70, 33, dtype=dtype)
    assert torch.equal(ops.pack_linear_weight(w), ops.pack_linear_weight(w.T.contiguous().T))


def test_zero_rows_give_an_empty_result(ops) -> None:
    packed = ops.pack_linear_weight(torch.randn(40, 16, dtype=torch.bfloat16))
    assert ops.linear(torch.empty(0, 16, dtype=torch.bfloat16), packed, None).shape == (0, 40)


def test_bad_inputs_are_refused(ops) -> None:
    packed = ops.pack_linear_weight(torch.randn(40, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="features"):
        ops.linear(torch.randn(3, 17, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.linear(torch.randn(3, 16), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear(torch.randn(3, 16, dtype=torch.bfloat16), packed, torch.randn(39, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.pack_linear_weight(torch.zeros(4, 4, dtype=torch.int8))


@pytest.mark.parametrize(
    ("word", "error"),
    [(1, "version"), (4, "unknown layout"), (5, "k_blocks word"), (6, "format"), (7, "dtype")],
)
def test_a_packed_weight_with_a_corrupt_header_is_refused(ops, word: int, error: str) -> None:
    packed = ops.pack_linear_weight(torch.randn(40, 16, dtype=torch.bfloat16))
    packed[word] = 7
    with pytest.raises(RuntimeError, match=error):
        ops.linear(torch.randn(3, 16, dtype=torch.bfloat16), packed, None)


def test_a_weight_packed_for_another_vector_width_is_refused(ops) -> None:
    """A weight packed at another tier (as two tiers in one process could mix) is never misread."""
    # 64 features of 16: the same size packed for 8-float and for 16-float vectors.
    packed = ops.pack_linear_weight(torch.randn(64, 16, dtype=torch.float32))
    lanes = packed[8].item()
    packed[8] = 16 if lanes == 8 else 8
    with pytest.raises(RuntimeError, match="pack it again at this tier"):
        ops.linear(torch.randn(3, 16), packed, None)


def test_switched_off_packing_leaves_bf16_weights_as_loaded(ops, default_model_path) -> None:
    spec = read_model_spec(default_model_path)
    for packed_linear, dtype in ((False, torch.bfloat16), (True, torch.int32)):
        model = load_model(
            spec, torch.bfloat16, torch.device("cpu"), CpuAttentionBackend(ops), packed_linear=packed_linear
        )
        layer = model.layers[0]
        weights = [layer.self_attn.qkv_proj.weight, layer.mlp.down_proj.weight, model.lm_head.head_weight]
        assert [w.dtype for w in weights] == [dtype] * 3


# The model runs in this process (inproc) so that the script can look at its weights: a packed
# weight is int32.
GENERATE = """
import json, sys, torch
from engine import LLM, SamplingParams
prompts = json.loads(sys.stdin.read())
packed_linear, fused_gate_up, gemm_k_blocks = (flag == "1" for flag in sys.argv[2:5])
llm = LLM(
    model=sys.argv[1],
    dtype="bfloat16",
    executor="inproc",
    cpu_isa=sys.argv[5],
    packed_linear=packed_linear,
    fused_gate_up=fused_gate_up,
    gemm_k_blocks=gemm_k_blocks,
)
model = llm.engine.executor.worker.model_runner.model
packed = model.lm_head.head_weight.dtype == torch.int32
# Header word 4 of a packed weight is its layout (1 is gated); word 5 is 1 where its GEMM may take K in blocks.
gate_up = model.layers[0].mlp.gate_up_proj.weight
gated = packed and gate_up[4].item() == 1
weights = [model.layers[0].self_attn.qkv_proj.weight, gate_up, model.lm_head.head_weight]
k_blocks = [w[5].item() for w in weights] if packed else []
params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=5)
outs = [r.outputs[0] for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
logprobs = [[{str(t): lp.logprob for t, lp in step.items()} for step in o.logprobs] for o in outs]
print(json.dumps({
    "packed": packed, "gated": gated, "k_blocks": k_blocks, "tokens": [o.token_ids for o in outs], "logprobs": logprobs
}))
"""


NEAR_TIE = 0.25


def greedy_bf16(
    model: Path,
    prompts: list[list[int]],
    cpu_isa: str,
    packed_linear: str,
    fused_gate_up: str = "1",
    gemm_k_blocks: str = "1",
) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", GENERATE, str(model), packed_linear, fused_gate_up, gemm_k_blocks, cpu_isa],
        input=json.dumps(prompts),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def mixed_prompts(w1_prompts) -> list[list[int]]:
    return mixed_length_prompts(w1_prompts, count=8)


@pytest.fixture(scope="module")
def packed_run(ops, default_model_path, mixed_prompts) -> dict:
    return greedy_bf16(default_model_path, mixed_prompts, ops.tier, "1")


def test_packed_model_generates_what_the_unpacked_one_does(
    ops, default_model_path, mixed_prompts, packed_run
) -> None:
    packed = packed_run
    unpacked = greedy_bf16(default_model_path, mixed_prompts, ops.tier, "0")
    assert packed["packed"] and packed["gated"] and not unpacked["packed"]
    for i, (ours, theirs) in enumerate(zip(packed["tokens"], unpacked["tokens"], strict=True)):
        pos = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if pos is None:
            continue
        # A divergence is allowed only at a near-tie in both runs: two bf16 ulps of a logit in [16, 32),
        # since the F.linear path rounds logits to bf16 and the packed one keeps them in float32.
        for run, chosen, other in ((unpacked, theirs[pos], ours[pos]), (packed, ours[pos], theirs[pos])):
            top = run["logprobs"][i][pos]
            gap = top[str(chosen)] - top.get(str(other), float("-inf"))
            assert gap <= NEAR_TIE, f"prompt {i} diverges at {pos} where a run's margin was {gap:.3f}"


def test_fused_gate_up_changes_no_bit_of_the_output(
    ops, default_model_path, mixed_prompts, packed_run
) -> None:
    unfused = greedy_bf16(default_model_path, mixed_prompts, ops.tier, "1", "0")
    assert unfused["packed"] and not unfused["gated"]
    assert unfused["tokens"] == packed_run["tokens"]
    assert unfused["logprobs"] == packed_run["logprobs"]


def test_gemm_k_blocks_off_marks_every_weight_and_changes_no_bit(
    ops, default_model_path, mixed_prompts, packed_run
) -> None:
    whole_k = greedy_bf16(default_model_path, mixed_prompts, ops.tier, "1", "1", "0")
    assert packed_run["k_blocks"] == [1, 1, 1] and whole_k["k_blocks"] == [0, 0, 0]
    assert whole_k["tokens"] == packed_run["tokens"]
    assert whole_k["logprobs"] == packed_run["logprobs"]


def test_two_models_in_one_process_keep_their_own_k_blocks(ops, default_model_path) -> None:
    spec = read_model_spec(default_model_path)
    models = {
        k_blocks: load_model(
            spec, torch.bfloat16, torch.device("cpu"), CpuAttentionBackend(ops), gemm_k_blocks=k_blocks
        )
        for k_blocks in (True, False)
    }
    for k_blocks, model in models.items():
        layer = model.layers[-1]
        weights = [layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight, model.lm_head.head_weight]
        assert [w[5].item() for w in weights] == [int(k_blocks)] * 3

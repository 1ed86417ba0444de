"""The integer GEMM over quantized weights (csrc/cpu/gemm_quant.cpp), at every kernel tier this CPU runs,
against a numpy model of its arithmetic written from quant_weight.h's definitions (int8 activations per
block of 32, exact integer dot products, float32 scaling); and GGUF blocks converted to its kinds
(worker/quantized_weights.py) against the gguf package's own dequantization."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as reference_dequantize

from gguf_blocks import random_blocks
from worker.native_abi import QUANT_Q4, QUANT_Q4_SYM, QUANT_Q8
from worker.quantized_weights import (
    EXACT_TYPES,
    NEAR_EXACT_TYPES,
    QUANTIZED_TYPES,
    REQUANTIZED_TYPES,
    QuantizedRows,
    from_gguf,
    quantize_q8,
)

HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 0.0}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
KINDS = {"q8": QUANT_Q8, "q4": QUANT_Q4, "q4sym": QUANT_Q4_SYM}


@pytest.fixture(scope="module")
def ops(native):
    return native


def random_rows(kind: int, rows: int, k: int, rng: np.random.Generator) -> QuantizedRows:
    blocks = k // 32
    if kind == QUANT_Q8:
        values = rng.integers(-127, 128, size=(rows, blocks, 32)).astype(np.int8).view(np.uint8)
    else:
        values = rng.integers(0, 256, size=(rows, blocks, 16), dtype=np.uint8)
    planes = 2 if kind == QUANT_Q4 else 1
    scales = (rng.normal(size=(rows, blocks, planes)) * 0.02).astype(np.float16)
    return QuantizedRows(kind, values, scales, "test")


def integer_weights(rows: QuantizedRows) -> np.ndarray:
    """q [rows, blocks, 32] as the kernel multiplies it (Q4 symmetric: q - 8)."""
    if rows.kind == QUANT_Q8:
        return rows.values.view(np.int8).astype(np.int64)
    q = np.concatenate([rows.values & 0x0F, rows.values >> 4], axis=-1).astype(np.int64)
    return q - 8 if rows.kind == QUANT_Q4_SYM else q


def quantize_activations(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Each block of 32 of each row: d = max |x| / 127 and q = x * 127 / max |x| rounded half away from
    zero in one rounding (float32 throughout, as the kernel computes it)."""
    values = x.float().numpy()
    m, k = values.shape
    blocks = values.reshape(m, k // 32, 32)
    amax = np.abs(blocks).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(amax > 0, amax, np.float32(1))
    inverse = np.where(amax > 0, np.float32(127) / safe, np.float32(0)).astype(np.float32)
    # v * inverse is exact in float64, and so is adding 1/2: one rounding to float32 as an fma makes.
    half = np.where(blocks >= 0, 0.5, -0.5)
    fused = (blocks.astype(np.float64) * inverse[..., None].astype(np.float64) + half).astype(np.float32)
    return np.trunc(fused).astype(np.int64), d


def integer_model(
    x: torch.Tensor, parts: list[QuantizedRows], bias: torch.Tensor | None
) -> tuple[np.ndarray, np.ndarray]:
    """x @ W^T + bias as the kernel defines it, in float64, and the sum of its terms' magnitudes."""
    qx, dx = quantize_activations(x)
    sum_x = dx * qx.sum(axis=-1).astype(np.float32)  # float32, as the kernel keeps it
    results, magnitudes = [], []
    for part in parts:
        qw = integer_weights(part)
        dots = np.einsum("mbj,nbj->mnb", qx, qw).astype(np.float64)
        # The kernel may sum a block's products in float lanes: bound by their magnitudes, not the sum's.
        abs_dots = np.einsum("mbj,nbj->mnb", np.abs(qx), np.abs(qw)).astype(np.float64)
        dw = part.scales[..., 0].astype(np.float32)
        scale = (dw[None, :, :] * dx[:, None, :]).astype(np.float32).astype(np.float64)
        terms, abs_terms = dots * scale, abs_dots * np.abs(scale)
        if part.kind == QUANT_Q4:
            mins = part.scales[..., 1].astype(np.float64)[None] * sum_x[:, None, :].astype(np.float64)
            terms = np.concatenate([terms, mins], axis=-1)
            abs_terms = np.concatenate([abs_terms, np.abs(mins)], axis=-1)
        results.append(terms.sum(axis=-1))
        magnitudes.append(abs_terms.sum(axis=-1))
    result, magnitude = np.concatenate(results, axis=1), np.concatenate(magnitudes, axis=1)
    if bias is not None:
        b = bias.double().numpy()
        result, magnitude = result + b, magnitude + np.abs(b)
    return result, magnitude


def assert_matches(got: torch.Tensor, exact: np.ndarray, magnitude: np.ndarray, k: int) -> None:
    """float32 sums of K / 32 scaled blocks (and the scales' own float32 products): a few units of
    2^-24 per block of the terms' magnitude, plus half an ulp where the result is rounded."""
    float_error = 4 * (k // 32 + 4) * 2.0**-24 * magnitude
    half_ulp = HALF_ULP[got.dtype]
    # Rounding the float32 result to the dtype: half an ulp of that result, which holds the float error too.
    tolerance = (1 + half_ulp) * float_error + half_ulp * np.abs(exact) + 1e-30
    diff = np.abs(got.double().numpy() - exact)
    assert (diff <= tolerance).all(), f"max excess {(diff - tolerance).max()}"


MIXES = [["q8"], ["q4"], ["q4sym"], ["q8", "q4", "q4sym"]]


@pytest.mark.parametrize("mix", MIXES, ids="+".join)
# 32 and 96: fewer blocks than the prefetch distance; 256, 288 and 576 (the default model): more.
@pytest.mark.parametrize("k", [32, 96, 256, 288, 576])
@pytest.mark.parametrize("rows", [1, 2, 3, 17, 70])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_linear_matches_the_integer_model(
    ops, dtype: torch.dtype, rows: int, k: int, mix: list[str]
) -> None:
    rng = np.random.default_rng(rows * 1000 + k + len(mix))
    # Segment heights that leave the last tile of each short of 8 rows.
    parts = [random_rows(KINDS[kind], height, k, rng) for kind, height in zip(mix, (13, 6, 5), strict=False)]
    n = sum(p.shape[0] for p in parts)
    x = torch.from_numpy(rng.normal(size=(rows, k)).astype(np.float32)).to(dtype)
    bias = torch.from_numpy(rng.normal(size=n).astype(np.float32)).to(dtype)
    packed = ops.pack_quantized_weight(parts, dtype)
    info = ops.packed_info(packed)
    assert (info.n, info.k, info.out_features, info.format, info.gated) == (n, k, n, 3, 0)
    for b in (None, bias):
        exact, magnitude = integer_model(x, parts, b)
        got = ops.linear(x, packed, b)
        assert got.dtype == dtype and got.shape == (rows, n)
        assert_matches(got, exact, magnitude, k)
        got32 = ops.linear_float32(x, packed, b)
        assert got32.dtype == torch.float32
        assert_matches(got32, exact, magnitude, k)


@pytest.mark.parametrize("kind", KINDS)
def test_the_integer_gemm_stays_within_the_activation_rounding_of_the_float_product(ops, kind: str) -> None:
    """Against the dequantized weight in float64: int8 activations err by at most half a step
    (d_x / 2) per element, so |error| <= sum |w| d_x / 2 over each row's blocks."""
    rng = np.random.default_rng(11)
    part = random_rows(KINDS[kind], 40, 512, rng)
    x = torch.from_numpy(rng.normal(size=(9, 512)).astype(np.float32))
    got = ops.linear_float32(x, ops.pack_quantized_weight([part], torch.float32), None).double()
    w = part.dequantize().double()
    _, dx = quantize_activations(x)
    bound = torch.einsum("nbj,mb->mn", w.abs().reshape(40, 16, 32), torch.from_numpy(dx).double()) / 2
    assert bool(((got - x.double() @ w.T).abs() <= bound * 1.001 + 1e-6).all())


def test_a_row_gets_the_same_bits_alone_and_in_any_batch(ops) -> None:
    rng = np.random.default_rng(5)
    parts = [random_rows(QUANT_Q4, 30, 320, rng), random_rows(QUANT_Q8, 21, 320, rng)]
    packed = ops.pack_quantized_weight(parts, torch.bfloat16)
    x = torch.from_numpy(rng.normal(size=(70, 320)).astype(np.float32)).to(torch.bfloat16)
    whole = ops.linear_float32(x, packed, None)
    for rows in (1, 2, 3, 5, 13, 66):
        for start in (0, 3):
            assert torch.equal(
                ops.linear_float32(x[start : start + rows], packed, None), whole[start : start + rows]
            )


def test_a_few_rows_take_q8_tiles_side_by_side_with_the_sums_and_bits_of_a_batch(ops) -> None:
    """A decode step's few rows over a tall Q8 weight: gemm_quant.cpp runs its tiles side by side (whole
    groups, then what is left of each work item) and must give the integer model's sums, and the bits a
    larger batch gets from the tiles one at a time."""
    rng = np.random.default_rng(13)
    # 70 tiles of 8 rows, the last short by 3: work items of 5 tiles, a group of 4 and one left over each.
    parts = [random_rows(QUANT_Q8, 557, 256, rng), random_rows(QUANT_Q4_SYM, 20, 256, rng)]
    packed = ops.pack_quantized_weight(parts, torch.bfloat16)
    x = torch.from_numpy(rng.normal(size=(9, 256)).astype(np.float32)).to(torch.bfloat16)
    bias = torch.from_numpy(rng.normal(size=577).astype(np.float32)).to(torch.bfloat16)
    whole = ops.linear_float32(x, packed, bias)
    for rows in (1, 2, 3):
        got = ops.linear_float32(x[:rows], packed, bias)
        exact, magnitude = integer_model(x[:rows], parts, bias)
        assert_matches(got, exact, magnitude, 256)
        assert torch.equal(got, whole[:rows])


def test_the_fused_model_step_and_gated_linear_take_a_quantized_gate_up(ops) -> None:
    """A quantized gate_up is never gated: gated_linear applies silu_and_mul after the GEMM."""
    rng = np.random.default_rng(8)
    part = random_rows(QUANT_Q4_SYM, 64, 96, rng)
    packed = ops.pack_quantized_weight([part], torch.bfloat16)
    x = torch.from_numpy(rng.normal(size=(4, 96)).astype(np.float32)).to(torch.bfloat16)
    assert torch.equal(ops.gated_linear(x, packed, None), ops.silu_and_mul(ops.linear(x, packed, None)))


def test_bad_quantized_weights_and_inputs_are_refused(ops) -> None:
    rng = np.random.default_rng(2)
    part = random_rows(QUANT_Q8, 8, 64, rng)
    packed = ops.pack_quantized_weight([part], torch.bfloat16)
    with pytest.raises(RuntimeError, match="features but the quantized weight expects 64"):
        ops.linear(torch.randn(2, 96, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="packed for bfloat16 activations"):
        ops.linear(torch.randn(2, 64), packed, None)
    with pytest.raises(RuntimeError, match="size does not match"):
        ops.linear(torch.randn(2, 64, dtype=torch.bfloat16), packed[:-16], None)
    corrupt = packed.clone()
    corrupt[11] = 9
    with pytest.raises(RuntimeError, match="unknown quantized block kind 9"):
        ops.linear(torch.randn(2, 64, dtype=torch.bfloat16), corrupt, None)
    odd = QuantizedRows(QUANT_Q8, part.values[:, :1], part.scales[:, :1], "test")
    assert ops.linear(
        torch.randn(1, 32, dtype=torch.bfloat16), ops.pack_quantized_weight([odd], torch.bfloat16), None
    ).shape == (1, 8)
    assert ops.linear(torch.empty(0, 64, dtype=torch.bfloat16), packed, None).shape == (0, 8)


@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
def test_gguf_blocks_convert_to_the_kernel_kinds(type_name: str) -> None:
    """Exact types give the gguf package's values bit for bit; Q4_K's per-32 scales are rounded to
    float16 (2^-11 relative); the others are requantized to 8 bits within half a step of the block."""
    rng = np.random.default_rng(sum(map(ord, type_name)))
    rows, cols = 6, 512
    raw = random_blocks(type_name, rows, cols, rng)
    expected = np.array(reference_dequantize(raw, gguf.GGMLQuantizationType[type_name]), dtype=np.float64)
    converted = from_gguf(raw, type_name, (rows, cols))
    assert converted.shape == (rows, cols) and converted.source == type_name
    got = converted.dequantize().double().numpy()
    if type_name in EXACT_TYPES:
        assert np.array_equal(got, expected.astype(np.float32))
    elif type_name in NEAR_EXACT_TYPES:
        assert converted.kind == QUANT_Q4
        # d * scale * q - dmin * min with each product's scale rounded once to float16.
        q = np.concatenate([converted.values & 0x0F, converted.values >> 4], axis=-1).astype(np.float64)
        bound = (
            (np.abs(q) + 1)
            * 2.0**-11
            * np.abs(converted.scales.astype(np.float64)).max(axis=-1, keepdims=True)
        )
        assert (np.abs(got - expected) <= bound.reshape(rows, cols) + 1e-12).all()
    else:
        assert type_name in REQUANTIZED_TYPES and converted.kind == QUANT_Q8
        blocks = expected.reshape(rows, cols // 32, 32)
        step = np.abs(blocks).max(axis=-1, keepdims=True) / 127
        # Half a step, and the float16 rounding of d (2^-11 relative) over 127 steps.
        bound = step * (0.5 + 127 * 2.0**-11)
        assert (np.abs(got.reshape(blocks.shape) - blocks) <= bound + 1e-12).all()


def test_requantizing_floats_keeps_every_value_within_half_a_step() -> None:
    values = torch.randn(5, 128) * torch.logspace(-3, 2, 5)[:, None]
    rows = quantize_q8(values, "float")
    blocks = values.double().reshape(5, 4, 32)
    step = blocks.abs().amax(dim=-1, keepdim=True) / 127
    error = (rows.dequantize().double().reshape(5, 4, 32) - blocks).abs()
    assert bool((error <= step * (0.5 + 127 * 2.0**-11)).all())
    zero = quantize_q8(torch.zeros(2, 32), "float")
    assert not zero.dequantize().any()


@pytest.mark.parametrize(("quantization", "share"), [("int8", 0.02), ("int4", 0.1)])
def test_quantization_at_load_packs_every_linear_and_the_lm_head(
    ops, quantization: str, share: float
) -> None:
    """--quantization: each projection and the LM head packed for the integer GEMM, each product within
    the weights' and the activations' rounding (a share of sum |x||w|) of the float weights'."""
    from sluice.model_spec import read_model_spec
    from tiny_models import tiny_model_dir
    from worker.attention.cpu_backend import CpuAttentionBackend
    from worker.model_loader import load_model

    spec = read_model_spec(tiny_model_dir("llama"))
    cpu = torch.device("cpu")
    floats = load_model(spec, torch.float32, cpu, CpuAttentionBackend(ops), packed_linear=False)
    quantized = load_model(spec, torch.float32, cpu, CpuAttentionBackend(ops), quantization=quantization)
    torch.manual_seed(1)
    pairs = [(floats.lm_head.weight, quantized.lm_head.head_weight)]
    for float_layer, layer in zip(floats.layers, quantized.layers, strict=True):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            pairs.append((float_layer.get_submodule(name).weight, layer.get_submodule(name).weight))
    for weight, packed in pairs:
        assert ops.packed_info(packed).format == 3
        x = torch.randn(3, weight.shape[1])
        exact = x.double() @ weight.double().T
        got = ops.linear_float32(x, packed, None).double()
        assert bool(
            ((got - exact).abs() <= share * (x.double().abs() @ weight.double().abs().T) + 1e-6).all()
        )


def test_int8_at_load_follows_the_bf16_model_until_a_near_tie(default_model_path) -> None:
    from sluice import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Monday, Tuesday,", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    answers = {}
    for quantization in (None, "int8"):
        llm = LLM(
            str(default_model_path),
            max_model_len=128,
            kv_cache_memory=0.1,
            executor="inproc",
            enforce_eager=True,
            quantization=quantization,
        )
        answers[quantization] = [r.outputs[0] for r in llm.generate(prompts, params)]
        del llm
    compared = 0
    for exact, ours in zip(answers[None], answers["int8"], strict=True):
        for step, token in enumerate(exact.token_ids):
            top = sorted((lp.logprob for lp in exact.logprobs[step].values()), reverse=True)
            if len(top) < 2 or top[0] - top[1] < 0.5:
                break
            assert ours.token_ids[step] == token
            compared += 1
    assert compared >= 6


def test_quantization_at_load_quantizes_experts_and_leaves_routers_in_float(ops) -> None:
    """--quantization on a mixture of experts: every expert and the shared expert run on the integer GEMM;
    the router and the shared expert's gate stay float, so the same experts are chosen."""
    from sluice.model_spec import read_model_spec
    from tiny_models import tiny_model_dir
    from worker.attention.cpu_backend import CpuAttentionBackend
    from worker.model_loader import load_model

    spec = read_model_spec(tiny_model_dir("qwen2_moe"))
    cpu = torch.device("cpu")
    floats = load_model(spec, torch.float32, cpu, CpuAttentionBackend(ops))
    quantized = load_model(spec, torch.float32, cpu, CpuAttentionBackend(ops), quantization="int8")
    moe = quantized.layers[1].mlp
    experts = [*moe.experts, moe.shared_expert]
    for weight in [e.gate_up_proj.weight for e in experts] + [e.down_proj.weight for e in experts]:
        assert ops.packed_info(weight).format == 3
    for router in (moe.gate.weight, moe.shared_expert_gate.weight):
        assert ops.packed_info(router).format != 3
    x = torch.randn(7, spec.hf_config["hidden_size"], generator=torch.Generator().manual_seed(0))
    exact = ops.moe(x, floats.layers[1].tensors.moe)
    got = ops.moe(x, quantized.layers[1].tensors.moe)
    assert (got - exact).abs().max() <= 0.03 * exact.abs().max()

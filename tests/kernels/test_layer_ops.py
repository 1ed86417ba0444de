"""The fused layer kernels, at every tier this CPU runs, against transformers' formulas written out in torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.layer_ops import TorchLayerOps

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def ops(native):
    return native


def assert_matches(ours: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor | None = None) -> None:
    """float32 to rounding; half types allow a rare rounding flip (from a different summation order)
    of one ulp of `magnitude`, the size of the intermediate that was rounded (default: the result).
    """
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, expected, rtol=2e-6, atol=2e-6)
        return
    magnitude = expected.float().abs() if magnitude is None else magnitude
    ulp = torch.finfo(ours.dtype).eps * magnitude.clamp_min(1e-3)
    diff = (ours.float() - expected.float()).abs()
    assert bool((diff <= ulp * 1.01).all()), f"max diff {diff.max()}"
    assert (diff > 0).float().mean() < 0.01


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 37])
def test_rms_norm_matches_transformers(ops, dtype, rows):
    torch.manual_seed(rows)
    x = torch.randn(rows, 200, dtype=dtype) * 3
    weight = torch.randn(200, dtype=dtype)
    expected = hf_rms_norm(x, weight, 1e-5)
    assert_matches(
        ops.rms_norm(x, weight, 1e-5), expected, magnitude=expected.float().abs() + weight.abs() * 4
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_then_normalises(ops, dtype):
    torch.manual_seed(1)
    residual = torch.randn(21, 576, dtype=dtype)
    delta = torch.randn(21, 576, dtype=dtype)
    weight = torch.randn(576, dtype=dtype)
    expected_residual = residual + delta
    expected = hf_rms_norm(expected_residual, weight, 1e-6)
    out = ops.add_rms_norm(residual, delta, weight, 1e-6)
    assert torch.equal(residual, expected_residual)
    # The normalised value is rounded before the weight multiplies it.
    assert_matches(out, expected, magnitude=(expected.float().abs() + weight.float().abs() * 4))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 40])
def test_silu_and_mul_matches_transformers(ops, dtype, width):
    torch.manual_seed(width)
    gate_up = torch.randn(9, 2 * width, dtype=dtype) * 4
    gate, up = gate_up[:, :width], gate_up[:, width:]
    assert_matches(ops.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
# 1536: whole vectors; 45: a tail shorter than a vector.
@pytest.mark.parametrize("width", [1536, 45])
def test_gelu_matches_erf_in_place(ops, dtype, width):
    torch.manual_seed(width)
    x = torch.randn(7, width, dtype=dtype) * 3
    x[0, :9] = torch.tensor([0.0, -0.0, 1e-3, -1e-3, 6.0, -6.0, 9.0, -9.0, 0.5])
    x64 = x.double()
    expected = x64 * 0.5 * (1 + torch.erf(x64 / 2**0.5))
    ours = ops.gelu(x)
    assert ours.data_ptr() == x.data_ptr(), "gelu works in place"
    if dtype == torch.float32:
        # Abramowitz and Stegun's erfc: within |x| 7.5e-8 of exact, plus float32's rounding.
        torch.testing.assert_close(ours.double(), expected, rtol=3e-7, atol=1e-6)
    else:
        # One rounding to the half type from a float32 value within 1e-6 of exact: at most one ulp away.
        ulp = torch.finfo(dtype).eps * expected.abs().clamp_min(1e-3)
        assert bool(((ours.double() - expected).abs() <= ulp).all())


@pytest.mark.parametrize("dtype", DTYPES)
# 64: whole 16-lane vectors; 40: a vector and a scalar tail in each half.
@pytest.mark.parametrize("dim", [64, 40])
def test_rotary_embedding_matches_rotate_half(ops, dtype, dim):
    torch.manual_seed(2)
    tokens, heads, kv_heads = 13, 9, 3
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, dtype=dtype)
    angles = torch.rand(tokens, dim // 2) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
    sin_signed = torch.cat((-sin[:, : dim // 2], sin[:, dim // 2 :]), -1)
    qk = qkv[:, : heads + kv_heads]
    expected = qk * cos[:, None] + rotate_half(qk) * sin[:, None]
    untouched = qkv[:, heads + kv_heads :].clone()
    ops.rotary_embedding(qk, cos, sin_signed)
    assert_matches(qk, expected)
    assert torch.equal(qkv[:, heads + kv_heads :], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_matches_transformers_per_head_norms(ops, dtype):
    torch.manual_seed(4)
    tokens, heads, kv_heads, dim = 11, 6, 2, 64
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, dtype=dtype) * 2
    q_weight, k_weight = torch.randn(dim, dtype=dtype), torch.randn(dim, dtype=dtype)
    qk = qkv[:, : heads + kv_heads]
    # transformers' Qwen3: q_norm(q) and k_norm(k), each an RMSNorm over head_dim.
    expected = torch.cat(
        (hf_rms_norm(qk[:, :heads], q_weight, 1e-6), hf_rms_norm(qk[:, heads:], k_weight, 1e-6)), dim=1
    )
    untouched = qkv[:, heads + kv_heads :].clone()
    fallback = qk.clone()
    ops.qk_norm(qk, heads, q_weight, k_weight, 1e-6)
    weights = torch.cat((q_weight.expand(heads, dim), k_weight.expand(kv_heads, dim))).float().abs()
    assert_matches(qk, expected, magnitude=expected.float().abs() + weights * 4)
    assert torch.equal(qkv[:, heads + kv_heads :], untouched)
    TorchLayerOps().qk_norm(fallback, heads, q_weight, k_weight, 1e-6)
    assert_matches(fallback, expected, magnitude=expected.float().abs() + weights * 4)


def test_torch_fallback_agrees_with_native(ops):
    torch.manual_seed(3)
    fallback = TorchLayerOps()
    x = torch.randn(5, 64)
    weight = torch.randn(64)
    torch.testing.assert_close(fallback.rms_norm(x, weight, 1e-6), ops.rms_norm(x, weight, 1e-6))
    x, gate_up_weight, bias = torch.randn(5, 32), torch.randn(128, 32), torch.randn(128)
    torch.testing.assert_close(
        fallback.gated_linear(x, gate_up_weight, bias), ops.gated_linear(x, gate_up_weight, bias)
    )


def test_bad_shapes_are_refused(ops):
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="halves"):
        ops.silu_and_mul(torch.randn(2, 7))

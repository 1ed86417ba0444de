"""--kv-cache-dtype int8 and fp8_e4m3: the kernels' cache writes against the torch oracle bit for bit (fp8's
rounding against torch's own float8 conversion), their attention against torch's over the same quantized
rows at every tier this CPU runs, the error against an unquantized cache, the block budget, the refusals,
and a served model that follows its bf16-cache answers."""

from __future__ import annotations

import pytest
import torch

from paged_attention_cases import MIXED, Case, make_case
from sluice.config import CacheConfig, ModelConfig, SluiceConfig
from sluice.kv_cache_groups import kv_cache_groups
from sluice.kv_cache_layout import kv_cache_bytes_per_block
from sluice.model_spec import read_model_spec
from worker.attention.cpu_backend import CpuAttentionBackend
from worker.attention.kv_cache_format import (
    SCALE_BYTES,
    dequantize_rows,
    quantize_rows,
    quantized_cache,
    token_major,
)
from worker.attention.torch_backend import TorchAttentionBackend
from worker.native_ops import NativeKernelError

QUANTIZED = [torch.int8, torch.float8_e4m3fn]
DECODES = [(1, 1), (15, 1), (16, 1), (130, 1), (257, 1), (600, 1)]


def quantized_case(case: Case, dtype: torch.dtype, poison: bool = True) -> Case:
    """The case with its caches quantized; with `poison`, every row no sequence may read gets a NaN scale."""
    key_cache, value_cache = quantized_cache(case.key_cache, dtype), quantized_cache(case.value_cache, dtype)
    if poison:
        block_size = case.key_cache.shape[1]
        unused = torch.ones(case.key_cache.shape[0] * block_size, dtype=torch.bool)
        unused[case.used_slots] = False
        slots = unused.nonzero().flatten()
        nan = torch.full((1,), float("nan")).view(torch.uint8)
        for cache in (key_cache, value_cache):
            token_major(cache).view(torch.uint8)[
                slots // block_size, slots % block_size, :, -SCALE_BYTES:
            ] = nan
    return Case(**{**case.__dict__, "key_cache": key_cache, "value_cache": value_cache})


def clone(case: Case) -> Case:
    return Case(
        **{**case.__dict__, "key_cache": case.key_cache.clone(), "value_cache": case.value_cache.clone()}
    )


def rows_at(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    rows = token_major(cache).view(torch.uint8)
    return rows[slots // rows.shape[1], slots % rows.shape[1]]


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_writes_match_the_oracle_bit_for_bit(native, cache_dtype: torch.dtype, dtype: torch.dtype) -> None:
    case = quantized_case(make_case(MIXED, num_kv_heads=3, group=1, head_dim=64, dtype=dtype), cache_dtype)
    # The model slices k and v out of one fused projection: strided views. One row is all zeros (scale 0),
    # one has a single large value, so that the others fall to the smallest steps (fp8's subnormals).
    kv = torch.cat([case.key, case.value], dim=1).clone()
    kv[0, 0] = 0.0
    kv[1, 1] = kv[1, 1] * 1e-3
    kv[1, 1, 5] = 30.0
    key, value = kv[:, :3], kv[:, 3:]
    before_k, before_v = case.key_cache.clone(), case.value_cache.clone()
    slots = case.metadata.slot_mapping
    native.write_kv_cache(key, value, case.key_cache, case.value_cache, slots)
    for cache, before, rows in ((case.key_cache, before_k, key), (case.value_cache, before_v, value)):
        want = quantize_rows(rows, cache_dtype).view(torch.uint8)
        assert torch.equal(rows_at(cache, slots), want)
        untouched = torch.ones(cache.shape[0] * cache.shape[2], dtype=torch.bool)
        untouched[slots] = False
        others = untouched.nonzero().flatten()
        assert torch.equal(rows_at(cache, others), rows_at(before, others))
    assert torch.equal(
        rows_at(case.key_cache, slots[:1])[0, 0], torch.zeros(64 + SCALE_BYTES, dtype=torch.uint8)
    )


def test_fp8_rounds_every_value_and_tie_as_torch_does(native) -> None:
    # Rows whose largest value is 448 are written unscaled: every e4m3 value, every midpoint between two
    # neighbours (ties go to the even one), and values just either side of the midpoints.
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[:-1] + grid[1:]) / 2
    values = torch.cat([grid, mids, mids * (1 + 2**-12), mids * (1 - 2**-12), torch.tensor([448.0])])
    values = torch.cat([values, -values])
    dim = 64
    rows = torch.nn.functional.pad(values, (0, -values.numel() % (dim - 1))).view(-1, dim - 1)
    rows = torch.cat([torch.full((rows.shape[0], 1), 448.0), rows], dim=1)
    num = rows.shape[0]
    cache = torch.zeros(num, 1, 1, dim + SCALE_BYTES, dtype=torch.float8_e4m3fn)
    other = cache.clone()
    native.write_kv_cache(rows[:, None], rows[:, None], cache, other, torch.arange(num))
    got = cache.view(num, dim + SCALE_BYTES)[:, :dim].view(torch.uint8)
    assert torch.equal(got, rows.to(torch.float8_e4m3fn).view(torch.uint8))


def test_rows_wider_than_a_quantized_write_takes_are_refused(native) -> None:
    rows = torch.zeros(1, 1, 1040)
    cache = torch.zeros(1, 1, 1, 1040 + SCALE_BYTES, dtype=torch.int8)
    with pytest.raises(NativeKernelError, match="a quantized KV cache takes head_dim up to 1024"):
        native.write_kv_cache(rows, rows, cache, cache.clone(), torch.zeros(1, dtype=torch.int64))


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "group"), [(64, 3), (96, 1), (128, 5)])
@pytest.mark.parametrize("decode_path", [True, False])
def test_attention_matches_torch_over_the_same_rows(
    native, cache_dtype: torch.dtype, dtype: torch.dtype, head_dim: int, group: int, decode_path: bool
) -> None:
    case = quantized_case(
        make_case(MIXED + DECODES, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, seed=3),
        cache_dtype,
    )
    ours, ref = clone(case), clone(case)
    got = CpuAttentionBackend(native, decode_path=decode_path).forward(
        ours.query, ours.key, ours.value, ours.key_cache, ours.value_cache, ours.metadata, head_dim**-0.5
    )
    want = TorchAttentionBackend().forward(
        ref.query, ref.key, ref.value, ref.key_cache, ref.value_cache, ref.metadata, head_dim**-0.5
    )
    assert torch.isfinite(got.float()).all()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(ours.key_cache.view(torch.uint8), ref.key_cache.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_long_decodes_split_among_threads_match_torch(native, cache_dtype: torch.dtype) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        case = quantized_case(
            make_case(
                [(3001, 1), (700, 1), (90, 1)], num_kv_heads=1, group=8, head_dim=64, dtype=torch.float32
            ),
            cache_dtype,
        )
        for split_keys in (True, False):
            ours, ref = clone(case), clone(case)
            got = CpuAttentionBackend(native, split_keys=split_keys).forward(
                ours.query, ours.key, ours.value, ours.key_cache, ours.value_cache, ours.metadata, 0.125
            )
            want = TorchAttentionBackend().forward(
                ref.query, ref.key, ref.value, ref.key_cache, ref.value_cache, ref.metadata, 0.125
            )
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    finally:
        torch.set_num_threads(before)


# The largest error of the attention output over randn data, against a float32 cache: int8 keeps 7 bits
# below each row's largest value, e4m3 3 mantissa bits.
ERROR_BOUND = {torch.int8: 0.03, torch.float8_e4m3fn: 0.15}


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_quantized_cache_stays_close_to_a_float_cache(native, cache_dtype: torch.dtype) -> None:
    exact = make_case(MIXED + DECODES, num_kv_heads=2, group=3, head_dim=64, dtype=torch.float32, seed=9)
    case = quantized_case(clone(exact), cache_dtype, poison=False)
    rows = quantize_rows(exact.key_cache, cache_dtype)
    assert (dequantize_rows(rows) - exact.key_cache).abs().max() <= exact.key_cache.abs().max() / (
        127 if cache_dtype == torch.int8 else 8
    )
    got = CpuAttentionBackend(native).forward(
        case.query, case.key, case.value, case.key_cache, case.value_cache, case.metadata, 0.125
    )
    want = TorchAttentionBackend().forward(
        exact.query, exact.key, exact.value, exact.key_cache, exact.value_cache, exact.metadata, 0.125
    )
    error = (got - want).abs().max().item()
    assert 0 < error < ERROR_BOUND[cache_dtype]


def test_a_quantized_block_holds_a_byte_per_value_and_a_scale_per_row(default_model_path) -> None:
    spec = read_model_spec(default_model_path)
    # SmolLM2-135M: 30 layers, 3 KV heads of 64; blocks of 16 tokens, keys and values.
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (30, 3, 64)
    model = ModelConfig(path=str(default_model_path), dtype="bfloat16")
    sizes = {
        dtype: kv_cache_bytes_per_block(
            SluiceConfig(model=model, cache=CacheConfig(kv_cache_dtype=dtype)),
            spec,
            kv_cache_groups([0] * 30),
        )
        for dtype in ("auto", "int8", "fp8_e4m3")
    }
    assert sizes == {
        "auto": 30 * 2 * 16 * 3 * 64 * 2,
        "int8": 30 * 2 * 16 * 3 * 68,
        "fp8_e4m3": 30 * 2 * 16 * 3 * 68,
    }


def test_a_quantized_cache_serves_the_bf16_cache_answers_until_a_near_tie(default_model_path) -> None:
    from sluice import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Monday, Tuesday,", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    answers = {}
    for kv_cache_dtype in ("auto", "int8", "fp8_e4m3"):
        # The fused decode step and its graphs (the default) read the cache as the eager path does.
        llm = LLM(
            str(default_model_path), max_model_len=128, kv_cache_memory=0.1, kv_cache_dtype=kv_cache_dtype
        )
        answers[kv_cache_dtype] = [r.outputs[0] for r in llm.generate(prompts, params)]
        del llm
    for kv_cache_dtype in ("int8", "fp8_e4m3"):
        compared = 0
        for exact, ours in zip(answers["auto"], answers[kv_cache_dtype], strict=True):
            for step, token in enumerate(exact.token_ids):
                top = sorted((lp.logprob for lp in exact.logprobs[step].values()), reverse=True)
                if len(top) < 2 or top[0] - top[1] < 0.5:
                    break
                assert ours.token_ids[step] == token, kv_cache_dtype
                compared += 1
        assert compared >= 6, kv_cache_dtype

"""Times the CPU paged-attention kernel on SmolLM2-135M's shapes against the reference and SDPA.

Run: .venv/bin/python bench/attention_kernel.py [--no-cpu-decode-attention]
(--no-cpu-decode-attention times decode on the general tile path instead, for comparison.)
The decode cases from DRAM with one or two sequences time the decode path with its keys split among
the threads (KernelConfig.cpu_decode_split_keys) and without, alternating, and print both.

    .venv/bin/python bench/attention_kernel.py --kv-cache-dtypes

times decode at 4,096 tokens of context over a bf16, an int8 and an fp8_e4m3 cache (--kv-cache-dtype), in
turn, medians of 5: from DRAM (one cache per layer, as a forward pass reads them) and from cache (one
layer, the kernel's compute alone), on SmolLM2-135M's and the 1.1B model's head shapes.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from sluice.cpu_tiers import CPU_ISA_CHOICES
from worker.attention.backend import AttentionMetadata
from worker.attention.kv_cache_format import QUANTIZED_DTYPES, quantized_cache
from worker.attention.torch_backend import TorchAttentionBackend
from worker.native_ops import NativeOps, cpu_kernels, use_cpu_isa

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 9, 3, 64, 16, torch.bfloat16
SCALE = HEAD_DIM**-0.5


def batch(
    num_seqs: int, context: int, q_len: int, kv_heads: int = KV_HEADS, heads: int = HEADS
) -> tuple[torch.Tensor, ...]:
    blocks_per_seq = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = num_seqs * blocks_per_seq
    block_table = torch.randperm(num_blocks, dtype=torch.int32).view(num_seqs, blocks_per_seq)
    shape = (num_blocks, BLOCK_SIZE, kv_heads, HEAD_DIM)
    key_cache, value_cache = torch.randn(shape).to(DTYPE), torch.randn(shape).to(DTYPE)
    query = torch.randn(num_seqs * q_len, heads, HEAD_DIM).to(DTYPE)
    key = torch.randn(num_seqs * q_len, kv_heads, HEAD_DIM).to(DTYPE)
    value = torch.randn(num_seqs * q_len, kv_heads, HEAD_DIM).to(DTYPE)
    query_start_loc = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    positions = torch.arange(context - q_len, context)
    slots = (block_table.long()[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).flatten()
    return query, key, value, key_cache, value_cache, block_table, query_start_loc, seq_lens, slots


def kernels() -> NativeOps:
    ops = cpu_kernels()
    if ops is None:
        raise SystemExit("attention_kernel times Sluice's kernels: --cpu-isa none has none")
    return ops


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def report(name: str, num_seqs: int, context: int, q_len: int, repeats: int, decode_path: bool) -> None:
    ops = kernels()
    query, key, value, key_cache, value_cache, block_table, qsl, seq_lens, slots = batch(
        num_seqs, context, q_len
    )
    out = torch.empty_like(query)
    ops.write_kv_cache(key, value, key_cache, value_cache, slots)
    kernel = median_ms(
        lambda: ops.paged_attention(
            out, query, key_cache, value_cache, block_table, qsl, seq_lens, SCALE, 0, 0.0, decode_path, True
        ),
        repeats,
    )
    write = median_ms(lambda: ops.write_kv_cache(key, value, key_cache, value_cache, slots), repeats)
    metadata = AttentionMetadata(
        num_tokens=query.shape[0],
        num_seqs=num_seqs,
        slot_mapping=slots,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_table=block_table,
        max_query_len=q_len,
        max_seq_len=context,
    )
    reference_backend = TorchAttentionBackend()
    reference = median_ms(
        lambda: reference_backend.forward(query, key, value, key_cache, value_cache, metadata, SCALE),
        max(3, repeats // 10),
    )
    line = (
        f"{name:<34} kernel {kernel:8.3f} ms   cache write {write:6.3f} ms   "
        f"reference {reference:8.2f} ms ({reference / kernel:5.1f}x)"
    )
    if q_len == context and q_len > 1:
        q = query.view(num_seqs, q_len, HEADS, HEAD_DIM).transpose(1, 2)
        k = key.view(num_seqs, q_len, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = value.view(num_seqs, q_len, KV_HEADS, HEAD_DIM).transpose(1, 2)
        sdpa = median_ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=SCALE, enable_gqa=True
            ),
            repeats,
        )
        line += f"   sdpa (fresh k/v, batched) {sdpa:8.3f} ms"
    print(line, flush=True)


def report_from_dram(
    name: str,
    num_seqs: int,
    context: int,
    layers: int,
    repeats: int,
    decode_path: bool,
    split: bool = False,
    kv_heads: int = KV_HEADS,
) -> None:
    """Cycles through one cache per layer, as a forward pass does, so K/V come from DRAM, not L3. With
    `split`, also times the decode path with its keys split among the threads off, in turn. kv_heads
    other than the default model's keep its 3 query heads per KV head."""
    ops = kernels()
    heads = kv_heads * (HEADS // KV_HEADS)
    batches = [batch(num_seqs, context, 1, kv_heads, heads) for _ in range(layers)]
    out = torch.empty_like(batches[0][0])

    def forward(split_keys: bool) -> None:
        for query, _, _, key_cache, value_cache, block_table, qsl, seq_lens, _ in batches:
            ops.paged_attention(
                out,
                query,
                key_cache,
                value_cache,
                block_table,
                qsl,
                seq_lens,
                SCALE,
                0,
                0.0,
                decode_path,
                split_keys,
            )

    if not split:
        print(
            f"{name:<34} kernel {median_ms(lambda: forward(True), repeats) / layers:8.3f} ms per layer",
            flush=True,
        )
        return
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(3):
        for split_keys in (True, False):
            times[split_keys].append(median_ms(functools.partial(forward, split_keys), repeats) / layers)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"{name:<34} kernel {on:8.3f} ms per layer with keys split, {off:8.3f} without ({off / on:.2f}x)",
        flush=True,
    )


def report_cache_dtypes(
    name: str, num_seqs: int, context: int, layers: int, kv_heads: int, heads: int
) -> None:
    """Decode over the same keys and values cached as bf16, int8 and fp8_e4m3, alternating, medians of 5."""
    ops = kernels()
    batches = [batch(num_seqs, context, 1, kv_heads, heads) for _ in range(layers)]
    caches: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {
        "bf16": [(b[3], b[4]) for b in batches],
        **{
            cache_dtype: [(quantized_cache(b[3], dtype), quantized_cache(b[4], dtype)) for b in batches]
            for cache_dtype, dtype in QUANTIZED_DTYPES.items()
        },
    }
    out = torch.empty_like(batches[0][0])

    def forward(cache_dtype: str) -> None:
        for (query, *_, block_table, qsl, seq_lens, _), (key_cache, value_cache) in zip(
            batches, caches[cache_dtype], strict=True
        ):
            ops.paged_attention(
                out, query, key_cache, value_cache, block_table, qsl, seq_lens, SCALE, 0, 0.0, True, True
            )

    times: dict[str, list[float]] = {dtype: [] for dtype in caches}
    # Five rounds: this kind of machine's memory bandwidth drifts between seconds.
    for _ in range(5):
        for dtype in caches:
            times[dtype].append(median_ms(functools.partial(forward, dtype), 10) / layers)
    medians = {dtype: statistics.median(t) for dtype, t in times.items()}
    runs = "  ".join(
        f"{dtype} {medians[dtype]:.3f} ms ({', '.join(f'{t:.3f}' for t in times[dtype])})" for dtype in caches
    )
    ratios = "  ".join(f"{dtype} {medians['bf16'] / medians[dtype]:.2f}x" for dtype in QUANTIZED_DTYPES)
    print(f"{name:<44} per layer: {runs}   faster than bf16: {ratios}", flush=True)


def compare_cache_dtypes() -> None:
    for label, kv_heads, heads in (
        ("SmolLM2-135M heads (9 / 3 KV)", 3, 9),
        ("1.1B heads (32 / 4 KV)", 4, 32),
    ):
        report_cache_dtypes(f"{label}, 1 x 4096, 32 layers' caches", 1, 4096, 32, kv_heads, heads)
        report_cache_dtypes(f"{label}, 4 x 4096, 8 layers' caches", 4, 4096, 8, kv_heads, heads)
        report_cache_dtypes(f"{label}, 1 x 4096, one layer (in cache)", 1, 4096, 1, kv_heads, heads)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu-decode-attention", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--cpu-isa", default="auto", choices=CPU_ISA_CHOICES, help="the kernels' tier")
    parser.add_argument(
        "--kv-cache-dtypes", action="store_true", help="only compare bf16, int8 and fp8_e4m3 caches in decode"
    )
    args = parser.parse_args()
    decode_path = args.cpu_decode_attention
    use_cpu_isa(args.cpu_isa)
    if args.kv_cache_dtypes:
        print(f"torch threads {torch.get_num_threads()}, head_dim {HEAD_DIM}, {kernels().tier} kernels")
        compare_cache_dtypes()
        return
    print(
        f"torch threads {torch.get_num_threads()}, bf16, {HEADS} heads / {KV_HEADS} kv heads, head_dim {HEAD_DIM}, "
        f"{kernels().tier} kernels"
    )
    report("decode 64 seqs x 256 context", 64, 256, 1, 50, decode_path)
    report_from_dram("decode 64 x 256, 16 layers' caches", 64, 256, 16, 20, decode_path)
    report_from_dram("decode 16 x 2048, 8 layers' caches", 16, 2048, 8, 20, decode_path)
    report_from_dram("decode 1 x 2048, 48 layers' caches", 1, 2048, 48, 20, decode_path, split=True)
    report_from_dram("decode 1 x 8192, 16 layers' caches", 1, 8192, 16, 20, decode_path, split=True)
    report_from_dram("decode 2 x 8192, 8 layers' caches", 2, 8192, 8, 20, decode_path, split=True)
    report_from_dram("decode 1 x 8192, 1 KV head x 48", 1, 8192, 48, 20, decode_path, True, 1)
    report("prefill 64 seqs x 128 tokens", 64, 128, 128, 20, decode_path)
    report("prefill 1 seq x 2048 tokens", 1, 2048, 2048, 5, decode_path)
    report("decode 1 seq x 160 context", 1, 160, 1, 200, decode_path)


if __name__ == "__main__":
    main()

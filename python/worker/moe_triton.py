"""The mixture-of-experts feed-forward on CUDA: tokens grouped by expert on the device, then two grouped
GEMM launches of one Triton kernel over the experts' stacked weights.

Routing never leaves the device and every shape depends only on the step's token count, so a CUDA graph
captures the whole layer (torch_moe picks its experts on the host and cannot be captured):
- each (token, choice) pair is one row; the rows are sorted by expert and each expert's run is padded to
  a multiple of BLOCK_M with a row id past the end, so that every tile of BLOCK_M rows has one expert;
- the first launch multiplies each tile by its expert's [gate; up] and writes silu(gate) * up per row;
- the second multiplies that by the expert's down weight, scales each row by its routing weight, and
  the rows of a token are summed in float32.

Whether the kernel runs compiled or under Triton's interpreter (TRITON_INTERPRET=1, on CPU tensors) is
fixed when this module is imported, as for worker/attention/triton_kernels.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from worker.moe_tensors import Linear, MoeTensors, route, shared_expert

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    row_weight_ptr,
    sorted_rows_ptr,
    tile_expert_ptr,
    num_padded_rows_ptr,
    num_rows,
    n,
    k,
    stride_a,
    stride_w_expert,
    stride_w_row,
    stride_out,
    # Rows of a that one row id reads: top_k when a holds one row per token, 1 when one per row.
    ROWS_PER_A_ROW: tl.constexpr,
    # w holds [gate; up] (2n rows); the program writes silu(gate) * up.
    GATED: tl.constexpr,
    # Each output row is scaled by its routing weight.
    WEIGHTED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program: a tile of BLOCK_M sorted rows, all routed to one expert, times BLOCK_N of its
    output columns."""
    pid = tl.program_id(0)
    column_tiles = tl.cdiv(n, BLOCK_N)
    tile = pid // column_tiles
    # Tiles past the padded rows are the launch's slack for a step with fewer distinct experts.
    if tile * BLOCK_M >= tl.load(num_padded_rows_ptr):
        return
    rows = tl.load(sorted_rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_rows
    a_rows = (rows // ROWS_PER_A_ROW).to(tl.int64)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    columns = (pid % column_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + expert * stride_w_expert
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=valid[:, None] & (ks[None, :] < k))
        w_mask = (ks[:, None] < k) & (columns[None, :] < n)
        w = tl.load(w_base + columns[None, :].to(tl.int64) * stride_w_row + ks[:, None], mask=w_mask)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        if GATED:
            up_rows = (columns[None, :] + n).to(tl.int64)
            w_up = tl.load(w_base + up_rows * stride_w_row + ks[:, None], mask=w_mask)
            if DOT_IN_FP32:
                w_up = w_up.to(tl.float32)
            acc_up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(row_weight_ptr + rows, mask=valid, other=0.0)[:, None]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_out + columns[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (columns[None, :] < n))


@dataclass(frozen=True, slots=True)
class ExpertTiles:
    """The step's (token, choice) rows sorted by expert, in tiles of block_m rows of one expert each."""

    # [capacity]: a row id (token * top_k + choice) per sorted position; num_rows at padding.
    sorted_rows: torch.Tensor
    # [capacity // block_m]: the expert of each tile (tiles past num_padded_rows repeat the last).
    tile_expert: torch.Tensor
    # [1]: how many sorted positions the experts' padded runs take.
    num_padded_rows: torch.Tensor
    block_m: int


def tile_rows_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertTiles:
    """experts [tokens, top_k]: each token's chosen experts. Device ops only, with shapes fixed by the
    token count, so a CUDA graph can capture it."""
    flat = experts.flatten()
    num_rows = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    # A row's place in its expert's padded run: the run's start plus the row's rank among its expert's.
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_rows, device=device) - first_of_expert[sorted_experts]
    destination = padded_ends[sorted_experts] - padded[sorted_experts] + rank
    # At most min(experts, rows) runs are non-empty, each padded by fewer than block_m rows.
    capacity = triton.cdiv(num_rows + min(num_experts, num_rows) * (block_m - 1), block_m) * block_m
    sorted_rows = torch.full((capacity,), num_rows, dtype=torch.int32, device=device)
    sorted_rows[destination] = order.to(torch.int32)
    tile_starts = torch.arange(0, capacity, block_m, device=device)
    tile_expert = torch.searchsorted(padded_ends, tile_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertTiles(sorted_rows, tile_expert.to(torch.int32), padded_ends[-1:], block_m)


def _block_m(num_rows: int, num_experts: int) -> int:
    # Small steps (decodes) leave most experts a few rows: short tiles waste less on padding.
    return 16 if num_rows <= 4 * num_experts else 64


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    tiles: ExpertTiles,
    rows_per_a_row: int,
    gated: bool,
    row_weight: torch.Tensor | None,
) -> None:
    assert w.shape[1] == out.shape[1] * (2 if gated else 1), (w.shape, out.shape)
    n, k = out.shape[1], a.shape[1]
    assert a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1
    dot_in_fp32 = INTERPRETED and a.dtype == torch.bfloat16
    grid = (tiles.tile_expert.numel() * triton.cdiv(n, BLOCK_N),)
    grouped_gemm_kernel[grid](
        a,
        w,
        out,
        row_weight if row_weight is not None else out,
        tiles.sorted_rows,
        tiles.tile_expert,
        tiles.num_padded_rows,
        out.shape[0] if rows_per_a_row == 1 else a.shape[0] * rows_per_a_row,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        ROWS_PER_A_ROW=rows_per_a_row,
        GATED=gated,
        WEIGHTED=row_weight is not None,
        # fp32 operands must not silently drop to tf32 inside tl.dot.
        DOT_PRECISION="ieee" if dot_in_fp32 or a.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=dot_in_fp32,
        BLOCK_M=tiles.block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )


def triton_moe(x: torch.Tensor, t: MoeTensors, linear: Linear, gated_linear: Linear) -> torch.Tensor:
    """torch_moe's result (worker/moe_tensors.py) from the experts' stacked weights, which
    SparseMoe.prepare makes on CUDA; the router and the shared expert, if any, run on linear and
    gated_linear."""
    assert t.stacked_gate_up is not None and t.stacked_down is not None
    num_tokens, hidden = x.shape
    weights, experts = route(x, t, linear)
    num_rows = num_tokens * t.top_k
    tiles = tile_rows_by_expert(experts, t.num_experts, _block_m(num_rows, t.num_experts))
    inner = torch.empty((num_rows, t.inner), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, t.stacked_gate_up, inner, tiles, t.top_k, gated=True, row_weight=None)
    rows = torch.empty((num_rows, hidden), dtype=torch.float32, device=x.device)
    _grouped_gemm(
        inner, t.stacked_down, rows, tiles, 1, gated=False, row_weight=weights.flatten().contiguous()
    )
    out = rows.view(num_tokens, t.top_k, hidden).sum(dim=1)
    shared = shared_expert(x, t, linear, gated_linear)
    if shared is not None:
        out += shared
    return out.to(x.dtype)

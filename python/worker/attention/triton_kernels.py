"""Triton kernels that write new K/V rows into the paged cache and attend through the block table.

Whether these run compiled or under the interpreter is fixed when this module is
imported: triton.jit reads TRITON_INTERPRET at decoration time.
"""

from __future__ import annotations

import triton
import triton.language as tl

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)


@triton.jit
def write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    num_kv_heads,
    head_dim,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # Padded tokens (CUDA-graph batches) carry slot -1 and must not touch the cache.
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    k = tl.load(key_ptr + token * stride_k_tok + heads * stride_k_head + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_v_tok + heads * stride_v_head + dims, mask=mask)
    k_dst = key_cache_ptr + slot * stride_kc_slot + heads * stride_kc_head + dims
    v_dst = value_cache_ptr + slot * stride_vc_slot + heads * stride_vc_head + dims
    tl.store(k_dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def paged_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    window,
    softcap_log2,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_kc_block,
    stride_kc_offset,
    stride_kc_head,
    stride_vc_block,
    stride_vc_offset,
    stride_vc_head,
    stride_bt_seq,
    block_size,
    head_dim,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """One program: one sequence, one KV head, and a tile of query tokens times the GROUP
    query heads that share that KV head, so each K/V tile is loaded once for the whole group."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_first = q_tile * BLOCK_Q
    if tile_first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_before = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok_in_seq = tile_first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (tok_in_seq < q_len)
    # Padding rows get a position past the context, so every key is visible to them and
    # their softmax stays finite; they are never stored.
    q_pos = tl.where(row_valid, context_before + tok_in_seq, seq_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < head_dim

    token = (q_start + tok_in_seq).to(tl.int64)
    q_offsets = token[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0)
    q = q.to(key_cache_ptr.dtype.element_ty)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # Keys past the tile's last query position are masked for every row, so stop there; under a window
    # (window > 0), keys before the first row's window are masked for every row, so start there.
    tile_last = tl.minimum(tile_first + BLOCK_Q, q_len) - 1
    kv_end = context_before + tile_last + 1
    kv_start = tl.where(window > 0, tl.maximum(context_before + tile_first - window + 1, 0), 0)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
    cols = tl.arange(0, BLOCK_N)
    for n_start in range(kv_start, kv_end, BLOCK_N):
        k_pos = n_start + cols
        k_valid = k_pos < kv_end
        block_ids = tl.load(table_row + k_pos // block_size, mask=k_valid, other=0).to(tl.int64)
        in_block = (k_pos % block_size).to(tl.int64)
        kv_mask = k_valid[:, None] & dim_valid[None, :]
        k_offsets = block_ids * stride_kc_block + in_block * stride_kc_offset + kv_head * stride_kc_head
        k = tl.load(key_cache_ptr + k_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v_offsets = block_ids * stride_vc_block + in_block * stride_vc_offset + kv_head * stride_vc_head
        v = tl.load(value_cache_ptr + v_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        # Soft-capping (softcap_log2 > 0, in the log2 units of the scores): c tanh(s / c), as
        # c (1 - 2 / (e^(2 s / c) + 1)).
        cap = tl.where(softcap_log2 > 0, softcap_log2, 1.0)
        capped = cap * (1.0 - 2.0 / (tl.math.exp2(scores * (2.0 * 1.4426950408889634 / cap)) + 1.0))
        scores = tl.where(softcap_log2 > 0, capped, scores)
        in_window = (window <= 0) | (k_pos[None, :] > q_pos[:, None] - window)
        visible = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None]) & in_window
        scores = tl.where(visible, scores, float("-inf"))
        # A row that has seen no key yet (its window starts past this tile) keeps m = -inf: it subtracts
        # 0 instead, so that its alpha and p are 0, not NaN.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_sub)
        p = tl.math.exp2(scores - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    o_offsets = token[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
    tl.store(out_ptr + o_offsets, acc.to(out_ptr.dtype.element_ty), mask=q_mask)

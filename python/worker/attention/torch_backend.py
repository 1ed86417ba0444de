"""Attention in torch's own ops: the CPU's backend at the "none" tier (no Sluice kernels), and the
obviously correct oracle that the real backends are tested against.

It gathers each sequence's whole KV out of the paged cache, which is exactly what the fast backends
must not do; it is slow, and it is meant to be plainly right.
"""

from __future__ import annotations

import torch

from worker.attention.backend import AttentionMetadata
from worker.attention.kv_cache_format import dequantize_rows, is_quantized, quantize_rows, token_major


class TorchAttentionBackend:
    # It reads lengths back to the host, which a captured graph cannot do.
    supports_full_graph = False

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        # Views indexed [block, offset]: writes through them land in the caches.
        k_rows, v_rows = token_major(key_cache), token_major(value_cache)
        block_size, num_kv_heads = k_rows.shape[1], k_rows.shape[2]
        quantized = is_quantized(key_cache)

        def cache_rows(x: torch.Tensor) -> torch.Tensor:
            return quantize_rows(x, key_cache.dtype) if quantized else x.to(key_cache.dtype)

        def read_rows(rows: torch.Tensor) -> torch.Tensor:
            return dequantize_rows(rows) if quantized else rows.float()

        # Padded tokens carry slot -1 and write nothing, as in every real backend.
        written = metadata.slot_mapping >= 0
        slots = metadata.slot_mapping[written].long()
        k_rows[slots // block_size, slots % block_size] = cache_rows(key[written])
        v_rows[slots // block_size, slots % block_size] = cache_rows(value[written])
        num_heads = query.shape[1]
        group = num_heads // num_kv_heads
        out = torch.empty_like(query)
        starts = metadata.query_start_loc.tolist()
        for i in range(metadata.num_seqs):
            q = query[starts[i] : starts[i + 1]].float()
            q_len = q.shape[0]
            seq_len = int(metadata.seq_lens[i])
            blocks = metadata.block_table[i, : (seq_len + block_size - 1) // block_size].long()
            # Under a window, keys before the first query's window are never read: their blocks may have
            # been released (engine/kv_cache_manager.py).
            first = max(0, seq_len - q_len - window + 1) if window else 0
            positions = torch.arange(first, seq_len)
            at = (blocks[positions // block_size], positions % block_size)
            k = read_rows(k_rows[at]).repeat_interleave(group, dim=1)
            v = read_rows(v_rows[at]).repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
            k_pos = positions[None, :]
            hidden = (k_pos > q_pos) | (k_pos <= q_pos - window) if window else k_pos > q_pos
            scores = scores.masked_fill(hidden, float("-inf"))
            out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(
                query.dtype
            )
        return out

"""CPU attention: Sluice's kernels (of the tier this process runs) write and read the paged KV cache in place."""

from __future__ import annotations

import torch

from worker.attention.backend import AttentionMetadata
from worker.native_ops import NativeOps


class CpuAttentionBackend:
    supports_full_graph = True

    def __init__(self, ops: NativeOps, decode_path: bool = True, split_keys: bool = True) -> None:
        """decode_path: one-token sequences take the kernel's decode path (KernelConfig.cpu_decode_attention);
        split_keys: that path may split their keys among the threads (KernelConfig.cpu_decode_split_keys)."""
        self.ops = ops
        self.decode_path = decode_path
        self.split_keys = split_keys

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
        self.ops.write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        out = query.new_empty(query.shape)
        self.ops.paged_attention(
            out,
            query,
            key_cache,
            value_cache,
            metadata.block_table,
            metadata.query_start_loc,
            metadata.seq_lens,
            scale,
            window,
            softcap,
            self.decode_path,
            self.split_keys,
        )
        return out

"""Sluice's CPU kernels as tensor ops: the library of one instruction-set tier (sluice/kernel_libraries.py
picks and verifies it), called through its C ABI (worker/native_abi.py) with the tensors' memory.

The process runs one tier, set once from KernelConfig.cpu_isa (use_cpu_isa) before the model is built;
cpu_kernels() returns its ops, or None at the "none" tier, where the worker runs torch's own ops. Tests
and benches take any tier the CPU runs with native_ops_for. The kernels need contiguous rows in the
model's dtypes; what does not fit is refused with a NativeKernelError, never guessed at.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from sluice import cpu_tiers
from sluice.errors import SluiceError
from sluice.kernel_libraries import KernelLibraryError, choose_kernels, rebuild_command
from worker import native_abi as abi
from worker.attention.kv_cache_format import head_dim_of, token_major
from worker.moe_tensors import MoeTensors, torch_moe
from worker.native_abi import Batch, Heads, KvCache, Matrix, MoeWeights, PackedInfo, Slots
from worker.quantized_weights import QuantizedRows

logger = logging.getLogger("sluice.worker")


class NativeKernelError(SluiceError, RuntimeError):
    """A kernel refused its arguments; the message is the kernel's own."""


def _dtype(t: torch.Tensor) -> int:
    code = abi.DTYPE_OF.get(t.dtype)
    if code is None or t.device.type != "cpu":
        raise NativeKernelError(
            f"the CPU kernels take float32, bfloat16 or float16 CPU tensors, got {t.dtype} on {t.device}"
        )
    return code


def matrix(t: torch.Tensor) -> Matrix:
    """A 2-d tensor whose rows are contiguous, as the kernels' Matrix."""
    if t.dim() != 2 or (t.stride(1) != 1 and t.shape[1] > 1):
        raise NativeKernelError(
            f"expected a 2-d tensor with contiguous rows, got shape {tuple(t.shape)} strides {t.stride()}"
        )
    return Matrix(t.data_ptr(), _dtype(t), t.shape[0], t.shape[1], t.stride(0))


def heads(t: torch.Tensor) -> Heads:
    """A [tokens, heads, dim] tensor, contiguous in dim, as the kernels' Heads."""
    if t.dim() != 3 or (t.stride(2) != 1 and t.shape[2] > 1):
        raise NativeKernelError(
            f"expected [num_tokens, heads, head_dim] contiguous in head_dim, got {tuple(t.shape)}"
        )
    return Heads(t.data_ptr(), _dtype(t), t.shape[0], t.shape[1], t.shape[2], t.stride(0), t.stride(1))


def kv_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> KvCache:
    if (
        key_cache.dim() != 4
        or key_cache.shape != value_cache.shape
        or key_cache.dtype != value_cache.dtype
        or not key_cache.is_contiguous()
        or not value_cache.is_contiguous()
    ):
        raise NativeKernelError(
            "key_cache and value_cache must be contiguous [num_blocks, block_size, num_kv_heads, head_dim] of one "
            "dtype (an int8 or fp8 cache: [num_blocks, num_kv_heads, block_size, head_dim + 4])"
        )
    code = abi.CACHE_DTYPE_OF.get(key_cache.dtype)
    if code is None or key_cache.device.type != "cpu":
        raise NativeKernelError(
            f"the CPU kernels read KV caches of {', '.join(map(str, abi.CACHE_DTYPE_OF))} on the CPU, "
            f"got {key_cache.dtype} on {key_cache.device}"
        )
    num_blocks, block_size, num_kv_heads, _ = token_major(key_cache).shape
    return KvCache(
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        code,
        num_blocks,
        block_size,
        num_kv_heads,
        head_dim_of(key_cache),
    )


def slots(slot_mapping: torch.Tensor) -> Slots:
    if (
        slot_mapping.dim() != 1
        or not slot_mapping.is_contiguous()
        or slot_mapping.dtype not in (torch.int64, torch.int32)
    ):
        raise NativeKernelError("slot_mapping must be a contiguous 1-d int64 or int32 tensor")
    return Slots(slot_mapping.data_ptr(), slot_mapping.dtype == torch.int64, slot_mapping.shape[0])


def batch(block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> Batch:
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32 or not t.is_contiguous() or t.dim() != 1:
            raise NativeKernelError(f"{name} must be a contiguous 1-d int32 tensor")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.stride(1) != 1:
        raise NativeKernelError("block_table must be a 2-d int32 tensor with contiguous rows")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] < num_seqs + 1 or block_table.shape[0] < num_seqs:
        raise NativeKernelError("query_start_loc or block_table is shorter than seq_lens")
    return Batch(
        query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
        num_seqs,
        block_table.data_ptr(),
        *block_table.shape[:1],
        block_table.stride(0),
    )


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def packed_ref(weight: torch.Tensor | None) -> abi.PackedRef:
    """A packed weight as the kernels' PackedRef; a null one for None."""
    return abi.PackedRef() if weight is None else abi.PackedRef(weight.data_ptr(), weight.numel())


def is_packed_weight(w: torch.Tensor) -> bool:
    """Whether w is a weight that prepare_linear_weight packed (packed_weight.h): a 1-d int32 tensor, which
    no loaded weight is; the kernel checks its header (magic, version, shape) on every use."""
    return w.dtype == torch.int32 and w.dim() == 1


class NativeOps:
    """The ops of one tier's library: worker/layer_ops.py's LayerOps, the attention kernels, the greedy
    argmax and thread binding. worker/cpu_model_step.py builds the model step over `library`."""

    def __init__(self, tier: str, path: Path) -> None:
        self.tier = tier
        self.path = path
        # Each MoE layer's MoeWeights (and the arrays it points into), built on its first use.
        self._moe_weights: weakref.WeakKeyDictionary[
            MoeTensors, tuple[MoeWeights, ctypes.Array, ctypes.Array]
        ]
        self._moe_weights = weakref.WeakKeyDictionary()
        try:
            self.library = abi.open_library(path)
        except (OSError, ValueError) as exc:
            raise KernelLibraryError(
                f"the {tier} kernel library {path} does not load ({exc}); rebuild it with {rebuild_command()}"
            ) from None

    def check(self, status: int) -> None:
        if status != 0:
            raise NativeKernelError(self.library.sluice_last_error().decode(errors="replace"))

    # Linear layers.

    def packed_info(self, w: torch.Tensor) -> PackedInfo:
        info = PackedInfo()
        self.check(self.library.sluice_packed_info(w.data_ptr(), w.numel(), ctypes.byref(info)))
        return info

    def _pack(self, weight: torch.Tensor, layout: int, k_blocks: bool) -> torch.Tensor:
        if weight.dim() != 2:
            raise NativeKernelError(f"only a 2-d weight can be packed, got shape {tuple(weight.shape)}")
        code = _dtype(weight)
        info = PackedInfo()
        n, k = weight.shape
        self.check(self.library.sluice_packing_info(code, n, k, layout, int(k_blocks), ctypes.byref(info)))
        packed = self._packed_buffer(info.total_ints)
        self.check(
            self.library.sluice_pack_weight(
                weight.data_ptr(),
                code,
                n,
                k,
                weight.stride(0),
                weight.stride(1),
                layout,
                int(k_blocks),
                packed.data_ptr(),
                info.total_ints,
            )
        )
        return packed

    def _packed_buffer(self, ints: int) -> torch.Tensor:
        """`ints` int32 words on a 2 MiB boundary with huge pages asked for: a decode step streams every
        weight once."""
        huge = 1 << 21
        buffer = torch.empty(ints * 4 + huge, dtype=torch.uint8)
        start = -buffer.data_ptr() % huge
        packed = buffer[start : start + ints * 4].view(torch.int32)
        self.library.sluice_advise_huge_pages(packed.data_ptr(), ints * 4)
        return packed

    def pack_quantized_weight(self, parts: Sequence[QuantizedRows], dtype: torch.dtype) -> torch.Tensor:
        """Row parts of W [N, K], top to bottom, as one quantized weight (csrc/cpu/quant_weight.h) that
        linear multiplies with activations of `dtype`; adjacent parts of one kind become one segment."""
        segments: list[list[QuantizedRows]] = []
        for part in parts:
            if segments and segments[-1][0].kind == part.kind:
                segments[-1].append(part)
            else:
                segments.append([part])
        kinds = [group[0].kind for group in segments]
        values = [np.ascontiguousarray(np.concatenate([p.values for p in group])) for group in segments]
        # Scales as planes, [rows, d (and m), blocks] (quant_weight.h).
        scales = [
            np.ascontiguousarray(np.concatenate([p.scales for p in group]).transpose(0, 2, 1))
            for group in segments
        ]
        row_ends = np.cumsum([v.shape[0] for v in values]).astype(np.int64)
        n, k = int(row_ends[-1]), parts[0].shape[1]
        count = len(segments)
        args = (
            abi.DTYPE_OF[dtype],
            n,
            k,
            count,
            (ctypes.c_int64 * count)(*row_ends.tolist()),
            (ctypes.c_int32 * count)(*kinds),
            (ctypes.c_void_p * count)(*(v.ctypes.data for v in values)),
            (ctypes.c_void_p * count)(*(s.ctypes.data for s in scales)),
        )
        info = PackedInfo()
        self.check(self.library.sluice_pack_quantized(*args, None, 0, ctypes.byref(info)))
        packed = self._packed_buffer(info.total_ints)
        self.check(
            self.library.sluice_pack_quantized(*args, packed.data_ptr(), info.total_ints, ctypes.byref(info))
        )
        return packed

    def pack_linear_weight(self, weight: torch.Tensor, k_blocks: bool = True) -> torch.Tensor:
        """W [N, K] in the tier's packed layout; k_blocks: whether the GEMM may take K in blocks."""
        return self._pack(weight, abi.PLAIN_LAYOUT, k_blocks)

    def pack_gated_linear_weight(self, weight: torch.Tensor, k_blocks: bool = True) -> torch.Tensor:
        """W = [gate; up] [2 I, K] in the gated layout, for gated_linear (KernelConfig.fused_gate_up)."""
        return self._pack(weight, abi.GATED_LAYOUT, k_blocks)

    runs_quantized = True

    def prepare_linear_weight(self, weight: torch.Tensor, k_blocks: bool = True) -> torch.Tensor:
        return self.pack_linear_weight(weight, k_blocks)

    def prepare_quantized_linear_weight(self, parts: list[QuantizedRows], dtype: torch.dtype) -> torch.Tensor:
        return self.pack_quantized_weight(parts, dtype)

    def prepare_gated_linear_weight(self, weight: torch.Tensor, k_blocks: bool = True) -> torch.Tensor:
        return self.pack_gated_linear_weight(weight, k_blocks)

    def _packed_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        info: PackedInfo,
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], info.out_features, dtype=dtype)
        self.linear_out(out, rows, weight, bias, info)
        return out.view(*x.shape[:-1], info.out_features)

    def linear_out(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        info: PackedInfo | None = None,
    ) -> None:
        """out = x @ W^T + bias for a packed weight, into a preallocated out (its header checked as info)."""
        info = self.packed_info(weight) if info is None else info
        if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous() or bias.numel() != info.n):
            raise NativeKernelError(
                f"bias must be a contiguous {x.dtype} vector of the weight's {info.n} features"
            )
        self.check(
            self.library.sluice_linear(
                ctypes.byref(matrix(x)),
                weight.data_ptr(),
                weight.numel(),
                _pointer(bias),
                ctypes.byref(matrix(out)),
            )
        )

    def _plain_info(self, weight: torch.Tensor) -> PackedInfo:
        info = self.packed_info(weight)
        if info.gated:
            raise NativeKernelError(
                "a gated packed weight (gate and up) goes through gated_linear, not linear"
            )
        return info

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T + bias: the tier's GEMM for a packed weight, F.linear for any other."""
        if not is_packed_weight(weight):
            return F.linear(x, weight, bias)
        return self._packed_linear(x, weight, bias, x.dtype, self._plain_info(weight))

    def linear_float32(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """linear's result in float32: a packed weight's fp32 sums are stored without rounding first."""
        if not is_packed_weight(weight):
            return F.linear(x, weight, bias).float()
        return self._packed_linear(x, weight, bias, torch.float32, self._plain_info(weight))

    def gated_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """silu(x @ gate^T + b) * (x @ up^T + b) for weight = [gate; up]: in the GEMM's epilogue where the
        weight was packed gated, else linear then silu_and_mul (the same bits)."""
        if is_packed_weight(weight):
            info = self.packed_info(weight)
            if info.gated:
                return self._packed_linear(x, weight, bias, x.dtype, info)
        return self.silu_and_mul(self.linear(x, weight, bias))

    def moe_weights(self, moe: MoeTensors) -> MoeWeights:
        """The kernels' MoeWeights over a MoE layer's packed weights, kept while the tensors live."""
        held = self._moe_weights.get(moe)
        if held is None:
            gate_up = (abi.PackedRef * moe.num_experts)(*map(packed_ref, moe.gate_up))
            down = (abi.PackedRef * moe.num_experts)(*map(packed_ref, moe.down))
            weights = MoeWeights(
                router=packed_ref(moe.router),
                gate_up=gate_up,
                down=down,
                num_experts=moe.num_experts,
                top_k=moe.top_k,
                inner=moe.inner,
                renormalize=int(moe.renormalize),
                shared_gate_up=packed_ref(moe.shared_gate_up),
                shared_down=packed_ref(moe.shared_down),
                shared_gate=packed_ref(moe.shared_gate),
                shared_inner=moe.shared_inner,
            )
            held = self._moe_weights[moe] = (weights, gate_up, down)
        return held[0]

    def moe(self, x: torch.Tensor, moe: MoeTensors) -> torch.Tensor:
        """The MoE feed-forward in one kernel call over packed weights (csrc/cpu/moe.cpp), else in torch."""
        if not is_packed_weight(moe.router):
            return torch_moe(x, moe, self.linear, self.gated_linear)
        rows = x if x.stride(-1) == 1 else x.contiguous()
        out = torch.empty_like(rows)
        self.check(
            self.library.sluice_moe(
                ctypes.byref(matrix(rows)), ctypes.byref(self.moe_weights(moe)), ctypes.byref(matrix(out))
            )
        )
        return out

    # The elementwise ops of a decoder layer.

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        self._check_norm_weight(weight, x)
        self.check(
            self.library.sluice_rms_norm(
                ctypes.byref(matrix(out)), ctypes.byref(matrix(x)), weight.data_ptr(), eps
            )
        )
        return out

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += delta in place; returns rms_norm(residual) * weight."""
        out = torch.empty_like(residual)
        self._check_norm_weight(weight, residual)
        self.check(
            self.library.sluice_add_rms_norm(
                ctypes.byref(matrix(out)),
                ctypes.byref(matrix(residual)),
                ctypes.byref(matrix(delta)),
                weight.data_ptr(),
                eps,
            )
        )
        return out

    @staticmethod
    def _check_norm_weight(weight: torch.Tensor, x: torch.Tensor) -> None:
        if not weight.is_contiguous() or weight.numel() != x.shape[-1] or weight.dtype != x.dtype:
            raise NativeKernelError("weight must be a contiguous vector of x's width and dtype")

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        """x = gelu(x) (with erf) in place; returns x."""
        self.check(self.library.sluice_gelu(ctypes.byref(matrix(x))))
        return x

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        self.check(self.library.sluice_silu_and_mul(ctypes.byref(matrix(out)), ctypes.byref(matrix(gate_up))))
        return out

    def rotary_embedding(self, qk: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
        self.check(
            self.library.sluice_rotary_embedding(
                ctypes.byref(heads(qk)), ctypes.byref(matrix(cos)), ctypes.byref(matrix(sin_signed))
            )
        )

    def qk_norm(
        self, qk: torch.Tensor, q_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float
    ) -> None:
        """Qwen3's per-head norms of q (the first q_heads heads) and k, in place."""
        for weight in (q_weight, k_weight):
            if not weight.is_contiguous() or weight.numel() != qk.shape[-1] or weight.dtype != qk.dtype:
                raise NativeKernelError(
                    "q and k norm weights must be contiguous head_dim vectors of qk's dtype"
                )
        self.check(
            self.library.sluice_qk_norm(
                ctypes.byref(heads(qk)), q_heads, q_weight.data_ptr(), k_weight.data_ptr(), eps
            )
        )

    # Sampling, attention and threads.

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax as torch.argmax(dim=-1) gives it, for float32 x [rows, n]."""
        if x.dtype != torch.float32:
            raise NativeKernelError(
                "argmax_rows: x must be a 2-d float32 tensor with contiguous, non-empty rows"
            )
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self.check(self.library.sluice_argmax_rows(ctypes.byref(matrix(x)), out.data_ptr()))
        return out

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Copies each new token's key/value row to its slot; slots below zero (padding) are skipped."""
        self.check(
            self.library.sluice_write_kv_cache(
                ctypes.byref(heads(key)),
                ctypes.byref(heads(value)),
                ctypes.byref(kv_cache(key_cache, value_cache)),
                ctypes.byref(slots(slot_mapping)),
            )
        )

    def paged_attention(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int,
        softcap: float,
        decode_path: bool,
        split_keys: bool,
    ) -> None:
        """Causal attention of each sequence's new query rows over its paged context (its last `window`
        keys up to each row's position where window > 0; scores capped at softcap tanh(s / softcap) where
        softcap > 0), into out."""
        self.check(
            self.library.sluice_paged_attention(
                ctypes.byref(heads(out)),
                ctypes.byref(heads(query)),
                ctypes.byref(kv_cache(key_cache, value_cache)),
                ctypes.byref(batch(block_table, query_start_loc, seq_lens)),
                scale,
                window,
                softcap,
                int(decode_path),
                int(split_keys),
            )
        )

    def attention_within_sequences(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        query_start_loc: torch.Tensor,
        num_seqs: int,
        scale: float,
    ) -> torch.Tensor:
        """An encoder's attention [num_tokens, heads, head_dim]: each query row to every key of its own
        sequence (rows query_start_loc[s] .. query_start_loc[s + 1]); query, key and value may be strided
        views, such as parts of a fused QKV projection's output."""
        if query_start_loc.dtype != torch.int32 or not query_start_loc.is_contiguous():
            raise NativeKernelError("query_start_loc must be a contiguous int32 tensor")
        if query_start_loc.shape[0] < num_seqs + 1:
            raise NativeKernelError("query_start_loc is shorter than num_seqs + 1")
        out = torch.empty(query.shape, dtype=query.dtype)
        self.check(
            self.library.sluice_attention_within_sequences(
                ctypes.byref(heads(out)),
                ctypes.byref(heads(query)),
                ctypes.byref(heads(key)),
                ctypes.byref(heads(value)),
                query_start_loc.data_ptr(),
                num_seqs,
                scale,
            )
        )
        return out

    def bind_threads(self, cpu_ids: list[int]) -> list[int]:
        """Pins thread i of the calling thread's OpenMP pool (torch's) to core cpu_ids[i]; per thread, the
        core it was pinned to, or -errno where the kernel refused."""
        ids = (ctypes.c_int64 * len(cpu_ids))(*cpu_ids)
        bound = (ctypes.c_int64 * len(cpu_ids))()
        self.check(self.library.sluice_bind_threads(ids, len(cpu_ids), bound))
        return list(bound)


@functools.cache
def native_ops_for(cpu_isa: str) -> NativeOps | None:
    """The ops of the tier that --cpu-isa `cpu_isa` picks on this CPU; None for "none"."""
    choice = choose_kernels(cpu_isa)
    if choice.library is None:
        return None
    return NativeOps(choice.tier, choice.library)


_process_cpu_isa = "auto"
_announced: list[str] = []


def use_cpu_isa(cpu_isa: str) -> NativeOps | None:
    """Sets this process's tier from KernelConfig.cpu_isa (before its model is built) and says, once per
    change, which it is."""
    global _process_cpu_isa
    ops = native_ops_for(cpu_isa)
    if cpu_isa != _process_cpu_isa or not _announced:
        choice = choose_kernels(cpu_isa)
        if ops is None:
            logger.warning("CPU kernels: none (%s); every op runs in torch", choice.reason)
        else:
            logger.info("CPU kernels: %s tier (%s), %s", ops.tier, choice.reason, ops.path)
        _announced.append(cpu_isa)
    _process_cpu_isa = cpu_isa
    return ops


def cpu_kernels() -> NativeOps | None:
    """This process's CPU kernels (use_cpu_isa; "auto" until it is called), or None at the "none" tier."""
    return native_ops_for(_process_cpu_isa)


def kernel_tier() -> str:
    ops = cpu_kernels()
    return cpu_tiers.NO_TIER if ops is None else ops.tier

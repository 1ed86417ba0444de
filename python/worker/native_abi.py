"""The kernel libraries' C ABI (csrc/cpu/abi.cpp) as ctypes sees it: the structs of csrc/cpu/ops.h and
model_step.h field for field, and each function's signature. open_library checks the ABI version and
every struct's size against the library's own, so a library built from other sources is refused."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

# csrc/cpu/abi.cpp kAbiVersion.
ABI_VERSION = 5

# csrc/cpu/dtypes.h DType.
FLOAT32, BFLOAT16, FLOAT16, INT8, FP8_E4M3 = 0, 1, 2, 3, 4
DTYPE_OF = {torch.float32: FLOAT32, torch.bfloat16: BFLOAT16, torch.float16: FLOAT16}
# The KV cache's dtypes: the activations' and the quantized row formats (csrc/cpu/kv_quant.h).
CACHE_DTYPE_OF = {**DTYPE_OF, torch.int8: INT8, torch.float8_e4m3fn: FP8_E4M3}
# csrc/cpu/packed_weight.h.
PLAIN_LAYOUT, GATED_LAYOUT = 0, 1
# csrc/cpu/quant_weight.h: the packed format of a quantized weight, and its block kinds.
FORMAT_QUANT_BLOCKS = 3
QUANT_Q8, QUANT_Q4, QUANT_Q4_SYM = 1, 2, 3

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64
_i32 = ctypes.c_int32


class Matrix(ctypes.Structure):
    _fields_ = [("data", _ptr), ("dtype", _i32), ("rows", _i64), ("cols", _i64), ("stride", _i64)]


class Heads(ctypes.Structure):
    _fields_ = [
        ("data", _ptr),
        ("dtype", _i32),
        ("tokens", _i64),
        ("heads", _i64),
        ("dim", _i64),
        ("token_stride", _i64),
        ("head_stride", _i64),
    ]


class KvCache(ctypes.Structure):
    _fields_ = [
        ("key", _ptr),
        ("value", _ptr),
        ("dtype", _i32),
        ("num_blocks", _i64),
        ("block_size", _i64),
        ("kv_heads", _i64),
        ("head_dim", _i64),
    ]


class Slots(ctypes.Structure):
    _fields_ = [("data", _ptr), ("wide", ctypes.c_bool), ("count", _i64)]


class Batch(ctypes.Structure):
    _fields_ = [
        ("query_start_loc", _ptr),
        ("seq_lens", _ptr),
        ("num_seqs", _i64),
        ("block_table", _ptr),
        ("block_table_rows", _i64),
        ("block_table_stride", _i64),
    ]


class PackedInfo(ctypes.Structure):
    _fields_ = [
        ("n", _i64),
        ("k", _i64),
        ("out_features", _i64),
        ("total_ints", _i64),
        ("gated", _i32),
        ("k_blocks", _i32),
        ("format", _i32),
        ("dtype", _i32),
        ("lanes", _i32),
    ]


class PackedRef(ctypes.Structure):
    _fields_ = [("data", _ptr), ("ints", _i64)]


class MoeWeights(ctypes.Structure):
    _fields_ = [
        ("router", PackedRef),
        ("gate_up", ctypes.POINTER(PackedRef)),
        ("down", ctypes.POINTER(PackedRef)),
        ("num_experts", _i64),
        ("top_k", _i64),
        ("inner", _i64),
        ("renormalize", _i64),
        ("shared_gate_up", PackedRef),
        ("shared_down", PackedRef),
        ("shared_gate", PackedRef),
        ("shared_inner", _i64),
    ]


class LayerWeights(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("eps", ctypes.c_double),
        ("qkv", PackedRef),
        ("qkv_bias", _ptr),
        ("o", PackedRef),
        ("o_bias", _ptr),
        ("gate_up", PackedRef),
        ("gate_up_bias", _ptr),
        ("down", PackedRef),
        ("down_bias", _ptr),
        ("moe", ctypes.POINTER(MoeWeights)),
        ("q_norm", _ptr),
        ("k_norm", _ptr),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate_size", _i64),
        ("sliding_window", _i64),
        ("scale", ctypes.c_double),
    ]


class Workspace(ctypes.Structure):
    _fields_ = [
        (name, _ptr)
        for name in (
            "normed",
            "qkv",
            "attn",
            "attn_out",
            "gate_up",
            "act",
            "mlp_out",
            "residual",
            "cos",
            "sin",
            "hidden",
        )
    ]


class ModelShape(ctypes.Structure):
    _fields_ = [
        ("dtype", _i32),
        ("hidden", _i64),
        ("vocab", _i64),
        ("max_tokens", _i64),
        ("max_positions", _i64),
        ("rotary_dim", _i64),
    ]


# In sluice_struct_sizes' order.
STRUCTS = (
    Matrix,
    Heads,
    KvCache,
    Slots,
    Batch,
    PackedInfo,
    PackedRef,
    LayerWeights,
    Workspace,
    ModelShape,
    MoeWeights,
)

_P = ctypes.POINTER
_SIGNATURES: dict[str, tuple[type | None, list]] = {
    "sluice_abi_version": (_i32, []),
    "sluice_tier": (ctypes.c_char_p, []),
    "sluice_last_error": (ctypes.c_char_p, []),
    "sluice_struct_sizes": (None, [_P(_i64)]),
    "sluice_packing_info": (_i32, [_i32, _i64, _i64, _i32, _i32, _P(PackedInfo)]),
    "sluice_pack_weight": (_i32, [_ptr, _i32, _i64, _i64, _i64, _i64, _i32, _i32, _ptr, _i64]),
    "sluice_packed_info": (_i32, [_ptr, _i64, _P(PackedInfo)]),
    "sluice_pack_quantized": (
        _i32,
        [_i32, _i64, _i64, _i32, _P(_i64), _P(_i32), _P(_ptr), _P(_ptr), _ptr, _i64, _P(PackedInfo)],
    ),
    "sluice_advise_huge_pages": (_i32, [_ptr, _i64]),
    "sluice_linear": (_i32, [_P(Matrix), _ptr, _i64, _ptr, _P(Matrix)]),
    "sluice_moe": (_i32, [_P(Matrix), _P(MoeWeights), _P(Matrix)]),
    "sluice_rms_norm": (_i32, [_P(Matrix), _P(Matrix), _ptr, ctypes.c_double]),
    "sluice_add_rms_norm": (_i32, [_P(Matrix), _P(Matrix), _P(Matrix), _ptr, ctypes.c_double]),
    "sluice_silu_and_mul": (_i32, [_P(Matrix), _P(Matrix)]),
    "sluice_gelu": (_i32, [_P(Matrix)]),
    "sluice_rotary_embedding": (_i32, [_P(Heads), _P(Matrix), _P(Matrix)]),
    "sluice_qk_norm": (_i32, [_P(Heads), _i64, _ptr, _ptr, ctypes.c_double]),
    "sluice_argmax_rows": (_i32, [_P(Matrix), _ptr]),
    "sluice_write_kv_cache": (_i32, [_P(Heads), _P(Heads), _P(KvCache), _P(Slots)]),
    "sluice_paged_attention": (
        _i32,
        [_P(Heads), _P(Heads), _P(KvCache), _P(Batch), ctypes.c_double, _i64, ctypes.c_double, _i32, _i32],
    ),
    "sluice_attention_within_sequences": (
        _i32,
        [_P(Heads), _P(Heads), _P(Heads), _P(Heads), _ptr, _i64, ctypes.c_double],
    ),
    "sluice_bind_threads": (_i32, [_P(_i64), _i64, _P(_i64)]),
    "sluice_model_step_new": (
        _ptr,
        [
            _P(LayerWeights),
            _i64,
            _P(ModelShape),
            _ptr,
            _ptr,
            ctypes.c_double,
            _ptr,
            _ptr,
            _P(Workspace),
            _i32,
            _i32,
        ],
    ),
    "sluice_model_step_free": (None, [_ptr]),
    "sluice_model_step_set_kv_caches": (_i32, [_ptr, _P(KvCache), _i64]),
    "sluice_model_step_forward": (_i32, [_ptr, _ptr, _ptr, _i64, _P(Slots), _P(Batch)]),
    "sluice_model_step_attention_input": (_i32, [_ptr, _i64, _P(Matrix), _P(Matrix), _P(Matrix), _P(Matrix)]),
    "sluice_model_step_attention_output": (_i32, [_ptr, _i64, _P(Matrix)]),
    "sluice_model_step_feed_forward": (_i32, [_ptr, _i64, _P(Matrix), _P(Matrix)]),
}


def open_library(path: Path) -> ctypes.CDLL:
    """The library with every function's signature set; OSError if it does not load, ValueError if it
    speaks another ABI (its version, a missing function or a struct of another size)."""
    # RTLD_LOCAL: two tiers in one process (the tests compare them) keep their own symbols.
    library = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
    try:
        library.sluice_abi_version.restype = _i32
        version = library.sluice_abi_version()
        if version != ABI_VERSION:
            raise ValueError(f"it speaks kernel ABI {version}, and this Sluice speaks {ABI_VERSION}")
        for name, (restype, argtypes) in _SIGNATURES.items():
            function = getattr(library, name)
            function.restype = restype
            function.argtypes = argtypes
    except AttributeError as exc:
        raise ValueError(f"it lacks a function of the kernel ABI ({exc})") from None
    sizes = (_i64 * len(STRUCTS))()
    library.sluice_struct_sizes(sizes)
    for struct, size in zip(STRUCTS, sizes, strict=True):
        if ctypes.sizeof(struct) != size:
            raise ValueError(
                f"its {struct.__name__} is {size} bytes, and this Sluice's is {ctypes.sizeof(struct)}"
            )
    return library

"""Build a Llama-family model from a Hugging Face folder's safetensors or a GGUF file, fusing q/k/v
and gate/up.

Under tensor parallelism each rank reads only its shard of each checkpoint tensor (safetensors
slices), as the model's Projection.split and vocab-parallel tables say, so no rank ever holds the
whole model. A GGUF tensor is dequantized whole, one at a time, then sliced; a quantized linear weight
is converted to the integer GEMM's blocks instead, sliced on them, and packed from them.
"""

from __future__ import annotations

import ctypes
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from sluice.config import QUANTIZATION_BLOCK, Quantization
from sluice.errors import SluiceError
from sluice.model_spec import ModelSpec
from worker.attention.backend import AttentionBackend
from worker.distributed import TensorParallelGroup
from worker.gguf_weights import gguf_tensors
from worker.models.bert import QKV_PARTS, BertEncoder, our_name
from worker.models.layers import Projection, Split
from worker.models.llama import LlamaForCausalLM
from worker.models.vocab_parallel import VocabParallelEmbedding
from worker.quantized_weights import (
    REQUANTIZED_TYPES,
    QuantizedParts,
    QuantizedRows,
    quantize_q4,
    quantize_q8,
)

logger = logging.getLogger("sluice.worker")

# Which checkpoint tensors are stacked, in order, into one fused parameter.
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Mixtral's names for its MoE block and its experts' projections, and the names the model uses (Qwen's).
_MIXTRAL_NAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)
# A checkpoint tensor: a safetensors slice (PySafeSlice, read lazily) or a tensor in memory.
Checkpoint = Any


class WeightLoadError(SluiceError, ValueError):
    """The folder's tensors do not match what the model's config.json describes."""


def load_model(
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    attention: AttentionBackend,
    max_model_len: int | None = None,
    tp: TensorParallelGroup | None = None,
    packed_linear: bool = True,
    fused_gate_up: bool = True,
    gemm_k_blocks: bool = True,
    gguf_dequantize: bool = False,
    quantization: Quantization | None = None,
    fused_moe: bool = True,
    needs_lm_head: bool = True,
    hybrid_kv_cache: bool = True,
) -> LlamaForCausalLM:
    """The model with this rank's shard of every weight; tp defaults to the process's group.

    packed_linear (KernelConfig.packed_linear) puts the linear weights in the form the device's linear
    reads fastest (on CPU, bf16 packed for Sluice's GEMM); False keeps them as loaded. fused_gate_up
    (KernelConfig.fused_gate_up) packs each MLP's gate_up so that the GEMM applies the activation, and
    gemm_k_blocks (KernelConfig.gemm_k_blocks) marks the packed weights for a GEMM that takes K in blocks.
    A GGUF file's quantized linear weights stay quantized for the integer GEMM where the ops run it,
    unless gguf_dequantize (KernelConfig.gguf_dequantize) widens them to `dtype` as they load. quantization
    (KernelConfig.quantization) quantizes a folder's linear weights and LM head for it once they are loaded
    (sluice/config_checks.py has checked that the model and the tier allow it). fused_moe
    (KernelConfig.fused_moe) runs each MoE layer in the ops' one call rather than expert by expert.
    needs_lm_head is False under the pooling runner: a checkpoint without an LM head loads (a base
    model's names lack the "model." prefix), and the unused head is zeros. hybrid_kv_cache
    (CacheConfig.hybrid_kv_cache) gives layers of different windows their own block tables."""
    with torch.device(device):
        model = LlamaForCausalLM(
            spec.hf_config,
            dtype,
            attention,
            max_model_len=max_model_len,
            tp=tp,
            fused_moe=fused_moe,
            hybrid_kv_cache=hybrid_kv_cache,
        )
    targets = _checkpoint_targets(model)
    loaded: set[str] = set()
    # Quantized GGUF weights stay quantized where packed_linear packs for Sluice's integer GEMM.
    keep_quantized = (
        spec.gguf_file is not None and packed_linear and not gguf_dequantize and model.ops.runs_quantized
    )
    quantized: QuantizedParts = {}
    tensors = _checkpoint_tensors(spec, show_progress=model.tp.rank == 0, keep_quantized=keep_quantized)
    for file, checkpoint_name, checkpoint in tensors:
        if checkpoint_name.endswith(_IGNORED_SUFFIXES):
            continue
        name = _model_name(checkpoint_name)
        if not spec.has_lm_head and not name.startswith("model."):
            name = f"model.{name}"
        if isinstance(checkpoint, QuantizedRows):
            # A tied LM head shares the embedding's shard of vocab rows.
            tied_head = name == "lm_head.weight" and model.tie_word_embeddings
            target = targets["model.embed_tokens.weight" if tied_head else name]
            owner = "lm_head.weight" if name == "lm_head.weight" else target.owner
            quantized.setdefault(owner, []).append(
                (target.row_offset, _quantized_shard(target, checkpoint, name))
            )
            loaded.add(name)
            continue
        if name == "lm_head.weight" and model.tie_word_embeddings:
            continue
        for part_name, part in _checkpoint_parts(name, checkpoint, targets):
            if part_name not in targets:
                raise WeightLoadError(
                    f"{file.name} holds tensor {name!r}, which {spec.architecture} with this "
                    "config.json does not have"
                )
            _copy_into(targets[part_name], part, part_name)
            loaded.add(part_name)
    if quantization is not None:
        quantized = _quantize_linear_weights(model, quantization)
    if quantized:
        _log_quantized(quantized, model.tp.rank)
    if not needs_lm_head and "lm_head.weight" in targets and "lm_head.weight" not in loaded:
        model.lm_head.weight.data.zero_()
        loaded.add("lm_head.weight")
    missing = [name for name in targets if name not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise WeightLoadError(f"model {str(spec.gguf_file or spec.path)!r} lacks tensor(s) {shown}")
    if packed_linear:
        model.prepare_linear_weights(fused_gate_up, gemm_k_blocks, quantized)
    del quantized
    _return_freed_memory()
    return model.eval()


def load_encoder(
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    packed_linear: bool,
    k_blocks: bool,
    quantization: Quantization | None = None,
    kernel_ops: bool = True,
) -> BertEncoder:
    """An encoder (BertModel, XLMRobertaModel) with every weight of its folder; packed_linear, k_blocks
    and quantization (its layers' linears; a cross-encoder's head stays float) as for load_model;
    kernel_ops as BertEncoder takes it."""
    with torch.device(device):
        model = BertEncoder(spec.hf_config, dtype, spec.is_cross_encoder, kernel_ops=kernel_ops)
    targets = _encoder_targets(model)
    loaded: set[str] = set()
    for file, checkpoint_name, checkpoint in _checkpoint_tensors(
        spec, show_progress=model.tp.rank == 0, keep_quantized=False
    ):
        name = our_name(checkpoint_name, spec.is_cross_encoder)
        if name is None:
            continue
        if name not in targets:
            raise WeightLoadError(
                f"{file.name} holds tensor {checkpoint_name!r}, which {spec.architecture} with this "
                "config.json does not have"
            )
        _copy_into(targets[name], checkpoint, checkpoint_name)
        loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        raise WeightLoadError(f"model {str(spec.path)!r} lacks tensor(s) {', '.join(missing[:5])}")
    if packed_linear:
        model.prepare_linear_weights(
            k_blocks, _quantize_projections(model, quantization) if quantization is not None else {}
        )
    return model.eval()


def _model_name(checkpoint_name: str) -> str:
    """The name the model gives a checkpoint tensor: the same, except for Mixtral's experts."""
    if ".block_sparse_moe." not in checkpoint_name:
        return checkpoint_name
    name = checkpoint_name
    for theirs, ours in _MIXTRAL_NAMES:
        name = name.replace(theirs, ours)
    return name


def _return_freed_memory() -> None:
    """Hands the memory that loading freed back to the OS: glibc keeps the converted tensors' freed blocks
    in its heap (590 MB of a Q4_0 1.1B file's), which would count in the worker's RSS for good."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its allocator keeps what it keeps
        return
    libc.malloc_trim(0)


def _checkpoint_tensors(
    spec: ModelSpec, show_progress: bool, keep_quantized: bool
) -> Iterator[tuple[Path, str, Checkpoint]]:
    """(file, Hugging Face name, tensor) for every checkpoint tensor: a lazy safetensors slice that
    reads only what is asked of it, or a GGUF tensor dequantized to float32 (or, keep_quantized,
    a linear weight's QuantizedRows)."""
    if spec.gguf_file is not None:
        for name, tensor in gguf_tensors(spec.gguf_file, spec.hf_config, show_progress, keep_quantized):
            yield spec.gguf_file, name, tensor
        return
    for file in weight_files(spec.path):
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield file, name, reader.get_slice(name)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files to read: those the shard index names, else every one in the folder."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    return sorted(folder.glob("*.safetensors"))


@dataclass(frozen=True, slots=True)
class _Target:
    """The slice of our parameter that a checkpoint tensor fills, and which part of that tensor it holds."""

    tensor: torch.Tensor
    # The checkpoint tensor's shape, as config.json implies it.
    full_shape: tuple[int, ...]
    # The parameter (model.named_parameters' name) and the first of its rows that the tensor fills.
    owner: str
    row_offset: int = 0
    # The dimension split over the ranks (None: every rank holds all of it), and this rank's offset on it.
    dim: int | None = None
    start: int = 0


def _checkpoint_parts(
    name: str, checkpoint: Checkpoint, targets: dict[str, _Target]
) -> Iterator[tuple[str, Checkpoint]]:
    """The checkpoint tensor, or, where the checkpoint fuses what the targets name apart (Phi-3's
    qkv_proj and gate_up_proj), each part's rows under its own name, for sharding like the rest."""
    fused = next((f for f in _FUSED if f".{f}." in name), None)
    if name in targets or fused is None:
        yield name, checkpoint
        return
    names = [name.replace(f".{fused}.", f".{part}.") for part in _FUSED[fused]]
    if not all(part_name in targets for part_name in names):
        yield name, checkpoint
        return
    rows = [targets[part_name].full_shape[0] for part_name in names]
    shape = tuple(checkpoint.shape if isinstance(checkpoint, torch.Tensor) else checkpoint.get_shape())
    if not shape or shape[0] != sum(rows):
        raise WeightLoadError(
            f"tensor {name!r} has shape {shape}, but config.json implies {sum(rows)} rows "
            f"({' + '.join(map(str, rows))} for {', '.join(_FUSED[fused])})"
        )
    start = 0
    for part_name, count in zip(names, rows, strict=True):
        yield part_name, checkpoint[start : start + count]
        start += count


def _checkpoint_targets(model: LlamaForCausalLM) -> dict[str, _Target]:
    """Map each Hugging Face tensor name to the slice of our parameter it fills."""
    targets: dict[str, _Target] = {}
    for name, param in model.named_parameters():
        hf_name = name if name.startswith("lm_head.") else f"model.{name}"
        module_path, _, kind = name.rpartition(".")
        module = model.get_submodule(module_path)
        if isinstance(module, VocabParallelEmbedding):
            full_shape = (module.vocab_size, *param.shape[1:])
            targets[hf_name] = _Target(param.data, full_shape, name, 0, 0, module.vocab_start)
            continue
        split = module.split if isinstance(module, Projection) else "replicated"
        owner, _, fused = module_path.rpartition(".")
        if fused not in _FUSED:
            targets[hf_name] = _shard_target(param.data, split, kind, model.tp, name, 0)
            continue
        sizes = getattr(model.get_submodule(owner), fused.removesuffix("_proj") + "_shards")
        offset = 0
        for part, size in zip(_FUSED[fused], sizes, strict=True):
            part_target = _shard_target(
                param.data[offset : offset + size], split, kind, model.tp, name, offset
            )
            targets[hf_name.replace(f".{fused}.", f".{part}.")] = part_target
            offset += size
    return targets


def _encoder_targets(model: BertEncoder) -> dict[str, _Target]:
    """Each parameter's part of its checkpoint tensor on this rank, split as its projection says (our
    names: worker/models/bert.py's our_name maps the checkpoint's to them)."""
    targets: dict[str, _Target] = {}
    for name, param in model.named_parameters():
        module_path, _, kind = name.rpartition(".")
        module = model.get_submodule(module_path)
        split = module.split if isinstance(module, Projection) else "replicated"
        layer, _, leaf = module_path.rpartition(".")
        if leaf != "qkv":
            targets[name] = _shard_target(param.data, split, kind, model.tp, name, 0)
            continue
        # The fused projection's rows: this rank's query rows, then its key rows, then its value rows.
        width = param.shape[0] // len(QKV_PARTS)
        for index, part in enumerate(QKV_PARTS):
            rows = param.data[index * width : (index + 1) * width]
            targets[f"{layer}.{part}.{kind}"] = _shard_target(
                rows, split, kind, model.tp, name, index * width
            )
    return targets


def _shard_target(
    tensor: torch.Tensor, split: Split, kind: str, tp: TensorParallelGroup, owner: str, row_offset: int
) -> _Target:
    """Rank r of a split holds the r-th of tp.size equal parts: output rows (column) or input columns (row)."""
    if split == "column":
        full_shape = (tensor.shape[0] * tp.size, *tensor.shape[1:])
        return _Target(tensor, full_shape, owner, row_offset, 0, tp.rank * tensor.shape[0])
    if split == "row" and kind == "weight":
        out_features, in_features = tensor.shape
        return _Target(
            tensor, (out_features, in_features * tp.size), owner, row_offset, 1, tp.rank * in_features
        )
    # Norms, replicated projections, and a row split's bias, which rank 0 alone adds.
    return _Target(tensor, tuple(tensor.shape), owner, row_offset)


def _check_shape(target: _Target, shape: tuple[int, ...], name: str) -> None:
    if shape != target.full_shape:
        raise WeightLoadError(
            f"tensor {name!r} has shape {shape}, but config.json implies {target.full_shape}"
        )


def _quantized_shard(target: _Target, rows: QuantizedRows, name: str) -> QuantizedRows:
    """This rank's part of quantized weight `name`: its output rows (padded with zero rows as the
    vocab's last shard is), or its input columns, which must fall on the blocks."""
    _check_shape(target, rows.shape, name)
    held = target.tensor.shape[0]
    if target.dim == 0:
        return rows.rows(slice(target.start, target.start + held)).padded(held)
    if target.dim == 1:
        stop = target.start + target.tensor.shape[1]
        if target.start % QUANTIZATION_BLOCK or stop % QUANTIZATION_BLOCK:
            raise WeightLoadError(
                f"tensor {name!r} is quantized in blocks of {QUANTIZATION_BLOCK} columns, and this rank's columns "
                f"{target.start}..{stop} split a block; load it with --gguf-dequantize"
            )
        return rows.columns(target.start, stop)
    return rows


def _quantize_linear_weights(model: LlamaForCausalLM, quantization: Quantization) -> QuantizedParts:
    """Every projection's weight and the LM head, as loaded (this rank's shards), quantized whole."""
    parts = _quantize_projections(model, quantization)
    quantize = quantize_q8 if quantization == "int8" else quantize_q4
    parts["lm_head.weight"] = [(0, quantize(model.lm_head.weight.data, quantization))]
    return parts


def _quantize_projections(model: nn.Module, quantization: Quantization) -> QuantizedParts:
    """Every quantizable projection's weight, as loaded, quantized whole, by parameter name."""
    quantize = quantize_q8 if quantization == "int8" else quantize_q4
    parts: QuantizedParts = {}
    for name, param in model.named_parameters():
        module = model.get_submodule(name.rpartition(".")[0])
        if isinstance(module, Projection) and module.quantizable and name.endswith(".weight"):
            parts[name] = [(0, quantize(param.data, quantization))]
    return parts


def _log_quantized(quantized: QuantizedParts, rank: int) -> None:
    """Says, once per source type, how its tensors run: as they are, with float16 scales, or requantized."""
    if rank != 0:
        return
    by_type: dict[str, int] = {}
    for parts in quantized.values():
        for _, rows in parts:
            by_type[rows.source] = by_type.get(rows.source, 0) + 1
    for source, count in sorted(by_type.items()):
        if source in REQUANTIZED_TYPES:
            logger.warning(
                "%d %s weight part(s) run requantized to 8 bits per value in blocks of 32 (no %s kernel)",
                count,
                source,
                source,
            )
        else:
            logger.info("%d %s weight part(s) stay quantized for the integer GEMM", count, source)


def _copy_into(target: _Target, checkpoint: Checkpoint, name: str) -> None:
    """Read this rank's part of checkpoint tensor `name` into the target; zero any padding past its end."""
    shape = tuple(checkpoint.shape if isinstance(checkpoint, torch.Tensor) else checkpoint.get_shape())
    _check_shape(target, shape, name)
    index = [slice(None)] * len(shape)
    if target.dim is None:
        target.tensor.copy_(checkpoint[tuple(index)])
        return
    dim, held = target.dim, target.tensor.shape[target.dim]
    count = max(0, min(held, shape[dim] - target.start))
    index[dim] = slice(target.start, target.start + count)
    target.tensor.narrow(dim, 0, count).copy_(checkpoint[tuple(index)])
    target.tensor.narrow(dim, count, held - count).zero_()

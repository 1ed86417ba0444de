"""Tiny random-init Hugging Face folders (Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2 and 3, and the
mixtures of experts Qwen3-MoE, Qwen2-MoE and Mixtral) written with transformers.

Biases and norm weights are randomised too, so a model that ignores them cannot pass, and the
weights are large enough that logits have clear winners. Each folder carries a byte-level
tokenizer (256 bytes + <s> and </s>) so that text-level code paths work on it.
"""

from __future__ import annotations

import atexit
import copy
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB_SIZE = 320
BOS_ID = 256
EOS_ID = 257

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.08,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "tie_word_embeddings": False,
}

_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    "qwen2": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "qwen3": {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    "mistral": {"sliding_window": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    # Fused qkv_proj and gate_up_proj in the checkpoint; transformers' own pad id (32000) is past this vocab.
    "phi3": {"pad_token_id": EOS_ID, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    # Experts in layers 0 and 2, a dense MLP in layer 1 (mlp_only_layers); top-2 of 8, renormalised.
    "qwen3_moe": {
        "head_dim": 32,
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    # Experts every second layer (decoder_sparse_step), each with the shared expert; top-3 of 6, not renormalised.
    "qwen2_moe": {
        "num_experts": 6,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96,
        "decoder_sparse_step": 2,
        "norm_topk_prob": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    # A sliding layer (window 16) then a global one; attention scores and logits soft-capped low enough
    # that the caps change what a random-init model computes.
    "gemma2": {
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": 16,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 5.0,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # A sliding layer (window 16, local rotary base) then a global one (linear scaling), soft-capped logits.
    "gemma3_text": {
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
    },
    "mixtral": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
}

_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<s>' + message['role'] + ': ' + message['content'] + '</s>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<s>assistant: ' }}{% endif %}"
)


def write_tiny_model(
    arch: str, folder: Path, dtype: str = "float32", seed: int = 0, overrides: dict[str, Any] | None = None
) -> Path:
    """Write a tiny `arch` model (a key of _ARCHITECTURES: "llama", "qwen3_moe", ...) into `folder`; returns it.

    `overrides` replaces config values (head counts, vocab size, ...).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    # A deep copy: transformers edits a config's nested dicts (rope_parameters) in place.
    fields = copy.deepcopy({**_COMMON, **_ARCHITECTURES[arch], **(overrides or {})})
    config = AutoConfig.for_model(arch, **fields)
    generator = torch.Generator().manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("mlp.gate.weight"):
                # A MoE router: logits far apart, so that no rounding can change which experts are chosen.
                param.copy_(noise)
            elif name.endswith("bias"):
                param.copy_(0.2 * noise)
            else:
                param.copy_(config.initializer_range * noise)
    model.to(torch_dtype).save_pretrained(folder)
    _write_tokenizer(folder)
    return folder


def write_tiny_embedding_model(
    arch: str, folder: Path, pooling_mode: str, normalize: bool, overrides: dict[str, Any] | None = None
) -> Path:
    """A tiny sentence-transformers embedding model: `arch`'s base model (its checkpoint and config as
    Qwen3-Embedding ships them: no LM head, no "model." prefix) with a Pooling module of
    `pooling_mode` ("lasttoken", "mean_tokens" or "cls_token") and, with `normalize`, a Normalize one."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    causal = write_tiny_model(arch, folder / "causal", overrides=overrides)
    AutoModelForCausalLM.from_pretrained(causal, dtype=torch.float32).model.save_pretrained(folder)
    shutil.rmtree(causal)
    _write_tokenizer(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(overrides or {})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    _write_sentence_transformers_modules(folder, config["hidden_size"], pooling_mode, normalize)
    return folder


# Encoders of the BERT family: post-LayerNorm layers, absolute positions (RoBERTa's after its padding index).
_ENCODERS: dict[str, dict[str, Any]] = {
    "bert": {"max_position_embeddings": 256, "type_vocab_size": 2, "hidden_act": "gelu"},
    "xlm-roberta": {
        "max_position_embeddings": 258,
        "type_vocab_size": 1,
        "pad_token_id": 1,
        "hidden_act": "gelu",
    },
}


def write_tiny_encoder(model_type: str, folder: Path, pooling_mode: str, normalize: bool) -> Path:
    """A tiny random-init BertModel or XLMRobertaModel (`model_type` "bert" or "xlm-roberta") as a
    sentence-transformers folder, pooled as write_tiny_embedding_model's are."""
    from transformers import AutoModel

    folder = Path(folder)
    config = _encoder_config(model_type)
    _randomize(AutoModel.from_config(config, add_pooling_layer=False, dtype=torch.float32)).save_pretrained(
        folder
    )
    _write_tokenizer(folder)
    _write_sentence_transformers_modules(folder, config.hidden_size, pooling_mode, normalize)
    return folder


# A query and documents for a cross-encoder to score: two that answer it, one that does not, one of a
# single character.
CROSS_ENCODER_QUERY = "what do cats eat?"
CROSS_ENCODER_DOCUMENTS = [
    "Cats eat meat: mice, birds and fish.",
    "The stock market fell on Tuesday.",
    "Kittens drink milk, then move on to solid food.",
    "x",
]


def write_tiny_cross_encoder(model_type: str, folder: Path) -> Path:
    """A tiny random-init BertForSequenceClassification or XLMRobertaForSequenceClassification of one
    label (a reranker), whose tokenizer types a pair as its family does: BERT's second text type 1,
    XLM-RoBERTa's all type 0 with a doubled separator."""
    from tokenizers import Tokenizer, processors
    from transformers import AutoModelForSequenceClassification

    folder = Path(folder)
    config = _encoder_config(model_type, num_labels=1)
    _randomize(AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)).save_pretrained(
        folder
    )
    _write_tokenizer(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos, eos = ("<s>", tokenizer.token_to_id("<s>")), ("</s>", tokenizer.token_to_id("</s>"))
    pair = "<s> $A </s> $B:1 </s>:1" if model_type == "bert" else "<s> $A </s> </s> $B </s>"
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair=pair, special_tokens=[bos, eos]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    # sentence-transformers' CrossEncoder asks its tokenizer to pad (it predicts one pair at a time in
    # the tests, so nothing is padded), and renders a pair through a chat template where there is one
    # (rerankers have none). BERT's tokenizers hand the model token types, XLM-RoBERTa's do not.
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    del tokenizer_config["chat_template"]
    if model_type == "bert":
        tokenizer_config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**tokenizer_config, "pad_token": "</s>"}, indent=2)
    )
    return folder


def _encoder_config(model_type: str, **fields: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        layer_norm_eps=1e-12,
        **_ENCODERS[model_type],
        **fields,
    )


def _randomize(model: Any) -> Any:
    """Weights large enough that every part of the encoder moves its output (LayerNorm gains near 1)."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "LayerNorm.weight" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.2 * noise)
            else:
                param.copy_(0.08 * noise)
    return model


def _write_sentence_transformers_modules(
    folder: Path, hidden: int, pooling_mode: str, normalize: bool
) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": hidden}
    pooling.update(
        {f"pooling_mode_{mode}": mode == pooling_mode for mode in ("lasttoken", "mean_tokens", "cls_token")}
    )
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))


@functools.cache
def tiny_model_dir(arch: str, dtype: str = "float32") -> Path:
    """A tiny folder shared by the whole test process, written on first use and removed at exit."""
    return write_tiny_model(arch, _session_root() / f"{arch}-{dtype}", dtype)


@functools.cache
def _session_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="sluice-tiny-models-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab=_byte_level_vocab(), merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": _COMMON["max_position_embeddings"],
        "chat_template": _CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def _byte_level_vocab() -> dict[str, int]:
    """ByteLevel's printable stand-in for each byte, mapped to id == byte value."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    vocab = {chr(b): b for b in printable}
    unprintable = [b for b in range(256) if b not in vocab.values()]
    vocab.update({chr(256 + i): b for i, b in enumerate(unprintable)})
    return vocab

"""Which layers attend through a sliding window, and how wide: read from a model's config by the workers
(each layer's attention) and, through sluice/kv_cache_groups.py, by the engine core (which KV blocks a
request may release)."""

from __future__ import annotations

from typing import Any


def sliding_windows(hf_config: dict[str, Any], architecture: str, max_model_len: int) -> list[int]:
    """Each layer's attention window as the model was trained (a query sees its last `window` keys), or 0
    where it sees the whole context: every layer of Mistral, Mixtral and Phi-3; with use_sliding_window,
    Qwen's from max_window_layers on (Qwen2-MoE's even layers below it); Gemma's but every
    sliding_window_pattern-th; as transformers lays them out, unless the config lists its layer_types.
    A window no shorter than max_model_len is no window."""
    layers = int(hf_config["num_hidden_layers"])
    window = int(hf_config.get("sliding_window") or 0)
    types = hf_config.get("layer_types")
    if "Qwen" in architecture:
        if not hf_config.get("use_sliding_window"):
            window = 0
        elif types is None:
            first = int(hf_config.get("max_window_layers", 28))
            if architecture == "Qwen2MoeForCausalLM":
                types = ["sliding_attention" if i % 2 == 0 and i < first else "full" for i in range(layers)]
            else:
                types = ["sliding_attention" if i >= first else "full" for i in range(layers)]
    elif architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        if types is None:
            # The Hub's configs give the pattern: every sliding_window_pattern-th layer is global (Gemma 2's
            # every other one, Gemma 3's every sixth).
            default = 2 if architecture == "Gemma2ForCausalLM" else 6
            pattern = int(hf_config.get("sliding_window_pattern", default))
            types = ["sliding_attention" if (i + 1) % pattern else "full" for i in range(layers)]
    elif architecture not in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM"):
        window = 0
    if window >= max_model_len:
        window = 0
    if types is None:
        return [window] * layers
    return [window if kind == "sliding_attention" else 0 for kind in types]

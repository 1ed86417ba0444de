"""How a model's layers share the KV block pool: groups of layers with one window each, as vLLM's hybrid
allocator lays them out. Read by the engine core (each group's block table per request, and which of its
blocks fall out of the window) and by the workers (each layer's block table and KV tensor).

Every group holds the same number of layers, so that one block id means the same bytes in every group:
a block is `num_slots` layers' keys and values, one in each of `num_slots` KV tensors. A layer reads its
group's block table and its own slot's tensor; layers of different groups at the same slot share that
tensor, each through its own group's blocks. A sliding-window group then holds about a window of blocks
per request while a full-attention group holds the whole context (Gemma 2: half the layers see 4,096
tokens; Gemma 3: five in six see 512 or 1,024).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sluice.model_spec import ModelSpec
from sluice.sliding_windows import sliding_windows


@dataclass(frozen=True, slots=True)
class KVCacheGroups:
    # Each group's window (a query sees its last `window` keys), or 0 for the whole context; the
    # full-context groups come first, so that group 0 is the one the prefix cache's events describe.
    windows: tuple[int, ...]
    # Each layer's group, and its KV tensor (its place within the group).
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.layer_group) == len(self.layer_slot)
        pairs = set(zip(self.layer_group, self.layer_slot, strict=True))
        assert len(pairs) == len(self.layer_group), "two layers of one group share a KV tensor"
        assert {group for group, _ in pairs} == set(range(len(self.windows))), "a group without layers"

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        """KV tensors, each of every block: a block id holds this many layers' keys and values."""
        return max(self.layer_slot) + 1


def kv_cache_groups(layer_windows: Sequence[int], hybrid: bool = True) -> KVCacheGroups:
    """The groups of layers whose windows are `layer_windows` (sluice/sliding_windows.py's, 0: the whole
    context). One group where every layer has the same window, or where `hybrid` is off
    (CacheConfig.hybrid_kv_cache): then no block is released before its request ends where any layer
    sees the whole context. Otherwise the layers of each window are cut into groups of the size of the
    smallest window's layer count, in layer order (a last, shorter group leaves slots unused)."""
    assert layer_windows, "a model without layers"
    kinds = sorted(set(layer_windows))
    if len(kinds) == 1 or not hybrid:
        window = kinds[0] if len(kinds) == 1 else 0
        return KVCacheGroups((window,), (0,) * len(layer_windows), tuple(range(len(layer_windows))))
    layers_of = {kind: [i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds}
    size = min(len(layers) for layers in layers_of.values())
    windows: list[int] = []
    layer_group = [0] * len(layer_windows)
    layer_slot = [0] * len(layer_windows)
    # sorted() puts 0, the full-context layers, first.
    for kind in kinds:
        layers = layers_of[kind]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer] = len(windows)
                layer_slot[layer] = slot
            windows.append(kind)
    return KVCacheGroups(tuple(windows), tuple(layer_group), tuple(layer_slot))


def model_kv_cache_groups(spec: ModelSpec, max_model_len: int, hybrid: bool) -> KVCacheGroups:
    """The model's groups: an encoder's one (it keeps no KV between steps), a decoder's by its windows."""
    if spec.is_encoder:
        return kv_cache_groups([0] * spec.num_layers)
    return kv_cache_groups(sliding_windows(spec.hf_config, spec.architecture, max_model_len), hybrid)

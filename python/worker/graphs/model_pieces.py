"""The model cut at its attention calls, for PIECEWISE graphs: num_layers + 1 dense pieces.

Piece 0 embeds and runs layer 0's attention_input; piece i runs layer i-1's attention_output and
feed_forward, then layer i's attention_input; the last piece ends with the final norm. Attention
runs eagerly between pieces. Everything that crosses from one piece to the next lives in the
static tensors here, so that each piece's graph reads and writes fixed addresses and every
tensor a graph allocates is scratch that dies inside it (which lets all graphs share one pool).

The pieces mirror LlamaForCausalLM.forward op for op; test_graph_runner checks that they match it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from worker.attention.backend import AttentionMetadata
from worker.models.llama import LlamaForCausalLM


class ModelPieces:
    def __init__(self, model: LlamaForCausalLM, max_num_tokens: int, hidden_out: torch.Tensor) -> None:
        self.model = model
        attn = model.layers[0].tensors
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        device, dtype = hidden_out.device, model.dtype
        hidden = model.embed_tokens.weight.shape[1]
        head_dim = attn.head_dim
        self.residual = torch.zeros(max_num_tokens, hidden, dtype=dtype, device=device)
        # The rotary tables' width: head_dim, or a partial rotary's share of it.
        rotary_dtype, rotary_dim = model.rotary.cos.dtype, model.rotary.cos.shape[1]
        self.cos = torch.zeros(max_num_tokens, rotary_dim, dtype=rotary_dtype, device=device)
        self.sin = torch.zeros(max_num_tokens, rotary_dim, dtype=rotary_dtype, device=device)
        self.qkv = torch.zeros(
            max_num_tokens, self.num_heads + 2 * self.num_kv_heads, head_dim, dtype=dtype, device=device
        )
        # Zeroed once: rows past a step's tokens keep finite values from earlier steps.
        self.attn = torch.zeros(max_num_tokens, self.num_heads, head_dim, dtype=dtype, device=device)
        self.hidden_out = hidden_out

    @property
    def num_pieces(self) -> int:
        return len(self.model.layers) + 1

    def piece(self, index: int, input_ids: torch.Tensor, positions: torch.Tensor) -> Callable[[], None]:
        """Piece `index` over the first len(input_ids) rows, as a closure over fixed views: it reads
        no Python state at call time, so a graph captured from it replays the same work."""
        num_tokens = input_ids.shape[0]
        model, layers = self.model, self.model.layers
        residual, cos, sin = self.residual[:num_tokens], self.cos[:num_tokens], self.sin[:num_tokens]
        attn, hidden_out = self.attn[:num_tokens], self.hidden_out[:num_tokens]
        qkv = self.qkv[:num_tokens]

        def store_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            heads, kv_heads = self.num_heads, self.num_kv_heads
            qkv[:, :heads].copy_(q)
            qkv[:, heads : heads + kv_heads].copy_(k)
            qkv[:, heads + kv_heads :].copy_(v)

        if index == 0:

            def first() -> None:
                residual.copy_(model.embed_tokens.embed(input_ids))
                table_cos, table_sin = model.rotary.lookup(positions)
                cos.copy_(table_cos)
                sin.copy_(table_sin)
                store_qkv(*layers[0].attention_input(None, residual, cos, sin))

            return first

        before = layers[index - 1]
        # Under tensor parallelism each rank's stage output is a partial sum, as in the model's forward.
        all_reduce = model.tp.all_reduce
        if index == len(layers):

            def last() -> None:
                delta = all_reduce(before.feed_forward(all_reduce(before.attention_output(attn)), residual))
                hidden_out.copy_(model.ops.add_rms_norm(residual, delta, model.norm.weight, model.norm.eps))

            return last

        after = layers[index]

        def middle() -> None:
            delta = all_reduce(before.feed_forward(all_reduce(before.attention_output(attn)), residual))
            store_qkv(*after.attention_input(delta, residual, cos, sin))

        return middle

    def attention(
        self,
        layer_index: int,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: Sequence[AttentionMetadata],
    ) -> None:
        """Layer `layer_index`'s attention over the step's real tokens, eagerly, into the static output;
        `metadata`, one per KV cache group."""
        metadata_of_layer = metadata[self.model.kv_cache_groups.layer_group[layer_index]]
        n = metadata_of_layer.num_tokens
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv[:n]
        q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        layer = self.model.layers[layer_index]
        t = layer.tensors
        out = self.model.attention.forward(
            q, k, v, kv_cache[0], kv_cache[1], metadata_of_layer, t.scale, t.sliding_window
        )
        self.attn[:n].copy_(out)

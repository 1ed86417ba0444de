"""Runs a function in N real processes that form a tensor-parallel group (gloo on CPU, NCCL on CUDA).

It stands in, in tests, for the engine core's multiprocess executor: each rank joins the group over
TCP on 127.0.0.1, runs `fn(*args)` with one thread, and hands back what it returned. A rank that
raises fails the whole run, and the others are stopped.
"""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing

from paged_sequences import PagedSequences
from sluice.model_spec import read_model_spec
from worker.attention.selector import select_attention_backend
from worker.distributed import destroy_tensor_parallel, init_tensor_parallel
from worker.model_loader import load_model
from worker.models.llama import LlamaForCausalLM


def run_tensor_parallel(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...] = (), device: str = "cpu"
) -> list[Any]:
    """What `fn(*args)` returned on each rank, in rank order. `fn` must be a module-level function."""
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    with tempfile.TemporaryDirectory(prefix="sluice-tp-") as out:
        torch.multiprocessing.spawn(
            _run_rank, args=(world_size, init_method, device, fn, args, out), nprocs=world_size, join=True
        )
        return [torch.load(Path(out) / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def _run_rank(
    rank: int,
    world_size: int,
    init_method: str,
    device: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out: str,
) -> None:
    # The ranks share the machine's cores; more threads than cores would only make them wait on each other.
    torch.set_num_threads(1)
    init_tensor_parallel(rank, world_size, init_method, device, timeout=timedelta(seconds=300))
    try:
        result = fn(*args)
    finally:
        destroy_tensor_parallel()
    torch.save(result, Path(out) / f"rank{rank}.pt")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def load_float32(folder: Path, device: str = "cpu", packed_linear: bool = True) -> LlamaForCausalLM:
    """This rank's shard of the model in `folder`, with the attention backend the worker uses;
    packed_linear False keeps the linear weights as loaded (KernelConfig.packed_linear)."""
    target = torch.device(device)
    return load_model(
        read_model_spec(folder),
        torch.float32,
        target,
        select_attention_backend(target),
        packed_linear=packed_linear,
    )


def greedy_generate(
    model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Per prompt: the greedy tokens, and the logits [max_new_tokens, vocab] each was picked from.

    All prompts prefill in one step, then decode together, one token each per step.
    """
    seqs = [list(prompt) for prompt in prompts]
    batch = PagedSequences(model, seqs, capacity=max(map(len, seqs)) + max_new_tokens)
    logits = batch.step([len(s) for s in seqs])
    last_rows = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
    logits = logits[last_rows.to(logits.device)]
    picked: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in range(max_new_tokens):
        if step:
            logits = batch.step([1] * len(seqs))
        for seq, rows, row in zip(seqs, picked, logits.cpu(), strict=True):
            rows.append(row)
            seq.append(int(row.argmax()))
    tokens = [seq[len(prompt) :] for seq, prompt in zip(seqs, prompts, strict=True)]
    return tokens, [torch.stack(rows) for rows in picked]

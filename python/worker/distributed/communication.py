"""One worker's place in its tensor-parallel group, and the collectives the sharded model runs."""

from __future__ import annotations

import secrets

import torch
import torch.distributed as dist


class TensorParallelGroup:
    """Rank `rank` of `size`; with one rank there is no process group and every collective is a no-op."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        assert 0 <= rank < size, (rank, size)
        assert (size == 1) == (group is None), "a process group exactly when there is more than one rank"
        self.rank = rank
        self.size = size
        self.group = group
        # Where the collectives' own tensors live: NCCL only moves CUDA tensors.
        self.device = device or torch.device("cpu")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`. Row-parallel outputs and embedding rows.

        Each element is summed in rank order in float32 and rounded to x's dtype once, so its value does
        not depend on the rest of the tensor. A library all-reduce (gloo's ring) splits the tensor into
        chunks by its size and adds each chunk in a different rank order, so one row's sum, rounded in
        bf16 at every step, would depend on how many rows share the step: a request's greedy tokens
        would change with the batch it lands in. The ranks gather every partial sum instead.
        """
        if self.size == 1:
            return x
        assert x.is_contiguous()
        # The collective stacks the ranks' tensors along the first dimension.
        gathered = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(gathered, x, group=self.group)
        gathered = gathered.view(self.size, *x.shape)
        total = gathered[0].to(torch.float32, copy=True)
        for rank in range(1, self.size):
            total += gathered[rank]
        x.copy_(total)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` [..., n] side by side in rank order: [..., size * n] on every rank."""
        if self.size == 1:
            return x
        # The collective stacks the ranks' tensors along the first dimension.
        gathered = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(gathered, x.contiguous(), group=self.group)
        ranks_first = gathered.view(self.size, *x.shape)
        return ranks_first.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def shared_generator(self) -> torch.Generator | None:
        """A CPU generator seeded alike on every rank, so they all draw the same tokens; None for one rank.

        Rank 0 picks the seed at random and broadcasts it, so two runs still sample differently.
        """
        if self.size == 1:
            return None
        seed = torch.tensor([secrets.randbits(62) if self.rank == 0 else 0], dtype=torch.int64)
        seed = seed.to(self.device)
        dist.broadcast(seed, src=0, group=self.group)
        return torch.Generator().manual_seed(int(seed.item()))

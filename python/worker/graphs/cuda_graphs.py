"""CUDA graph capture with PyTorch's torch.cuda.CUDAGraph, as a recorder for GraphRunner.

Every graph is captured on one side stream into one memory pool. Sharing the pool is safe because
no graph reads memory another graph allocated: whatever crosses a graph boundary lives in static
tensors allocated outside capture (StaticInputBuffers, ModelPieces, the runner's hidden states),
and graphs never replay concurrently. Captures run largest first, so smaller graphs fit in blocks
the larger ones already reserved.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from worker.graphs.graph_runner import Replay


class CudaGraphRecorder:
    def __init__(self, device: torch.device, warmup_runs: int = 2) -> None:
        assert device.type == "cuda", device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.warmup_runs = warmup_runs

    def __call__(self, fn: Callable[[], None]) -> Replay:
        # Lazy initialisation (cuBLAS handles and workspaces, Triton compiles, allocator growth)
        # must happen before capture, and off the default stream, as PyTorch's CUDA graph notes ask.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(self.warmup_runs):
                fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        # The same stream for every capture that shares the pool, as torch.cuda.graph's docs ask.
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            fn()
        # The bound method keeps the graph, and with it its share of the pool, alive.
        return graph.replay

"""Tensor parallelism over torch.distributed: the process group of a worker's ranks and its collectives.

gloo on CPU, NCCL on CUDA. A single rank initialises nothing and every collective returns its input.
"""

from worker.distributed.communication import TensorParallelGroup
from worker.distributed.parallel_state import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    tensor_parallel_group,
)

__all__ = ["TensorParallelGroup", "destroy_tensor_parallel", "init_tensor_parallel", "tensor_parallel_group"]

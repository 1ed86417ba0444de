"""Typed errors raised at Sluice's boundaries, before any work is scheduled."""


class SluiceError(Exception):
    """Base class of every error Sluice raises on purpose."""


class InvalidRequestError(SluiceError, ValueError):
    """A request or one of its parameters is out of range; `param` names the culprit."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(SluiceError, FileNotFoundError):
    """The model folder does not exist or lacks config.json / safetensors."""


class UnsupportedArchitectureError(SluiceError, ValueError):
    """The model's architecture is not one Sluice implements."""


class KVCacheTooSmallError(SluiceError, ValueError):
    """The KV cache memory budget cannot hold a single request of max_model_len."""


class DeviceUnavailableError(SluiceError, RuntimeError):
    """The configured device is not present on this machine."""


class WorkerDiedError(SluiceError, RuntimeError):
    """A worker process exited or failed: the engine core cannot go on and fails what is in flight."""


class GraphConfigError(SluiceError, ValueError):
    """The graph options do not fit the scheduler's limits (e.g. a capture size above max_num_seqs)."""


class AttentionBackendError(SluiceError, ValueError):
    """The attention backend asked for cannot serve this cache (its block size or dtype)."""


class InvalidConfigError(SluiceError, ValueError):
    """An engine option that cannot work here (an unknown device, a TP size the executor cannot run)."""


class TensorParallelSizeError(SluiceError, ValueError):
    """The tensor-parallel size is below 1 or does not divide the model's heads or MLP width."""

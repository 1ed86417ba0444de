"""Sluice: serve and run LLMs. The public offline API is `from sluice import LLM, SamplingParams`
(and BeamSearchParams, PoolingParams).

The package's modules are also the pieces shared by the engine core, the workers and the CLI
(config, errors, seam types), so the API is imported lazily: `engine` imports `sluice`, and
`import sluice.config` must not pull in the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.beam_search import BeamSearchParams
    from engine.llm import LLM
    from sluice.pooling import PoolingParams
    from sluice.sampling_params import SamplingParams

__all__ = ["LLM", "BeamSearchParams", "PoolingParams", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "BeamSearchParams":
        from engine.beam_search import BeamSearchParams

        return BeamSearchParams
    if name == "PoolingParams":
        from sluice.pooling import PoolingParams

        return PoolingParams
    if name == "SamplingParams":
        from sluice.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'sluice' has no attribute {name!r}")

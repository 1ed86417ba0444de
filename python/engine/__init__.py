"""The engine core: requests as token ids, the scheduler, the KV cache manager, the offline API."""

from engine.beam_search import BeamSearchParams
from engine.llm import LLM
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from sluice.sampling_params import SamplingParams

__all__ = ["LLM", "BeamSearchParams", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]

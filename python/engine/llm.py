"""The offline API: `LLM(model=...).generate(prompts, params)` and `.chat(messages, params)`, tokenizing,
rendering chat templates, detokenizing and cutting at stop strings in Python."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, NotRequired, TypedDict

import numpy as np

from engine.beam_search import (
    CANDIDATES_PER_BEAM,
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    PromptBeams,
)
from engine.engine_core import EngineCore
from engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from sluice.config import SluiceConfig, SpeculativeConfig
from sluice.engine_args import config_from_options
from sluice.errors import InvalidRequestError
from sluice.frontend_seam import EngineOutput
from sluice.pooling import PoolingParams, runner_mismatch, second_text_start_of
from sluice.sampling_params import SamplingParams
from sluice.worker_seam import Logprobs


class TextPrompt(TypedDict):
    prompt: str
    # vLLM's: the request shares cached KV blocks only with requests of the same salt.
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt


class _Prompt(NamedTuple):
    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None


# One conversation: OpenAI-style messages ({"role": ..., "content": ...}).
Conversation = Sequence[Mapping[str, Any]]


@dataclass(slots=True)
class _Child:
    """One of a request's n samples, tracked until it finishes."""

    output: CompletionOutput
    parent: RequestOutput
    params: SamplingParams
    # The text up to and without (or with) the stop string that ended it; None until one does.
    stopped_text: str | None = None
    finished: bool = False


class LLM:
    def __init__(
        self, model: str | None = None, speculative_config: dict[str, Any] | None = None, **options: Any
    ) -> None:
        """`options` are the engine's command-line options by their names (`max_num_seqs`, `kv_cache_memory`,
        `num_kv_blocks`, `cpu_isa`, ...: `sluice generate --help`), with the same defaults."""
        config = config_from_options(model, **options)
        if speculative_config is not None:
            # vLLM's shape: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, ...}.
            config = replace(config, speculative=SpeculativeConfig(**speculative_config))
        self._start(config)

    @classmethod
    def from_config(cls, config: SluiceConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: SluiceConfig) -> None:
        self.config = config
        self.engine = EngineCore(config)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.engine.spec.path)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in prompt order.

        Every prompt is validated before any is queued, so a bad one queues nothing.
        """
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        return self._run([self._tokenize(p) for p in prompt_list], params, priority)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt, in prompt order (the model must be served with the pooling runner).

        Every prompt is validated before any is queued, so a bad one queues nothing; a request that
        fails in the engine raises InvalidRequestError naming it."""
        if self.engine.spec.is_cross_encoder:
            raise InvalidRequestError(runner_mismatch("pooling", cross_encoder=True), param="model")
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        return self._pool([self._tokenize(p) for p in prompt_list], pooling_params or PoolingParams())

    def _pool(
        self,
        requests: list[_Prompt],
        params: PoolingParams,
        second_text_starts: list[int | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's pooled vector (a cross-encoder's: its one score, of the pair that its
        second_text_start splits), validating every prompt before any is queued."""
        starts = second_text_starts or [None] * len(requests)
        # Unused by a pooling request, and never sampled: only its prompt is computed.
        sampling = SamplingParams(max_tokens=1)
        for request, start in zip(requests, starts, strict=True):
            self.engine.check_request(request.token_ids, sampling, request.cache_salt, params, start)
        now = time.monotonic()
        request_ids = [str(next(self._ids)) for _ in requests]
        for request_id, request, start in zip(request_ids, requests, starts, strict=True):
            self.engine.add_request(
                request_id, request.token_ids, sampling, now, 0, request.cache_salt, params, start
            )
        finished: dict[str, EngineOutput] = {}
        while self.engine.has_unfinished_requests():
            for core_output in self.engine.step():
                if core_output.finish_reason is not None:
                    finished[core_output.request_id] = core_output
        results = []
        for request_id, request in zip(request_ids, requests):
            core_output = finished[request_id]
            if core_output.embedding is None:
                raise InvalidRequestError(
                    f"prompt {request_id} failed: {core_output.error}", param=core_output.invalid_param
                )
            vector = np.frombuffer(core_output.embedding, dtype="<f4").tolist()
            results.append(
                EmbeddingRequestOutput(
                    request_id, request.token_ids, EmbeddingOutput(vector), core_output.num_cached_tokens
                )
            )
        return results

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's: the similarity of each pair, for an embedding model the cosine of their embeddings.

        One data_1 is paired with every data_2, else they pair one to one; results come in data_2's order.
        """
        first = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
        second = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
        if not second or len(first) not in (1, len(second)):
            raise InvalidRequestError(
                f"score pairs one data_1 with each data_2, or data_1 and data_2 one to one; got {len(first)} "
                f"and {len(second)}",
                param="data_2",
            )
        if self.engine.spec.is_cross_encoder:
            return self._cross_encode(
                first * len(second) if len(first) == 1 else first, second, pooling_params
            )
        embedded = self.embed([*first, *second], pooling_params)
        queries, documents = embedded[: len(first)], embedded[len(first) :]
        if len(queries) == 1:
            queries = queries * len(documents)
        results = []
        for query, document in zip(queries, documents, strict=True):
            a, b = np.array(query.outputs.embedding), np.array(document.outputs.embedding)
            cosine = float(a @ b / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))
            results.append(
                ScoringRequestOutput(
                    f"{query.request_id}-{document.request_id}",
                    [*query.prompt_token_ids, *document.prompt_token_ids],
                    ScoringOutput(cosine),
                )
            )
        return results

    def _cross_encode(
        self, first: list[PromptType], second: list[PromptType], pooling_params: PoolingParams | None
    ) -> list[ScoringRequestOutput]:
        """A cross-encoder's score of each pair, tokenized as one prompt by the tokenizer's pair template."""
        requests, starts = [], []
        for a, b in zip(first, second, strict=True):
            encoded = self.tokenizer(
                self._text(a, "data_1"), self._text(b, "data_2"), return_token_type_ids=True
            )
            requests.append(_Prompt(None, list(encoded["input_ids"])))
            starts.append(second_text_start_of(list(encoded["token_type_ids"])))
        scored = self._pool(requests, pooling_params or PoolingParams(), starts)
        return [
            ScoringRequestOutput(
                pair.request_id, pair.prompt_token_ids, ScoringOutput(pair.outputs.embedding[0])
            )
            for pair in scored
        ]

    @staticmethod
    def _text(prompt: PromptType, param: str) -> str:
        """A cross-encoder's text: its pair template needs both texts, not token ids."""
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"]
        raise InvalidRequestError(
            "a cross-encoder scores pairs of texts (a string or {'prompt': str}); token ids have no pair template",
            param=param,
        )

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """vLLM's: each prompt's params.beam_width best continuations (engine/beam_search.py), best first."""
        params.validate()
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        requests = [self._tokenize(p) for p in prompt_list]
        searches = []
        for request in requests:
            room = self.engine.max_model_len - len(request.token_ids)
            if room < 1:
                raise InvalidRequestError(
                    f"the prompt has {len(request.token_ids)} tokens: max_model_len ({self.engine.max_model_len}) "
                    "leaves no room for a beam's token",
                    param="prompt",
                )
            # A beam ends at the context's end, as a generation does.
            beam_params = replace(params, max_tokens=min(params.max_tokens, room))
            first = BeamSearchSequence(list(request.token_ids), len(request.token_ids))
            searches.append(PromptBeams(beam_params, self.engine.spec.eos_token_ids, [first]))
        # One greedy token per live beam, with its best candidates' logprobs (raw: the model's own).
        step = SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=CANDIDATES_PER_BEAM * params.beam_width, ignore_eos=True
        )
        while any(not search.done for search in searches):
            live = [
                (search, beam, request) for search, request in zip(searches, requests) for beam in search.live
            ]
            outputs = self._run(
                [_Prompt(None, beam.tokens, request.cache_salt) for _, beam, request in live], step, None
            )
            tops: dict[int, list[dict[int, float]]] = {}
            for (search, _, _), output in zip(live, outputs, strict=True):
                completion = output.outputs[0]
                if completion.error is not None:
                    raise InvalidRequestError(completion.error, param=completion.error_param)
                assert completion.logprobs, "a beam step asked for logprobs"
                top = {token_id: entry.logprob for token_id, entry in completion.logprobs[0].items()}
                tops.setdefault(id(search), []).append(top)
            for search in searches:
                if not search.done:
                    search.advance(tops[id(search)])
        results = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = self.tokenizer.decode(beam.output_token_ids, skip_special_tokens=True)
            results.append(BeamSearchOutput(best))
        return results

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation through the model's chat template and generate its reply.

        `messages` is one conversation (a list of messages) or a list of them; results come back
        in the same order, one per conversation. chat_template_kwargs are extra template
        variables (e.g. enable_thinking), as in vLLM.
        """
        if not messages:
            raise InvalidRequestError("chat() needs at least one message", param="messages")
        first = messages[0]
        conversations = [messages] if isinstance(first, Mapping) else list(messages)
        if self.tokenizer.chat_template is None:
            raise InvalidRequestError("this model has no chat template; use generate()", param="messages")
        requests = []
        for conversation in conversations:
            if not conversation or not all(isinstance(m, Mapping) for m in conversation):
                raise InvalidRequestError("a conversation must be a non-empty list of messages", "messages")
            text = self.tokenizer.apply_chat_template(
                [dict(m) for m in conversation],
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **dict(chat_template_kwargs or {}),
            )
            # The template writes the special tokens itself, as the frontend's chat endpoint does.
            requests.append(_Prompt(text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(requests, params, None)

    def _run(
        self,
        requests: list[_Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
    ) -> list[RequestOutput]:
        params = params or SamplingParams()
        param_list = [params] * len(requests) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(requests):
            raise InvalidRequestError("one SamplingParams is needed per prompt, or one for all")
        priorities = list(priority) if priority is not None else [0] * len(requests)
        param_list = [self._with_bad_word_ids(p) for p in param_list]
        for request, p in zip(requests, param_list):
            self.engine.check_request(request.token_ids, p, request.cache_salt)
        results: list[RequestOutput] = []
        children: dict[str, _Child] = {}
        now = time.monotonic()
        for (text, token_ids, cache_salt), p, prio in zip(requests, param_list, priorities):
            parent = RequestOutput(request_id=str(next(self._ids)), prompt=text, prompt_token_ids=token_ids)
            results.append(parent)
            for index in range(p.n):
                # The n samples share one prompt: the first computes its logprobs for all.
                child_params = replace(
                    p,
                    n=1,
                    seed=None if p.seed is None else p.seed + index,
                    prompt_logprobs=p.prompt_logprobs if index == 0 else None,
                )
                child_id = f"{parent.request_id}-{index}"
                out = CompletionOutput(
                    index=index,
                    text="",
                    token_ids=[],
                    logprobs=[] if p.logprobs is not None else None,
                    finish_reason=None,
                )
                parent.outputs.append(out)
                children[child_id] = _Child(out, parent, child_params)
                self.engine.add_request(child_id, token_ids, child_params, now, prio, cache_salt)
        while self.engine.has_unfinished_requests():
            for core_output in self.engine.step():
                child = children[core_output.request_id]
                if not child.finished:
                    self._absorb(child, core_output)
                if child.stopped_text is not None and not child.finished:
                    child.finished = True
                    self.engine.abort_requests([core_output.request_id])
        for child in children.values():
            child.output.text = (
                child.stopped_text
                if child.stopped_text is not None
                else self._detokenize(child.output.token_ids, child.params)
            )
        return results

    def _with_bad_word_ids(self, params: SamplingParams) -> SamplingParams:
        """params with its bad_words tokenized as the frontend tokenizes them: each word with its
        leading whitespace removed, and again after one space (a word inside text), as vLLM does."""
        if not params.bad_words:
            return params
        params.validate()
        sequences = [list(ids) for ids in params.bad_words_token_ids or ()]
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids not in sequences:
                    sequences.append(ids)
        return replace(params, bad_words_token_ids=sequences)

    def _detokenize(self, token_ids: list[int], params: SamplingParams) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)

    def _tokenize(self, prompt: PromptType) -> _Prompt:
        if isinstance(prompt, str):
            return _Prompt(prompt, self.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if "prompt_token_ids" in prompt:
                return _Prompt(None, [int(t) for t in prompt["prompt_token_ids"]], salt)
            if isinstance(prompt.get("prompt"), str):
                text = prompt["prompt"]
                return _Prompt(text, self.tokenizer.encode(text, add_special_tokens=True), salt)
        raise InvalidRequestError(
            "a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}", param="prompt"
        )

    def _absorb(self, child: _Child, core_output: EngineOutput) -> None:
        out = child.output
        kept = 0
        for token_id in core_output.new_token_ids:
            out.token_ids.append(token_id)
            kept += 1
            if self._cut_at_stop_string(child):
                break
        if out.logprobs is not None and core_output.new_logprobs:
            for entry in core_output.new_logprobs[:kept]:
                out.logprobs.append(self._logprob_dict(entry))
                out.cumulative_logprob = (out.cumulative_logprob or 0.0) + entry.logprobs[0]
        if core_output.prompt_logprobs is not None:
            child.parent.prompt_logprobs = [None, *map(self._logprob_dict, core_output.prompt_logprobs)]
        child.parent.num_cached_tokens = max(child.parent.num_cached_tokens, core_output.num_cached_tokens)
        if child.stopped_text is None and core_output.finish_reason is not None:
            out.finish_reason = core_output.finish_reason
            out.stop_reason = core_output.stop_reason
            out.error, out.error_param = core_output.error, core_output.invalid_param
        child.finished = core_output.finish_reason is not None

    def _cut_at_stop_string(self, child: _Child) -> bool:
        """Whether the newest token completed one of the stop strings; if so, end the output there.

        As in vLLM, stop strings are looked for once min_tokens are out, only in text that the
        newest token touched, and the earliest match wins.
        """
        params, out = child.params, child.output
        if not params.stop or len(out.token_ids) < params.min_tokens:
            return False
        text = self._detokenize(out.token_ids, params)
        # The earlier text, less the replacement characters that an unfinished UTF-8 sequence shows.
        before = len(self._detokenize(out.token_ids[:-1], params).rstrip("\ufffd"))
        matches = []
        for stop in params.stop:
            at = text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0:
                matches.append((at, stop))
        if not matches:
            return False
        at, stop = min(matches)
        child.stopped_text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
        out.finish_reason = "stop"
        out.stop_reason = stop
        return True

    def _logprob_dict(self, entry: Logprobs) -> dict[int, Logprob]:
        ranked = {entry.token_ids[0]: Logprob(entry.logprobs[0], entry.sampled_rank)}
        for rank, (token_id, logprob) in enumerate(zip(entry.token_ids[1:], entry.logprobs[1:]), start=1):
            ranked.setdefault(token_id, Logprob(logprob, rank))
        for token_id, lp in ranked.items():
            lp.decoded_token = self.tokenizer.decode([token_id])
        return ranked

"""Checks a request against the served model before anything is scheduled."""

from __future__ import annotations

from sluice.errors import InvalidRequestError
from sluice.sampling_params import SamplingParams


def validate_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    max_model_len: int,
    vocab_size: int,
    eos_token_ids: tuple[int, ...] = (),
    cache_salt: str | None = None,
) -> None:
    params.validate()
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidRequestError("cache_salt must be a non-empty string", param="cache_salt")
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if len(prompt_token_ids) > max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(prompt_token_ids)} tokens, more than max_model_len ({max_model_len})",
            param="prompt",
        )
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})", param="prompt"
        )
    for token_id in list(params.logit_bias or ()) + list(params.stop_token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"token id {token_id} in logit_bias or stop_token_ids is outside the vocabulary "
                f"[0, {vocab_size})",
                param="logit_bias" if token_id in (params.logit_bias or {}) else "stop_token_ids",
            )
    bad = next((t for t in params.allowed_token_ids or () if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"token id {bad} in allowed_token_ids is outside the vocabulary [0, {vocab_size})",
            param="allowed_token_ids",
        )
    bad = next((t for ids in params.bad_words_token_ids or () for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"token id {bad} in a bad word is outside the vocabulary [0, {vocab_size})", param="bad_words"
        )
    budget = params.thinking_budget
    tags = [] if budget is None else budget.start_token_ids + budget.end_token_ids
    bad = next((t for t in tags if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"token id {bad} in the thinking budget's tags is outside the vocabulary [0, {vocab_size})",
            param="thinking_token_budget",
        )
    if params.allowed_token_ids is not None and params.min_tokens > 0:
        # Under min_tokens the stop ids and EOS are suppressed: nothing at all could be sampled.
        suppressed = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        if set(params.allowed_token_ids) <= suppressed:
            raise InvalidRequestError(
                "allowed_token_ids holds only stop or end-of-sequence tokens, which min_tokens "
                f"({params.min_tokens}) forbids: no token could be sampled",
                param="allowed_token_ids",
            )

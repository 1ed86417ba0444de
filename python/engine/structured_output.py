"""Structured output in the engine core: compile a request's constraint, follow its tokens, mask the next one.

The masks come from llguidance (chosen over xgrammar by bench/structured_backend_choice.py; the
figures are in docs/structured_output.md). A constraint is compiled when the request is added, so
one that cannot compile is rejected as invalid before it runs. Each accepted token advances the
request's matcher; before a step samples a structured request, its next-token bitmask is computed
here and sent to the workers after the step itself, so the mask is computed while the forward runs.

JSON is compiled with compact separators and no free whitespace: a model cannot wander into blank
lines that eat max_tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import llguidance
import numpy as np

from sluice.errors import InvalidRequestError
from sluice.sampling_params import StructuredOutput

# Compact JSON: "," and ":" with no whitespace around them, and none allowed between tokens.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
# Any JSON value that is an object, for response_format json_object.
_ANY_OBJECT_SCHEMA = '{"type": "object"}'


def grammar_text(constraint: StructuredOutput) -> str:
    """The llguidance grammar of a constraint; InvalidRequestError if its spec is malformed."""
    grammar = _constraint_grammar(constraint.kind, constraint.spec)
    return _after(constraint.after, grammar) if constraint.after else grammar


def _after(marker: str, grammar: str) -> str:
    """`grammar` preceded by free text up to and including `marker`'s first occurrence: a grammar of
    two, the first naming the second (`@answer`), as llguidance composes grammars."""
    try:
        # llguidance's builders answer a top-level grammar as JSON; a Lark grammar is its own text.
        answer = json.loads(grammar)["grammars"][0]
    except json.JSONDecodeError:
        answer = {"lark_grammar": grammar}
    free = f"start: free @answer\nfree[stop={json.dumps(marker)}]: /(?s:.*)/\n"
    grammars = [{"name": "free_then_answer", "lark_grammar": free}, {**answer, "name": "answer"}]
    return json.dumps({"grammars": grammars})


def _constraint_grammar(kind: str, spec: str) -> str:
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise _invalid(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise _invalid("a JSON schema must be an object or a boolean")
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT_SCHEMA, overrides=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = _choices(spec)
        # A regex of the choices, each escaped: they are alternatives, never patterns.
        return llguidance.LLMatcher.grammar_from_regex("|".join(_escape_regex(c) for c in choices))
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(spec)
    raise _invalid(f"unknown structured output kind {kind!r}")


def _choices(spec: str) -> list[str]:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise _invalid(f"choice must be a JSON array of strings: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise _invalid("choice must be a non-empty array of strings")
    return choices


def _escape_regex(text: str) -> str:
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}/-" else ch for ch in text)


def _invalid(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param="structured_output")


class GrammarTokenizer:
    """The served model's vocabulary as llguidance sees it, built on first use (about a second)."""

    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_path = Path(model_path)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None

    def get(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            text = (self.model_path / "tokenizer.json").read_text()
            self._tokenizer = llguidance.LLTokenizer(
                text, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
        return self._tokenizer

    def compile(self, constraint: StructuredOutput) -> RequestGrammar:
        """A matcher at the start of the constraint; InvalidRequestError if it does not compile."""
        grammar = grammar_text(constraint)
        tokenizer = self.get()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise _invalid(f"the {constraint.kind} constraint does not compile: {error.strip()}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise _invalid(f"the {constraint.kind} constraint does not compile: {matcher.get_error()}")
        return RequestGrammar(matcher, mask_words(self.vocab_size))


def mask_words(vocab_size: int) -> int:
    """32-bit words per bitmask row: bit t of word t // 32 allows token t."""
    return -(-vocab_size // 32)


@dataclass(slots=True)
class RequestGrammar:
    """One request's matcher: it has consumed exactly the request's output tokens so far."""

    matcher: llguidance.LLMatcher
    num_words: int

    def accept_token(self, token_id: int) -> bool:
        """Whether the matcher took the token. The mask allowed every token the worker could sample,
        unless the request's other masks (allowed_token_ids, min_tokens' suppression of stop and EOS
        tokens) left the row no token at all, and the worker took one anyway."""
        return bool(self.matcher.consume_token(token_id))

    @property
    def error(self) -> str:
        return str(self.matcher.get_error())

    @property
    def is_terminated(self) -> bool:
        """The constraint is complete and nothing may follow it."""
        return self.matcher.is_stopped()

    def fill_bitmask(self, row: np.ndarray) -> None:
        assert row.dtype == np.int32 and row.shape == (self.num_words,) and row.flags.c_contiguous
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)


class RowMask(Protocol):
    """What fills one request's bitmask row: its matcher, or its thinking budget's forced token."""

    def fill_bitmask(self, row: np.ndarray) -> None: ...


def batch_bitmask(masks: Sequence[RowMask | None], num_words: int) -> bytes:
    """The next-token bitmasks of `masks`, one row each, as little-endian int32 words; None
    allows every token."""
    rows = np.full((len(masks), num_words), -1, dtype="<i4")
    for row, mask in zip(rows, masks, strict=True):
        if mask is not None:
            mask.fill_bitmask(row)
    return rows.tobytes()

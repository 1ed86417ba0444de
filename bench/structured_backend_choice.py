"""Which grammar library masks tokens faster on this machine: llguidance or xgrammar.

For a few JSON schemas and a regex, on the served model's vocabulary: the time to compile the
constraint (cold, no cache), and the time per token to compute the next-token bitmask while the
matcher walks a valid output token by token. Medians of --repeats runs, printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar
from transformers import AutoTokenizer

# (name, kind, constraint, an output that satisfies it)
CASES: list[tuple[str, str, Any, str]] = [
    (
        "flat object",
        "json",
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        '{"name":"Ada Lovelace","age":36}',
    ),
    (
        "nested+enum+array",
        "json",
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 0, "maximum": 1000},
                        "role": {"enum": ["admin", "editor", "viewer"]},
                    },
                    "required": ["id", "role"],
                },
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            },
            "required": ["user", "tags"],
        },
        '{"user":{"id":42,"role":"editor"},"tags":["alpha","beta","gamma"]}',
    ),
    ("regex date", "regex", r"\d{4}-\d{2}-\d{2}", "2024-05-17"),
]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def run_llguidance(tok: Any, vocab: int, kind: str, constraint: Any, ids: list[int]) -> tuple[float, float]:
    ll_tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

    def compile_it() -> Any:
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(constraint), overrides=options)
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(constraint)
        matcher = llguidance.LLMatcher(ll_tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    compile_s, matcher = timed(compile_it)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    mask_s = 0.0
    for token in ids:
        dt, _ = timed(lambda: llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0))
        mask_s += dt
        assert matcher.consume_token(token), matcher.get_error()
    return compile_s, mask_s / len(ids)


def run_xgrammar(tok: Any, vocab: int, kind: str, constraint: Any, ids: list[int]) -> tuple[float, float]:
    info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    # A fresh compiler each time: its cache would hide the compile cost.
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile_it() -> Any:
        if kind == "json":
            compiled = compiler.compile_json_schema(
                json.dumps(constraint), any_whitespace=False, separators=(",", ":")
            )
        else:
            compiled = compiler.compile_regex(constraint)
        return xgrammar.GrammarMatcher(compiled)

    compile_s, matcher = timed(compile_it)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    mask_s = 0.0
    for token in ids:
        dt, _ = timed(lambda: matcher.fill_next_token_bitmask(bitmask, 0))
        mask_s += dt
        assert matcher.accept_token(token)
    return compile_s, mask_s / len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=os.environ.get("SLUICE_MODEL_DIR"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(args.model)
    with open(os.path.join(args.model, "config.json")) as config:
        vocab = int(json.load(config)["vocab_size"])
    print(f"vocab {vocab}; medians of {args.repeats} runs; compile ms (cold), mask us per token")
    print(
        f"{'case':20} {'tokens':>6} {'llg compile':>12} {'xgr compile':>12} {'llg mask':>10} {'xgr mask':>10}"
    )
    for name, kind, constraint, text in CASES:
        ids = tok.encode(text, add_special_tokens=False)
        results: dict[str, list[tuple[float, float]]] = {"llg": [], "xgr": []}
        for _ in range(args.repeats):
            results["llg"].append(run_llguidance(tok, vocab, kind, constraint, ids))
            results["xgr"].append(run_xgrammar(tok, vocab, kind, constraint, ids))
        med = {k: [statistics.median(x[i] for x in v) for i in range(2)] for k, v in results.items()}
        print(
            f"{name:20} {len(ids):>6} {med['llg'][0] * 1e3:>12.1f} {med['xgr'][0] * 1e3:>12.1f} "
            f"{med['llg'][1] * 1e6:>10.1f} {med['xgr'][1] * 1e6:>10.1f}"
        )


if __name__ == "__main__":
    main()

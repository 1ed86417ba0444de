"""The hybrid KV cache's figure: a Gemma-2-shaped random-init model of about 1B parameters, at --context
tokens of context (8,192 by default), with the hybrid allocator on (sluice/kv_cache_groups.py: the
sliding-window layers keep only their window's blocks) against --no-hybrid-kv-cache (every layer holds
the whole context), both engines resident, alternating in one run.

The issue's figure: KV cache memory at most 0.6x that of every layer global, and decode at least as fast.
Gemma 2 makes every other layer global and gives the others a window of 4,096 tokens, so at 8,192 tokens
the held bytes cannot fall below (L + window + block) / 2L, about 0.75: the script prints that bound,
computed from the model's config and the engine's groups, beside the measurement, and the context length
at which the bound falls to 0.6. `--pattern 6 --window 512` tries Gemma 3's layout (five in six layers
windowed) on the same weights.

Each engine prefills the prompt (about --context - 80 random token ids, seeded) once, generating
--new-tokens greedy tokens with ignore_eos; the KV bytes held are the blocks its request holds (every
group's, released ones not counted) x the bytes of a block, at the last step and the most over steps.
Decode is then timed on the same prompt, a prefix-cache hit but for the last block, as W2 times it:
ms/token = (T(n) - T(1)) / (n - 1), medians of --runs.

  python bench/hybrid_kv_cache.py [--context 8192] [--new-tokens 48] [--runs 3] [--model-dir DIR]
         [--window 4096] [--pattern 2] [--kv-cache-memory 2]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from transformers import Gemma2Config

from engine import LLM, SamplingParams
from harness import Workload, log, time_workload
from make_w4_model import attention_shapes, build, mlp_shapes
from sluice.config import sluice_cache_dir
from sluice.cpu_tiers import cpu_flags
from sluice.default_model import prepare_default_model
from sluice.frontend_seam import EngineOutput
from sluice.kv_cache_groups import KVCacheGroups, model_kv_cache_groups
from sluice.kv_cache_layout import kv_cache_bytes_per_block
from sluice.model_spec import read_model_spec

BLOCK_SIZE = 16
PROMPT_SEED = 0
# The prompt leaves this many tokens of the context for the generated ones.
CONTEXT_MARGIN = 80
# Token ids drawn below this, clear of the tokenizer's special ones at the top.
VOCAB_SIZE = 49152
ISSUE_RATIO = 0.6
# A step longer than this (a prefill chunk) is logged as it ends.
PROGRESS_STEP_S = 5.0
HYBRID = "hybrid"
ALL_GLOBAL = "no hybrid"


def gemma2_config(window: int, pattern: int, context: int) -> Gemma2Config:
    """Gemma 2's design at about 1B parameters; every `pattern`-th layer global, the others `window` wide."""
    layers = 26
    return Gemma2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=1536,
        intermediate_size=6144,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        sliding_window=window,
        layer_types=["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)],
        query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        max_position_embeddings=max(8192, context),
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="bfloat16",
        architectures=["Gemma2ForCausalLM"],
    )


def tensor_shapes(config: Gemma2Config) -> dict[str, tuple[int, ...]]:
    """Every weight of a tied-embedding Gemma 2, as the Hugging Face checkpoint names it."""
    hidden = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        shapes |= attention_shapes(config, layer)
        shapes[f"{layer}.pre_feedforward_layernorm.weight"] = (hidden,)
        shapes[f"{layer}.post_feedforward_layernorm.weight"] = (hidden,)
        shapes |= mlp_shapes(f"{layer}.mlp", hidden, config.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def default_model_dir(window: int, pattern: int) -> Path:
    suffix = "" if (window, pattern) == (4096, 2) else f"-w{window}-p{pattern}"
    return sluice_cache_dir() / "bench" / f"gemma2-1b-random{suffix}"


def machine_flags() -> str:
    """The AVX-512 flags this CPU reports, or that it has AVX2 only."""
    flags = cpu_flags()
    avx512 = sorted(flag for flag in flags if flag.startswith("avx512"))
    if avx512:
        return " ".join(avx512)
    return "AVX2 only" if "avx2" in flags else "no AVX2"


def bound_ratio(groups: KVCacheGroups, num_layers: int, length: int) -> float:
    """The least that hybrid can hold against every layer global, for a request of `length` tokens: a full
    group holds every token, a windowed one its window and a block."""
    held = sum(min(length, window + BLOCK_SIZE) if window else length for window in groups.windows)
    return held * groups.num_slots / (num_layers * length)


def window_at_ratio(groups: KVCacheGroups, num_layers: int, length: int, ratio: float) -> int | None:
    """The widest window (in whole blocks) that brings the bound at `length` tokens to `ratio`, the
    groups' layout kept; None where even no window does not."""
    for window in range(length, -1, -BLOCK_SIZE):
        narrowed = [window if w else 0 for w in groups.windows]
        held = sum(min(length, w + BLOCK_SIZE) if w else length for w in narrowed)
        if held * groups.num_slots / (num_layers * length) <= ratio:
            return window
    return None


def context_at_ratio(groups: KVCacheGroups, num_layers: int, ratio: float) -> int | None:
    """The shortest context, in whole blocks, at which the bound falls to `ratio`; None where it never does."""
    windowed = [window for window in groups.windows if window]
    full = len(groups.windows) - len(windowed)
    # Past every window the bound tends to full groups' share of the layers.
    if full * groups.num_slots / num_layers >= ratio:
        return None
    length = BLOCK_SIZE
    while bound_ratio(groups, num_layers, length) > ratio:
        length += BLOCK_SIZE
    return length


@dataclass
class Engine:
    name: str
    llm: LLM
    bytes_per_block: int
    num_blocks: int
    # Blocks the running request holds after each step.
    held: list[int] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    ms_per_token: list[float] = field(default_factory=list)


def start_engine(name: str, model: Path, args: argparse.Namespace) -> Engine:
    log(f"[{time.strftime('%H:%M:%S')}] starting {name}")
    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        max_model_len=args.context,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        hybrid_kv_cache=name == HYBRID,
        kv_cache_memory=args.kv_cache_memory,
    )
    spec = read_model_spec(str(model))
    groups = model_kv_cache_groups(spec, args.context, name == HYBRID)
    manager = llm.engine.scheduler.kv_cache_manager
    engine = Engine(
        name, llm, kv_cache_bytes_per_block(llm.config, spec, groups), manager.block_pool.num_blocks
    )
    step = llm.engine.step

    def recording_step() -> list[EngineOutput]:
        start = time.perf_counter()
        outputs = step()
        engine.step_times.append(time.perf_counter())
        if engine.step_times[-1] - start > PROGRESS_STEP_S:
            log(f"[{time.strftime('%H:%M:%S')}]   {name}: step of {engine.step_times[-1] - start:.1f} s")
        engine.held.append(sum(len(manager.held_blocks(request)) for request in manager.req_to_blocks))
        return outputs

    llm.engine.step = recording_step
    return engine


def generator(engine: Engine, logprobs: int | None = None) -> Callable[[list[list[int]], int], list[int]]:
    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
        outputs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for output in outputs:
            completion = output.outputs[0]
            if completion.logprobs is not None:
                values = [
                    entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids)
                ]
                if not all(math.isfinite(v) for v in values):
                    log(f"  {engine.name}: non-finite logprobs {values[:8]}")
            if completion.error:
                log(f"  {engine.name}: request failed: {completion.error}")
        return [len(output.outputs[0].token_ids) for output in outputs]

    return generate


def prefill(engine: Engine, prompt: list[int], new_tokens: int) -> dict[str, float]:
    """The first run: the whole prompt computed, new_tokens generated; the KV bytes held, per step."""
    engine.held.clear()
    engine.step_times.clear()
    log(f"[{time.strftime('%H:%M:%S')}] {engine.name}: prefill of {len(prompt)} tokens, {new_tokens} out")
    start = time.perf_counter()
    [length] = generator(engine, logprobs=1)([prompt], new_tokens)
    elapsed = time.perf_counter() - start
    # The step that finishes the request frees its blocks: its last holding step is the run's end.
    holding = [held for held in engine.held if held]
    log(
        f"[{time.strftime('%H:%M:%S')}] {engine.name}: {length} tokens in {elapsed:.1f} s, "
        f"{len(engine.held)} steps, {holding[-1]} blocks held at the end"
    )
    return {
        "end_bytes": holding[-1] * engine.bytes_per_block,
        "max_bytes": max(holding) * engine.bytes_per_block,
        "end_blocks": holding[-1],
        "first_run_s": elapsed,
    }


def random_prompt(length: int) -> list[int]:
    rng = random.Random(PROMPT_SEED)
    return [rng.randrange(3, VOCAB_SIZE - 64) for _ in range(length)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--context", type=int, default=8192, help="max_model_len, and the prompt's length + 80"
    )
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens generated per run")
    parser.add_argument("--runs", type=int, default=3, help="timed decode runs per engine (medians)")
    parser.add_argument("--window", type=int, default=4096, help="the windowed layers' sliding_window")
    parser.add_argument("--pattern", type=int, default=2, help="every PATTERN-th layer global (Gemma 3: 6)")
    parser.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB of KV cache per engine")
    parser.add_argument("--model-dir", type=Path, default=None, help="the model's folder, built once")
    args = parser.parse_args()
    if args.new_tokens < 2 or args.context <= CONTEXT_MARGIN + args.new_tokens:
        parser.error("--new-tokens must be at least 2, and --context longer than the prompt margin")
    return args


def main() -> None:
    args = parse_args()
    print(f"CPU flags: {machine_flags()}")
    config = gemma2_config(args.window, args.pattern, args.context)
    model_dir = args.model_dir or default_model_dir(args.window, args.pattern)
    log(f"[{time.strftime('%H:%M:%S')}] model folder {model_dir}")
    build(model_dir, prepare_default_model(), config, tensor_shapes(config))

    spec = read_model_spec(str(model_dir))
    groups = model_kv_cache_groups(spec, args.context, True)
    layers = spec.num_layers
    prompt = random_prompt(args.context - CONTEXT_MARGIN)
    final_length = len(prompt) + args.new_tokens
    bound = bound_ratio(groups, layers, final_length)
    # Windows as wide as the context are no windows: the layout at any length comes from a long one.
    long_groups = model_kv_cache_groups(spec, 1 << 30, True)
    at_ratio = context_at_ratio(long_groups, layers, ISSUE_RATIO)
    window_needed = window_at_ratio(long_groups, layers, final_length, ISSUE_RATIO)
    print(
        f"model: Gemma 2 shape, {layers} layers, window {args.window}, every {args.pattern} global; "
        f"hybrid groups {groups.windows}, {groups.num_slots} layers a block"
    )
    print(
        f"context {args.context}: prompt {len(prompt)} + {args.new_tokens} out = {final_length} tokens; "
        f"bound on the KV ratio from the config: {bound:.3f}"
    )
    print(
        f"the bound reaches {ISSUE_RATIO} at "
        + (f"{at_ratio} tokens of context" if at_ratio else "no context length (too few windowed layers)")
        + (
            f"; at {final_length} tokens, with a window of at most {window_needed}"
            if window_needed is not None
            else ""
        )
    )

    engines = [start_engine(name, model_dir, args) for name in (HYBRID, ALL_GLOBAL)]
    memory = {engine.name: prefill(engine, prompt, args.new_tokens) for engine in engines}
    workload = Workload("hybrid", [prompt], args.new_tokens, single_stream=True)
    for run in range(args.runs):
        for engine in engines if run % 2 == 0 else engines[::-1]:
            timed = time_workload(generator(engine), workload)
            engine.ms_per_token.append(timed["ms_per_token"])
            log(
                f"[{time.strftime('%H:%M:%S')}] run {run + 1}/{args.runs} {engine.name}: "
                f"{timed['ms_per_token']:.1f} ms/token, first token {timed['first_token_ms']:.0f} ms"
            )
    for engine in engines:
        engine.llm.engine.shutdown()

    print(
        f"\n{'':10} {'bytes/block':>11} {'blocks':>7} {'KV MB end':>10} {'KV MB max':>10} "
        f"{'run 1 s':>10} {'ms/token':>9}  (median of {args.runs})"
    )
    for engine in engines:
        m = memory[engine.name]
        print(
            f"{engine.name:10} {engine.bytes_per_block:>11} {m['end_blocks']:>7.0f} {m['end_bytes'] / 1e6:>10.1f} "
            f"{m['max_bytes'] / 1e6:>10.1f} {m['first_run_s']:>10.1f} {statistics.median(engine.ms_per_token):>9.1f}"
        )
    on, off = memory[HYBRID], memory[ALL_GLOBAL]
    speed = statistics.median(engines[0].ms_per_token) / statistics.median(engines[1].ms_per_token)
    ratio = on["end_bytes"] / off["end_bytes"]
    print(
        f"\nhybrid / no hybrid: KV bytes at the end {ratio:.3f} (max over steps "
        f"{on['max_bytes'] / off['max_bytes']:.3f}; bound {bound:.3f}, issue's figure <= {ISSUE_RATIO}: "
        f"{'met' if ratio <= ISSUE_RATIO else 'not met'}); ms/token {speed:.3f} "
        f"({'as fast or faster' if speed <= 1.0 else 'slower'}; per run "
        f"{[round(v, 1) for v in engines[0].ms_per_token]} vs {[round(v, 1) for v in engines[1].ms_per_token]})"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""The throughput cost of a thinking budget, in one run: the same greedy batch (--requests prompts,
--max-tokens each, ignore_eos) with no budget, with a budget it never reaches (only the steps whose token
may be forced carry a bitmask, so the thinking keeps async scheduling's overlap), and with a budget of
--budget tokens that forces `</think>` in every request. The default model through the offline API on
worker processes (the served engine's executor); the three legs of a round run one after another on one
engine, for --repeats rounds. Prints each leg's median output tokens per second and its ratio to no budget,
and writes them as JSON.

    flock -x /tmp/sluice-bench.lock .venv/bin/python bench/thinking_budget_cost.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from harness import log, make_output_folders
from sluice.default_model import prepare_default_model

RESULTS = Path(__file__).resolve().parent / "results" / "thinking_budget_cost.json"
NEVER = 1_000_000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=32, help="the budget that every request reaches")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    assert args.repeats >= 3, "medians of at least 3 runs"

    from engine import LLM
    from sluice.sampling_params import SamplingParams, ThinkingBudget

    llm = LLM(model=str(prepare_default_model()), executor="mp", enable_prefix_caching=False)
    end = llm.tokenizer.encode("</think>", add_special_tokens=False)

    def params(budget: int | None) -> SamplingParams:
        thinking = None if budget is None else ThinkingBudget(budget, start_token_ids=[], end_token_ids=end)
        return SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, thinking_budget=thinking
        )

    legs = {
        "no budget": params(None),
        "budget never reached": params(NEVER),
        f"budget {args.budget}": params(args.budget),
    }
    rates: dict[str, list[float]] = {leg: [] for leg in legs}
    llm.generate(["Warm up."] * args.requests, params(None))
    for repeat in range(args.repeats):
        # Fresh prompts each round, the same for every leg.
        prompts = [f"Round {repeat}, question {i}: explain how tides work." for i in range(args.requests)]
        for leg, leg_params in legs.items():
            start = time.perf_counter()
            outputs = llm.generate(prompts, leg_params)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            assert tokens == args.requests * args.max_tokens, (leg, tokens)
            rates[leg].append(tokens / seconds)
            log(f"round {repeat + 1}/{args.repeats} {leg}: {tokens / seconds:.1f} tokens/s")
    llm.engine.shutdown()
    base = statistics.median(rates["no budget"])
    result = {
        leg: {
            "tokens_per_s": statistics.median(values),
            "ratio": statistics.median(values) / base,
            "runs": values,
        }
        for leg, values in rates.items()
    }
    for leg, figures in result.items():
        print(f"{leg:>22}: {figures['tokens_per_s']:8.1f} tokens/s  {figures['ratio']:.3f}x no budget")
    make_output_folders(args.json)
    args.json.write_text(
        json.dumps({"args": vars(args) | {"json": str(args.json)}, "legs": result}, indent=2)
    )


if __name__ == "__main__":
    main()

"""Sluice's side of the offline benchmark: the same protocol as vllm_driver.py, through `LLM`.

Loads one model (bf16, max_model_len 2048, prefix caching off) with the engine switches given,
warms up, then answers {"workload": "W1"} lines on stdin with that workload's figure.

  python bench/sluice_driver.py --model DIR [--no-async-scheduling] [--enforce-eager]
                                [--executor mp|inproc] [--num-threads N] [--cpu-bind auto|none|LIST]
"""

from __future__ import annotations

import argparse

from harness import run_command, serve_json_lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--executor", default="mp", choices=["mp", "inproc"])
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--cpu-bind", default="auto")
    parser.add_argument("--omp-spin-count", default="auto")
    args = parser.parse_args()

    from engine import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        max_model_len=2048,
        enable_prefix_caching=False,
        kv_cache_memory=1.0,
        async_scheduling=args.async_scheduling,
        enforce_eager=args.enforce_eager,
        executor=args.executor,
        num_threads=args.num_threads,
        cpu_bind=args.cpu_bind,
        omp_spin_count=args.omp_spin_count,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [len(r.outputs[0].token_ids) for r in results]

    serve_json_lines(lambda command: run_command(generate, command))


if __name__ == "__main__":
    main()

"""Sluice's side of the offline benchmark: the same protocol as vllm_driver.py, through `LLM`.

Loads one model (bf16, max_model_len 2048, prefix caching off, a 1 GiB KV cache, unless the
options say otherwise) with the engine options given (any of `sluice generate`'s, such as
--no-async-scheduling, --enforce-eager or --no-packed-linear), warms up, then answers
{"workload": "W1"} lines on stdin with that workload's figure.

  python bench/sluice_driver.py --model DIR [ENGINE OPTIONS]
"""

from __future__ import annotations

import argparse

from harness import run_command, serve_json_lines


def main() -> None:
    from sluice.engine_args import add_engine_arguments, config_from_args

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_arguments(parser)
    parser.set_defaults(
        dtype="bfloat16", max_model_len=2048, enable_prefix_caching=False, kv_cache_memory=1.0
    )
    args = parser.parse_args()
    if args.model is None:
        parser.error("--model is required")

    from engine import LLM, SamplingParams

    llm = LLM.from_config(config_from_args(args))

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [len(r.outputs[0].token_ids) for r in results]

    serve_json_lines(lambda command: run_command(generate, command))


if __name__ == "__main__":
    main()

"""The vLLM peer's side of the offline benchmark: run with vLLM's own venv python (its env, see README).

Loads one model into vLLM's offline `LLM` (bf16, max_model_len 2048, prefix caching off), warms
it up, then answers commands on stdin, one JSON line each, such as {"workload": "W1"}: it runs
the workload once (token-id prompts, greedy, ignore_eos) and replies with its figure. Started by
compare_offline.py; standard library and vLLM only, so that it runs where Sluice is not installed.

  VENV/bin/python bench/vllm_driver.py --model DIR
"""

from __future__ import annotations

import argparse
import os

from harness import run_command, serve_json_lines

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=2048, enable_prefix_caching=False, seed=0)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        return [len(r.outputs[0].token_ids) for r in llm.generate(inputs, params, use_tqdm=False)]

    serve_json_lines(lambda command: run_command(generate, command))


if __name__ == "__main__":
    main()

"""N-gram speculative decoding: single-stream ms per token with it on and off, on repetitive text and W2.

Three engines on the default model run in this one process, alternating run by run so that the
machine's noise hits them alike: speculation off (the default, async scheduling on), off with
async scheduling off (what --speculative gives up: it runs one step in flight), and
`--speculative ngram`. ms/token is single-stream, by the difference method
(T(n) - T(1)) / (n - 1), greedy with ignore_eos, medians over --runs. Also printed: the
acceptance rate per workload, and the proposer's cost per call on a long context (it runs in the
engine core's scheduling, between steps).

  python bench/spec_decode.py [--runs 3] [--k 4] [--lock /tmp/sluice-bench.lock]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine import LLM, SamplingParams
from engine.ngram_proposer import NgramProposer
from harness import Workload, bench_lock, log, time_workload, w2_prompt
from sluice.config import ModelConfig, SchedulerConfig, SluiceConfig, SpeculativeConfig
from sluice.default_model import prepare_default_model

RESULTS = Path(__file__).resolve().parent / "results" / "issue11" / "spec_decode.json"
CODE = """def parse_config(path):
    with open(path) as handle:
        lines = handle.read().splitlines()
    config = {}
    for line in lines:
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config
"""
ARTICLE = (
    'The committee met on Tuesday. "We will not raise the fees this year," said the chair, Ana Ruiz. '
    '"The reserve covers the shortfall, and the members voted for stability." The treasurer added: '
    '"Spending on the library rose by four percent, but the roof repairs came in under budget." '
    'A member asked about the new hall. "Construction starts in spring," Ruiz answered.'
)
TASKS = {
    "code edit": f"Rename the function parse_config to load_settings and return the whole code:\n\n{CODE}",
    "summary with quotes": f"Summarise this report, quoting the chair and the treasurer word for word:\n\n"
    f"{ARTICLE}",
}
SYSTEMS = ("off", "off, sync", "ngram")


def chat_prompt(llm: LLM, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    encoded = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(encoded["input_ids"])


def make_generate(llm: LLM):
    def generate(prompts: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [len(out.outputs[0].token_ids) for out in outputs]

    return generate


def proposer_us(k: int, context: int = 2048, calls: int = 200) -> float:
    """Median microseconds of one proposal over a context of `context` repetitive tokens."""
    tokens = [i % 97 for i in range(context)]
    proposer = NgramProposer(2, 4)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        proposer.propose(tokens, k)
        times.append(1e6 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    parser.add_argument("--task-output", type=int, default=128)
    parser.add_argument("--w2-output", type=int, default=256)
    parser.add_argument("--lock", default=os.environ.get("SLUICE_BENCH_LOCK"))
    args = parser.parse_args()

    model = ModelConfig(path=str(prepare_default_model()), max_model_len=1024)
    configs = {
        "off": SluiceConfig(model=model),
        "off, sync": SluiceConfig(model=model, scheduler=SchedulerConfig(async_scheduling=False)),
        "ngram": SluiceConfig(
            model=model, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=args.k)
        ),
    }
    with bench_lock(args.lock, exclusive=False):
        log("loading three engines on the default model (bf16)")
        engines = {name: LLM.from_config(config) for name, config in configs.items()}
    any_llm = engines["off"]
    workloads = {name: ([chat_prompt(any_llm, text)], args.task_output) for name, text in TASKS.items()}
    workloads["W2"] = ([w2_prompt()], args.w2_output)

    ms: dict[str, dict[str, list[float]]] = {w: {s: [] for s in SYSTEMS} for w in workloads}
    acceptance: dict[str, list[int]] = {w: [0, 0] for w in workloads}
    with bench_lock(args.lock, exclusive=True):
        for llm in engines.values():
            make_generate(llm)([workloads["W2"][0][0]], 4)
        for run in range(1, args.runs + 1):
            for name, (prompts, output) in workloads.items():
                workload = Workload(name, prompts, output, single_stream=True)
                for system, llm in engines.items():
                    before = llm.engine.stats()
                    result = time_workload(make_generate(llm), workload)
                    after = llm.engine.stats()
                    ms[name][system].append(result["ms_per_token"])
                    if system == "ngram" and run == 1:
                        acceptance[name] = [
                            after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
                            after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                        ]
                    log(f"run {run}/{args.runs} {name} {system}: {result['ms_per_token']:.2f} ms/token")
        cost_us = proposer_us(args.k)
    for llm in engines.values():
        llm.engine.shutdown()

    summary: dict[str, dict[str, float]] = {}
    print(f"single-stream ms/token, medians of {args.runs} runs; K = {args.k}, ngram window 2..4, bf16")
    print(f"{'workload':22} {'off':>8} {'off,sync':>9} {'ngram':>8} {'speed-up':>9} {'accepted':>9}")
    for name in workloads:
        medians = {system: statistics.median(ms[name][system]) for system in SYSTEMS}
        accepted, drafted = acceptance[name]
        rate = accepted / drafted if drafted else 0.0
        speedup = medians["off"] / medians["ngram"]
        summary[name] = {**{f"{s}_ms_per_token": v for s, v in medians.items()}, "speedup": speedup}
        summary[name]["acceptance_rate"] = rate
        print(
            f"{name:22} {medians['off']:8.2f} {medians['off, sync']:9.2f} {medians['ngram']:8.2f} "
            f"{speedup:8.2f}x {rate:8.0%}"
        )
    print(f"proposer: {cost_us:.0f} us per call on a 2048-token context")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {"runs": args.runs, "k": args.k, "workloads": summary, "raw_ms": ms, "proposer_us": cost_us},
            indent=2,
        )
        + "\n"
    )
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()

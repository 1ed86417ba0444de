"""What a stored conversation saves: the time to first token of a `previous_response_id` follow-up on
/v1/responses, against the same conversation sent whole to a server without the prefix cache.

One run, two `sluice serve` of the default model, one after the other (so that they never share the
cores): `cache on` (prefix caching, the default) and `cache off` (`--no-enable-prefix-caching`).
Each repetition is a fresh conversation: a long first turn (a document of about --document-words
words and a question), then a follow-up question.

- cache on: the first turn is answered and stored; the follow-up is sent as `previous_response_id`
  plus the new question, streamed. Its earlier turns come from the prefix cache, which its
  `cached_tokens` reports.
- cache off: the same conversation (the first answer as cache on gave it) is sent whole as input
  items, streamed.

TTFT is the time from sending to the first `response.output_text.delta`, through the `openai`
client. Medians of --repeats (at least 3) are printed with the ratio, and written to --out as JSON.

    .venv/bin/python bench/responses_followup.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

from harness import log, make_output_folders
from servers import Server, start_sluice

MODEL = "SmolLM2-135M-Instruct"
INSTRUCTIONS = "You are a helpful assistant. Answer in one sentence."
FIRST_QUESTION = "What is the document above about?"
FOLLOW_UP = "Name one word that the document uses twice."
ANSWER_TOKENS = 24
WORDS = [
    "river",
    "stone",
    "market",
    "winter",
    "lantern",
    "harbor",
    "orchard",
    "signal",
    "copper",
    "meadow",
    "thunder",
    "village",
    "bridge",
    "candle",
    "forest",
    "mirror",
    "garden",
    "engine",
    "silver",
    "window",
    "ladder",
    "basket",
    "island",
    "shadow",
    "morning",
]


def document(seed: int, words: int) -> str:
    """A text no other conversation of the run starts with."""
    rng = random.Random(seed)
    return f"Document {seed}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def first_turn_input(seed: int, words: int) -> str:
    return f"{document(seed, words)}\n\n{FIRST_QUESTION}"


def streamed_ttft(client: openai.OpenAI, **request: Any) -> tuple[float, Any]:
    """Seconds to the first text delta of a streamed response, and the finished response."""
    sent = time.perf_counter()
    first: float | None = None
    final: Any = None
    with client.responses.create(stream=True, **request) as stream:
        for event in stream:
            if first is None and event.type == "response.output_text.delta":
                first = time.perf_counter() - sent
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert first is not None and final is not None, "the stream had no text or did not finish"
    return first, final


def serve(name: str, extra: list[str], log_dir: Path) -> Server:
    server = start_sluice(
        name, None, ["--responses-store", str(log_dir / f"{name}.sqlite3"), *extra], log_dir
    )
    server.wait_ready()
    return server


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--document-words", type=int, default=900)
    parser.add_argument("--out", type=Path, default=Path("bench/results/responses_followup.json"))
    args = parser.parse_args()
    assert args.repeats >= 3, "medians of at least 3"
    make_output_folders(args.out)
    greedy: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_output_tokens": ANSWER_TOKENS}
    seeds = list(range(args.repeats))
    follow_up_ttft: list[float] = []
    cached: list[int] = []
    prompt_tokens: list[int] = []
    first_answers: list[str] = []
    with tempfile.TemporaryDirectory(prefix="sluice-bench-responses-") as folder:
        log_dir = Path(folder)
        server = serve("cache_on", ["--enable-prefix-caching"], log_dir)
        try:
            client = client_of(server)
            # A first request of its own, so that no measured one pays for warming up.
            client.responses.create(input="Hello", store=False, **greedy)
            for seed in seeds:
                first = client.responses.create(
                    input=first_turn_input(seed, args.document_words), instructions=INSTRUCTIONS, **greedy
                )
                first_answers.append(first.output_text)
                ttft, final = streamed_ttft(
                    client,
                    previous_response_id=first.id,
                    input=FOLLOW_UP,
                    instructions=INSTRUCTIONS,
                    **greedy,
                )
                follow_up_ttft.append(ttft)
                cached.append(final.usage.input_tokens_details.cached_tokens)
                prompt_tokens.append(final.usage.input_tokens)
                log(
                    f"cache on, conversation {seed}: TTFT {ttft * 1000:.1f} ms, {cached[-1]} of {prompt_tokens[-1]} cached"
                )
        finally:
            server.stop()
        whole_ttft: list[float] = []
        whole_cached: list[int] = []
        server = serve("cache_off", [], log_dir)
        try:
            client = client_of(server)
            client.responses.create(input="Hello", store=False, **greedy)
            for seed, answer in zip(seeds, first_answers, strict=True):
                conversation = [
                    {"role": "user", "content": first_turn_input(seed, args.document_words)},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": FOLLOW_UP},
                ]
                ttft, final = streamed_ttft(client, input=conversation, instructions=INSTRUCTIONS, **greedy)
                whole_ttft.append(ttft)
                whole_cached.append(final.usage.input_tokens_details.cached_tokens)
                log(
                    f"cache off, conversation {seed}: TTFT {ttft * 1000:.1f} ms, {final.usage.input_tokens} prompt tokens"
                )
        finally:
            server.stop()
    result = {
        "repeats": args.repeats,
        "prompt_tokens_median": statistics.median(prompt_tokens),
        "follow_up_cached_tokens_median": statistics.median(cached),
        "whole_cached_tokens_median": statistics.median(whole_cached),
        "follow_up_ttft_ms_median": statistics.median(follow_up_ttft) * 1000,
        "whole_ttft_ms_median": statistics.median(whole_ttft) * 1000,
    }
    result["ttft_ratio_whole_over_follow_up"] = (
        result["whole_ttft_ms_median"] / result["follow_up_ttft_ms_median"]
    )
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"follow-up (previous_response_id, cache on): TTFT {result['follow_up_ttft_ms_median']:.1f} ms median, "
        f"{result['follow_up_cached_tokens_median']:.0f} of {result['prompt_tokens_median']:.0f} prompt tokens cached"
    )
    print(
        f"whole conversation (cache off): TTFT {result['whole_ttft_ms_median']:.1f} ms median, "
        f"{result['whole_cached_tokens_median']:.0f} cached"
    )
    print(f"ratio: the follow-up's first token comes {result['ttft_ratio_whole_over_follow_up']:.1f}x sooner")


if __name__ == "__main__":
    main()

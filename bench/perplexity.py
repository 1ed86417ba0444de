"""Issue 27's quality figures: the perplexity of a fixed English text (bench/workloads/perplexity.txt,
written for this) under Sluice and under llama.cpp's llama-perplexity, on the same GGUF files of the
default model (a trained model), with the same chunking, and each against the bf16 folder's.

llama-perplexity's method, repeated for Sluice: the text is tokenized whole, cut into chunks of --ctx
tokens (the last partial chunk dropped), each chunk is one sequence, and only the second half of each
is scored: the negative log-likelihood of every token after position ctx / 2, from the logits of the
token before it. The perplexity is exp of the mean over every scored token. Sluice reads those
log-likelihoods from its prompt logprobs (SamplingParams.prompt_logprobs), one LLM per system, in this
process. The default model's tokenizer adds no BOS, so neither does either side.

  python bench/perplexity.py --llamacpp-dir DIR [--formats Q8_0,Q4_0,Q4_K_M] [--ctx 256] [--cpu-isa avx2]
         [--kv-cache-dtypes int8,fp8_e4m3] [--json F]

--kv-cache-dtypes also scores the bf16 folder with each quantized KV cache (--kv-cache-dtype), against the
bf16 cache's perplexity (issue 27: within 0.5%); --formats "" skips the GGUF files.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import subprocess
from pathlib import Path
from typing import Any

from harness import BENCH_DIR, log, make_output_folders
from llamacpp_peer import THREADS, gguf_file, llamacpp_dir, quantized_gguf, tool

TEXT = BENCH_DIR / "workloads" / "perplexity.txt"
# Sluice and llama.cpp on the same file agree within this share of the perplexity (issue 27).
AGREEMENT = 0.005


def chunks_of(tokens: list[int], ctx: int) -> list[list[int]]:
    return [tokens[start : start + ctx] for start in range(0, len(tokens) - ctx + 1, ctx)]


def sluice_perplexity(
    model: str, chunks: list[list[int]], cpu_isa: str, gguf_dequantize: bool, kv_cache_dtype: str = "auto"
) -> float:
    from sluice import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="bfloat16",
        max_model_len=len(chunks[0]) + 8,
        kv_cache_memory=0.5,
        enable_prefix_caching=False,
        executor="inproc",
        cpu_isa=cpu_isa,
        gguf_dequantize=gguf_dequantize,
        kv_cache_dtype=kv_cache_dtype,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    results = llm.generate([{"prompt_token_ids": chunk} for chunk in chunks], params)
    total, count = 0.0, 0
    for chunk, result in zip(chunks, results, strict=True):
        first = len(chunk) // 2
        for position in range(first + 1, len(chunk)):
            total -= result.prompt_logprobs[position][chunk[position]].logprob
            count += 1
    del llm
    gc.collect()
    return math.exp(total / count)


def llamacpp_perplexity(folder: Path, gguf: Path, ctx: int) -> float:
    argv = [tool(folder, "native", "llama-perplexity"), "-m", str(gguf), "-f", str(TEXT), "-c", str(ctx)]
    done = subprocess.run(
        [*argv, "-t", str(THREADS), "-b", str(ctx)], capture_output=True, text=True, check=True
    )
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if match is None:
        raise RuntimeError(
            f"no perplexity in llama-perplexity's output:\n{(done.stdout + done.stderr)[-2000:]}"
        )
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--llamacpp-dir", default=None, help="install_llamacpp.sh's folder (or $SLUICE_BENCH_LLAMACPP_DIR)"
    )
    parser.add_argument("--formats", default="Q8_0,Q4_0,Q4_K_M", help="llama-quantize types, comma-separated")
    parser.add_argument("--ctx", type=int, default=256, help="tokens per chunk (llama-perplexity's -c)")
    parser.add_argument("--cpu-isa", default="auto", help="Sluice's kernel tier")
    parser.add_argument(
        "--kv-cache-dtypes",
        default="",
        help="quantized KV caches to score the bf16 folder with, comma-separated",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args()
    make_output_folders(args.json, None)
    folder = llamacpp_dir(args.llamacpp_dir)
    if folder is None:
        raise SystemExit(
            "no llama.cpp: --llamacpp-dir or $SLUICE_BENCH_LLAMACPP_DIR (install_llamacpp.sh's folder)"
        )

    from tokenizers import Tokenizer

    from sluice.default_model import prepare_default_model

    model = prepare_default_model()
    tokens = (
        Tokenizer.from_file(str(model / "tokenizer.json"))
        .encode(TEXT.read_text(), add_special_tokens=False)
        .ids
    )
    chunks = chunks_of(tokens, args.ctx)
    log(
        f"{TEXT.name}: {len(tokens)} tokens, {len(chunks)} chunks of {args.ctx}, {args.ctx // 2 - 1} scored in each"
    )
    figures: dict[str, Any] = {"ctx": args.ctx, "tokens": len(tokens), "chunks": len(chunks), "formats": {}}
    reference = sluice_perplexity(str(model), chunks, args.cpu_isa, gguf_dequantize=False)
    peer_reference = llamacpp_perplexity(folder, gguf_file(folder, model, "bf16"), args.ctx)
    figures["bf16"] = {"sluice": reference, "llama.cpp": peer_reference}
    print(f"bf16 folder: Sluice {reference:.4f}; llama.cpp on the bf16 GGUF {peer_reference:.4f}")
    for kv_cache_dtype in filter(None, args.kv_cache_dtypes.split(",")):
        ours = sluice_perplexity(str(model), chunks, args.cpu_isa, False, kv_cache_dtype)
        figures.setdefault("kv_cache_dtypes", {})[kv_cache_dtype] = ours
        distance = ours / reference - 1
        verdict = "met" if abs(distance) <= AGREEMENT else "NOT met"
        print(
            f"bf16 folder, --kv-cache-dtype {kv_cache_dtype}: Sluice {ours:.4f}, {100 * distance:+.2f}% from the "
            f"bf16 cache's {reference:.4f} (target within {100 * AGREEMENT:g}%: {verdict})"
        )
    for qtype in filter(None, args.formats.split(",")):
        gguf = quantized_gguf(folder, model, qtype)
        log(f"{qtype}: {gguf}")
        ours = sluice_perplexity(str(gguf), chunks, args.cpu_isa, gguf_dequantize=False)
        widened = sluice_perplexity(str(gguf), chunks, args.cpu_isa, gguf_dequantize=True)
        peer = llamacpp_perplexity(folder, gguf, args.ctx)
        figures["formats"][qtype] = {"sluice": ours, "sluice, gguf dequantize": widened, "llama.cpp": peer}
        agreement = ours / peer - 1
        verdict = "met" if abs(agreement) <= AGREEMENT else "NOT met"
        print(
            f"{qtype}: Sluice {ours:.4f} (integer GEMM), {widened:.4f} (--gguf-dequantize); llama.cpp {peer:.4f}; "
            f"Sluice vs llama.cpp {100 * agreement:+.2f}% (target within {100 * AGREEMENT:g}%: {verdict}); "
            f"vs the bf16 folder: Sluice {100 * (ours / reference - 1):+.2f}%, "
            f"llama.cpp {100 * (peer / peer_reference - 1):+.2f}%"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()

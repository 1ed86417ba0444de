"""Embeddings throughput: Sluice's pooling runner against sentence-transformers and llama.cpp's
`llama-server --embedding`, on the same model, the same texts and the same batches, in one run.

The model is an embedding model (a sentence-transformers folder: all-MiniLM-L6-v2, say), or a decoder
served for embeddings (by default the default model, wrapped in a sentence-transformers folder of
symlinks with a last-token Pooling and a Normalize module, so that every peer pools it the same way). The legs run one after the other, so that none shares the cores:

- `sentence-transformers`: `SentenceTransformer.encode` in this process, fp32 (its fast choice on a CPU:
  its bf16 ran 20x slower here), batches of --batch-size, torch on 2 threads;
- `sluice offline`: `LLM.embed` over all the texts at once (its scheduler batches them);
- `sluice offline int8` (decoders): the same with `--quantization int8` (int8 weights in blocks of 32 with a scale each, the
  integer GEMM: on AVX2 its `vpmaddubsw` does twice the multiply-adds per cycle of bf16's fp32 FMAs);
- `sluice offline, no encoder kernels` (encoders): the same with `--no-cpu-encoder-kernels` (torch's SDPA one
  sequence at a time and torch's GELU), the off switch of the encoder's attention and GELU kernels;
- `sluice serve`: `sluice serve --runner pooling`, the `openai` client's `embeddings.create` with
  batches of --batch-size, --concurrency requests in flight;
- `llama.cpp`: `llama-server --embedding --pooling last` over the model's f16 GGUF file (llama.cpp's own
  converter), the same requests (with --llamacpp-dir, or $SLUICE_BENCH_LLAMACPP_DIR).

Each repetition embeds fresh texts (--texts of them, --shortest to --longest words), the same for every
leg; the prefix cache can serve none of them. Printed: the median over --repeats (at least 3) of the
input tokens embedded per second, each leg's ratio to sentence-transformers and to llama.cpp, and the
least cosine similarity of each leg's embeddings to sentence-transformers' on the first repetition.
Written to --out as JSON.

    .venv/bin/python bench/embeddings_throughput.py --llamacpp-dir /tmp/lcpp
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai

from harness import log, make_output_folders
from limits import fma_peak_gflops, linear_shapes
from llamacpp_peer import THREADS, add_llamacpp_arguments, gguf_file, llamacpp_dir, tool
from responses_followup import WORDS
from servers import Server, free_port, health_status, start_server, start_sluice
from sluice.cpu_tiers import cpu_flags, host_arch, runnable_tiers
from sluice.model_spec import model_pooling, read_model_spec

# One leg's embeddings of a list of texts, in order.
Embed = Callable[[list[str]], np.ndarray]


def texts_for(repeat: int, count: int, shortest: int, longest: int) -> list[str]:
    rng = random.Random(1000 + repeat)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(shortest, longest))) for _ in range(count)]


def sentence_transformers_folder(model: Path, into: Path) -> Path:
    """`model` as a sentence-transformers folder: its files linked, plus last-token Pooling and Normalize."""
    if (model / "modules.json").is_file():
        return model
    folder = into / model.name
    folder.mkdir()
    for item in model.iterdir():
        (folder / item.name).symlink_to(item.resolve())
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "2_Normalize").mkdir()
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_lasttoken": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return folder


def sentence_transformers_leg(folder: Path, batch_size: int) -> tuple[Embed, Callable[[], None]]:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(THREADS)
    model = SentenceTransformer(str(folder), device="cpu", model_kwargs={"dtype": torch.float32})
    tokenizer = model.tokenizer
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    def embed(texts: list[str]) -> np.ndarray:
        return model.encode(texts, batch_size=batch_size, convert_to_numpy=True)

    return embed, lambda: None


def sluice_offline_leg(folder: Path, dtype: str, **options: Any) -> tuple[Embed, Callable[[], None]]:
    from engine import LLM

    llm = LLM(model=str(folder), dtype=dtype, enable_prefix_caching=False, **options)

    def embed(texts: list[str]) -> np.ndarray:
        return np.array([r.outputs.embedding for r in llm.embed(texts)], dtype=np.float32)

    return embed, llm.engine.shutdown


def http_leg(
    server: Server, model: str, batch_size: int, concurrency: int
) -> tuple[Embed, Callable[[], None]]:
    server.wait_ready()
    # llama-server answers /v1/models while it still loads the model; /health says 200 once it can serve.
    while health_status(server.url) != 200:
        time.sleep(0.5)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
    pool = ThreadPoolExecutor(concurrency)

    def one_batch(batch: list[str]) -> list[list[float]]:
        answer = client.embeddings.create(model=model, input=batch, extra_body=server.request_extra or None)
        return [item.embedding for item in sorted(answer.data, key=lambda item: item.index)]

    def embed(texts: list[str]) -> np.ndarray:
        batches = [texts[i : i + batch_size] for i in range(0, len(texts), batch_size)]
        return np.array([row for rows in pool.map(one_batch, batches) for row in rows], dtype=np.float32)

    def stop() -> None:
        pool.shutdown()
        server.stop()

    return embed, stop


def start_llamacpp_embedder(folder: Path, gguf: Path, pooling: str, slots: int, log_dir: Path) -> Server:
    """llama-server serving embeddings: `pooling` (last, mean or cls), L2-normalised (its default), 2 threads."""
    port = free_port()
    argv = [tool(folder, "native", "llama-server"), "-m", str(gguf), "--embedding", "--pooling", pooling]
    argv += ["--host", "127.0.0.1", "--port", str(port), "-t", str(THREADS), "-tb", str(THREADS)]
    argv += ["-np", str(slots), "-c", str(2048 * slots), "-b", "2048", "-ub", "2048", "--alias", gguf.stem]
    server = start_server("llama.cpp embeddings", port, argv, None, log_dir)
    return server


def linear_flops_per_token(model: Path) -> int:
    """Multiply-adds x 2 of every decoder layer's linears for one token (the LM head never runs)."""
    config = json.loads((model / "config.json").read_text())
    if read_model_spec(model).is_encoder:
        # q, k, v and the attention's output, then one up and one down projection (no gate).
        hidden, inter = config["hidden_size"], config["intermediate_size"]
        per_layer = 4 * hidden * hidden + 2 * hidden * inter
    else:
        per_layer = sum(k * n for name, k, n in linear_shapes(config) if name != "lm_head")
    return 2 * config["num_hidden_layers"] * per_layer


def cosine_floor(a: np.ndarray, b: np.ndarray) -> float:
    cos = (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return float(cos.min())


def run_leg(
    name: str,
    warm_up: list[str],
    start: Callable[[], tuple[Embed, Callable[[], None]]],
    runs: list[list[str]],
    tokens: list[int],
) -> dict[str, Any]:
    log(f"{name}: starting")
    embed, stop = start()
    try:
        # Warm-up on texts of no repetition: the steps' shapes are met once before they are timed.
        embed(warm_up)
        rates, first = [], None
        for index, texts in enumerate(runs):
            began = time.perf_counter()
            vectors = embed(texts)
            seconds = time.perf_counter() - began
            assert vectors.shape[0] == len(texts)
            first = vectors if first is None else first
            rates.append(tokens[index] / seconds)
            log(f"{name}: repetition {index + 1}/{len(runs)}: {rates[-1]:.0f} tokens/s ({seconds:.2f} s)")
    finally:
        stop()
    return {"tokens_per_s": rates, "median_tokens_per_s": statistics.median(rates), "first": first}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default: the default model)")
    parser.add_argument("--texts", type=int, default=128, help="texts per repetition")
    parser.add_argument("--shortest", type=int, default=40, help="fewest words in a text")
    parser.add_argument("--longest", type=int, default=120, help="most words in a text")
    parser.add_argument("--batch-size", type=int, default=32, help="texts per encode batch and per request")
    parser.add_argument("--concurrency", type=int, default=4, help="HTTP requests in flight")
    parser.add_argument("--dtype", default="bfloat16", help="Sluice's dtype")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--legs",
        default=None,
        help="comma-separated legs to run (default: all); sentence-transformers always runs",
    )
    parser.add_argument("--out", default="bench/results/embeddings_throughput.json")
    add_llamacpp_arguments(parser)
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3: medians of fewer runs say little")
    from sluice.default_model import prepare_default_model

    model = (Path(args.model) if args.model else prepare_default_model()).resolve()
    lcpp = llamacpp_dir(args.llamacpp_dir)
    runs = [texts_for(r, args.texts, args.shortest, args.longest) for r in range(args.repeats)]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokens = [sum(len(tokenizer(text)["input_ids"]) for text in texts) for texts in runs]
    log(
        f"{args.texts} texts per repetition, {statistics.mean(tokens) / args.texts:.0f} tokens each on average"
    )
    log_dir = Path(tempfile.mkdtemp(prefix="sluice-embeddings-bench-"))
    folder = sentence_transformers_folder(model, log_dir)
    spec = read_model_spec(folder)
    pooling = model_pooling(spec)
    legs: dict[str, Callable[[], tuple[Embed, Callable[[], None]]]] = {
        "sentence-transformers": lambda: sentence_transformers_leg(folder, args.batch_size),
        "sluice offline": lambda: sluice_offline_leg(folder, args.dtype),
        "sluice serve": lambda: http_leg(
            start_sluice(
                "sluice",
                folder,
                # start_sluice's --max-model-len 2048, cut to an encoder's 512 (the last flag wins).
                [
                    "--runner",
                    "pooling",
                    "--dtype",
                    args.dtype,
                    "--max-model-len",
                    str(min(2048, spec.max_context)),
                ],
                log_dir,
            ),
            model.name,
            args.batch_size,
            args.concurrency,
        ),
    }
    if spec.is_encoder:
        # The off switch of the encoder's own kernels (attention, GELU), measured in the same run.
        legs["sluice offline, no encoder kernels"] = lambda: sluice_offline_leg(
            folder, args.dtype, cpu_encoder_kernels=False
        )
    else:
        # --quantization is the decoders' (an encoder refuses it).
        legs["sluice offline int8"] = lambda: sluice_offline_leg(folder, args.dtype, quantization="int8")
    if lcpp is not None:
        gguf = gguf_file(lcpp, model, "f16")
        legs["llama.cpp"] = lambda: http_leg(
            start_llamacpp_embedder(lcpp, gguf, pooling.method, args.concurrency, log_dir),
            gguf.stem,
            args.batch_size,
            args.concurrency,
        )
    if args.legs:
        chosen = {"sentence-transformers", *args.legs.split(",")}
        unknown = chosen - set(legs)
        if unknown:
            parser.error(f"unknown legs {sorted(unknown)}: choose from {', '.join(legs)}")
        legs = {name: start for name, start in legs.items() if name in chosen}
    # The bound: this tier's fp32 FMA peak over the linears' FLOPs per token (attention left out, so the
    # true bound is lower). sentence-transformers runs fp32; Sluice's bf16 GEMM accumulates in fp32 by FMA
    # on every tier but avx512bf16's bf16 pairs, which run twice the rate (no bound is claimed there).
    tier = runnable_tiers(host_arch(), cpu_flags())[0].name
    peak = fma_peak_gflops(tier)
    bound = peak * 1e9 / linear_flops_per_token(model)
    log(f"fp32 FMA peak at the {tier} tier: {peak:.0f} GFLOP/s: at most {bound:.0f} tokens/s of fp32 linears")
    warm_up = texts_for(-1, args.batch_size * 2, args.shortest, args.longest)
    results = {name: run_leg(name, warm_up, start, runs, tokens) for name, start in legs.items()}
    reference = results["sentence-transformers"]
    reference_first = reference["first"]
    peer = results.get("llama.cpp")
    print(f"\nembeddings of {model.name}, {args.texts} texts x {args.repeats}, batches of {args.batch_size}")
    print(f"{'leg':34} {'tokens/s':>10} {'vs ST':>7} {'vs llama.cpp':>13} {'min cosine':>11}")
    summary = {}
    for name, result in results.items():
        rate = result["median_tokens_per_s"]
        versus_st = rate / reference["median_tokens_per_s"]
        versus_peer = rate / peer["median_tokens_per_s"] if peer else None
        cosine = cosine_floor(result.pop("first"), reference_first)
        peer_text = f"{versus_peer:12.2f}x" if versus_peer is not None else f"{'-':>13}"
        print(f"{name:34} {rate:10.0f} {versus_st:6.2f}x {peer_text} {cosine:11.5f}")
        summary[name] = {
            **result,
            "vs_sentence_transformers": versus_st,
            "vs_llamacpp": versus_peer,
            "min_cosine": cosine,
        }
    wanted = 3 * reference["median_tokens_per_s"]
    print(
        f"\nthe machine's bound ({tier} fp32 FMA peak {peak:.0f} GFLOP/s over the linears): {bound:.0f} tokens/s"
    )
    if tier != "avx512bf16" and wanted > bound:
        print(
            f"3x sentence-transformers would be {wanted:.0f} tokens/s: {wanted / bound:.2f}x this machine's bound"
        )
    out = Path(args.out)
    make_output_folders(out)
    out.write_text(
        json.dumps(
            {
                "model": model.name,
                "texts": args.texts,
                "batch_size": args.batch_size,
                "tier": tier,
                "fma_peak_gflops": peak,
                "bound_tokens_per_s": bound,
                "legs": summary,
            },
            indent=2,
        )
    )
    log(f"wrote {out}")


if __name__ == "__main__":
    main()

"""llama.cpp's side of the offline benchmark: the same protocol as sluice_driver.py, through its own tools.

Converts the model folder to a GGUF file of --outtype once (bench/llamacpp_peer.py), or takes --gguf FILE
as it is, then answers
{"workload": "W1"} lines on stdin, each with a fresh run of llama.cpp's tool for that workload:
  W1, W4: llama-batched-bench, -npl 64 -npp 128 -ntg 128 and -npl 16 -npp 128 -ntg 64 (all output
          tokens over the whole time, prefill included), as the issue measures it;
  W2, W5: llama-bench token generation of 256 and 128 tokens (-p 0 -n N), ms per token.
A warm-up does nothing: each run loads the model anew, as the tools do.

  python bench/llamacpp_driver.py --llamacpp-dir DIR (--model HF_DIR --outtype f16|bf16 | --gguf FILE)
         [--mode native|avx2]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from harness import offline_workload, serve_json_lines
from llamacpp_peer import batched_tok_s, decode_ms_per_token, gguf_file, llamacpp_dir


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llamacpp-dir", required=True)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--outtype", choices=["f16", "bf16"], default=None)
    parser.add_argument("--gguf", type=Path, default=None, help="a GGUF file to run as it is")
    parser.add_argument("--mode", choices=["native", "avx2"], default="native")
    args = parser.parse_args()
    folder = llamacpp_dir(args.llamacpp_dir)
    assert folder is not None
    if args.gguf is None and (args.model is None or args.outtype is None):
        parser.error("give --gguf FILE, or --model and --outtype")
    gguf = args.gguf or gguf_file(folder, args.model, args.outtype)

    def handle(command: dict[str, Any]) -> dict[str, float]:
        if command.get("warmup"):
            return {}
        workload = offline_workload(command["workload"])
        if workload.single_stream:
            return {"ms_per_token": decode_ms_per_token(folder, args.mode, gguf, workload.output_tokens)}
        prompt_tokens = len(workload.prompts[0])
        assert all(len(p) == prompt_tokens for p in workload.prompts), "batched-bench takes one prompt length"
        tok_s = batched_tok_s(
            folder, args.mode, gguf, len(workload.prompts), prompt_tokens, workload.output_tokens
        )
        return {"tok_s": tok_s}

    serve_json_lines(handle)


if __name__ == "__main__":
    main()

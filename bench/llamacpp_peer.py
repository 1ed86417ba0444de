"""Where the llama.cpp peer lives and how its tools are run: the folder that install_llamacpp.sh made,
GGUF files converted from the same Hugging Face folders Sluice loads, and each tool's figure parsed.

The folder (--llamacpp-dir, or $SLUICE_BENCH_LLAMACPP_DIR) holds src/ (the llama.cpp sources that the
llama-cpp-python sdist vendors) and llama.cpp-<MODE>/bin/ (the tools, MODE native or avx2). GGUF files are
written once into <DIR>/gguf/ (named after the folder and a digest of its path) by llama.cpp's own
convert_hf_to_gguf.py, run with this venv's Python (it has torch and transformers), the sources' gguf-py
and DIR/gguf-deps, where the converter's own imports go:
  pip install --target DIR/gguf-deps sentencepiece protobuf
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

DIR_ENV = "SLUICE_BENCH_LLAMACPP_DIR"
THREADS = 2


def llamacpp_dir(option: str | None) -> Path | None:
    """The folder from --llamacpp-dir, else $SLUICE_BENCH_LLAMACPP_DIR; None: no llama.cpp peer."""
    value = option or os.environ.get(DIR_ENV)
    if not value:
        return None
    folder = Path(value).expanduser().resolve()
    if not (folder / "src").is_dir():
        raise SystemExit(f"{folder} has no src/: --llamacpp-dir must name install_llamacpp.sh's folder")
    return folder


def add_llamacpp_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--llamacpp-dir", default=None, help="install_llamacpp.sh's folder (or $SLUICE_BENCH_LLAMACPP_DIR)"
    )
    parser.add_argument("--mode", choices=["native", "avx2"], default="native", help="which llama.cpp build")


def required_llamacpp_dir(option: str | None) -> Path:
    """llamacpp_dir(option), which this benchmark cannot go without."""
    folder = llamacpp_dir(option)
    if folder is None:
        raise SystemExit(
            "no llama.cpp: --llamacpp-dir or $SLUICE_BENCH_LLAMACPP_DIR (install_llamacpp.sh's folder)"
        )
    return folder


def tool(folder: Path, mode: str, name: str) -> str:
    path = folder / f"llama.cpp-{mode}" / "bin" / name
    if not path.is_file():
        raise SystemExit(f"no {path}: build it with install_llamacpp.sh {folder} {mode}")
    return str(path)


def _gguf_path(folder: Path, model: Path, kind: str) -> Path:
    """Where model's GGUF file of `kind` (an outtype or a quantization) is kept: named after the folder
    and a digest of its path, since two models' folders may share a name (a package's `model`)."""
    key = hashlib.sha256(str(model.resolve()).encode()).hexdigest()[:8]
    return folder / "gguf" / f"{model.name}-{key}-{kind}.gguf"


def gguf_file(folder: Path, model: Path, outtype: str) -> Path:
    """model (a Hugging Face folder) as a GGUF file of outtype (f16, bf16), converted on first use."""
    out = _gguf_path(folder, model, outtype)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    sources = folder / "src" / "vendor" / "llama.cpp"
    paths = [str(sources / "gguf-py"), str(folder / "gguf-deps"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    # The converter wants a .gguf name; the file takes its final one once whole.
    tmp = out.with_name(f"{out.stem}.partial.gguf")
    argv = [sys.executable, str(sources / "convert_hf_to_gguf.py"), str(model), "--outtype", outtype]
    done = subprocess.run(
        [*argv, "--outfile", str(tmp)], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model}:\n{done.stderr[-3000:]}")
    tmp.replace(out)
    return out


def quantized_gguf(folder: Path, model: Path, qtype: str) -> Path:
    """model's f16 GGUF file quantized to qtype (Q8_0, Q4_0, Q4_K_M, ...) by llama-quantize, once."""
    out = _gguf_path(folder, model, qtype)
    if out.is_file():
        return out
    source = gguf_file(folder, model, "f16")
    tmp = out.with_name(f"{out.stem}.partial.gguf")
    argv = [tool(folder, "native", "llama-quantize"), str(source), str(tmp), qtype, str(THREADS)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama-quantize {qtype} failed on {source}:\n{done.stderr[-3000:]}")
    tmp.replace(out)
    return out


def batched_tok_s(
    folder: Path, mode: str, gguf: Path, prompts: int, prompt_tokens: int, output_tokens: int
) -> float:
    """llama-batched-bench with `prompts` sequences: every output token over the whole time (prefill included)."""
    context = prompts * (prompt_tokens + output_tokens) + 256
    argv = [
        tool(folder, mode, "llama-batched-bench"),
        "-m",
        str(gguf),
        "-t",
        str(THREADS),
        "-tb",
        str(THREADS),
    ]
    argv += ["-c", str(context), "-npp", str(prompt_tokens), "-ntg", str(output_tokens), "-npl", str(prompts)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    # The table's row: |PP|TG|B|N_KV|T_PP s|S_PP t/s|T_TG s|S_TG t/s|T s|S t/s|
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0] == str(prompt_tokens) and cells[2] == str(prompts):
            return prompts * output_tokens / float(cells[8])
    raise RuntimeError(f"no result row in llama-batched-bench's output:\n{out[-2000:]}")


def decode_ms_per_token(folder: Path, mode: str, gguf: Path, output_tokens: int) -> float:
    """llama-bench's token generation of `output_tokens` from an empty context: ms per token."""
    argv = [tool(folder, mode, "llama-bench"), "-m", str(gguf), "-t", str(THREADS), "-p", "0"]
    argv += ["-n", str(output_tokens), "-r", "1", "-o", "json"]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    results = json.loads(out[out.index("[") :])
    (result,) = [r for r in results if r["n_gen"] == output_tokens]
    return 1e3 / result["avg_ts"]


def version(folder: Path, mode: str) -> str:
    done = subprocess.run(
        [tool(folder, mode, "llama-bench"), "--version"], capture_output=True, text=True, check=False
    )
    match = re.search(r"version: (\S+)", done.stdout + done.stderr)
    return match.group(1) if match else "unknown"

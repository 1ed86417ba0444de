"""Bad engine options get a typed error that names them before any process starts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import engine.multiproc_executor
from engine import LLM
from sluice.cpu_binding import CpuBindError
from sluice.errors import GraphConfigError, InvalidConfigError, KVCacheTooSmallError
from tiny_models import tiny_model_dir

SLUICE = str(Path(sys.executable).parent / "sluice")


@pytest.fixture
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a worker process was started for a configuration that cannot work")

    monkeypatch.setattr(engine.multiproc_executor.subprocess, "Popen", refuse)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            {"capture_sizes": (1, 2, 64), "max_num_seqs": 8},
            GraphConfigError,
            r"capture size 64.*max_num_seqs",
        ),
        ({"device": "tpu"}, InvalidConfigError, r"unknown device 'tpu'"),
        ({"executor": "inproc", "tensor_parallel_size": 2}, InvalidConfigError, r"in-process executor"),
        ({"cpu_bind": "0-4095"}, CpuBindError, r"cores .* this process may not use"),
        ({"cpu_bind": "1-0"}, CpuBindError, r"runs backwards"),
        ({"omp_spin_count": "lots"}, InvalidConfigError, r"--omp-spin-count 'lots' is not auto"),
        ({"step_timeout_s": -1.0}, InvalidConfigError, r"step_timeout_s must be a finite number .* got -1.0"),
        ({"kv_cache_memory": 0.001}, KVCacheTooSmallError, r"raise --kv-cache-memory"),
        (
            {"speculative_config": {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}},
            InvalidConfigError,
            r"ngram-prompt-lookup-min <= --ngram-prompt-lookup-max, got 5 and 3",
        ),
        ({"speculative_config": {"method": "eagle"}}, InvalidConfigError, r"unknown speculative method"),
        ({"quantization": "int3"}, InvalidConfigError, r"unknown quantization 'int3': use int8 or int4"),
        (
            {"quantization": "int8", "cpu_isa": "none"},
            InvalidConfigError,
            r"integer GEMM: it needs --device cpu",
        ),
        ({"quantization": "int4", "packed_linear": False}, InvalidConfigError, r"not --no-packed-linear"),
        (
            {"kv_cache_dtype": "int4"},
            InvalidConfigError,
            r"unknown kv_cache_dtype 'int4': use auto, int8, fp8_e4m3",
        ),
        (
            {"kv_cache_dtype": "fp8_e4m3", "device": "cuda"},
            InvalidConfigError,
            r"--kv-cache-dtype fp8_e4m3 is read by the CPU attention kernels",
        ),
        (
            {"cuda_attention_backend": "xformers"},
            InvalidConfigError,
            r"unknown cuda_attention_backend 'xformers': use auto, flash_attn, triton",
        ),
    ],
)
def test_bad_options_are_refused_before_any_process(
    default_model_path, no_processes, options, error, message
):
    with pytest.raises(error, match=message):
        LLM(model=str(default_model_path), **options)


def test_a_quantized_kv_cache_refuses_heads_wider_than_its_write_takes(tmp_path: Path, no_processes) -> None:
    folder = tmp_path / "wide-heads"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["head_dim"] = 1040
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidConfigError, match=r"int8 takes head_dim up to 1024; this model's is 1040"):
        LLM(model=str(folder), kv_cache_dtype="int8")


def test_serve_refuses_bad_capture_sizes_before_starting_anything(default_model_path):
    done = subprocess.run(
        [SLUICE, "serve", "--capture-sizes", "1,512", "--max-num-seqs", "8", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "capture size 512" in done.stderr and "Traceback" not in done.stderr
    assert "engine core" not in done.stderr


def test_quantizing_a_gguf_file_or_a_width_off_the_blocks_is_refused(no_processes, tmp_path, monkeypatch):
    from sluice.default_model import gguf_path
    from tiny_models import tiny_model_dir

    with pytest.raises(InvalidConfigError, match=r"GGUF file, quantized already"):
        LLM(model=str(gguf_path()), quantization="int8")
    # A copy of a tiny model whose MLP is 40 wide: not a multiple of the blocks of 32.
    folder = tmp_path / "odd"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 40
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidConfigError, match=r"intermediate_size per rank is 40, not a multiple of 32"):
        LLM(model=str(folder), quantization="int4")

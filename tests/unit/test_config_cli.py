"""The engine's command line is generated from the config: every field declared with `setting` is an option of
every command that runs an engine, with the field's default, and `sluice serve` hands each one to its engine core."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

from engine.engine_core_server import build_parser as engine_core_parser
from sluice.config import (
    SECTION_TYPES,
    CacheConfig,
    EngineRestartConfig,
    GraphConfig,
    ParallelConfig,
    SluiceConfig,
)
from sluice.config_option import option_of
from sluice.engine_args import SERVE_SCOPE, add_engine_arguments, config_from_args, config_from_options
from sluice.serve.argv import engine_argv
from sluice.serve.flags import add_serve_arguments

# Every section field and its value when given on the command line: none of these is its default.
GIVEN = {
    "--dtype": ("model", "dtype", "float32", "float32"),
    "--max-model-len": ("model", "max_model_len", "640", 640),
    "--runner": ("model", "runner", "pooling", "pooling"),
    "--max-num-seqs": ("scheduler", "max_num_seqs", "9", 9),
    "--max-num-batched-tokens": ("scheduler", "max_num_batched_tokens", "333", 333),
    "--scheduling-policy": ("scheduler", "policy", "priority", "priority"),
    "--no-async-scheduling": ("scheduler", "async_scheduling", None, False),
    "--no-structured-output-overlap": ("scheduler", "structured_output_overlap", None, False),
    "--no-early-step-output": ("scheduler", "early_step_output", None, False),
    "--block-size": ("cache", "block_size", "32", 32),
    "--kv-cache-memory": ("cache", "kv_cache_memory_gib", "0.75", 0.75),
    "--kv-cache-dtype": ("cache", "kv_cache_dtype", "int8", "int8"),
    "--no-enable-prefix-caching": ("cache", "enable_prefix_caching", None, False),
    "--no-hybrid-kv-cache": ("cache", "hybrid_kv_cache", None, False),
    "--num-kv-blocks": ("cache", "num_gpu_blocks_override", "77", 77),
    "--kv-events-port": ("cache", "kv_events_port", "5557", 5557),
    "--kv-events-host": ("cache", "kv_events_host", "0.0.0.0", "0.0.0.0"),
    "-tp": ("parallel", "tensor_parallel_size", "2", 2),
    "--executor": ("parallel", "executor", "inproc", "inproc"),
    "--step-timeout-s": ("parallel", "step_timeout_s", "0", 0.0),
    "--enforce-eager": ("graph", "enforce_eager", None, True),
    "--graph-mode": ("graph", "mode", "piecewise", "piecewise"),
    "--capture-sizes": ("graph", "capture_sizes", "1,2,4", (1, 2, 4)),
    "--device": ("device", "device", "cuda", "cuda"),
    "--num-threads": ("device", "num_threads", "3", 3),
    "--cpu-bind": ("device", "cpu_bind", "0-1", "0-1"),
    "--omp-spin-count": ("device", "omp_spin_count", "inherit", "inherit"),
    "--cpu-isa": ("kernel", "cpu_isa", "avx2", "avx2"),
    "--no-packed-linear": ("kernel", "packed_linear", None, False),
    "--no-gemm-k-blocks": ("kernel", "gemm_k_blocks", None, False),
    "--no-fused-gate-up": ("kernel", "fused_gate_up", None, False),
    "--no-fused-moe": ("kernel", "fused_moe", None, False),
    "--gguf-dequantize": ("kernel", "gguf_dequantize", None, True),
    "--quantization": ("kernel", "quantization", "int4", "int4"),
    "--no-cpu-decode-attention": ("kernel", "cpu_decode_attention", None, False),
    "--no-cpu-decode-split-keys": ("kernel", "cpu_decode_split_keys", None, False),
    "--no-native-argmax": ("kernel", "native_argmax", None, False),
    "--no-cpu-encoder-kernels": ("kernel", "cpu_encoder_kernels", None, False),
    "--cuda-attention-backend": ("kernel", "cuda_attention_backend", "triton", "triton"),
    "--speculative": ("speculative", "method", "ngram", "ngram"),
    "--num-speculative-tokens": ("speculative", "num_speculative_tokens", "6", 6),
    "--ngram-prompt-lookup-min": ("speculative", "prompt_lookup_min", "1", 1),
    "--ngram-prompt-lookup-max": ("speculative", "prompt_lookup_max", "5", 5),
}
SERVE_ONLY = {"-dp": ("parallel", "data_parallel_size", "2", 2)}


def _argv(table: dict[str, tuple[str, str, str | None, object]]) -> list[str]:
    argv: list[str] = []
    for flag, (_, _, text, _) in table.items():
        argv += [flag] if text is None else [flag, text]
    return argv


def _parser(scopes: tuple[str, ...] = ("engine",), model_positional: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_arguments(parser, model_positional=model_positional, scopes=scopes)  # type: ignore[arg-type]
    return parser


def test_only_the_named_fields_have_no_option() -> None:
    without = {
        (kind.__name__, field.name)
        for kind in [*SECTION_TYPES.values(), EngineRestartConfig]
        for field in fields(kind)
        if option_of(field.metadata) is None
    }
    assert without == {
        ("ModelConfig", "path"),
        ("EngineRestartConfig", "backoff_s"),
        ("EngineRestartConfig", "backoff_max_s"),
    }
    # The table above covers every engine option, so a new field must be added to it.
    optioned = sum(1 for kind in SECTION_TYPES.values() for f in fields(kind) if option_of(f.metadata))
    assert optioned == len(GIVEN) + len(SERVE_ONLY)


def test_defaults_are_the_config_defaults() -> None:
    config = config_from_args(_parser().parse_args([]), model_path="/m")
    assert config == SluiceConfig(model=config.model)
    assert config.model.dtype == "bfloat16" and config.cache == CacheConfig()


def test_each_option_reaches_its_field() -> None:
    config = config_from_args(_parser().parse_args(_argv(GIVEN)), model_path="/m")
    for flag, (section, name, _, value) in GIVEN.items():
        assert getattr(getattr(config, section), name) == value, flag


def test_serve_hands_every_engine_option_to_the_engine_core() -> None:
    serve_args = _parser(SERVE_SCOPE, model_positional=True).parse_args(
        ["/models/m", *_argv(GIVEN | SERVE_ONLY)]
    )
    served = config_from_args(serve_args, model_path="/models/m")
    assert served.parallel.data_parallel_size == 2
    engine_args = engine_core_parser().parse_args(
        ["--input", "ipc:///tmp/a", "--output", "ipc:///tmp/b", *engine_argv(serve_args, Path("/models/m"))]
    )
    assert "-dp" not in engine_argv(serve_args, Path("/models/m")), "an engine core is one replica"
    assert config_from_args(engine_args) == SluiceConfig(
        model=served.model,
        scheduler=served.scheduler,
        cache=served.cache,
        parallel=ParallelConfig(**{**_as_dict(served.parallel), "data_parallel_size": 1}),
        graph=served.graph,
        device=served.device,
        kernel=served.kernel,
        speculative=served.speculative,
    )


def _as_dict(section: object) -> dict[str, object]:
    return {field.name: getattr(section, field.name) for field in fields(section)}  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-num-seqs", "0"], "must be at least 1"),
        (["--kv-cache-memory", "0"], "must be more than 0.0"),
        (["--kv-cache-memory", "inf"], "must be a finite number"),
        (["--step-timeout-s", "-1"], "must be at least 0.0"),
        (["--kv-events-port", "70000"], "must be at most 65535"),
        (["--capture-sizes", "1,x"], "expected an integer, got 'x'"),
        (["--capture-sizes", "4,0"], "must be at least 1"),
        (["--dtype", "int3"], "invalid choice"),
        (["--cpu-isa", "sse2"], "invalid choice"),
    ],
)
def test_bad_values_are_refused_with_the_reason(argv: list[str], message: str) -> None:
    with pytest.raises(argparse.ArgumentError, match=message):
        _parser().parse_args(argv)


def test_help_shows_each_default_from_the_config() -> None:
    text = _parser(SERVE_SCOPE).format_help()
    for expected in (
        "one step (default: 128)",
        "tokens per KV block (default: 16)",
        "(default: full_and_piecewise)",
        "(default: 1)",  # -dp, serve's only
    ):
        assert expected in " ".join(text.split()), expected
    assert GraphConfig().mode == "full_and_piecewise"


def test_keyword_options_are_named_as_on_the_command_line() -> None:
    """LLM(...)'s keywords: the same options, by their command-line names, with the same defaults."""
    config = config_from_options(
        "/m",
        kv_cache_memory=0.5,
        num_kv_blocks=40,
        graph_mode="none",
        capture_sizes=[1, 2],
        omp_spin_count=500,
    )
    assert config.model.path == "/m"
    assert (config.cache.kv_cache_memory_gib, config.cache.num_gpu_blocks_override) == (0.5, 40)
    assert (config.graph.mode, config.graph.capture_sizes) == ("none", (1, 2))
    assert config.device.omp_spin_count == "500"
    assert config.scheduler == config_from_args(_parser().parse_args([]), model_path="/m").scheduler
    with pytest.raises(TypeError, match="unknown engine options: kv_cache_memory_gib"):
        config_from_options("/m", kv_cache_memory_gib=1.0)
    with pytest.raises(TypeError, match="data_parallel_size"):
        config_from_options("/m", data_parallel_size=2)


def test_every_serve_option_is_in_the_readme() -> None:
    """An option added to the config (or to the frontend) shows in `--help` at once; the README must say it too."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    flags = [
        action.option_strings[0]
        for action in parser._actions
        if action.option_strings and action.option_strings[0].startswith("--") and action.dest != "help"
    ]
    assert len(flags) > 60
    named = set(re.findall(r"(?<![\w-])--[a-z0-9-]+", readme))
    missing = [flag for flag in flags if flag not in named and f"--no-{flag[2:]}" not in named]
    assert not missing, f"undocumented in README.md: {missing}"

"""The kernels' off switches travel as KernelConfig, one typed value, from every entry point to the worker."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sluice.config import KernelConfig, config_from_dict, config_to_dict
from sluice.engine_args import add_engine_arguments, config_from_args
from sluice.serve.argv import engine_argv
from sluice.serve.flags import add_serve_arguments

OFF = [
    "--cpu-isa",
    "none",
    "--no-packed-linear",
    "--no-gemm-k-blocks",
    "--no-fused-gate-up",
    "--no-fused-moe",
    "--no-cpu-decode-attention",
    "--no-cpu-decode-split-keys",
    "--no-cpu-encoder-kernels",
    "--no-native-argmax",
    "--cuda-attention-backend",
    "triton",
]
ALL_OFF = KernelConfig(
    cpu_isa="none",
    packed_linear=False,
    gemm_k_blocks=False,
    fused_gate_up=False,
    fused_moe=False,
    cpu_decode_attention=False,
    cpu_decode_split_keys=False,
    cpu_encoder_kernels=False,
    native_argmax=False,
    cuda_attention_backend="triton",
)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_leave_every_kernel_on() -> None:
    assert config_from_args(parse([]), model_path="/m").kernel == KernelConfig(
        cpu_isa="auto",
        packed_linear=True,
        gemm_k_blocks=True,
        fused_gate_up=True,
        fused_moe=True,
        cpu_decode_attention=True,
        cpu_decode_split_keys=True,
        cpu_encoder_kernels=True,
        native_argmax=True,
        cuda_attention_backend="auto",
    )


def test_switches_reach_the_config_and_survive_the_worker_seam() -> None:
    config = config_from_args(parse(OFF), model_path="/m")
    assert config.kernel == ALL_OFF
    # The multiprocess executor hands workers the config as plain values (msgpack/JSON).
    assert config_from_dict(config_to_dict(config)).kernel == ALL_OFF


def test_serve_passes_the_switches_to_its_engine_core() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    argv = engine_argv(parser.parse_args(OFF), Path("/m"))
    assert config_from_args(parse(argv), model_path="/m").kernel == ALL_OFF


@pytest.mark.parametrize(
    ("option", "value"), [("--cuda-attention-backend", "xformers"), ("--cpu-isa", "sse2")]
)
def test_an_unknown_choice_is_refused_by_the_parser(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse([option, value])
    assert f"invalid choice: '{value}'" in capsys.readouterr().err

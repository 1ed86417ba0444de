"""The `sluice` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SLUICE = str(Path(sys.executable).parent / "sluice")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SLUICE, *args], check=False, capture_output=True, text=True, timeout=300)


def test_generate_prints_a_completion_from_the_default_model(default_model_path):
    result = run("generate", "--max-tokens", "8", "The capital of France is")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_model_prepare_prints_the_folder_last(default_model_path):
    result = run("model", "prepare")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(default_model_path)


def test_missing_model_is_a_clear_error_not_a_traceback(tmp_path):
    result = run("generate", "--model", str(tmp_path / "absent"), "hello")
    assert result.returncode == 2
    assert "does not exist" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("model", ["absent.gguf", "notes.txt"])
def test_serve_refuses_a_model_that_is_neither_folder_nor_gguf_file(tmp_path, model):
    (tmp_path / "notes.txt").write_text("not a model")
    result = run("serve", str(tmp_path / model), "--port", "1")
    assert result.returncode == 2
    assert "must be a local Hugging Face folder or a .gguf file" in result.stderr
    assert "Traceback" not in result.stderr


def test_chat_generate_uses_the_chat_template(default_model_path):
    result = run("generate", "--chat", "--max-tokens", "8", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when CUDA is absent")
def test_cuda_without_a_gpu_is_a_clear_error(default_model_path):
    result = run("generate", "--device", "cuda", "hello")
    assert result.returncode == 2
    assert "no CUDA device" in result.stderr

"""GGUF loading: our dequantization against the gguf package's, the default model's own Q4_1 file
against the Hugging Face folder converted from it (by transformers), and `sluice serve model.gguf`
against `sluice serve FOLDER`, through the official openai client."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import openai
import pytest
import torch
from gguf.quants import dequantize as reference_dequantize
from safetensors.torch import load_file
from tokenizers import Tokenizer

from gguf_blocks import FLOAT16_OFFSETS, random_blocks
from gguf_families import gguf_name, write_byte_level_vocabulary
from serve_fixtures import Server, running_server
from sluice.default_model import gguf_path
from sluice.errors import ModelNotFoundError
from sluice.gguf_model import ROPE_FREQS_TENSOR, gguf_model_folder
from sluice.model_spec import read_model_spec
from worker.gguf_dequantize import UnsupportedQuantizationError, dequantize
from worker.gguf_weights import GGUFTensorError, gguf_tensors, hf_tensor_name, unpermute_rotary_rows

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1"
FOLDER_NAME = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
# A logprob lead (nats) below which the int8 activations' rounding may swap the two best tokens.
NEAR_TIE = 0.5
TEXTS = [
    "Hello world 12345!",
    "<|im_start|>user\nWhat's 2+2?<|im_end|>\n",
    "  spaces\t\ttabs\n\nnewlines  ",
    "def f(x):\n    return x**2  # ünïcödé 日本語 🎉",
    "<repo_name>sluice<file_sep>main.rs",
]


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", *FLOAT16_OFFSETS])
def test_dequantize_equals_the_gguf_package(type_name: str) -> None:
    rng = np.random.default_rng(sum(map(ord, type_name)))
    rows, cols = 6, 512
    raw = random_blocks(type_name, rows, cols, rng)
    expected = torch.from_numpy(np.array(reference_dequantize(raw, gguf.GGMLQuantizationType[type_name])))
    ours = dequantize(raw, type_name, (rows, cols))
    assert ours.dtype == torch.float32 and ours.shape == (rows, cols)
    assert torch.equal(ours, expected.to(torch.float32))


def test_unsupported_quantization_names_the_type() -> None:
    # IQ4_XS: 256 values in 136 bytes, one of llama.cpp's importance-matrix types.
    with pytest.raises(UnsupportedQuantizationError, match="IQ4_XS"):
        dequantize(np.zeros(136, np.uint8), "IQ4_XS", (1, 256))


def test_unpermute_undoes_llama_cpp_rotary_interleave() -> None:
    heads, head_dim, hidden = 3, 8, 5
    weight = torch.arange(heads * head_dim * hidden, dtype=torch.float32).reshape(heads * head_dim, hidden)
    # llama.cpp's convert_hf_to_gguf.py: the halves of each head's rows become interleaved pairs.
    interleaved = weight.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(weight.shape)
    assert not torch.equal(interleaved, weight)
    assert torch.equal(unpermute_rotary_rows(interleaved, heads), weight)
    bias = torch.arange(heads * head_dim, dtype=torch.float32)
    interleaved_bias = bias.reshape(heads, 2, head_dim // 2).swapaxes(1, 2).reshape(bias.shape)
    assert torch.equal(unpermute_rotary_rows(interleaved_bias, heads), bias)


def test_default_gguf_weights_equal_the_converted_folder(default_model_path: Path) -> None:
    """Every tensor, dequantized by us and rounded to bfloat16, equals transformers' conversion."""
    reference = load_file(str(default_model_path / "model.safetensors"))
    spec = read_model_spec(gguf_path())
    names = []
    for name, tensor in gguf_tensors(gguf_path(), spec.hf_config, show_progress=False):
        assert torch.equal(tensor.to(torch.bfloat16), reference[name]), name
        names.append(name)
    assert sorted(names) == sorted(reference)


def test_gguf_folder_config_tokenizer_and_template_match(default_model_path: Path, tmp_path: Path) -> None:
    folder = gguf_model_folder(gguf_path(), cache_dir=tmp_path)
    assert folder.parent == tmp_path / "gguf"
    config = json.loads((folder / "config.json").read_text())
    expected = json.loads((default_model_path / "config.json").read_text())
    same_keys = [
        "architectures",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ]
    assert {k: config[k] for k in same_keys} == {k: expected[k] for k in same_keys}
    assert config["rope_theta"] == expected["rope_parameters"]["rope_theta"]
    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    theirs = Tokenizer.from_file(str(default_model_path / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs.encode(text).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == theirs.decode(ids)
    assert (folder / "chat_template.jinja").read_text() == (
        default_model_path / "chat_template.jinja"
    ).read_text()
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    assert (settings["bos_token"], settings["eos_token"], settings["add_bos_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        False,
    )
    # A second call finds the folder already written.
    assert gguf_model_folder(gguf_path(), cache_dir=tmp_path) == folder


def test_missing_gguf_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        read_model_spec(tmp_path / "absent.gguf")


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, default_model_path: Path
) -> Iterator[tuple[Server, Server, Server]]:
    """`sluice serve model.gguf --gguf-dequantize`, `sluice serve FOLDER` (the folder converted from that
    file), and `sluice serve model.gguf` (its quantized weights on the integer GEMM)."""
    logs = tmp_path_factory.mktemp("serve-gguf")
    args = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "0.25", "--max-num-seqs", "8"]
    with (
        running_server([str(gguf_path()), *args, "--gguf-dequantize"], logs / "gguf.log") as from_gguf,
        running_server([str(default_model_path), *args], logs / "folder.log") as from_folder,
        running_server([str(gguf_path()), *args], logs / "quantized.log") as quantized,
    ):
        yield from_gguf, from_folder, quantized


def clients(servers: tuple[Server, ...]) -> list[openai.OpenAI]:
    return [
        openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120) for s in servers
    ]


def test_served_gguf_is_named_after_the_file(servers: tuple[Server, Server, Server]) -> None:
    from_gguf, from_folder, quantized = clients(servers)
    assert [m.id for m in from_gguf.models.list()] == [GGUF_NAME]
    assert [m.id for m in quantized.models.list()] == [GGUF_NAME]
    assert [m.id for m in from_folder.models.list()] == [FOLDER_NAME]
    assert "dequantizing" in servers[0].log.read_text(errors="replace")
    # The default model's file is Q4_1, its embedding table (the tied LM head) Q8_0.
    log = servers[2].log.read_text(errors="replace")
    assert "210 Q4_1 weight part(s) stay quantized" in log and "1 Q8_0 weight part(s) stay quantized" in log


def test_served_gguf_greedy_completions_equal_the_folder(servers: tuple[Server, Server, Server]) -> None:
    from_gguf, from_folder, _ = clients(servers)
    for prompt in ["The capital of France is", "def fibonacci(n):", "List 3 colors: 1."]:
        answers = [
            client.completions.create(
                model=model, prompt=prompt, max_tokens=16, temperature=0, logprobs=0
            ).choices[0]
            for client, model in zip((from_gguf, from_folder), (GGUF_NAME, FOLDER_NAME))
        ]
        assert answers[0].logprobs.tokens == answers[1].logprobs.tokens, prompt
        assert answers[0].text == answers[1].text and answers[0].text


def test_served_gguf_chat_uses_the_template_from_the_metadata(servers: tuple[Server, Server, Server]) -> None:
    from_gguf, from_folder, _ = clients(servers)
    messages = [{"role": "user", "content": "Name three rivers."}]
    replies = [
        client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
        for client, model in zip((from_gguf, from_folder), (GGUF_NAME, FOLDER_NAME))
    ]
    assert replies[0].usage.prompt_tokens == replies[1].usage.prompt_tokens
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    streamed = from_gguf.chat.completions.create(
        model=GGUF_NAME, messages=messages, max_tokens=32, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == replies[0].choices[0].message.content


def test_served_quantized_gguf_follows_the_folder_until_a_near_tie(
    servers: tuple[Server, Server, Server],
) -> None:
    """The integer GEMM's int8 activations move each logit slightly, so its greedy tokens equal the
    exact weights' wherever the folder's best token leads its second by a clear margin."""
    _, from_folder, quantized = clients(servers)
    compared = 0
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "List 3 colors: 1.",
        "Water boils at",
        "1, 2, 3, 4,",
        "import numpy as",
        "Monday, Tuesday,",
        "The largest planet in the solar system is",
    ]
    for prompt in prompts:
        exact = from_folder.completions.create(
            model=FOLDER_NAME, prompt=prompt, max_tokens=16, temperature=0, logprobs=2
        ).choices[0]
        ours = quantized.completions.create(
            model=GGUF_NAME, prompt=prompt, max_tokens=16, temperature=0, logprobs=2
        ).choices[0]
        for step, token in enumerate(exact.logprobs.tokens):
            top = sorted(exact.logprobs.top_logprobs[step].values(), reverse=True)
            if len(top) < 2 or top[0] - top[1] < NEAR_TIE:
                break
            assert ours.logprobs.tokens[step] == token, (prompt, step)
            compared += 1
    assert compared >= 8


def _llama3_rope_divisors(rope: dict, config: dict) -> np.ndarray:
    """What llama.cpp's converter writes for Llama 3's rope scaling: each frequency's divisor, 1 for short
    wavelengths, the factor for long ones, a smooth blend between."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    inv_freq = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    original, factor = rope["original_max_position_embeddings"], rope["factor"]
    low_wavelength = original / rope["low_freq_factor"]
    high_wavelength = original / rope["high_freq_factor"]
    divisors = []
    for frequency in inv_freq:
        wavelength = 2 * math.pi / frequency
        if wavelength < high_wavelength:
            divisors.append(1.0)
        elif wavelength > low_wavelength:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def write_tiny_gguf(arch: str, folder: Path, path: Path) -> dict[str, torch.Tensor]:
    """A GGUF of the tiny `arch` folder's weights, 2-D ones cycling through the six types, as
    llama.cpp's converter writes them; returns what each tensor should load as (float32)."""
    config = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", config["num_hidden_layers"])
    writer.add_uint32(f"{arch}.context_length", config["max_position_embeddings"])
    writer.add_uint32(f"{arch}.embedding_length", config["hidden_size"])
    writer.add_uint32(f"{arch}.feed_forward_length", config["intermediate_size"])
    writer.add_uint32(f"{arch}.attention.head_count", config["num_attention_heads"])
    writer.add_uint32(f"{arch}.attention.head_count_kv", config["num_key_value_heads"])
    if config.get("head_dim"):
        writer.add_uint32(f"{arch}.attention.key_length", config["head_dim"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_divisors(rope, config))
    write_byte_level_vocabulary(writer, folder, config["vocab_size"])
    # The types whose quantizer the gguf package has (it only dequantizes the K-quants).
    types = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
    expected = {}
    for index, (name, weight) in enumerate(sorted(load_file(str(folder / "model.safetensors")).items())):
        values = weight.to(torch.float32).numpy()
        qtype = gguf.GGMLQuantizationType[types[index % len(types)] if values.ndim == 2 else "F32"]
        stored = values
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        part = name.split(".")[-2]
        if arch == "llama" and part in heads:
            # convert_hf_to_gguf.py's LlamaModel.permute.
            n = heads[part]
            stored = values.reshape(n, 2, values.shape[0] // n // 2, *values.shape[1:])
            stored = stored.swapaxes(1, 2).reshape(values.shape)
        raw = gguf.quants.quantize(np.ascontiguousarray(stored), qtype)
        writer.add_tensor(gguf_name(name), raw, raw_dtype=qtype)
        # Quantization blocks lie within rows, so permuting rows commutes with it.
        expected[name] = torch.from_numpy(
            np.array(reference_dequantize(gguf.quants.quantize(values, qtype), qtype))
        ).to(torch.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_of_each_architecture_and_type_loads_as_written(arch: str, tmp_path: Path) -> None:
    from tiny_models import tiny_model_dir

    folder = tiny_model_dir(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = write_tiny_gguf(arch, folder, path)
    config = json.loads((gguf_model_folder(path, cache_dir=tmp_path) / "config.json").read_text())
    source = json.loads((folder / "config.json").read_text())
    for key in ("num_attention_heads", "num_key_value_heads", "hidden_size", "tie_word_embeddings"):
        assert config[key] == source[key], key
    assert config["head_dim"] == source.get(
        "head_dim", source["hidden_size"] // source["num_attention_heads"]
    )
    loaded = dict(gguf_tensors(path, config, show_progress=False))
    assert sorted(loaded) == sorted(expected)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, expected[name]), name


def test_a_llama3_gguf_rotates_as_its_folder(tmp_path: Path) -> None:
    """llama.cpp keeps Llama 3's rope scaling as the rope_freqs tensor; served, it gives the folder's tables."""
    from tiny_models import tiny_model_dir
    from worker.attention.torch_backend import TorchAttentionBackend
    from worker.model_loader import load_model

    folder = tiny_model_dir("llama")
    path = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf("llama", folder, path)
    assert json.loads((folder / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    config = json.loads((gguf_model_folder(path, cache_dir=tmp_path) / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "longrope"

    def rotary(model_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
        model = load_model(
            read_model_spec(model_path), torch.float32, torch.device("cpu"), TorchAttentionBackend()
        )
        return model.rotary.cos, model.rotary.sin_signed

    for ours, reference in zip(rotary(path), rotary(folder), strict=True):
        torch.testing.assert_close(ours, reference, rtol=0, atol=2e-5)


# Each fused weight of the tiny models and the checkpoint tensors it stacks, top to bottom.
FUSED_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_runs_its_quantized_weights_quantized(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native
) -> None:
    """Each fused weight with a quantized part is packed for the integer GEMM, its parts in order (q and
    k unpermuted) and its float parts quantized beside them; multiplied, it stays within the int8
    activations' rounding (and the requantized types' 8-bit step) of the file's own values; with
    gguf_dequantize every weight is packed as floats instead."""
    from tiny_models import tiny_model_dir
    from worker.attention.cpu_backend import CpuAttentionBackend
    from worker.model_loader import load_model
    from worker.quantized_weights import QUANTIZED_TYPES

    monkeypatch.setenv("SLUICE_CACHE", str(tmp_path))
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = write_tiny_gguf(arch, tiny_model_dir(arch), path)
    tensors = gguf.GGUFReader(str(path)).tensors
    types = {hf_tensor_name(t.name): t.tensor_type.name for t in tensors if t.name != ROPE_FREQS_TENSOR}
    spec = read_model_spec(path)
    cpu = torch.device("cpu")
    quantized = load_model(spec, torch.float32, cpu, CpuAttentionBackend(native))
    widened = load_model(spec, torch.float32, cpu, CpuAttentionBackend(native), gguf_dequantize=True)
    torch.manual_seed(0)
    seen = set()
    for index, (layer, float_layer) in enumerate(zip(quantized.layers, widened.layers, strict=True)):
        for fused, parts in FUSED_PARTS.items():
            names = [f"model.layers.{index}.{part}.weight" for part in parts]
            weight = layer.get_submodule(fused).weight
            is_quantized = any(types[name] in QUANTIZED_TYPES for name in names)
            seen.add(is_quantized)
            assert (native.packed_info(weight).format == 3) == is_quantized, (
                fused,
                [types[n] for n in names],
            )
            assert native.packed_info(float_layer.get_submodule(fused).weight).format != 3
            if not is_quantized:
                continue
            reference = torch.cat([expected[name] for name in names]).double()
            x = torch.randn(5, reference.shape[1])
            got = native.linear_float32(x, weight, None).double()
            scale = x.double().abs() @ reference.abs().T
            assert bool(((got - x.double() @ reference.T).abs() <= 0.02 * scale + 1e-6).all()), fused
    assert seen == {True, False}


def test_a_truncated_gguf_file_is_refused_naming_what_is_cut(tmp_path: Path) -> None:
    # The error names the tensor cut short, its type and its bytes, whatever its type.
    path = tmp_path / "quantized.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor(
        "blk.0.ffn_up.weight", gguf.quants.quantize(np.ones((4, 64), np.float32), q8), raw_dtype=q8
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = gguf.GGUFReader(str(path)).tensors
    start, end = int(tensor.data_offset), int(tensor.data_offset) + int(tensor.n_bytes)
    path.write_bytes(path.read_bytes()[: end - 4])
    config = {"model_type": "qwen2", "num_attention_heads": 2}
    message = rf"quantized.gguf is truncated or corrupt: tensor 'blk.0.ffn_up.weight' \(Q8_0\) spans bytes {start} to {end}, but the file ends at byte {end - 4}"
    for keep_quantized in (False, True):
        with pytest.raises(GGUFTensorError, match=message):
            list(gguf_tensors(path, config, show_progress=False, keep_quantized=keep_quantized))
    # A float tensor cut short (the tiny model's last is F32).
    from tiny_models import tiny_model_dir

    tiny = tmp_path / "tiny.gguf"
    write_tiny_gguf("llama", tiny_model_dir("llama"), tiny)
    tiny_config = json.loads((gguf_model_folder(tiny, cache_dir=tmp_path) / "config.json").read_text())
    last = gguf.GGUFReader(str(tiny)).tensors[-1]
    tiny.write_bytes(tiny.read_bytes()[: int(last.data_offset) + int(last.n_bytes) - 4])
    with pytest.raises(
        GGUFTensorError, match=rf"tiny.gguf is truncated or corrupt: tensor '{last.name}' \(F32\) spans bytes"
    ):
        list(gguf_tensors(tiny, tiny_config, show_progress=False))


def test_offline_llm_loads_the_gguf_file(servers: tuple[Server, Server, Server]) -> None:
    from sluice import LLM, SamplingParams

    llm = LLM(
        str(gguf_path()),
        max_model_len=256,
        kv_cache_memory=0.1,
        executor="inproc",
        enforce_eager=True,
        gguf_dequantize=True,
    )
    prompt = "The capital of France is"
    (result,) = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    _, from_folder, _ = clients(servers)
    expected = from_folder.completions.create(
        model=FOLDER_NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.outputs[0].text == expected.choices[0].text
    assert llm.tokenizer.chat_template == (gguf_model_folder(gguf_path()) / "chat_template.jinja").read_text()

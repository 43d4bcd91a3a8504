"""Shared fixtures: tiny HF-saved models for parity tests and the ready models (loaded once per session)."""

from __future__ import annotations

import gc
import os

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


# The slowest test files on the CI machine (2 cores), slowest first: they are collected first and
# ``scripts/test.sh`` keeps that order (``--no-loadscope-reorder``), so the two xdist workers start on the long
# files and finish with the short ones, together. Measured with ``scripts/test.sh --durations=0``.
SLOWEST_FILES = ("test_real_models.py", "test_locret.py", "test_methods_e2e.py", "test_accelerator_compile.py",
                 "test_synthetic.py", "test_mesh.py",
                 "test_heterocache_synckv.py", "test_eval_runner.py", "test_kernel_lowering.py", "test_hcattention.py",
                 "test_selection.py", "test_pallas_paged_attention.py")


def pytest_collection_modifyitems(config, items):
    """Collect the files of :data:`SLOWEST_FILES` first, in that order; the others keep their order after them."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop jax's compiled programs after each test module.

    Every XLA:CPU executable keeps its code in memory mappings; a whole-suite run keeps thousands of
    executables alive and crosses the kernel's ``vm.max_map_count`` (65,530), after which XLA crashes
    while compiling (SIGSEGV / SIGABRT in ``backend_compile_and_load``). Tests never rely on a
    previous module's compilations (trace counts are compared within a test).
    """
    yield
    jax.clear_caches()
    gc.collect()


def ready_model_or_skip(name: str):
    """Path of a ready model's GGUF, or skip the test when its package is not installed."""
    from kvjax.models import is_installed
    from kvjax.models.registry import ready_model_path

    if not is_installed(name):
        pytest.skip(f"ready model {name} not installed")
    return ready_model_path(name)


@pytest.fixture(scope="session")
def tiny_llama3(tmp_path_factory):
    """A tiny random Llama-3 (rope scaling) saved by HF ``transformers`` and loaded by kvjax (float32, no tokenizer)."""
    from kvjax.models import load_model
    from tests.tiny import save_tiny

    path = tmp_path_factory.mktemp("tiny_llama3")
    save_tiny("llama3_rope", str(path), seed=3)
    return load_model(str(path), "float32", tokenizer=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The SmolLM2-135M tokenizer (has a chat template), without the model's weights."""
    from kvjax.models.tokenizer import load_tokenizer

    return load_tokenizer(ready_model_or_skip("smollm2-135m"))


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """Path of a 2-layer random Llama with SmolLM2's tokenizer (and chat template) saved next to it. The layers'
    weights are scaled up (x50) so attention is peaked and greedy answers depend on the prompt (at the default
    initialisation every answer is a run of newlines, and comparing answers would prove nothing)."""
    import torch
    import transformers

    from kvjax.models.registry import ready_model_path
    from kvjax.models.tokenizer import load_tokenizer
    from tests.tiny import scale_layer_matrices

    ready_model_or_skip("smollm2-135m")
    tok = load_tokenizer(ready_model_path("smollm2-135m"))
    path = str(tmp_path_factory.mktemp("tiny_chat"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                      tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    scale_layer_matrices(model, 50)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2():
    """The SmolLM2-135M ready model, loaded by kvjax in float32."""
    ready_model_or_skip("smollm2-135m")
    from kvjax.models import load_model

    return load_model("smollm2-135m", "float32")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    """The same GGUF loaded by transformers (PyTorch, float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = smollm2.path
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()

"""Shape-only models (random weights of the papers' model shapes) and caches built directly at a length
(:mod:`kvjax.evals.synthetic`), checked against HF ``transformers``, the paper's published head classes and a real prefill."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.evals.synthetic import abstract_compressed_cache, filled_cache, synthetic_artifact
from kvjax.cache import CacheSpec, memory_kind, new_cache
from kvjax.decoding import compress, decode_step, prefill_prompt
from kvjax.methods import METHODS, get_method
from kvjax.models import load_model, model_architecture
from tests.mesh_worker import CONFIG, tiny_model


@pytest.mark.parametrize("name,published", [("llama-3.1-8b", 8_030_261_248), ("qwen2.5-7b", 7_615_616_512)])
def test_shape_models_have_the_real_parameter_count(name, published):
    """The abstract model's parameters equal HF transformers' model of the same config (built on the meta device)
    and the count the model's publisher states."""
    import torch
    import transformers
    from flax import nnx

    from kvjax.models.llama import abstract_model

    config, _ = model_architecture(name)
    ours = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nnx.split(abstract_model(config))[1]))
    if config.architecture == "llama":
        hf_config = transformers.LlamaConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_kv_heads, tie_word_embeddings=False)
        cls = transformers.LlamaForCausalLM
    else:
        hf_config = transformers.Qwen2Config(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_kv_heads, tie_word_embeddings=False)
        cls = transformers.Qwen2ForCausalLM
    with torch.device("meta"):
        hf = sum(p.numel() for p in cls(hf_config).parameters())
    assert ours == hf == published
    assert config.max_position_embeddings == 131072
    if name == "llama-3.1-8b":
        assert config.rope_scaling == ("llama3", 8.0, 1.0, 4.0, 8192) and config.head_dim == 128


def test_shape_models_load_only_with_random_weights():
    """A shape-only model has no weights to load: a clear error; its random weights are those of ``random_model``,
    made by one jitted program."""
    from flax import nnx

    from kvjax.models.llama import random_model, random_params

    with pytest.raises(ValueError, match="shapes only"):
        load_model("llama-3.1-8b", "bfloat16", tokenizer=False)
    eager = jax.tree_util.tree_leaves(nnx.split(random_model(CONFIG, jnp.bfloat16, seed=3))[1])
    jitted = jax.tree_util.tree_leaves(random_params(CONFIG, jnp.bfloat16, seed=3))
    assert len(eager) == len(jitted)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(eager, jitted))


def test_heterocache_synthetic_classes_are_the_papers_for_llama_8b():
    """The synthetic HeteroCache artifact for Llama-3.1-8B shapes has the paper's classes: 33 pivot, 196 satellite,
    17 volatile, 10 anchor of 256 KV heads; every satellite follows a pivot of its own layer."""
    config, _ = model_architecture("llama-3.1-8b")
    spec = CacheSpec.for_model(config, 1, 1024, 8, "bfloat16")
    meta = synthetic_artifact(get_method("heterocache", budget=0.25), spec).meta_dict()
    counts = collections.Counter(r for row in meta["roles"] for r in row)
    assert counts == {"pivot": 33, "satellite": 196, "volatile": 17, "anchor": 10}
    for layer, row in enumerate(meta["roles"]):
        for head, role in enumerate(row):
            if role == "satellite":
                pl, ph = meta["pivot_of"][layer][head]
                assert pl == layer and meta["roles"][pl][ph] == "pivot"


PROMPT, ROOM = 96, 4


@pytest.fixture(scope="module")
def model():
    return tiny_model(CONFIG)


def _leaves(cache):
    return [(jax.tree_util.keystr(p), tuple(x.shape), jnp.dtype(x.dtype).name, memory_kind(x))
            for p, x in jax.tree_util.tree_leaves_with_path(cache) if hasattr(x, "dtype")]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_filled_cache_has_the_real_layout(model, name):
    """For every method, the cache built directly from random data has the structure, shapes, dtypes and memory kinds
    (host tiers in ``pinned_host``) of the cache a real prefill + compress makes, ``abstract_compressed_cache`` describes
    it without allocating, and a decode step runs on it."""
    bounded = {"locret": {"local": 16, "chunk": 32}, "chunked_eviction": {"local": 16, "chunk": 32, "stabilizers": 8},
               "kvzip": {"allocation": "head", "chunk": 32}}.get(name, {})  # KVzip: the planned layout, per head
    method = get_method(name) if name == "full" else get_method(name, budget=0.5, **bounded)
    spec = CacheSpec.for_model(model.config, 2, PROMPT, ROOM, "float32")
    artifact = synthetic_artifact(method, spec)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, PROMPT), 0, model.config.vocab_size, jnp.int32)
    real = new_cache(method, model.config, 2, PROMPT, ROOM, "float32", artifact=artifact)
    _, real = prefill_prompt(model.graphdef, model.params, tokens, real)
    if method.rereads_context():
        from kvjax.methods.kvzip import ReconstructionPrompt, score_context

        real = score_context(model.graphdef, model.params, real, np.asarray(tokens),
                             ReconstructionPrompt(prefix=2, first=(3, 4), later=(5,), suffix=(6,)))
    real = compress(real)
    synthetic = filled_cache(method, spec, artifact, seed=1)
    assert jax.tree_util.tree_structure(synthetic) == jax.tree_util.tree_structure(real)
    assert _leaves(synthetic) == _leaves(real)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    abstract = abstract_compressed_cache(method, spec, mesh, artifact)
    assert [(p, s, d) for p, s, d, _ in _leaves(abstract)] == [(p, s, d) for p, s, d, _ in _leaves(real)]
    assert [k for *_, k in _leaves(abstract)] == [k for *_, k in _leaves(real)]
    nxt, logits, _ = decode_step(model.graphdef, model.params, tokens[:, -1], synthetic, jax.random.PRNGKey(0))
    assert nxt.shape == (2,) and bool(jnp.all(jnp.isfinite(logits)))


@pytest.mark.parametrize("name", sorted(METHODS))
def test_replicated_rows_equal_a_batch_of_identical_rows(name):
    """``replicated_cache`` (one row staged, then tiled: page tables offset per row) equals leaf for leaf, integers
    included, the cache the method's own ``finish_prefill`` makes from a batch whose rows are identical."""
    from kvjax.evals.synthetic import replicated_cache

    bounded = {"locret": {"local": 16, "chunk": 32}, "chunked_eviction": {"local": 16, "chunk": 32, "stabilizers": 8}}
    method = get_method(name) if name == "full" else get_method(name, budget=0.5, **bounded.get(name, {}))
    spec = CacheSpec.for_model(CONFIG, 3, PROMPT, ROOM, "float32")
    artifact = synthetic_artifact(method, spec)
    tiled = replicated_cache(method, spec, artifact, seed=2)
    whole = filled_cache(method, spec, artifact, seed=2, same_rows=True)
    assert jax.tree_util.tree_structure(tiled) == jax.tree_util.tree_structure(whole)
    assert _leaves(tiled) == _leaves(whole)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(tiled), jax.tree_util.tree_leaves(whole)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_bench_takes_the_shipped_artifact_else_a_synthetic_one_with_random_weights():
    """``kvjax bench``'s artifacts: the shipped calibration for a ready model; for a shape-only model with random
    weights a synthetic one (the paper's head classes); with real weights and nothing shipped, the method's own
    error."""
    from kvjax.evals.bench_methods import bench_artifacts

    methods = {"snapkv": get_method("snapkv"), "heterocache": get_method("heterocache"),
               "hcattention": get_method("hcattention")}
    ready, _ = model_architecture("qwen2.5-coder-0.5b")
    arts, sources = bench_artifacts(methods, ready, random_weights=True)
    assert sources == {"snapkv": None, "heterocache": "own", "hcattention": "own"}  # the shipped calibrations
    assert arts == {"snapkv": None, "heterocache": None, "hcattention": None}
    shape, _ = model_architecture("llama-3.1-8b")
    arts, sources = bench_artifacts(methods, shape, random_weights=True)
    assert sources == {"snapkv": None, "heterocache": "synthetic", "hcattention": "synthetic"}
    spec = CacheSpec.for_model(shape, 1, 1, 1, "float32")
    assert arts["heterocache"].meta == synthetic_artifact(methods["heterocache"], spec).meta
    with pytest.raises(ValueError, match="no heterocache artifact .* none ships with kvjax"):
        bench_artifacts(methods, shape, random_weights=False)

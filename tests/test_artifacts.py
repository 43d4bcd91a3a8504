"""Artifacts travel with the cache as data and are checked against the model they were made for."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.artifacts import Artifact, model_identity, require_artifact
from kvjax.cache import CacheSpec
from kvjax.methods import FullCache, SnapKV
from kvjax.models.config import ModelConfig


def config(**kw):
    base = dict(architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                tie_word_embeddings=False, attention_bias=False, qk_norm=False, rope_scaling=None, name="tiny")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in {**base, **kw}.items() if k in fields})


def test_model_identity_is_stable_and_separates_architectures():
    assert model_identity(config()) == model_identity(config())
    assert model_identity(config()) != model_identity(config(num_kv_heads=4))
    assert model_identity(config()) != model_identity(config(name="other"))


def test_artifact_for_another_model_is_a_clear_error():
    art = Artifact(arrays={"classes": jnp.zeros((2, 2), jnp.int32)}, kind="heterocache", model_id=model_identity(config()))
    require_artifact(art, "heterocache", model_identity(config()))  # fine
    with pytest.raises(ValueError, match="made for model 'tiny:.*but the cache is for 'tiny:"):
        require_artifact(art, "heterocache", model_identity(config(num_layers=3)))
    with pytest.raises(ValueError, match="artifact of kind 'heterocache' given to a 'synckv' method"):
        require_artifact(art, "synckv", model_identity(config()))
    with pytest.raises(ValueError, match="needs an artifact"):
        require_artifact(None, "synckv", model_identity(config()))


def test_methods_without_artifacts_refuse_one():
    spec = CacheSpec.for_model(config(), 1, 32, 4, "float32")
    art = Artifact(arrays=jnp.zeros(3), kind="locret", model_id=spec.model_id)
    for method in (FullCache(), SnapKV(budget=8, window=4)):
        with pytest.raises(ValueError, match="takes no artifact"):
            method.init_cache(spec, art)


def test_artifact_is_a_pytree_argument_not_a_static_field():
    """Changing the artifact's arrays does not retrace a jitted function of the cache; it is data."""
    spec = CacheSpec.for_model(config(), 1, 32, 4, "float32")
    cache = FullCache().init_cache(spec)
    traces = []

    @jax.jit
    def read(c):
        traces.append(1)
        return c.artifact.arrays["w"].sum()

    for value in (1.0, 2.0):
        c = cache.replace(artifact=Artifact(arrays={"w": jnp.full((3,), value)}, kind="x", model_id=spec.model_id))
        assert float(read(c)) == 3 * value
    assert len(traces) == 1
    assert np.isclose(cache.replace(artifact=Artifact(arrays={"w": jnp.ones(5)})).stats()["device_bytes"]
                      - cache.stats()["device_bytes"], 20)  # the artifact's bytes are counted


@pytest.mark.parametrize("argv, where", [([], "user"), (["--ship"], "shipped"), (["--out-dir", "OUT"], "out")])
def test_calibrate_writes_where_the_methods_look(tmp_path, monkeypatch, argv, where):
    """``kvjax calibrate``'s artifact goes to this machine's artifacts by default (where ``installed_artifact`` looks
    after the shipped ones), to the shipped location with ``--ship``, or to ``--out-dir``; not both."""
    from kvjax.artifacts import shipped_artifact_path
    from kvjax.make_artifacts import artifact_out, build_parser

    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path))
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in argv]
    args = build_parser().parse_args(["heterocache", *argv])
    got = artifact_out(args, "heterocache", "some-model:abc", "g8", ".json")
    expected = {"user": tmp_path / "artifacts" / "heterocache" / "some-model-g8.json",
                "shipped": shipped_artifact_path("heterocache", "some-model:abc", "g8", suffix=".json"),
                "out": tmp_path / "out" / "some-model-g8.json"}[where]
    assert got == expected
    with pytest.raises(SystemExit):
        build_parser().parse_args(["heterocache", "--ship", "--out-dir", "x"])

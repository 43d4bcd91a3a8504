"""Eviction during chunked prefill with a bounded working buffer (the mechanism Locret will use).

A test method keeps at most ``capacity + chunk`` tokens per KV head while prefilling and evicts to
``capacity`` (by key norm) after every chunk. Checked: it equals the full cache when nothing is
evicted (chunked, ragged batch), its layer-0 survivors equal a numpy simulation of the policy on
the full cache's keys, and its memory does not grow with the prompt.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.api import generate_tokens
from kvjax.cache import Cache, new_cache
from kvjax.decoding import prefill_prompt
from kvjax.methods import FullCache
from kvjax.paged import append_and_attend, build_paged
from kvjax.working_buffer import buffer_chunk, evict_to, init_working, kept_indices
from kvjax.models import load_model
from tests.tiny import PEAKED, save_tiny


@dataclasses.dataclass(frozen=True)
class EvictEveryChunk:
    """Test method: bounded buffer, evict to ``capacity`` tokens by key norm after every chunk."""

    capacity: int
    chunk: int
    page_size: int = 8
    name = "evict_every_chunk"

    def recording(self):
        return None

    def artifact_for(self, spec, artifact=None):
        return None

    def init_cache(self, spec, artifact=None):
        return Cache.create(init_working(spec, self.capacity, self.chunk), self, spec)

    def prefill_chunk(self, state, q, k, v, ctx):
        out, state = buffer_chunk(state, q, k, v, ctx, jnp.linalg.norm(k.astype(jnp.float32), axis=-1))
        return out, evict_to(state, state.scores)

    def finish_prefill(self, state, ctx):
        idx, count = kept_indices(state)
        return build_paged(state.k, state.v, idx, count, (self.capacity,) * state.k.shape[1], ctx.spec.room, self.page_size)

    def decode_attend(self, state, q, k, v, ctx):
        return append_and_attend(state, q, k, v, "xla")

    def around_layers(self, cache, tokens, run):
        return run(cache)

    def question_passes(self):
        return 1

    def rereads_context(self):
        return False

    def stats(self, cache):
        return {}

    def bytes_read_per_step(self, cache):
        return 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_buffer")
    save_tiny("qwen2", str(path), seed=9, scale=PEAKED)
    return load_model(str(path), "float32", tokenizer=False)


def test_nothing_evicted_equals_full_cache(tiny):
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(0, 97, size=45)), list(rng.integers(0, 97, size=23))]
    full, _, _, _ = generate_tokens(tiny, rows, method=FullCache(block=16), max_new_tokens=6)
    got, _, cache, _ = generate_tokens(tiny, rows, method=EvictEveryChunk(capacity=48, chunk=16), max_new_tokens=6,
                                       chunk_size=16)
    np.testing.assert_array_equal(got, full)
    assert np.asarray(cache.layers[0].lengths).tolist() == [[45 + 5] * 2, [23 + 5] * 2]


def test_survivors_match_a_numpy_simulation(tiny):
    """Layer 0's keys do not depend on the cache: simulate the policy on the full cache's layer-0 keys."""
    rng = np.random.default_rng(1)
    L, chunk, cap = 48, 16, 12
    tokens = rng.integers(0, 97, size=(1, L)).astype(np.int32)
    full = new_cache(FullCache(block=16), tiny.config, 1, L, 0, tiny.dtype)
    _, full = prefill_prompt(tiny.graphdef, tiny.params, tokens, full)
    keys = np.asarray(full.layers[0].k)[0, :, :L]  # [Hkv, L, D]
    cache = new_cache(EvictEveryChunk(capacity=cap, chunk=chunk), tiny.config, 1, L, 0, tiny.dtype)
    _, cache = prefill_prompt(tiny.graphdef, tiny.params, tokens, cache, chunk_size=chunk)
    got = np.asarray(cache.layers[0].slots)[0]
    for h in range(keys.shape[0]):
        norms = np.linalg.norm(keys[h], axis=-1)
        held: list[int] = []
        for start in range(0, L, chunk):
            held = held + list(range(start, start + chunk))
            held = sorted(sorted(held, key=lambda s: (-norms[s], s))[:cap])  # ties: the earlier slot
        assert got[h, :cap].tolist() == held
        assert (got[h, cap:] == -1).all()
        np.testing.assert_allclose(np.asarray(cache.layers[0].k)[0, h, :cap], keys[h, held], atol=1e-5)


def test_memory_does_not_grow_with_the_prompt(tiny):
    method = EvictEveryChunk(capacity=8, chunk=16)
    sizes = [new_cache(method, tiny.config, 1, L, 4, tiny.dtype).device_bytes() for L in (32, 256)]
    assert sizes[0] == sizes[1]
    with pytest.raises(ValueError, match="does not fit the working buffer's chunk of 16"):
        generate_tokens(tiny, [[1] * 40], method=method, max_new_tokens=2, chunk_size=32)

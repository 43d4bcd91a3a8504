"""The full (contiguous) cache stored in a ``kv_dtype``: decode attention over an int8 cache against a float64 numpy
reference, the model's dtype unchanged, device bytes with scales, generation close to the unquantized cache, and
``kvjax eval``'s row of the full cache stored in ``--kv-dtype`` beside the reference."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.api import left_pad
from kvjax.attention import causal_cache_attention
from kvjax.cache import AttendContext, CacheSpec, FinishContext
from kvjax.cli import main as cli_main
from kvjax.decoding import compress, decode_step, prefill, prefill_prompt
from kvjax.methods import FullCache
from kvjax.methods.full import DenseKV
from kvjax.sharding import ROWS_HEADS
from kvjax.staging import StagedKV, write_slots

B, HKV, G, S, D = 2, 2, 2, 128, 16  # S: a multiple of the kernel's 64-token pages


def numpy_int8(x: np.ndarray):
    """(codes, scales, dequantized float64) of the scheme in numpy: ``s = absmax / 127`` and ``x / s`` in float32 as
    the scheme computes them, ``round`` half to even, the product ``q * s`` in float64."""
    x = x.astype(np.float32)
    s = (np.abs(x).max(axis=-1) / np.float32(127)).astype(np.float32)
    y = x / np.where(s > 0, s, np.float32(1))[..., None]
    q = np.clip(np.round(y), -127, 127)
    return q.astype(np.int8), s, q.astype(np.float64) * s[..., None].astype(np.float64)


def numpy_attention(q, k, v, q_slots, pad):
    """Causal GQA attention in float64: ``q[B, T, Hq, D]`` at slots ``q_slots``, ``k, v[B, Hkv, S, D]``; a key slot
    is visible from ``pad[b]`` to the query's own slot."""
    Bq, T, Hq, Dq = q.shape
    groups = Hq // k.shape[1]
    out = np.zeros((Bq, T, Hq, Dq))
    for b in range(Bq):
        for t in range(T):
            for h in range(Hq):
                keys = k[b, h // groups, pad[b]:q_slots[t] + 1]
                s = keys @ q[b, t, h] / np.sqrt(Dq)
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ v[b, h // groups, pad[b]:q_slots[t] + 1]
    return out


def int8_spec():
    return CacheSpec(num_layers=1, num_heads=HKV * G, num_kv_heads=HKV, head_dim=D, batch=B, prompt_slots=96,
                     longest_row=96, room=S - 96, dtype="float32", kv_dtype="int8")


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_int8_full_cache_decode_attention_against_float64_reference(implementation):
    """A prompt of 96 slots (rows left-padded by 0 and 37; keys whose per-token ranges span 0.1x to 10x, one outlier
    token) becomes an int8 cache at compression, then a 3-token question and one decoded token are appended.

    Against a float64 numpy reference over the numpy-quantized-then-dequantized keys and values, the cache stores
    exactly numpy's codes and scales, and its attention differs by float32 rounding alone (<= 2e-5: the same values,
    summed over at most 128 slots in float32).

    Against float64 attention over the unquantized keys and values, the difference stays within the scheme's bound:
    per element ``|k - deq(k)| <= s_k / 2``, so a logit moves by at most ``delta = ||q||_1 max s_k / 2 / sqrt(D)``,
    the softmax weights by at most ``e^(2 delta) - 1`` in L1 norm, and an output element by at most
    ``(e^(2 delta) - 1) max |deq(v)| + max s_v / 2``.
    """
    rng = np.random.default_rng(0)
    pad = np.asarray([0, 37], np.int32)
    k = rng.normal(size=(B, HKV, S, D)) * rng.uniform(0.1, 10, size=(B, HKV, S, 1))
    v = rng.normal(size=(B, HKV, S, D))
    k[:, :, 50, 3] = 300.0  # an outlier token: only its own scale grows
    k[:, :, 96:], v[:, :, 96:] = 0.0, 0.0  # the room: nothing written yet
    k[1, :, :37], v[1, :, :37] = 0.0, 0.0  # the second row's left padding
    new_k = rng.normal(size=(B, 4, HKV, D)) * 3.0  # a 3-token question, then one decoded token
    new_v = rng.normal(size=(B, 4, HKV, D))
    q = rng.normal(size=(B, 4, HKV * G, D))

    spec = int8_spec()
    method = FullCache(block=64, implementation=implementation)
    staged = StagedKV(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), None, None)
    state = method.finish_prefill(staged, FinishContext(pad=jnp.asarray(pad), spec=spec))
    assert state.k.dtype == jnp.int8 and state.k_scales.shape == (B, HKV, S) and state.k_scales.dtype == jnp.float32

    def attend(state, start, t):
        ctx = AttendContext(start=jnp.asarray(start, jnp.int32), pad=jnp.asarray(pad),
                            positions=jnp.zeros((B, len(t)), jnp.int32))
        return method.decode_attend(state, jnp.asarray(q[:, t], jnp.float32), jnp.asarray(new_k[:, t], jnp.float32),
                                    jnp.asarray(new_v[:, t], jnp.float32), ctx)

    out_question, state = attend(state, 96, [0, 1, 2])
    out_step, state = attend(state, 99, [3])

    k_all, v_all = k.copy(), v.copy()
    k_all[:, :, 96:100], v_all[:, :, 96:100] = new_k.transpose(0, 2, 1, 3), new_v.transpose(0, 2, 1, 3)
    (k_codes, k_s, k_deq), (v_codes, v_s, v_deq) = numpy_int8(k_all), numpy_int8(v_all)
    # XLA may divide by 127 as a product with its reciprocal: a scale within 2 float32 ulps of numpy's (no code of
    # these values sits that close to a rounding tie, so the codes are numpy's exactly)
    np.testing.assert_array_equal(np.asarray(state.k), k_codes)  # prompt at compression, appended tokens as written
    np.testing.assert_array_equal(np.asarray(state.v), v_codes)
    np.testing.assert_allclose(np.asarray(state.k_scales), k_s, rtol=2.5e-7)
    np.testing.assert_allclose(np.asarray(state.v_scales), v_s, rtol=2.5e-7)

    got = np.concatenate([np.asarray(out_question), np.asarray(out_step)], axis=1)
    slots = np.arange(96, 100)
    want = numpy_attention(q, k_deq, v_deq, slots, pad)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)

    exact = numpy_attention(q, k_all, v_all, slots, pad)
    delta = np.abs(q).sum(-1).max() * k_s.max() / 2 / np.sqrt(D)
    bound = (np.exp(2 * delta) - 1) * np.abs(v_deq).max() + v_s.max() / 2
    assert np.abs(got - exact).max() <= bound
    assert np.abs(got - exact).max() > 1e-4  # quantization is really there: the comparison above is not vacuous


@dataclasses.dataclass(frozen=True)
class PreviousFull(FullCache):
    """The full cache as it was before ``kv_dtype`` reached it: the staging becomes the cache, each later token is
    written into it, attention reads it as stored."""

    def finish_prefill(self, state, ctx):
        return DenseKV(k=state.k, v=state.v)

    def decode_attend(self, state, q, k, v, ctx):
        from kvjax.attention import contiguous_decode_attention, kernel_reads_contiguous

        k_new, v_new = write_slots(state.k, k, ctx.start), write_slots(state.v, v, ctx.start)
        T, Dq = q.shape[1], q.shape[3]
        if T == 1 and kernel_reads_contiguous(k_new.shape[2], Dq, self.implementation):
            out = contiguous_decode_attention(q[:, 0], k_new, v_new, length=ctx.start + 1, pad=ctx.pad,
                                              implementation=self.implementation, mesh=ctx.mesh)[:, None]
        else:
            out = causal_cache_attention(q, k_new, v_new, q_start=ctx.start, pad=ctx.pad, scale=Dq**-0.5,
                                         block=self.block, implementation=self.implementation)
        return out, DenseKV(k=k_new, v=v_new)


@pytest.fixture(scope="module")
def tiny(tiny_llama3):
    return tiny_llama3


def teacher_forced(model, method, rows, feed, *, chunk, kv_dtype, question=None):
    """``(logits [B, 1 + len(feed), V], cache)``: the prompt's last logits (or the question's, prefilled after
    compression), then each decode step's, feeding ``feed[B, N]``; rows left-padded to a multiple of ``chunk``."""
    tokens, pad = left_pad(rows, 0, multiple=chunk)
    room = feed.shape[1] + (0 if question is None else question.shape[1])
    spec = CacheSpec.for_model(model.config, len(rows), tokens.shape[1], room, model.dtype,
                               longest_row=max(len(r) for r in rows), kv_dtype=kv_dtype)
    cache = method.init_cache(spec).replace(pad=jnp.asarray(pad))
    logits, cache = prefill_prompt(model.graphdef, model.params, jnp.asarray(tokens), cache, chunk_size=chunk)
    cache = compress(cache)
    if question is not None:
        logits, cache = prefill(model.graphdef, model.params, jnp.asarray(question), cache)
    out = [np.asarray(logits)]
    for t in range(feed.shape[1]):
        _, logits, cache = decode_step(model.graphdef, model.params, jnp.asarray(feed[:, t]), cache,
                                       jax.random.PRNGKey(0))
        out.append(np.asarray(logits))
    return np.stack(out, axis=1), cache


def ragged(seed=11):
    rng = np.random.default_rng(seed)
    rows = [list(rng.integers(0, 97, size=40)), list(rng.integers(0, 97, size=20))]
    return rows, rng.integers(0, 97, size=(2, 3)).astype(np.int32), rng.integers(0, 97, size=(2, 5)).astype(np.int32)


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_model_kv_dtype_is_the_previous_full_cache(tiny, implementation):
    """``kv_dtype`` = the model's dtype (and None) gives exactly the logits of the full cache as it was before
    ``kv_dtype`` (:class:`PreviousFull`) on a left-padded ragged batch with chunk padding, a question prefilled after
    compression and decode steps; the cache holds the same arrays, no scales, and splits K/V alone."""
    rows, question, feed = ragged()
    previous, prev_cache = teacher_forced(tiny, PreviousFull(block=64, implementation=implementation), rows, feed,
                                          chunk=32, kv_dtype=None, question=question)
    for kv_dtype in (None, "float32"):
        got, cache = teacher_forced(tiny, FullCache(block=64, implementation=implementation), rows, feed, chunk=32,
                                    kv_dtype=kv_dtype, question=question)
        np.testing.assert_array_equal(got, previous, err_msg=str(kv_dtype))
        for st, prev in zip(cache.layers, prev_cache.layers):
            assert st.k_scales is None and st.v_scales is None and not st.quantized
            assert len(jax.tree_util.tree_leaves(st)) == 2 and st.k.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(st.k), np.asarray(prev.k))
            np.testing.assert_array_equal(np.asarray(st.v), np.asarray(prev.v))
        part = cache.method.state_partition(cache.layers[0], cache.spec)
        assert (part.k, part.v, part.k_scales, part.v_scales) == (ROWS_HEADS, ROWS_HEADS, None, None)
        assert cache.stats()["device_bytes"] == prev_cache.stats()["device_bytes"]


@pytest.mark.parametrize("kv_dtype, itemsize, scale_bytes", [("float32", 4, 0), ("bfloat16", 2, 0), ("int8", 1, 4),
                                                             ("float8_e4m3fn", 1, 4)])
def test_device_bytes_count_the_stored_dtype_and_scales(tiny, kv_dtype, itemsize, scale_bytes):
    """Rows of 40 and 20 tokens padded to 64 slots, a 3-token question and 5 decode steps: round_up(64 + 8, 64) = 128
    slots per (row, KV head, layer); each stores D values of K and of V in ``kv_dtype`` and, quantized, one float32
    scale each. A decode step reads every written slot (72 after the 5 steps fed) in the same form."""
    cfg = tiny.config
    rows, question, feed = ragged()
    _, cache = teacher_forced(tiny, FullCache(block=64), rows, feed, chunk=32, kv_dtype=kv_dtype, question=question)
    per_slot = 2 * (cfg.head_dim * itemsize + scale_bytes)  # K and V
    stats = cache.stats()
    assert stats["device_bytes"] == cfg.num_layers * 2 * cfg.num_kv_heads * 128 * per_slot + 4 + 2 * 4  # + length, pad
    assert stats["kv_bytes_read_per_step"] == cfg.num_layers * 2 * cfg.num_kv_heads * 72 * per_slot
    st = cache.layers[0]
    assert st.k.dtype == jnp.dtype(kv_dtype) and st.quantized == (scale_bytes > 0)
    part = cache.method.state_partition(st, cache.spec)
    assert part.k_scales == (ROWS_HEADS if scale_bytes else None)


def test_int8_full_cache_logits_close_to_the_unquantized(tiny):
    """Teacher-forced over a question and 5 decode steps, the int8 full cache's log-probabilities stay within 0.005
    nats of the float32 cache's (max over rows, steps and the 97-token vocabulary), and the argmax never changes where
    the float32 cache's top two are more than 0.1 nats apart. The bound: int8 stores each element within
    ``absmax / 254`` of its value (0.4% of its token's range); on this model that moved the log-probs by 6e-4 nats at
    most, so 0.005 leaves an 8x margin. The fp8 cache (up to 6% per element) moves them more than int8 does."""
    rows, question, feed = ragged(5)
    ref, _ = teacher_forced(tiny, FullCache(block=64), rows, feed, chunk=32, kv_dtype=None, question=question)
    got, cache = teacher_forced(tiny, FullCache(block=64), rows, feed, chunk=32, kv_dtype="int8", question=question)
    fp8, _ = teacher_forced(tiny, FullCache(block=64), rows, feed, chunk=32, kv_dtype="float8_e4m3fn",
                            question=question)
    assert cache.layers[0].k.dtype == jnp.int8
    lp_ref, lp_got, lp_fp8 = (np.asarray(jax.nn.log_softmax(x, axis=-1)) for x in (ref, got, fp8))
    diff = np.abs(lp_got - lp_ref).max()
    assert 0 < diff <= 0.005
    assert np.abs(lp_fp8 - lp_ref).max() > diff
    top2 = np.sort(lp_ref, axis=-1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 0.1
    assert (lp_got.argmax(-1) == lp_ref.argmax(-1))[clear].all()


def _lines(path):
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def test_eval_full_listed_with_kv_dtype_is_its_own_row(tiny_chat_model, tmp_path, capsys):
    """``--methods full,snapkv --kv-dtype int8``: the reference ``full`` is the float32 run's (same answers, same
    bytes), the row ``full:kv_dtype=int8`` keeps every token in int8 with per-token scales (hand-computed bytes:
    ``(D + 4) / (4 D)`` of the reference's K/V), every record names its dtype, the report and the fidelity check have
    the row, a resumed run adds nothing, and ``full`` with options is refused."""
    common = ["eval", "--model", tiny_chat_model, "--budgets", "0.5", "--tasks", "niah_single", "--lengths", "300",
              "--samples", "2", "--batch-size", "2", "--chunk-size", "128", "--out-root", str(tmp_path),
              "--fidelity-texts", "1", "--fidelity-prefix", "128", "--fidelity-tokens", "4", "--no-progress"]
    assert cli_main(common + ["--methods", "full,snapkv", "--run-name", "f32"]) == 0
    f32 = {(r["index"], r["method"]): r for r in _lines(tmp_path / "f32" / "samples.jsonl")}
    assert {m for _, m in f32} == {"full", "snapkv"}  # without --kv-dtype, `full` adds no row
    argv = common + ["--methods", "full,snapkv", "--run-name", "int8", "--kv-dtype", "int8"]
    assert cli_main(argv) == 0
    records = _lines(tmp_path / "int8" / "samples.jsonl")
    int8 = {(r["index"], r["method"]): r for r in records}
    assert len(records) == len(int8) == 2 * 3
    config = json.loads((tmp_path / "int8" / "config.json").read_text())
    with open(f"{tiny_chat_model}/config.json") as f:
        hf = json.load(f)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    for i in (0, 1):
        ref, stored = int8[i, "full"], int8[i, "full:kv_dtype=int8"]
        assert (ref["output"], ref["device_bytes"]) == (f32[i, "full"]["output"], f32[i, "full"]["device_bytes"])
        assert ref["kv_dtype"] == "float32" and stored["kv_dtype"] == int8[i, "snapkv"]["kv_dtype"] == "int8"
        assert stored["budget"] == "full"
        overhead = (4 + 2 * 4) // 2  # the slot counter and the two rows' padding, shared by the batch's 2 rows
        kv = ref["device_bytes"] - overhead
        assert stored["device_bytes"] == kv * (head_dim + 4) // (4 * head_dim) + overhead
    assert config["kv_dtype"] == "int8" and "full" in config["methods"]
    md = (tmp_path / "int8" / "README.md").read_text()
    assert "| full:kv_dtype=int8 | full |" in md
    assert "the row `full:kv_dtype=int8`: the full cache stored in int8" in md and "Incomplete" not in md
    summary = json.loads((tmp_path / "int8" / "summary.json").read_text())
    assert [(r["method"], r["budget"]) for r in summary["rows"]] == [("full", "full"), ("full:kv_dtype=int8", "full"),
                                                                    ("snapkv", "0.5")]
    fid = {(r["method"], r["budget"]): r for r in _lines(tmp_path / "int8" / "fidelity.jsonl")}
    assert fid[("full", "full")]["kl"] == 0.0 and fid[("full", "full")]["kv_dtype"] == "float32"
    stored_fid = fid[("full:kv_dtype=int8", "full")]
    assert stored_fid["kv_dtype"] == "int8" and stored_fid["kl"] > 0  # quantized against the float32 reference
    assert stored_fid["device_bytes"] < 0.5 * fid[("full", "full")]["device_bytes"]
    # resumed: nothing new
    assert cli_main(argv) == 0
    assert len(_lines(tmp_path / "int8" / "samples.jsonl")) == len(records)
    capsys.readouterr()
    assert cli_main(common + ["--methods", "full:block=64,snapkv", "--run-name", "bad", "--kv-dtype", "int8"]) == 2
    assert "the full cache takes no options in methods" in capsys.readouterr().err


MESH_SCRIPT = """
import json
import numpy as np
from kvjax.api import generate_tokens
from kvjax.methods import FullCache
from kvjax.models.sharding import shard_model
from tests.mesh_worker import CONFIG_D16, tiny_model

base = tiny_model(CONFIG_D16)
rng = np.random.default_rng(0)
rows = [list(rng.integers(1, 128, size=n)) for n in (40, 33, 28, 40)]
out = {}
for mesh in ("one device", "data=2,model=2"):
    model = base if mesh == "one device" else shard_model(base, mesh)
    for impl in ("xla", "pallas_interpret"):
        method = FullCache(block=64, implementation=impl)
        tokens, _, cache, _ = generate_tokens(model, rows, method=method, max_new_tokens=4, chunk_size=16, kv_dtype="int8")
        st = cache.layers[0]
        out[mesh + " " + impl] = {"tokens": np.asarray(tokens).tolist(), "bytes": cache.stats()["device_bytes"],
                                  "scale_shards": [list(s.data.shape) for s in st.k_scales.addressable_shards],
                                  "k_shards": [list(s.data.shape) for s in st.k.addressable_shards]}
print(json.dumps(out))
"""


def test_int8_full_cache_split_over_a_mesh():
    """On a (data=2, model=2) mesh of 4 simulated CPU devices the scales ``[B, Hkv, S]`` are split by row and KV head
    like K and V, and the int8 full cache generates the one-device tokens (XLA, and the Pallas kernel per device under
    ``shard_map`` reading its own rows' and heads' scales)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
               JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", MESH_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    for impl in ("xla", "pallas_interpret"):
        one, split = out[f"one device {impl}"], out[f"data=2,model=2 {impl}"]
        assert split["tokens"] == one["tokens"], impl
        assert split["bytes"] == one["bytes"]
        (b, h, s), = {tuple(x) for x in one["scale_shards"]}
        assert split["scale_shards"] == [[b // 2, h // 2, s]] * 4  # by row and KV head, one block per device
        assert split["k_shards"] == [[b // 2, h // 2, s, 16]] * 4

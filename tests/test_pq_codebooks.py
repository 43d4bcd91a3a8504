"""PQ codebooks (HCAttention keys): K-means on hand-made clusters, encode/decode against numpy brute force,
the PQ kernel's scores against numpy on our codes, the .npz artifact, errors, and key collection against HF."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.artifacts import (Artifact, installed_artifact, load_artifact, save_artifact, shipped_artifact_path,
                             user_artifact_path)
from kvjax.pq_codebooks import (code_dtype, codebook_variant, collect_keys, decode_keys, encode_keys, fit_codebooks,
                                hcattention_artifact, kmeans_minibatch, quantization_error)
from kvjax.pallas_kernels.pq_attention import pq_scores


# ------------------------------------------------------------------------------------------ K-means
def blobs(problems=3, per_blob=100, d=2, sigma=0.05, seed=0):
    """4 well-separated Gaussian blobs per problem: (points [P, 4 * per_blob, d], true centres [P, 4, d])."""
    rng = np.random.default_rng(seed)
    corners = np.array(list(itertools.product((-5.0, 5.0), repeat=d)))[:4]
    centres = corners[None] + rng.uniform(-1, 1, (problems, 4, d))
    pts = centres[:, :, None, :] + sigma * rng.standard_normal((problems, 4, per_blob, d))
    pts = pts.reshape(problems, 4 * per_blob, d)
    perm = rng.permutation(4 * per_blob)
    return pts[:, perm].astype(np.float32), centres


def match_error(found, true):
    """Largest distance between true centres and found centres under the best permutation."""
    return min(max(np.linalg.norm(found[list(p)] - true, axis=-1)) for p in itertools.permutations(range(len(true))))


def test_kmeans_recovers_blob_centres_deterministically():
    pts, centres = blobs()
    got = np.asarray(kmeans_minibatch(pts, 4, iterations=30, batch=64, seed=3))
    assert got.shape == (3, 4, 2) and got.dtype == np.float32
    for p in range(3):
        # blob means of 100 points with sigma 0.05 are within ~0.02 of the true centres
        assert match_error(got[p], centres[p]) < 0.05
    again = np.asarray(kmeans_minibatch(pts, 4, iterations=30, batch=64, seed=3))
    np.testing.assert_array_equal(got, again)
    other = np.asarray(kmeans_minibatch(pts, 4, iterations=30, batch=64, seed=4))
    for p in range(3):
        assert match_error(other[p], centres[p]) < 0.05


def test_kmeans_with_batch_of_everything_is_the_running_mean():
    """One step over one blob (c = 1): the centre becomes the mean of the drawn points."""
    pts = np.random.default_rng(1).standard_normal((2, 50, 3)).astype(np.float32)
    got = np.asarray(kmeans_minibatch(pts, 1, iterations=40, batch=256))
    np.testing.assert_allclose(got[:, 0], pts.mean(axis=1), atol=0.1)  # 40 * 256 draws with replacement


def test_kmeans_does_not_depend_on_the_scoring_chunk(monkeypatch):
    """The batch's points are scored in chunks sized by the distance block: chunks of 7 points (250 = 35 * 7 + 5,
    the last padded) give the same centres as one unpadded chunk of the whole batch, so the padding joins no
    centre's mean and the assignments do not depend on the chunk."""
    import kvjax.pq_codebooks as pq

    pts = 10.0 + np.random.default_rng(5).standard_normal((2, 900, 3)).astype(np.float32)  # far from the zero pad
    whole = np.asarray(kmeans_minibatch(pts, 5, iterations=20, batch=250, seed=1))
    for name in ("DISTANCE_BLOCK_BYTES_CPU", "DISTANCE_BLOCK_BYTES"):
        monkeypatch.setattr(pq, name, 4 * 2 * 7 * 5)  # 4 bytes * 2 problems * 7 points * 5 centres
    chunked = np.asarray(kmeans_minibatch(pts, 5, iterations=20, batch=250, seed=1))
    np.testing.assert_array_equal(whole, chunked)


def test_interrupted_fit_resumes_from_its_checkpoint(tmp_path):
    """A fit stopped after its first layer resumes at the second and equals an uninterrupted fit; a checkpoint of
    another fit (another seed) is ignored."""
    keys = np.random.default_rng(2).standard_normal((3, 2, 64, 8)).astype(np.float32)
    settings = dict(groups=2, centroids=4, iterations=5, batch=16)
    whole = fit_codebooks(keys, seed=0, **settings)
    ckpt = tmp_path / "cb.partial.npz"

    class Stop(Exception):
        pass

    def stop_after_first(layer):
        raise Stop

    with pytest.raises(Stop):
        fit_codebooks(keys, seed=0, checkpoint=ckpt, callback=stop_after_first, **settings)
    with np.load(ckpt) as saved:
        assert saved["codebooks"].shape[0] == 1 and float(saved["seconds"]) > 0
    fitted = []
    resumed = fit_codebooks(keys, seed=0, checkpoint=ckpt, callback=fitted.append, **settings)
    assert fitted == [1, 2]
    np.testing.assert_array_equal(resumed, whole)
    fitted.clear()
    other = fit_codebooks(keys, seed=1, checkpoint=ckpt, callback=fitted.append, **settings)
    assert fitted == [0, 1, 2]
    np.testing.assert_array_equal(other, fit_codebooks(keys, seed=1, **settings))
    assert not np.array_equal(other, whole)


def test_kmeans_errors():
    with pytest.raises(ValueError, match="at least 8 points per problem, got n=5"):
        kmeans_minibatch(np.zeros((2, 5, 2), np.float32), 8)
    with pytest.raises(ValueError, match="70000 centroids do not fit uint16"):
        kmeans_minibatch(np.zeros((1, 80000, 1), np.float32), 70000)
    with pytest.raises(ValueError, match=r"points must be \[N, n, d\]"):
        kmeans_minibatch(np.zeros((5, 2), np.float32), 2)
    with pytest.raises(ValueError, match="at least 1 centroid"):
        code_dtype(0)
    with pytest.raises(ValueError, match="65537 centroids do not fit uint16"):
        code_dtype(65537)
    assert code_dtype(256) == jnp.uint8 and code_dtype(257) == jnp.uint16 and code_dtype(65536) == jnp.uint16
    assert codebook_variant(32, 256) == "g32-c256"


# ---------------------------------------------------------------------------------- encode / decode
def numpy_codes(k, cb):
    """Brute-force nearest centroid in f64: codes [B, H, S, g] and the squared distances [B, H, S, g, c]."""
    B, H, S, D = k.shape
    _, g, c, d = cb.shape
    sub = k.astype(np.float64).reshape(B, H, S, g, 1, d)
    dist = ((sub - cb.astype(np.float64)[None, :, None]) ** 2).sum(-1)
    return dist.argmin(-1), dist


def numpy_decode(codes, cb):
    B, H, S, g = codes.shape
    out = np.zeros((B, H, S, g, cb.shape[-1]), np.float32)
    for b, h, s, gi in itertools.product(range(B), range(H), range(S), range(g)):
        out[b, h, s, gi] = cb[h, gi, codes[b, h, s, gi]]
    return out.reshape(B, H, S, -1)


@pytest.mark.parametrize("c, dtype", [(16, np.uint8), (256, np.uint8), (300, np.uint16)])
def test_encode_matches_numpy_brute_force(c, dtype):
    rng = np.random.default_rng(c)
    B, H, S, D, g = 2, 2, 77, 8, 4
    k = rng.standard_normal((B, H, S, D)).astype(np.float32)
    cb = rng.standard_normal((H, g, c, D // g)).astype(np.float32)
    codes = encode_keys(jnp.asarray(k), jnp.asarray(cb), chunk=32)  # 77 = 2 chunks + 13: padded
    assert codes.shape == (B, H, S, g) and codes.dtype == dtype
    ref, dist = numpy_codes(k, cb)
    got = np.asarray(codes).astype(np.int64)
    chosen = np.take_along_axis(dist, got[..., None], axis=-1)[..., 0]
    # f32 may pick another centroid only in a near-tie
    np.testing.assert_allclose(chosen, dist.min(-1), rtol=1e-5, atol=1e-5)
    assert (got == ref).mean() > 0.99
    np.testing.assert_array_equal(np.asarray(decode_keys(codes, jnp.asarray(cb))), numpy_decode(got, cb))
    # the chunk does not change the result, nor does a block budget that cuts it (to 3 tokens here)
    np.testing.assert_array_equal(np.asarray(encode_keys(jnp.asarray(k), jnp.asarray(cb), chunk=1024)), got)
    per_token = 4 * B * H * g * c
    np.testing.assert_array_equal(
        np.asarray(encode_keys(jnp.asarray(k), jnp.asarray(cb), chunk=1024, block_bytes=3 * per_token + 1)), got)


def test_encode_keys_bounds_its_distance_block():
    """c = 8192 with 16 groups over a 4-row, 4K-token batch: 1024-token chunks would need 4 GiB per distance block
    (12 GiB of temporaries compiled); the default block budget keeps the compiled temporaries to a few of its 512 MiB."""
    import jax

    k = jax.ShapeDtypeStruct((4, 2, 4096, 64), jnp.float32)
    cb = jax.ShapeDtypeStruct((2, 16, 8192, 4), jnp.float32)
    temp = encode_keys.lower(k, cb).compile().memory_analysis().temp_size_in_bytes
    unbounded = encode_keys.lower(k, cb, block_bytes=2**40).compile().memory_analysis().temp_size_in_bytes
    assert temp <= 4 * 512 * 2**20 < 8 * 2**30 <= unbounded


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
def test_pq_kernel_scores_on_our_codes_equal_numpy(implementation):
    """The kernel's layout is ours: its scores equal scale * q . Q(k) computed in numpy (f64)."""
    rng = np.random.default_rng(7)
    B, H, G, S, D, g, c = 2, 2, 3, 150, 16, 4, 32
    k = rng.standard_normal((B, H, S, D)).astype(np.float32)
    cb = rng.standard_normal((H, g, c, D // g)).astype(np.float32)
    q = rng.standard_normal((B, H * G, D)).astype(np.float32)
    codes = encode_keys(jnp.asarray(k), jnp.asarray(cb))
    kq = numpy_decode(np.asarray(codes).astype(np.int64), cb).astype(np.float64)  # [B, H, S, D]
    ref = np.einsum("bhGd,bhsd->bhGs", q.astype(np.float64).reshape(B, H, G, D), kq).reshape(B, H * G, S) * D**-0.5
    z = pq_scores(jnp.asarray(q), jnp.asarray(cb), codes, implementation=implementation)
    np.testing.assert_allclose(np.asarray(z), ref, rtol=1e-4, atol=1e-4)


def test_quantization_error_against_numpy():
    rng = np.random.default_rng(3)
    L, H, n, D, g, c = 2, 2, 40, 8, 4, 8
    keys = rng.standard_normal((L, H, n, D)).astype(np.float32)
    cbs = rng.standard_normal((L, H, g, c, D // g)).astype(np.float32)
    q = rng.standard_normal((L, 2 * H, 5, D)).astype(np.float32)
    err = quantization_error(keys, cbs, queries=q)
    for l in range(L):
        ref, _ = numpy_codes(keys[l][None], cbs[l])
        kq = numpy_decode(ref, cbs[l])[0]
        rel = ((keys[l] - kq) ** 2).sum(axis=(1, 2)) / (keys[l] ** 2).sum(axis=(1, 2))
        np.testing.assert_allclose(err["relative_error_per_head"][l], rel, rtol=1e-4)
        np.testing.assert_allclose(err["relative_error"][l], rel.mean(), rtol=1e-4)
        var = ((keys[l] - keys[l].mean(axis=1, keepdims=True)) ** 2).sum(axis=(1, 2))
        np.testing.assert_allclose(err["centred_error"][l], (((keys[l] - kq) ** 2).sum(axis=(1, 2)) / var).mean(),
                                   rtol=1e-4)
    assert len(err["attention_tv"]) == L and all(0 <= t <= 1 for t in err["attention_tv"])
    assert all(0 < m <= 1 + 1e-9 for m in err["top_p_mass"])
    exact = quantization_error(keys, np.stack([np.stack([k.reshape(n, g, D // g).transpose(1, 0, 2)[:, :c]
                                                         for k in keys[l]]) for l in range(L)]))
    assert exact["mean"] > 0  # 40 keys, 8 centroids: not exact
    # codebooks holding the keys themselves (8 keys, 8 centroids): exact attention, so Eq. 4's set holds >= tau
    few = keys[:, :, :c]
    books = np.stack([np.stack([k.reshape(c, g, D // g).transpose(1, 0, 2) for k in few[l]]) for l in range(L)])
    for tau in (0.5, 0.9, 1.0):
        lossless = quantization_error(few, books, queries=q, tau=tau)
        assert lossless["mean"] < 1e-6 and max(lossless["attention_tv"]) < 1e-5
        assert all(tau - 1e-5 <= m <= 1 + 1e-5 for m in lossless["top_p_mass"])


# ----------------------------------------------------------------------------------------- artifact
def test_npz_artifact_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    cbs = rng.standard_normal((3, 2, 4, 16, 2)).astype(np.float32)
    art = hcattention_artifact(cbs, "tiny:abc", samples=3, tokens=64, iterations=10, batch=32, seed=1,
                               relative_error=[0.1234567, 0.2, 0.3])
    meta = art.meta_dict()
    assert (meta["groups"], meta["centroids"], meta["relative_error"]) == (4, 16, (0.12346, 0.2, 0.3))
    hash(art.meta)
    path = tmp_path / "a.npz"
    save_artifact(art, path)
    back = load_artifact(path)
    assert (back.kind, back.model_id, back.meta) == ("hcattention", "tiny:abc", art.meta)
    assert back.arrays["codebooks"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(back.arrays["codebooks"]), cbs.astype(np.float16).astype(np.float32))
    exact = Artifact(arrays={"codebooks": cbs, "ids": np.arange(5, dtype=np.int32)}, kind="x", model_id="m:1",
                     meta=(("n", (1, 2)),))
    save_artifact(exact, tmp_path / "b.npz")
    back = load_artifact(tmp_path / "b.npz")
    np.testing.assert_array_equal(np.asarray(back.arrays["codebooks"]), cbs)
    assert back.arrays["ids"].dtype == jnp.int32 and back.meta == (("n", (1, 2)),)
    back = load_artifact(path)
    back.check("hcattention", "tiny:abc")
    with pytest.raises(ValueError, match="artifact of kind 'hcattention' given to a 'synckv' method"):
        back.check("synckv", "tiny:abc")
    with pytest.raises(ValueError, match="made for model 'tiny:abc', but the cache is for 'tiny:def'"):
        back.check("hcattention", "tiny:def")
    with pytest.raises(ValueError, match=r"\.json or \.npz"):
        save_artifact(art, tmp_path / "a.pkl")


def test_installed_artifact_made_on_this_machine(tmp_path, monkeypatch):
    """An artifact made on this machine (the user cache) is found where none ships; a shipped one wins over it."""
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path))
    shipped = load_artifact(shipped_artifact_path("hcattention", "qwen2.5-coder-0.5b:x", codebook_variant(32, 64)))
    mine = Artifact(arrays={"codebooks": shipped.arrays["codebooks"][:, :, :, :7]}, kind="hcattention",
                    model_id=shipped.model_id, meta=(("mine", True),))
    made = user_artifact_path("hcattention", shipped.model_id, "g32-c7", suffix=".npz")
    assert made == tmp_path / "artifacts" / "hcattention" / "qwen2.5-coder-0.5b-g32-c7.npz"
    made.parent.mkdir(parents=True)
    save_artifact(mine, made)
    assert installed_artifact("hcattention", shipped.model_id, "g32-c7").meta == mine.meta
    save_artifact(mine, user_artifact_path("hcattention", shipped.model_id, "g32-c64", suffix=".npz"))
    assert installed_artifact("hcattention", shipped.model_id, "g32-c64").meta == shipped.meta


def test_shipped_artifact_path_finds_npz():
    path = shipped_artifact_path("hcattention", "qwen2.5-coder-0.5b:x", codebook_variant(32, 256))
    assert path.suffix == ".npz" and path.exists()
    art = load_artifact(path)
    L, H, g, c, d = art.arrays["codebooks"].shape
    assert (L, H, g, c, d) == (24, 2, 32, 256, 2)
    assert installed_artifact("hcattention", art.model_id, "g32-c256").meta == art.meta
    with pytest.raises(ValueError, match="made for model"):
        installed_artifact("hcattention", "qwen2.5-coder-0.5b:000000000000", "g32-c256")
    with pytest.raises(ValueError, match=r"no hcattention artifact .*g3-c7\.json\|\.npz\): none ships with kvjax .* "
                                         r"`kvjax calibrate hcattention --model <model>`"):
        installed_artifact("hcattention", art.model_id, "g3-c7")
    # json artifacts keep their path
    assert shipped_artifact_path("heterocache", "qwen2.5-coder-0.5b:x", "g1").suffix == ".json"


# ------------------------------------------------------------------------------ keys of a real model
def test_collected_keys_equal_hf_cache_and_fit_end_to_end(tmp_path):
    import torch

    from kvjax.artifacts import model_identity
    from kvjax.models import load_model
    from tests.tiny import save_tiny

    hf = save_tiny("qwen2", str(tmp_path), seed=5)
    model = load_model(str(tmp_path), "float32", tokenizer=False)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 97, 40).tolist(), rng.integers(0, 97, 40).tolist()]
    keys, queries = collect_keys(model, rows, chunk_size=16, query_window=4)
    L, H, D = model.config.num_layers, model.config.num_kv_heads, model.config.head_dim
    assert keys.shape == (L, H, 80, D) and queries.shape == (L, model.config.num_heads, 8, D)
    for i, row in enumerate(rows):
        with torch.no_grad():
            out = hf(torch.tensor([row]), use_cache=True)
        pkv = out.past_key_values
        for l in range(L):
            ref = (pkv.layers[l].keys if hasattr(pkv, "layers") else pkv[l][0])[0].numpy()  # [H, S, D] post-RoPE
            np.testing.assert_allclose(keys[l, :, 40 * i:40 * (i + 1)], ref, atol=2e-5, rtol=1e-4)
    cbs = fit_codebooks(keys, groups=4, centroids=16, iterations=20, batch=32, seed=0)
    assert cbs.shape == (L, H, 4, 16, D // 4)
    err = quantization_error(keys, cbs)
    centred = keys - keys.mean(axis=2, keepdims=True)  # one centroid per group (the mean), numpy
    one = ((centred**2).sum(axis=(2, 3)) / (keys**2).sum(axis=(2, 3))).mean(axis=1)
    assert all(a < 0.7 * b for a, b in zip(err["relative_error"], one))  # 16 centroids beat the mean
    art = hcattention_artifact(cbs, model_identity(model.config), samples=2, tokens=40, iterations=20, batch=32,
                               seed=0, relative_error=err["relative_error"])
    save_artifact(art, tmp_path / "cb.npz")
    load_artifact(tmp_path / "cb.npz").check("hcattention", model_identity(model.config))


def test_calibrate_hcattention_measures_the_training_error_on_the_samples_asked(tiny_chat_model, tmp_path):
    """``--train-error-samples 1``: the report's training error is the error of the written codebooks on the first
    training sample's keys (collected again here), not on every training sample; out of range is an error."""
    import json

    import kvjax
    from kvjax.calibration import calibration_rows
    from kvjax.make_artifacts import main_hcattention
    from kvjax.pq_codebooks import quantization_error

    argv = ["--model", tiny_chat_model, "--groups", "4", "--centroids", "8", "--samples", "2", "--heldout", "1",
            "--tokens", "128", "--iterations", "5", "--batch", "64", "--out-dir", str(tmp_path / "art"),
            "--report-dir", str(tmp_path / "rep")]
    with pytest.raises(ValueError, match="--train-error-samples must be between 1 and --samples"):
        main_hcattention([*argv, "--train-error-samples", "3"])
    main_hcattention([*argv, "--train-error-samples", "1"])
    (art_path,) = (tmp_path / "art").glob("*.npz")
    (report,) = (tmp_path / "rep").iterdir()
    stats = json.loads((report / "stats.json").read_text())
    assert "training errors on the first 1 of the 2 training samples" in (report / "summary.md").read_text()
    model = kvjax.load(tiny_chat_model)
    rows = calibration_rows(model.tokenizer, 3, 128)
    codebooks = np.asarray(load_artifact(art_path).arrays["codebooks"])
    first = quantization_error(collect_keys(model, rows[:1]), codebooks)["relative_error"]
    both = quantization_error(collect_keys(model, rows[:2]), codebooks)["relative_error"]
    assert stats["train_error_samples"] == 1
    np.testing.assert_allclose(stats["train"]["relative_error"], first, rtol=1e-6)
    assert not np.allclose(first, both, rtol=1e-3)

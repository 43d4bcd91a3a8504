"""Training Locret's retaining heads: labels against HF ``transformers``, the loss by hand, frozen model, exact resume."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from kvjax.artifacts import load_artifact
from kvjax.retaining_heads import init_heads
from kvjax.models import load_model
from tests.tiny import save_tiny
from kvjax.train.dataset import build_dataset, open_dataset
from kvjax.train.labels import collect
from kvjax.train.locret import TrainConfig, loss_fn, make_step, smooth_l1, standardize_labels, top_overlap, train


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt_ids: tuple
    answer_ids: tuple
    kind: str = "test"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_train")
    hf = save_tiny("qwen2", str(path), seed=4)
    return load_model(str(path), "float32", tokenizer=False), hf


def hf_projections(hf, tokens):
    """Per layer: pre-RoPE q, k, v [T, H*D] and post-RoPE q [H, T, D], k [Hkv, T, D] from HF's own modules."""
    cfg = hf.config
    D = cfg.hidden_size // cfg.num_attention_heads
    got = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(
                lambda mod, inp, out, i=i, name=name: got.__setitem__((i, name), out.detach())))
    with torch.no_grad():
        ids = torch.as_tensor(tokens)[None]
        hf(ids)
        pos = torch.arange(ids.shape[1])[None]
        cos, sin = hf.model.rotary_emb(torch.zeros(1, ids.shape[1], cfg.hidden_size), pos)
    for h in hooks:
        h.remove()
    out = []
    T = len(tokens)
    for i in range(cfg.num_hidden_layers):
        q, k, v = (got[(i, n)][0] for n in ("q_proj", "k_proj", "v_proj"))
        qr, kr = apply_rotary_pos_emb(q.view(1, T, -1, D).transpose(1, 2), k.view(1, T, -1, D).transpose(1, 2), cos, sin)
        out.append((q.numpy(), k.numpy(), v.numpy(), qr[0].numpy(), kr[0].numpy()))
    return out


def test_features_and_labels_match_hf(tiny):
    model, hf = tiny
    rng = np.random.default_rng(0)
    prompt, answer = list(rng.integers(0, 97, size=21)), list(rng.integers(0, 97, size=5))
    feats, labels, pad, start = collect(model, prompt, answer, length=32, answer_max=8)
    assert (pad, start) == (6, 27)
    G = model.config.num_heads // model.config.num_kv_heads
    D = model.config.head_dim
    for i, (q, k, v, qr, kr) in enumerate(hf_projections(hf, prompt + answer)):
        np.testing.assert_allclose(feats[i, pad:], np.concatenate([q, k, v], -1), atol=1e-4)
        s = np.einsum("htd,hsd->hts", qr.astype(np.float64), np.repeat(kr, G, axis=0).astype(np.float64)) / np.sqrt(D)
        want = s[:, len(prompt):, : len(prompt)].reshape(-1, G, len(answer), len(prompt)).max(axis=(1, 2))
        np.testing.assert_allclose(labels[i][:, pad:start], want, atol=1e-4)
        assert (labels[i][:, :pad] == 0).all() and (labels[i][:, start:] == 0).all()


def test_loss_on_hand_computed_values():
    np.testing.assert_allclose(np.asarray(smooth_l1(jnp.array([0.0, 0.5, 3.0]), jnp.zeros(3))), [0.0, 0.125, 2.5])
    # one layer, F = 1, d_R = 1, one KV head: pred = silu(x * 1) * 1
    heads = {"w1": jnp.ones((1, 1, 1)), "w2": jnp.ones((1, 1, 1))}
    x = np.array([0.0, 1.0, 2.0, 5.0])
    feats = jnp.asarray(x[None, :, None])
    labels = jnp.asarray(np.array([[[0.0, 0.0, 0.0, 9.0]]]))
    mask = jnp.asarray([False, True, True, True])
    pred = x / (1 + np.exp(-x))
    reg = np.mean([0.5 * pred[1] ** 2 if pred[1] < 1 else pred[1] - 0.5,
                   pred[2] - 0.5, abs(pred[3] - 9.0) - 0.5])
    smooth = np.mean([(pred[2] - pred[1]) ** 2, (pred[3] - pred[2]) ** 2])
    total, per_layer = loss_fn(heads, feats, labels, mask, 0.0025, "none")
    np.testing.assert_allclose(float(total), reg + 0.0025 * smooth, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(per_layer), [reg], rtol=1e-6)


def test_standardized_labels_by_hand():
    labels = jnp.asarray(np.array([[[7.0, 1.0, 3.0, 0.0], [2.0, 5.0, 5.0, 5.0]]]))  # [L=1, H=2, N=4]
    mask = jnp.asarray([False, True, True, True])  # slot 0 is padding: left out of the statistics
    # head 0 over slots 1..3: [1, 3, 0], mean 4/3, std sqrt(14/9); head 1 constant -> zeros (no division by 0)
    mean, std = 4 / 3, np.sqrt(14 / 9)
    want = [[0.0, (1 - mean) / std, (3 - mean) / std, (0 - mean) / std], [0.0, 0.0, 0.0, 0.0]]
    np.testing.assert_allclose(np.asarray(standardize_labels(labels, mask))[0], want, rtol=1e-6, atol=1e-6)
    # the standardised loss ignores a per-head offset and scale of the labels; the paper's raw loss does not
    heads = {"w1": jnp.ones((1, 1, 1)), "w2": jnp.ones((1, 1, 2))}
    feats = jnp.asarray(np.array([0.0, 1.0, 2.0, 5.0])[None, :, None])
    shifted = labels * jnp.asarray([[[3.0], [0.5]]]) + jnp.asarray([[[900.0], [-40.0]]])
    a = loss_fn(heads, feats, labels, mask, 0.0025, "standardize")[0]
    b = loss_fn(heads, feats, shifted, mask, 0.0025, "standardize")[0]
    np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
    assert abs(float(loss_fn(heads, feats, shifted, mask, 0.0025, "none")[0]) - float(loss_fn(heads, feats, labels, mask, 0.0025, "none")[0])) > 1
    with pytest.raises(ValueError, match="label_norm"):
        TrainConfig(label_norm="minmax")


def test_top_overlap_by_hand():
    labels = np.array([[[5.0, 4, 3, 2, 1, 0, 0, 0, 0, 0, 9, 9]]])  # [L=1, H=1, N=12]
    mask = np.array([True] * 10 + [False] * 2)  # 10 prompt tokens: top 10% = 1 token (slot 0)
    assert top_overlap(labels, labels, mask).tolist() == [[1.0]]
    assert top_overlap(-labels, labels, mask).tolist() == [[0.0]]


@pytest.fixture(scope="module")
def dataset(tiny, tmp_path_factory):
    model, _ = tiny
    rng = np.random.default_rng(1)
    samples = [Sample(tuple(rng.integers(0, 97, size=int(rng.integers(20, 30)))), tuple(rng.integers(0, 97, size=4)))
               for _ in range(6)]
    path = tmp_path_factory.mktemp("locret_data")
    build_dataset(model, samples, path, tokens=32, answer_max=8)
    return path


def test_a_step_changes_only_the_heads(tiny, dataset):
    model, _ = tiny
    before = jax.tree_util.tree_map(np.array, model.params)
    features, labels, mask, meta = open_dataset(dataset)
    cfg = TrainConfig(hidden=8, steps=4, heldout=2)
    heads = init_heads(meta["num_layers"], meta["features"], meta["num_kv_heads"], cfg.hidden, cfg.seed)
    opt, step = make_step(cfg)
    state = opt.init(heads)
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(opt.init(heads))
    new = heads
    for _ in range(2):  # the warmup's first learning rate is 0 (as transformers' linear schedule)
        new, state, loss = step(new, state, jnp.asarray(features[0]), jnp.asarray(labels[0]), jnp.asarray(mask[0]))
        assert np.isfinite(float(loss))
    for name in ("w1", "w2"):
        assert not np.array_equal(np.asarray(new[name]), np.asarray(heads[name]))
    # the optimiser holds state for the heads only, and the model's parameters are untouched
    n_state = sum(x.size for x in jax.tree_util.tree_leaves(state) if hasattr(x, "size") and x.ndim > 0)
    n_heads = sum(x.size for x in jax.tree_util.tree_leaves(heads))
    assert n_state == 2 * n_heads  # AdamW's two moments
    jax.tree_util.tree_map(np.testing.assert_array_equal, before, jax.tree_util.tree_map(np.array, model.params))


def test_resumed_run_equals_an_uninterrupted_one(dataset, tmp_path):
    cfg = TrainConfig(hidden=8, steps=10, heldout=2, eval_every=4, checkpoint_every=3)
    train(dataset, tmp_path / "a", cfg)
    train(dataset, tmp_path / "b", cfg, stop_after=5)  # interrupted after step 5 (checkpointed)
    assert not (tmp_path / "b" / "heads.npz").exists()
    train(dataset, tmp_path / "b", cfg)
    ha, hb = (json.loads((tmp_path / r / "history.json").read_text()) for r in ("a", "b"))
    assert ha["loss"] == hb["loss"] and ha["eval"] == hb["eval"]
    a, b = (load_artifact(tmp_path / r / "heads.npz") for r in ("a", "b"))
    for name in ("w1", "w2"):
        np.testing.assert_array_equal(np.asarray(a.arrays[name]), np.asarray(b.arrays[name]))
    assert a.meta_dict()["label_norm"] == cfg.label_norm and a.meta_dict()["steps"] == 10  # how they were trained
    assert (tmp_path / "a" / "loss.png").stat().st_size > 0
    with pytest.raises(ValueError, match="another configuration"):
        train(dataset, tmp_path / "a", dataclasses.replace(cfg, steps=12))


def test_bad_input(tiny, dataset, tmp_path):
    model, _ = tiny
    with pytest.raises(ValueError, match="does not fit answer_max"):
        collect(model, [1] * 10, [2] * 9, length=32, answer_max=8)
    with pytest.raises(ValueError, match="exceed the layout"):
        collect(model, [1] * 30, [2] * 4, length=32, answer_max=8)
    with pytest.raises(ValueError, match="leave none to train on"):
        train(dataset, tmp_path / "x", TrainConfig(hidden=8, steps=2, heldout=6))
    with pytest.raises(ValueError, match="not a Locret training set"):
        open_dataset(tmp_path)
    with pytest.raises(ValueError, match="unknown target"):
        build_dataset(model, [], tmp_path / "y", tokens=8, answer_max=4, target="oracle")
    with pytest.raises(ValueError, match="reconstruction prompt"):
        build_dataset(model, [], tmp_path / "y", tokens=8, answer_max=4, target="reconstruction")


def test_default_data_dir_names_every_data_setting(monkeypatch, tmp_path):
    from kvjax.train.cli import build_parser, default_data_dir
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path))
    args = build_parser().parse_args(["--model", "m", "--out", "o", "--corpus", "django-docs", "--kinds", "fact,record",
                                      "--samples", "8", "--tokens", "512", "--target", "reconstruction"])
    got = default_data_dir("qwen", args)
    assert got.parent == tmp_path / "locret-data"
    assert got.name == f"qwen-django-docs-fact-record-8x512-a{args.answer_max}-seed{args.data_seed}-reconstruction"
    args = build_parser().parse_args(["--model", "m", "--out", "o", "--kinds", "fact"])
    assert not default_data_dir("qwen", args).name.endswith("-attention")

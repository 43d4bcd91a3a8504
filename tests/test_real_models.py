"""The ready models (GGUF from PyPI packages) against transformers loading the same GGUF file."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kvjax.api import generate_tokens
from kvjax.methods import FullCache
from kvjax.models import load_model
from kvjax.models.llama import forward
from tests.conftest import ready_model_or_skip
from kvjax.cache import new_cache

pytestmark = pytest.mark.real_model
PROMPT = "The quick brown fox jumps over the lazy dog. In 1969, the first person to walk on the Moon was"


def _logits(model, ids):
    cache = new_cache(FullCache(), model.config, 1, ids.shape[1], 0, model.dtype)
    logits, _ = jax.jit(forward, static_argnums=0)(
        model.graphdef, model.params, jnp.asarray(ids), jnp.arange(ids.shape[1])[None], cache
    )
    return np.asarray(logits)


def test_smollm2_logits_match_transformers(smollm2, smollm2_hf):
    ids = np.asarray(smollm2.tokenizer(PROMPT)["input_ids"], np.int32)[None]
    with torch.no_grad():
        ref = smollm2_hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    got = _logits(smollm2, ids)
    np.testing.assert_allclose(got, ref, atol=2e-3, rtol=1e-4)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_smollm2_greedy_generation_matches_transformers(smollm2, smollm2_hf):
    tok = smollm2.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Write a short story about a cat."}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text)["input_ids"]
    with torch.no_grad():
        ref = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    ref_new = ref[0, len(ids):].tolist()
    out, count, _, _ = generate_tokens(smollm2, [ids], max_new_tokens=16, eos_ids=[tok.eos_token_id])
    assert len(ref_new) == 16 and int(count[0]) == 16  # no early EOS: all 16 tokens are compared
    assert out[0].tolist() == ref_new


@pytest.fixture(scope="module")
def qwen():
    """The default ready model (Qwen2.5-Coder-0.5B-Instruct), loaded by kvjax in float32 once for this module."""
    ready_model_or_skip("qwen2.5-coder-0.5b")
    return load_model("qwen2.5-coder-0.5b", "float32")


def test_qwen_logits_match_transformers(qwen):
    path = qwen.path
    from transformers import AutoModelForCausalLM

    model = qwen
    ids = np.asarray(model.tokenizer(PROMPT)["input_ids"], np.int32)[None]
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    with torch.no_grad():
        ref = hf.eval()(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    del hf
    got = _logits(model, ids)
    np.testing.assert_allclose(got, ref, atol=2e-3, rtol=1e-4)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def _qwen_passkey_prompt(model):
    """(a 2K passkey sample at depth 0.3, its chat-templated prompt ids) for the default model."""
    from kvjax.evals.passkey import make_passkey

    tok = model.tokenizer
    sample = make_passkey(tok, 2048, depth=0.3, seed=1)
    text = tok.apply_chat_template([{"role": "user", "content": sample.prompt}], tokenize=False, add_generation_prompt=True)
    return sample, tok(text)["input_ids"]


PASSKEY_METHODS = ("snapkv", "hbw", "heterocache", "synckv", "hcattention")  # at 25%, sharing one prefill


@pytest.fixture(scope="module")
def qwen_passkey_prefill(qwen):
    """The default model's shared prefill of a 2K passkey prompt for ``PASSKEY_METHODS`` at 25%:
    (methods by name, staged cache, first token, sample, prompt length)."""
    from kvjax.api import left_pad
    from kvjax.cache import CacheSpec
    from kvjax.decoding import prefill_prompt
    from kvjax.methods import get_method
    from kvjax.shared_prefill import init_shared_cache

    sample, ids = _qwen_passkey_prompt(qwen)
    methods = {name: get_method(name, budget=0.25) for name in PASSKEY_METHODS}
    tokens, pad = left_pad([ids], qwen.tokenizer.pad_token_id, multiple=512)
    spec = CacheSpec.for_model(qwen.config, 1, tokens.shape[1], 8, qwen.dtype, longest_row=len(ids))
    staged = init_shared_cache(tuple(methods.values()), spec).replace(pad=jnp.asarray(pad))
    logits, staged = prefill_prompt(qwen.graphdef, qwen.params, tokens, staged, chunk_size=512)
    return methods, staged, jnp.argmax(logits, axis=-1).astype(jnp.int32), sample, len(ids)


def _qwen_passkey_2k(model, prefill, names, check_cache):
    """Per method of ``names``: compress the shared 2K passkey prefill, ``check_cache(method, cache, prompt_len,
    config)``, decode 8 tokens and assert the pass key is in the answer."""
    from kvjax.decoding import compress, decode_loop
    from kvjax.shared_prefill import cache_for

    methods, staged, first, sample, prompt_len = prefill
    tok = model.tokenizer
    for name in names:
        method = methods[name]
        cache = compress(cache_for(staged, method))
        check_cache(method, cache, prompt_len, model.config)
        out, count, _ = decode_loop(model.graphdef, model.params, first, cache, jax.random.PRNGKey(0),
                                    max_new_tokens=8, eos_ids=(tok.eos_token_id,))
        answer = tok.decode(np.asarray(out[0, : int(count[0])]), skip_special_tokens=True)
        assert sample.answer in answer, f"{method.name} answered {answer!r}, expected {sample.answer}"


def test_qwen_passkey_2k_with_snapkv_and_hbw_at_quarter_budget(qwen, qwen_passkey_prefill):
    """The default model answers a 2K passkey with SnapKV and HBW-KV at 25% (one shared prefill)."""

    def check(method, cache, prompt_len, config):
        kept = cache.stats()["kept_tokens_per_head"][0][0]
        assert kept == int(0.25 * prompt_len)  # of the real prompt, not of the padded 2048 slots
        assert np.asarray(cache.layers[0].lengths).tolist() == [[kept, kept]]

    _qwen_passkey_2k(qwen, qwen_passkey_prefill, ("snapkv", "hbw"), check)


@pytest.mark.parametrize("kind", ["heterocache", "synckv"])
def test_shipped_calibration_artifacts_match_the_ready_models(smollm2, kind):
    """Both ready models have a default (cross-layer) and a per-layer artifact of each kind, stamped with their identity."""
    from kvjax.artifacts import load_artifact, model_identity, shipped_artifact_path
    from kvjax.calibration import auto_group_layers

    mid = model_identity(smollm2.config)
    for group in (1, auto_group_layers(smollm2.config.num_kv_heads)):
        art = load_artifact(shipped_artifact_path(kind, mid, f"g{group}"))
        art.check(kind, mid)
        assert art.meta_dict()["group_layers"] == group
    qwen = shipped_artifact_path(kind, "qwen2.5-coder-0.5b:x", "g8")
    assert qwen.exists() and load_artifact(qwen).model_id.startswith("qwen2.5-coder-0.5b:")


def test_qwen_passkey_2k_with_host_tier_methods_at_quarter_budget(qwen, qwen_passkey_prefill):
    """The default model answers a 2K passkey with HeteroCache, SyncKV and HCAttention at 25% with the shipped
    calibrations and codebooks (one shared prefill), holding at most about a quarter of the prompt's KV on the
    device and the rest (followers' KV, HCAttention's values) on the host."""

    def check(method, cache, prompt_len, c):
        prompt_kv = 2 * c.num_layers * c.num_kv_heads * prompt_len * c.head_dim * 4
        s = cache.stats()
        assert s["host_bytes"] > 0 and s["device_bytes"] < 0.32 * prompt_kv  # 25% + room, page rounding, trackers
        if method.name == "hcattention":  # float32: codes of g = D/2 bytes (6.25%) + 3 MiB of codebooks
            assert s["key_representation"] == "pq g=32 c=256" and s["host_value_bytes"] >= prompt_kv // 2

    _qwen_passkey_2k(qwen, qwen_passkey_prefill, ("heterocache", "synckv", "hcattention"), check)


def test_shipped_hcattention_codebooks_match_the_default_model():
    """Codebooks for g = D/2 and D/4 (c = 256) ship for the default model, stamped with its identity."""
    path = ready_model_or_skip("qwen2.5-coder-0.5b")
    from kvjax.artifacts import installed_artifact, model_identity
    from kvjax.models.weights import gguf_config, open_gguf

    cfg = gguf_config(open_gguf(path), "qwen2.5-coder-0.5b")
    mid = model_identity(cfg)
    for g in (cfg.head_dim // 2, cfg.head_dim // 4):
        art = installed_artifact("hcattention", mid, f"g{g}-c256")
        assert art.arrays["codebooks"].shape == (cfg.num_layers, cfg.num_kv_heads, g, 256, cfg.head_dim // g)
        assert art.arrays["codebooks"].dtype == np.float32


@pytest.mark.parametrize("kind", ["heterocache", "synckv"])
def test_calibrate_command_end_to_end(smollm2, tmp_path, monkeypatch, kind):
    """`kvjax calibrate` on SmolLM2 (1 short sample): per-layer and cross-layer artifacts, reports and plots;
    the method plans its heads from the artifact; the smallest feasible budget is reported (per layer, SyncKV's
    N_r = 2 keeps 2 of SmolLM2's 3 KV heads full). The command gets the session's loaded model (loading is tested
    elsewhere)."""
    import kvjax
    from kvjax.artifacts import load_artifact
    from kvjax.cache import CacheSpec
    from kvjax.cli import main
    from kvjax.methods import get_method

    loaded = []
    monkeypatch.setattr(kvjax, "load", lambda name, dtype, progress=False: loaded.append((name, dtype)) or smollm2)
    rc = main(["calibrate", kind, "--model", "smollm2-135m", "--samples", "1", "--tokens", "300", "--decode-steps", "4",
               "--group-layers", "1,6", "--out-dir", str(tmp_path / "art"), "--report-dir", str(tmp_path / "rep")])
    assert rc == 0 and loaded == [("smollm2-135m", "float32")]
    for g in (1, 6):
        art = load_artifact(tmp_path / "art" / f"smollm2-135m-g{g}.json")
        assert art.meta_dict()["group_layers"] == g
        report = tmp_path / "rep" / f"{kind}-smollm2-135m-g{g}"
        assert {"summary.md", "stats.json", "roles.png", "stability.png", "similarity.png"} <= {p.name for p in report.iterdir()}
    summary = (tmp_path / "rep" / f"{kind}-smollm2-135m-g1" / "summary.md").read_text()
    if kind == "synckv":
        assert "N_r = 2: 60 R-heads of 90; budgets must exceed 0.667" in summary
    else:
        assert "budgets must exceed F / N" in summary
    # the method accepts the new artifact for this model and plans followers refreshed from host copies (running
    # it is tested on tiny models and, with the shipped artifacts, on the default model's passkey)
    spec = CacheSpec.for_model(smollm2.config, 1, 200, 4, smollm2.dtype)
    method = get_method(kind, budget=0.5)
    plans, _ = method.plans(spec, method.artifact_for(spec, load_artifact(tmp_path / "art" / "smollm2-135m-g6.json")))
    assert len(plans) == 30 and any(p.followers for p in plans)
    assert main(["calibrate", kind, "--model", "smollm2-135m", "--group-layers", "0"]) == 2  # clear error


def test_qwen_passkey_2k_with_locret_at_quarter_budget(qwen):
    """The default model answers a 2K passkey with Locret (shipped heads) at 25%, prefilled in chunks of 512 with
    eviction after each: every head ends with the budget's tokens, and the prefill never held more than b + n_loc + B."""
    from kvjax.methods import Locret

    model = qwen
    sample, ids = _qwen_passkey_prompt(model)
    tok = model.tokenizer
    method = Locret(budget=0.25, chunk=512)
    out, count, cache, _ = generate_tokens(model, [ids], method=method, max_new_tokens=8, chunk_size=512,
                                           eos_ids=(tok.eos_token_id,))
    answer = tok.decode(np.asarray(out[0, : int(count[0])]), skip_special_tokens=True)
    assert sample.answer in answer, f"locret answered {answer!r}, expected {sample.answer}"
    s = cache.stats()
    assert s["kept_tokens_per_head"][0] == [int(0.25 * len(ids))] * 2
    assert s["prefill_buffer_tokens_per_head"] == int(0.25 * len(ids)) + 512
    assert s["heads"] == "trained" and s["head_hidden"] == 128


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "smollm2-135m"])
def test_shipped_locret_heads_match_the_ready_models(name):
    """Trained retaining heads ship for both ready models, stamped with their identity and sized for them."""
    path = ready_model_or_skip(name)
    from kvjax.artifacts import installed_artifact, model_identity
    from kvjax.retaining_heads import check_heads
    from kvjax.models.weights import gguf_config, open_gguf

    cfg = gguf_config(open_gguf(path), name)
    art = installed_artifact("locret", model_identity(cfg))
    assert check_heads(art.arrays, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == 128
    assert art.meta_dict()["trained"] is True


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "smollm2-135m"])
def test_ready_model_configs_without_weights_match_their_gguf(name):
    """The registry's config of each ready model (used by ``random_weights`` where the packages are absent)
    equals the one read from the GGUF metadata, so the artifacts shipped for the model load for it."""
    path = ready_model_or_skip(name)
    from kvjax.artifacts import model_identity
    from kvjax.models.registry import ready_model_config
    from kvjax.models.weights import gguf_config, open_gguf

    from_gguf = gguf_config(open_gguf(path), name)
    assert ready_model_config(name) == from_gguf
    assert model_identity(ready_model_config(name)) == model_identity(from_gguf)


def test_an_interrupted_assembly_leaves_no_partial_file_and_the_next_one_succeeds(tmp_path, monkeypatch):
    """The multi-part ready model is assembled into the cache directory through a temporary file: an
    interruption removes it, and a later first use assembles the verified file with nothing left over."""
    from kvjax.models import registry

    ready_model_or_skip("qwen2.5-coder-0.5b")
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path))
    copy = registry.shutil.copyfileobj
    calls = []

    def interrupted(src, dst, length=0):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        copy(src, dst, length)

    monkeypatch.setattr(registry.shutil, "copyfileobj", interrupted)
    with pytest.raises(KeyboardInterrupt):
        registry.ready_model_path("qwen2.5-coder-0.5b")
    assert sorted(os.listdir(tmp_path)) == []
    monkeypatch.setattr(registry.shutil, "copyfileobj", copy)
    path = registry.ready_model_path("qwen2.5-coder-0.5b")
    assert path == os.path.join(str(tmp_path), "qwen2.5-coder-0.5b.gguf")
    assert os.path.getsize(path) == registry.READY_MODELS["qwen2.5-coder-0.5b"].size
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".part")]

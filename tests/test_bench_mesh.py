"""``kvjax bench mesh``: the recall methods' calibration on the bench's random model, and the report's table."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx

from kvjax.evals.bench_mesh import calibrate_on_model, make_method, markdown
from kvjax.cache import CacheSpec
from kvjax.models import LoadedModel
from kvjax.models.config import ModelConfig
from kvjax.models.llama import random_model

CONFIG = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=64, num_layers=2,
                     num_heads=16, num_kv_heads=8, head_dim=8, max_position_embeddings=1024, name="tiny-bench-mesh")


@pytest.fixture(scope="module")
def model():
    graphdef, params = nnx.split(random_model(CONFIG, seed=0))
    return LoadedModel(CONFIG, graphdef, params, None, "random", jnp.float32)


def test_heterocache_calibration_of_a_random_model_gives_followers_and_a_feasible_budget(model):
    art = calibrate_on_model("heterocache", model)
    roles = [r for row in art.meta_dict()["roles"] for r in row]
    assert {"pivot", "satellite", "anchor"} <= set(roles)  # the paper's thresholds would make every head volatile
    assert roles.count("pivot") + roles.count("volatile") <= len(roles) // 4  # full heads: most heads compress
    method, art2 = make_method("heterocache", 0.5, model)
    spec = CacheSpec.for_model(CONFIG, 2, 256, 8, jnp.float32)
    cache = method.init_cache(spec, art2)  # refuses an artifact of another model or an infeasible budget
    assert cache.method is method


def test_synckv_and_hcattention_artifacts_fit_the_bench_model(model):
    method, art = make_method("synckv", 0.25, model)
    method.init_cache(CacheSpec.for_model(CONFIG, 2, 256, 8, jnp.float32), art)
    method, art = make_method("hcattention", 0.25, model)
    assert art.arrays["codebooks"].shape == (2, 8, 4, 256, 2)  # g = D/2 = 4 at 25% in float32
    assert make_method("hcattention", 0.5, model)[1] is None  # exact keys: no codebooks
    with pytest.raises(ValueError, match="no calibration for 'snapkv'"):
        calibrate_on_model("snapkv", model)


def test_report_rows_have_as_many_cells_as_the_header():
    rows = [dict(mesh="data=1,model=1", method="full", decode_ms_per_token=10.0, device_bytes=2 ** 20,
                 device_bytes_per_device=2 ** 20, host_bytes=0, weights_bytes_per_device=2 ** 21, tokens=[[1]]),
            dict(mesh="data=1,model=1", method="synckv", decode_ms_per_token=8.0, device_bytes=2 ** 19,
                 device_bytes_per_device=2 ** 19, host_bytes=3 * 2 ** 20, weights_bytes_per_device=2 ** 21, tokens=[[2]]),
            dict(mesh="data=1,model=1", method="heterocache", error="budget too small", weights_bytes_per_device=0)]
    from kvjax.evals.bench_mesh import add_ratios

    add_ratios(rows)
    text = markdown(dict(devices=1, platform="cpu", command="kvjax bench mesh", date="2026-11-24", model="m",
                         batch=1, length=8, new_tokens=2, budget=0.25, rows=rows))
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in table}) == 1
    synckv = table[3].split("|")
    assert synckv[4].strip() == "0.80" and synckv[9].strip() == "3.0"  # decode vs full; host MiB

import os, sys; pass  # run from the repository root with PYTHONPATH=.aot-gpu:.aot-tpu:.
os.environ["JAX_PLATFORMS"]="cpu"
import jax, numpy as np
from kvjax.evals.bench_methods import make_methods, parse_methods, bench_artifacts
from kvjax.evals.synthetic import abstract_compressed_cache
from kvjax.evals.plan import TARGETS, target_mesh, lowering_for
from kvjax.cache import CacheSpec
from kvjax.sharding import is_split
from kvjax.models import load_model
m = load_model("llama-3.1-8b", "bfloat16", tokenizer=False, random_weights=True)
target = TARGETS["v5e-8"]; mesh = target_mesh(target, m.config)
methods = make_methods(parse_methods("heterocache"), 0.25)
arts, _ = bench_artifacts(methods, m.config, True)
spec = CacheSpec.for_model(m.config, 1, 16384, 64, m.dtype, mesh=mesh)
c = abstract_compressed_cache(methods["heterocache"], spec, mesh, arts.get("heterocache"))
for path, x in jax.tree_util.tree_leaves_with_path(c):
    ks = jax.tree_util.keystr(path)
    if "[0]" in ks and "layers" in ks:
        print(ks[:60], x.shape, x.dtype, getattr(x, "sharding", None))

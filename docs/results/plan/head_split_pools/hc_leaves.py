import os, sys; pass  # run from the repository root with PYTHONPATH=.
os.environ["JAX_PLATFORMS"]="cpu"
import jax, numpy as np
from kvjax.evals.bench_methods import make_methods, parse_methods, bench_artifacts
from kvjax.evals.synthetic import abstract_compressed_cache
from kvjax.evals.synthetic import cpu_mesh
from kvjax.cache import CacheSpec
from kvjax.models import load_model
m = load_model("llama-3.1-8b", "bfloat16", tokenizer=False, random_weights=True)
methods = make_methods(parse_methods(sys.argv[1]), float(sys.argv[2]))
arts, _ = bench_artifacts(methods, m.config, True)
for name, meth in methods.items():
    spec = CacheSpec.for_model(m.config, 1, int(sys.argv[3]), 64, m.dtype)
    c = abstract_compressed_cache(meth, spec, cpu_mesh(), arts.get(name))
    tot = {}
    for path, x in jax.tree_util.tree_leaves_with_path(c):
        kind = getattr(getattr(x, "sharding", None), "memory_kind", None) or "device"
        nb = int(np.prod(x.shape)) * x.dtype.itemsize
        tot[kind] = tot.get(kind, 0) + nb
        if "layers" in jax.tree_util.keystr(path) and "[0]" in jax.tree_util.keystr(path):
            print(name, jax.tree_util.keystr(path)[:90], x.shape, x.dtype, kind, round(nb/2**20,1), "MiB")
    print(name, {k: round(v/2**30,3) for k,v in tot.items()})

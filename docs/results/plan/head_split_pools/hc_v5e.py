import os, sys, re, collections; pass  # run from the repository root with PYTHONPATH=.aot-gpu:.aot-tpu:.
os.environ["JAX_PLATFORMS"]="cpu"
from kvjax.evals.plan import TARGETS, target_mesh, compile_step
from kvjax.evals.bench_methods import make_methods, parse_methods, bench_artifacts
from kvjax.models import load_model
import jax
m = load_model("llama-3.1-8b", "bfloat16", tokenizer=False, random_weights=True)
target = TARGETS["v5e-8"]; mesh = target_mesh(target, m.config)
methods = make_methods(parse_methods(sys.argv[1]), float(sys.argv[2]))
arts, _ = bench_artifacts(methods, m.config, True)
L = int(sys.argv[3])
for name, meth in methods.items():
    for b in (1, 2):
        r = compile_step(target, mesh, m.config, "bfloat16", meth, b, L, 64, arts.get(name))
        mem = r["compiled"].memory_analysis()
        print(name, b, "dev GiB", round(r["device_bytes"]/2**30,3), "temp", round(r["temp_bytes"]/2**30,3), "arg", round(mem.argument_size_in_bytes/2**30,3), "out", round(mem.output_size_in_bytes/2**30,3), "alias", round(mem.alias_size_in_bytes/2**30,3), "compile", round(r["compile_s"]), flush=True)
        hlo = r["compiled"].as_text()
        open(f"/tmp/{name}_{b}.hlo","w").write(hlo)

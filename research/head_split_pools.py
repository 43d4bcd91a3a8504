"""The recall methods' page pools on one device and on an accelerator's mesh: the compressed cache's arrays (traced,
no weights) and the compiled one-token step's memory per chip (``docs/results/plan/head_split_pools/``).

Run from the repository root, ``JAX_PLATFORMS=cpu PYTHONPATH=.aot-gpu:.aot-tpu:. python -m research.head_split_pools``
and one of:

* ``leaves METHODS BUDGET LENGTH``: each method's abstract compressed cache on one CPU device (batch 1, room 64):
  layer 0's arrays and the whole cache's GiB per memory kind (device, pinned_host);
* ``mesh-leaves METHODS BUDGET LENGTH [--target v5e-8]``: the same cache laid out on the target's (data, model) mesh:
  layer 0's arrays with their sharding (a page pool split by KV head has one pool shape on every chip);
* ``compile METHODS BUDGET LENGTH [--target v5e-8] [--batches 1,2]``: the one-token decode step compiled for the
  target (:func:`kvjax.evals.plan.compile_step`): device GiB per chip, XLA's temporaries, arguments, outputs and
  donated aliases, compile seconds.

METHODS: comma-separated, as ``kvjax bench --methods``; the model's shapes (``--model``, default Llama-3.1-8B),
bfloat16; synthetic calibrations (``kvjax.evals.bench_methods.bench_artifacts``).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOM = 64  # decode room per head, as the plans


def setup(model: str, methods: str, budget: float):
    """(config, {name: method}, {name: artifact}) for the model's shapes."""
    from kvjax.evals.bench_methods import bench_artifacts, make_methods, parse_methods
    from kvjax.models import model_architecture

    config, _ = model_architecture(model)
    made = make_methods(parse_methods(methods), budget)
    artifacts, _ = bench_artifacts(made, config, True)
    return config, made, artifacts


def layer0(cache):
    """``(path, array)`` of the cache's layer-0 leaves."""
    import jax

    for path, x in jax.tree_util.tree_leaves_with_path(cache):
        key = jax.tree_util.keystr(path)
        if "layers" in key and "[0]" in key:
            yield key, x


def leaves(args) -> None:
    import jax
    import numpy as np

    from kvjax.cache import CacheSpec
    from kvjax.evals.synthetic import abstract_compressed_cache, cpu_mesh

    config, made, artifacts = setup(args.model, args.methods, args.budget)
    for name, method in made.items():
        spec = CacheSpec.for_model(config, 1, args.length, ROOM, "bfloat16")
        cache = abstract_compressed_cache(method, spec, cpu_mesh(), artifacts.get(name))
        total = {}
        for _, x in jax.tree_util.tree_leaves_with_path(cache):
            kind = getattr(getattr(x, "sharding", None), "memory_kind", None) or "device"
            total[kind] = total.get(kind, 0) + int(np.prod(x.shape)) * x.dtype.itemsize
        for key, x in layer0(cache):
            kind = getattr(getattr(x, "sharding", None), "memory_kind", None) or "device"
            print(name, key[:90], x.shape, x.dtype, kind, round(int(np.prod(x.shape)) * x.dtype.itemsize / 2**20, 1), "MiB")
        print(name, {k: round(v / 2**30, 3) for k, v in total.items()})


def mesh_leaves(args) -> None:
    from kvjax.cache import CacheSpec
    from kvjax.evals.plan import TARGETS, target_mesh
    from kvjax.evals.synthetic import abstract_compressed_cache

    config, made, artifacts = setup(args.model, args.methods, args.budget)
    mesh = target_mesh(TARGETS[args.target], config)
    for name, method in made.items():
        spec = CacheSpec.for_model(config, 1, args.length, ROOM, "bfloat16", mesh=mesh)
        cache = abstract_compressed_cache(method, spec, mesh, artifacts.get(name))
        for key, x in layer0(cache):
            print(name, key[:60], x.shape, x.dtype, getattr(x, "sharding", None))


def compile_steps(args) -> None:
    from kvjax.evals.plan import TARGETS, compile_step, target_mesh

    config, made, artifacts = setup(args.model, args.methods, args.budget)
    target = TARGETS[args.target]
    mesh = target_mesh(target, config)
    gib = lambda b: round(b / 2**30, 3)  # noqa: E731
    for name, method in made.items():
        for batch in (int(b) for b in args.batches.split(",")):
            r = compile_step(target, mesh, config, "bfloat16", method, batch, args.length, ROOM, artifacts.get(name))
            mem = r["compiled"].memory_analysis()
            print(name, batch, "dev GiB", gib(r["device_bytes"]), "temp", gib(r["temp_bytes"]), "arg",
                  gib(mem.argument_size_in_bytes), "out", gib(mem.output_size_in_bytes), "alias",
                  gib(mem.alias_size_in_bytes), "compile", round(r["compile_s"]), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m research.head_split_pools", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["leaves", "mesh-leaves", "compile"])
    p.add_argument("methods", help="comma-separated methods, e.g. heterocache,synckv")
    p.add_argument("budget", type=float)
    p.add_argument("length", type=int, help="prompt tokens")
    p.add_argument("--model", default="llama-3.1-8b", help="ready or shape-only model (its shapes)")
    p.add_argument("--target", default="v5e-8", help="plan target of mesh-leaves and compile (kvjax.evals.plan)")
    p.add_argument("--batches", default="1,2", help="batches compile compiles (default 1,2)")
    args = p.parse_args(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"  # compile-only: targets are described by their topologies
    {"leaves": leaves, "mesh-leaves": mesh_leaves, "compile": compile_steps}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

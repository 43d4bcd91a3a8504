"""Device bytes of one method's one-token decode step compiled for an accelerator on the CPU (bf16, batch 1, random
weights of the model's shapes), grouped by the jax operation that made each instruction, largest first
(:func:`kvjax.evals.plan.instruction_bytes`).

``JAX_PLATFORMS=cpu PYTHONPATH=.aot-gpu:.aot-tpu:. python -m research.step_bytes METHOD BUDGET LENGTH [TOP]
[--model llama-3.1-8b] [--target h100]``, e.g. ``synckv:recall_schedule=pipelined 0.25 131008 12``: the compiled
step's device traffic and floor (as ``kvjax.evals.plan`` counts them), then one line per operation: GiB, share,
instructions.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys


def breakdown(name: str, budget: float, length: int, top: int = 30, *, model: str = "llama-3.1-8b",
              target: str = "h100") -> list[str]:
    """The report's lines (see the module docstring)."""
    import jax.numpy as jnp

    from kvjax.cache import CacheSpec
    from kvjax.evals import plan
    from kvjax.evals.gpu_schedule import compile_only_cuda
    from kvjax.evals.synthetic import synthetic_artifact
    from kvjax.methods import get_method
    from kvjax.models import model_architecture

    compile_only_cuda()
    config, _ = model_architecture(model)
    spot = plan.TARGETS[target]
    mesh = plan.target_mesh(spot, config)
    graphdef, params = plan.abstract_params(config, jnp.bfloat16, mesh)
    method = get_method(name, budget=budget)
    art = synthetic_artifact(method, CacheSpec.for_model(config, 1, length, 64, "bfloat16"))
    out = plan.compile_step(spot, mesh, config, "bfloat16", method, 1, length, 64, art, graphdef=graphdef,
                            params=params)
    lines = [f"device traffic GiB {out['device_traffic'] / 2**30:.3f}, floor GiB {out['floor_bytes'] / 2**30:.3f}"]
    by, count = collections.Counter(), collections.Counter()
    for _, op, d, _ in plan.instruction_bytes(out["compiled"].hlo_modules()[0].to_string()):
        key = re.sub(r"\[\d+\]", "", op)[-150:]
        by[key] += d
        count[key] += 1
    total = sum(by.values())
    for key, v in by.most_common(top):
        lines.append(f"{v / 2**30:8.3f} GiB {100 * v / total:5.1f}% x{count[key]:3d} {key}")
    return lines


def main(argv=None) -> int:
    from kvjax.evals.plan import TARGETS

    p = argparse.ArgumentParser(prog="python -m research.step_bytes", description=__doc__.splitlines()[0])
    p.add_argument("method", help="method spec, e.g. synckv:recall_schedule=pipelined")
    p.add_argument("budget", type=float)
    p.add_argument("length", type=int, help="prompt tokens")
    p.add_argument("top", type=int, nargs="?", default=30, help="operations listed (default 30)")
    p.add_argument("--model", default="llama-3.1-8b", help="ready or shape-only model (its shapes)")
    p.add_argument("--target", default="h100", choices=sorted(TARGETS))
    args = p.parse_args(argv)
    print("\n".join(breakdown(args.method, args.budget, args.length, args.top, model=args.model, target=args.target)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

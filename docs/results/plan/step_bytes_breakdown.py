"""Device bytes of one method's one-token decode step compiled for an H100 on the CPU (Llama-3.1-8B shapes, bf16,
batch 1), grouped by the jax operation that made each instruction, largest first (:func:`kvjax.evals.plan.instruction_bytes`).

``JAX_PLATFORMS=cpu PYTHONPATH=.aot-gpu:.aot-tpu:. python docs/results/plan/step_bytes_breakdown.py METHOD BUDGET
LENGTH [TOP]``, e.g. ``synckv:recall_schedule=pipelined 0.25 131008 12``."""

import collections
import re
import sys

import jax.numpy as jnp

from kvjax.evals import plan
from kvjax.evals.gpu_schedule import compile_only_cuda
from kvjax.evals.synthetic import synthetic_artifact
from kvjax.cache import CacheSpec
from kvjax.methods import get_method
from kvjax.models import model_architecture


def main(name: str, budget: float, length: int, top: int = 30) -> None:
    compile_only_cuda()
    config, _ = model_architecture("llama-3.1-8b")
    target = plan.TARGETS["h100"]
    mesh = plan.target_mesh(target, config)
    graphdef, params = plan.abstract_params(config, jnp.bfloat16, mesh)
    method = get_method(name, budget=budget)
    art = synthetic_artifact(method, CacheSpec.for_model(config, 1, length, 64, "bfloat16"))
    out = plan.compile_step(target, mesh, config, "bfloat16", method, 1, length, 64, art, graphdef=graphdef,
                            params=params)
    print(f"device traffic GiB {out['device_traffic'] / 2**30:.3f}, floor GiB {out['floor_bytes'] / 2**30:.3f}")
    by, count = collections.Counter(), collections.Counter()
    for _, op, d, _ in plan.instruction_bytes(out["compiled"].hlo_modules()[0].to_string()):
        key = re.sub(r"\[\d+\]", "", op)[-150:]
        by[key] += d
        count[key] += 1
    total = sum(by.values())
    for key, v in by.most_common(top):
        print(f"{v / 2**30:8.3f} GiB {100 * v / total:5.1f}% x{count[key]:3d} {key}")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), *(int(x) for x in sys.argv[4:5]))

"""Runs in its own process with jax's CUDA plugin and libtpu on the path (``tests/test_accelerator_compile.py`` starts
it): compiles every registered method's one-token decode step on a tiny model for an H100 and for a TPU v5e-8 slice,
without them (:func:`kvjax.evals.plan.compile_step`), and prints one JSON object on the last line of stdout: per target and
method, the compiled memory, the bytes moved, whether the program holds a Pallas kernel and which, its int8 and
host-memory arguments, or the error; the same for :data:`INT8`'s methods with an int8 cache.

``python -m tests.accelerator_compile_worker [targets]`` (``PYTHONPATH`` must hold ``.aot-gpu`` and ``.aot-tpu``).
"""

from __future__ import annotations

import json
import re
import sys

from kvjax.evals.gpu_schedule import compile_only_cuda

PROMPT, ROOM = 512, 8
# The kernels' custom calls in a compiled program: Pallas' GPU form (Triton) and TPU form (Mosaic).
KERNEL_CALLS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


# Configurations compiled beside every registered method: HCAttention with the paper's 16-bit codes (c > 256).
EXTRA = {"hcattention:centroids=1024": dict(budget=0.25)}
# Methods whose decode step is also compiled with an int8 cache (per-token scales): the full cache, the evicting
# methods' shared pools (SnapKV), Quest's pages with their bounds, the recall family's pools and host copy, and
# HCAttention's host values (PQ-coded keys, budget 0.25).
INT8 = ("full", "snapkv", "quest", "heterocache", "synckv", "hcattention")


def methods():
    """Every registered method at budget 0.5 (the full cache as is); HCAttention with PQ-coded keys (budget 0.25),
    with 8-bit codes (its default c = 256) and with 16-bit codes (:data:`EXTRA`)."""
    from kvjax.methods import METHODS, get_method

    out = {name: get_method(name) if name == "full" else get_method(name, budget=0.25 if name == "hcattention" else 0.5)
           for name in METHODS}
    out.update({name: get_method(name, **kwargs) for name, kwargs in EXTRA.items()})
    return out


def main() -> None:
    compile_only_cuda()
    from kvjax.evals.plan import TARGETS, compile_step, target_mesh
    from kvjax.evals.synthetic import synthetic_artifact
    from kvjax.cache import CacheSpec
    from tests.mesh_worker import CONFIG_D16

    targets = sys.argv[1].split(",") if len(sys.argv) > 1 else ["h100", "v5e-8"]
    result = {}
    for tname in targets:
        target = TARGETS[tname]
        mesh = target_mesh(target, CONFIG_D16)
        batch = mesh.devices.shape[0]
        rows = result.setdefault(tname, {"mesh": list(mesh.devices.shape), "methods": {}})["methods"]
        int8 = result[tname]["int8"] = {}
        for name, method in methods().items():
            artifact = synthetic_artifact(method, CacheSpec.for_model(CONFIG_D16, 1, PROMPT, ROOM, "float32"))
            for kv_dtype, into in ((None, rows), ("int8", int8)):
                if kv_dtype and name not in INT8:
                    continue
                try:
                    out = compile_step(target, mesh, CONFIG_D16, "float32", method, batch, PROMPT, ROOM, artifact,
                                       kv_dtype=kv_dtype)
                except Exception as e:  # noqa: BLE001 - reported, the test names it
                    into[name] = {"error": f"{type(e).__name__}: {e}"[:600]}
                    continue
                compiled = out.pop("compiled")
                text = compiled.hlo_modules()[0].to_string() if target.platform == "cuda" else compiled.as_text()
                out["kernel"] = KERNEL_CALLS[target.platform] in text
                out["pallas_calls"] = sorted(set(re.findall(r"/(\w+)/pallas_call", text)))  # the kernels' names
                entry = text[text.index("\nENTRY"):]
                entry = entry[:entry.index("\n}")]
                out["int8_arguments"] = len(re.findall(r"= s8\[[\d,]*\]\{[^}]*\} parameter\(", entry))
                # the shapes of the arguments in host memory (memory space S(5))
                out["host_arguments"] = sorted(re.findall(r"= (\w+\[[\d,]*\])\{[^}]*S\(5\)[^}]*\} parameter\(", entry))
                into[name] = out
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Runs in its own process with jax's CUDA plugin on the path (``tests/test_gpu_schedule.py`` starts it): compiles the
tiny model's decode loop for an H100, without one, and prints the host calls' windows and the step's conditionals,
with the shapes each program's one-token step copies and what its runtime launches per step (CUDA graphs), also for the
full cache's step, as one JSON object on the last line of stdout; also compiles
the paged kernel's Mosaic GPU form at Llama-3.1-8B's decode shape over bfloat16 and quantized pools.

``python -m tests.gpu_schedule_worker`` (``PYTHONPATH`` must hold the plugin's directory, ``.aot-gpu``).
"""

from __future__ import annotations

import json
import re

from kvjax.evals.gpu_schedule import (compile_for_gpu, compile_only_cuda, decode_module, gpu_topology, host_call_windows,
                                      loop_conditionals, step_launches, step_module)
from kvjax.evals.plan import instruction_bytes
from kvjax.decoding import GPU_DECODE_COMPILER_OPTIONS
from kvjax.methods import FullCache, HeteroCache, SyncKV
from tests.mesh_worker import CONFIG_D16, recall_artifacts, tiny_model

PROMPT, NEW = 64, 3


def main() -> None:
    compile_only_cuda()
    topology = gpu_topology("h100")
    model = tiny_model(CONFIG_D16)
    hetero, sync = recall_artifacts(CONFIG_D16)
    programs = {
        "heterocache-pipelined": (HeteroCache(budget=0.5, block=32, recall_schedule="pipelined"), hetero),
        "synckv-pipelined": (SyncKV(budget=0.5, num_representatives=3, block=32, recall_schedule="pipelined"), sync),
        "synckv-spread": (SyncKV(budget=0.5, num_representatives=3, block=32, recall_schedule="spread"), sync),
    }
    windows, conditionals, step_copies, graphs = {}, {}, {}, {}
    for name, (method, artifact) in programs.items():
        module = decode_module(model, method, PROMPT, NEW, artifact)
        for label, options in (("kvjax", GPU_DECODE_COMPILER_OPTIONS), ("xla-default", {})):
            hlo = compile_for_gpu(module, topology, options)
            windows[f"{name}/{label}"] = host_call_windows(hlo)
            conditionals[f"{name}/{label}"] = loop_conditionals(hlo)
        hlo, graphs[name] = step_launches(step_module(model, method, PROMPT, artifact), topology,
                                          GPU_DECODE_COMPILER_OPTIONS)
        step_copies[name] = [re.search(rf"%{re.escape(n)} = (\S+) copy\(", hlo)[1]
                             for n, op, _, _ in instruction_bytes(hlo) if op == "copy"]
    _, graphs["full"] = step_launches(step_module(model, FullCache(), PROMPT), topology, GPU_DECODE_COMPILER_OPTIONS)
    print(json.dumps({"windows": windows, "conditionals": conditionals, "step_copies": step_copies, "graphs": graphs,
                      "mosaic_paged": mosaic_paged_calls(topology)}))


def mosaic_paged_calls(topology) -> dict:
    """The paged kernel's Mosaic GPU form compiled for an H100 at Llama-3.1-8B's decode shape (batch 8, 32 query / 8 KV
    heads of 128 dims, 32K tokens per head in 16-token pages), over bfloat16 pools and over int8 / float8_e4m3fn pools
    with their per-token scales: per pool dtype the custom calls of the compiled program, the Mosaic GPU call's
    operand types, its temporary bytes and one pool's bytes."""
    import jax
    import jax.numpy as jnp

    from kvjax.evals.gpu_schedule import export_for_gpu, gpu_executable
    from kvjax.evals.hlo import custom_call_operands
    from kvjax.pallas_kernels.paged_attention import paged_decode_attention

    B, H_kv, G, D, page, tokens = 8, 8, 4, 128, 16, 32768
    pages = tokens // page
    S = jax.ShapeDtypeStruct
    out = {}
    for kv_dtype in ("bfloat16", "int8", "float8_e4m3fn"):
        quantized = kv_dtype != "bfloat16"
        pool = S((B * H_kv * pages, page, D), kv_dtype)
        scales = (S((B * H_kv * pages, page), jnp.float32),) * 2 if quantized else ()
        args = (S((B, H_kv * G, D), jnp.bfloat16), pool, pool, S((B, H_kv, pages), jnp.int32),
                S((B, H_kv), jnp.int32)) + scales

        def attend(q, k, v, table, lengths, k_scales=None, v_scales=None):
            return paged_decode_attention(q, k, v, table, lengths, implementation="pallas", backend="mosaic_gpu",
                                          k_scales=k_scales, v_scales=v_scales)

        executable = gpu_executable(export_for_gpu(attend, *args).mlir_module(), topology, {})
        hlo = executable.hlo_modules()[0].to_string()
        out[kv_dtype] = {"calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo))),
                         "operands": next(iter(custom_call_operands(hlo, "mosaic_gpu_v2")), []),
                         "temp_bytes": int(executable.get_compiled_memory_stats().temp_size_in_bytes),
                         "pool_bytes": int(pool.size * jnp.dtype(kv_dtype).itemsize)}
    return out


if __name__ == "__main__":
    main()

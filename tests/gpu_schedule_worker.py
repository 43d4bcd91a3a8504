"""Runs in its own process with jax's CUDA plugin on the path (``tests/test_gpu_schedule.py`` starts it): compiles the
tiny model's decode loop for an H100, without one, and prints the host calls' windows and the step's conditionals as
one JSON object on the last line of stdout.

``python -m tests.gpu_schedule_worker`` (``PYTHONPATH`` must hold the plugin's directory, ``.aot-gpu``).
"""

from __future__ import annotations

import json

from evals.gpu_schedule import (compile_for_gpu, compile_only_cuda, decode_module, gpu_topology, host_call_windows,
                                loop_conditionals)
from kvjax.decoding import GPU_DECODE_COMPILER_OPTIONS
from kvjax.methods import HeteroCache, SyncKV
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
        "synckv-ahead": (SyncKV(budget=0.5, num_representatives=3, block=32, recall_schedule="ahead"), sync),
    }
    windows, conditionals = {}, {}
    for name, (method, artifact) in programs.items():
        module = decode_module(model, method, PROMPT, NEW, artifact)
        for label, options in (("kvjax", GPU_DECODE_COMPILER_OPTIONS), ("xla-default", {})):
            hlo = compile_for_gpu(module, topology, options)
            windows[f"{name}/{label}"] = host_call_windows(hlo)
            conditionals[f"{name}/{label}"] = loop_conditionals(hlo)
    print(json.dumps({"windows": windows, "conditionals": conditionals}))


if __name__ == "__main__":
    main()

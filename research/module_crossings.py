"""How many times a SyncKV one-token decode step's Python code crosses from one kvjax module into another.

``python -m research.module_crossings [--schedule whole|spread|pipelined]``

A tiny random Llama (2 layers x 2 KV heads, ``tests/tiny.py``) with a hand-made SyncKV artifact (layer 0's head 0
leads the other three heads) prefills 48 tokens and compresses at half the prompt; then one ``decode_step`` is traced
(its first call, under ``sys.setprofile``). Counted: the calls whose caller and callee are functions of two different
``kvjax`` modules (the model's included), and the modules involved; the same for one follower layer's
``decode_attend`` run eagerly. A measure of how far a reader must follow one step through the code.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile


def crossings(fn) -> tuple[int, collections.Counter]:
    """``(calls between two kvjax modules, calls per (caller module, callee module))`` while ``fn()`` runs."""
    pairs: collections.Counter = collections.Counter()

    def module(frame):
        name = frame.f_globals.get("__name__", "")
        return name if name.startswith("kvjax") else None

    def profile(frame, event, _):
        if event != "call" or frame.f_back is None:
            return
        callee, caller = module(frame), module(frame.f_back)
        if callee and caller and callee != caller:
            pairs[caller, callee] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return sum(pairs.values()), pairs


def main(argv=None) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.artifacts import Artifact, model_identity
    from kvjax.cache import AttendContext, new_cache
    from kvjax.decoding import compress, decode_step, prefill
    from kvjax.methods import SyncKV
    from kvjax.models import load_model
    from tests.tiny import save_tiny

    p = argparse.ArgumentParser(prog="python -m research.module_crossings", description=__doc__.splitlines()[0])
    p.add_argument("--schedule", default="whole")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        save_tiny("llama3_rope", d, seed=3)
        model = load_model(d, "float32", tokenizer=False)
    lead = (((-1, -1), (0, 0)), ((0, 0), (0, 0)))
    art = Artifact(arrays={}, kind="synckv", model_id=model_identity(model.config),
                   meta=(("clusters", ((1, (("R", "NR"), ("NR", "NR")), lead),)), ("group_layers", 2)))
    method = SyncKV(budget=0.5, block=16, stride=2, num_representatives=1, recall_schedule=args.schedule)
    tokens = np.random.default_rng(0).integers(0, 97, size=(1, 49)).astype(np.int32)
    cache = new_cache(method, model.config, 1, 48, 8, model.dtype, artifact=art)
    _, cache = prefill(model.graphdef, model.params, jnp.asarray(tokens[:, :48]), cache)
    cache = compress(cache)
    rng = np.random.default_rng(1)
    D = model.config.head_dim
    q, k, v = (jnp.asarray(rng.standard_normal(s).astype(np.float32))
               for s in [(1, 1, model.config.num_heads, D), (1, 1, 2, D), (1, 1, 2, D)])
    ctx = AttendContext(start=cache.length, pad=cache.pad, positions=jnp.array([[48]]), layers=cache.layers, layer=1)
    layer, layer_pairs = crossings(lambda: method.decode_attend(cache.layers[1], q, k, v, ctx))
    key = jax.random.PRNGKey(0)  # the step donates the cache: measured last
    step, step_pairs = crossings(lambda: decode_step(model.graphdef, model.params, jnp.asarray(tokens[:, 48]), cache,
                                                     key))
    for name, total, pairs in (("decode_step (traced)", step, step_pairs), ("one follower layer's decode_attend", layer,
                                                                             layer_pairs)):
        modules = {m for pair in pairs for m in pair}
        print(f"{name}: {total} calls between {len(modules)} kvjax modules")
        for (a, b), n in pairs.most_common(8):
            print(f"  {n:4d}  {a} -> {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

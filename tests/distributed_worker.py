"""One process of a two-process job on this machine (``tests/test_mesh.py`` starts both).

``python -m tests.distributed_worker PROCESS_ID PORT``: joins the job through ``kvjax.distributed``
(localhost coordinator, CPU gloo collectives), splits the tiny model of ``tests/mesh_worker.py`` over
a ``data=1, model=2`` mesh spanning both processes (one CPU device each) and prints the generated
tokens as JSON on the last line of stdout. ``python -m tests.distributed_worker single`` prints the
one-process result.
"""

from __future__ import annotations

import json
import sys

from kvjax.distributed import initialize


def main() -> None:
    single = sys.argv[1] == "single"
    if not single:
        initialize(f"localhost:{sys.argv[2]}", 2, int(sys.argv[1]))
    import jax
    import numpy as np

    from kvjax.api import generate_tokens
    from kvjax.methods import FullCache, SnapKV
    from kvjax.models.sharding import shard_model
    from tests.mesh_worker import CHUNK, CONFIG, LENGTHS, NEW_TOKENS, tiny_model

    model = tiny_model()
    if not single:
        assert jax.process_count() == 2 and len(jax.devices()) == 2, (jax.process_count(), jax.devices())
        model = shard_model(model, "data=1,model=2")
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(1, CONFIG.vocab_size, size=n)) for n in LENGTHS[:2]]
    result = {}
    for name, method in (("full", FullCache(block=32)), ("snapkv", SnapKV(budget=40, window=8))):
        out, count, cache, _ = generate_tokens(model, rows, method=method, max_new_tokens=NEW_TOKENS, chunk_size=CHUNK)
        result[name] = np.asarray(out).tolist()
    result["process_index"] = jax.process_index()
    print(json.dumps(result))


if __name__ == "__main__":
    main()

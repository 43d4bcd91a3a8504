"""``kvjax bench mesh``: decode speed and per-device bytes of each method on each device mesh.

A random model with 8 KV heads (the ready models have 2 and 3, too few to split 8 ways) generates
for a batch of left-padded prompts on every mesh and method; the second of two identical runs is
timed (the first compiles). Per row: decode ms/token, prefill s, the cache's device bytes in all and
on the fullest device, its host bytes (HeteroCache, SyncKV, HCAttention), the weights' bytes per
device, and ratios against the full cache on the same mesh and against the same method on one
device, measured in the same run.

HeteroCache, SyncKV and HCAttention need artifacts made for the model: the bench calibrates them on
the random model itself (:func:`calibrate_on_model`: a few random token rows, the same functions as
``kvjax calibrate``), so their head roles and codebooks come from calibration, not by hand.

On CPU the devices are simulated (``--cpu-devices``): the numbers show the structure (what each
device holds), not the speed of a real mesh, since all "devices" share this machine's cores.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

from kvjax.reports import table, write_report

DEFAULT_MESHES = ("data=1,model=1", "data=2,model=4", "data=8,model=1", "data=1,model=8")
DEFAULT_METHODS = ("full", "snapkv", "quest", "locret")


def build_parser() -> argparse.ArgumentParser:
    """Options of ``kvjax bench mesh``."""
    p = argparse.ArgumentParser(prog="kvjax bench mesh", description=__doc__.splitlines()[0])
    p.add_argument("--meshes", default=";".join(DEFAULT_MESHES), help="';'-separated meshes (default: %(default)s)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma list among full, snapkv, quest, locret, "
                   "h2o, streaming_llm, heterocache, synckv, hcattention (default: %(default)s)")
    p.add_argument("--length", type=int, default=1024, help="prompt tokens of the longest row (default 1024)")
    p.add_argument("--batch", type=int, default=8, help="rows (default 8)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per run (default 32)")
    p.add_argument("--budget", type=float, default=0.25, help="budget of the compressing methods (default 0.25)")
    p.add_argument("--cpu-devices", type=int, default=8,
                   help="simulated CPU devices when jax runs on CPU (default 8; set before jax starts)")
    p.add_argument("--out", default=None, help="Markdown report (JSON beside it; default docs/results/bench_mesh_<platform>.md)")
    return p


def bench_model(seed: int = 0):
    """A random 4-layer model with 16 query and 8 KV heads of 64 dims (weights scaled so attention is peaked)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kvjax.models import LoadedModel
    from kvjax.models.config import ModelConfig
    from kvjax.models.llama import random_model

    config = ModelConfig(architecture="llama", vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=4,
                         num_heads=16, num_kv_heads=8, head_dim=64, max_position_embeddings=8192, name="bench-mesh")
    graphdef, params = nnx.split(random_model(config, seed=seed))
    params = jax.tree_util.tree_map(lambda x: x * 10 if x.ndim == 2 else x, params)
    return LoadedModel(config, graphdef, params, None, "random", jnp.float32)


CALIBRATION_ROWS, CALIBRATION_TOKENS = 4, 512  # random token rows the recall methods are calibrated on


def calibrate_on_model(kind: str, model, *, groups: int = 32, centroids: int = 256):
    """A ``heterocache``, ``synckv`` or ``hcattention`` artifact calibrated on ``model`` (random token rows).

    Head roles: attended sets over 8 greedy decode steps (top 10%), statistics over groups of
    :func:`kvjax.calibration.auto_group_layers` adjacent layers, as ``kvjax calibrate``; HeteroCache's
    thresholds are quantiles of those statistics (see below). Codebooks: ``groups`` x ``centroids``
    mini-batch k-means over the rows' post-RoPE keys (10 iterations).
    """
    import numpy as np

    from kvjax.artifacts import model_identity
    from kvjax.calibration import auto_group_layers, head_statistics, record_sets

    c = model.config
    rng = np.random.default_rng(1)
    rows = [list(rng.integers(1, c.vocab_size, size=CALIBRATION_TOKENS)) for _ in range(CALIBRATION_ROWS)]
    mid = model_identity(c)
    if kind == "hcattention":
        from kvjax.pq_codebooks import collect_keys, fit_codebooks, hcattention_artifact

        cbs = fit_codebooks(collect_keys(model, rows), groups=groups, centroids=centroids, iterations=10)
        return hcattention_artifact(cbs, mid, samples=len(rows), tokens=CALIBRATION_TOKENS, iterations=10, batch=4096,
                                    seed=0, calibration="random token rows (kvjax bench mesh)")
    topk = max(1, int(0.1 * (CALIBRATION_TOKENS - 1)))
    gqa = "mean" if kind == "heterocache" else "max"  # as kvjax calibrate
    records = record_sets(model, rows, decode_steps=8, topk=topk, gqa=gqa)
    stats = head_statistics(records, topk=topk, group_layers=auto_group_layers(c.num_kv_heads), tokens=CALIBRATION_TOKENS)
    if kind == "heterocache":
        from kvjax.calibration.heterocache import heterocache_artifact

        # A random model's heads sit near chance (stability about 0.1, overlaps about 0.2), so the
        # paper's thresholds (0.5) make every head volatile. Thresholds at quantiles of the model's own
        # statistics give every role: the top 10% of head pairs by overlap are similar, the 10% least
        # stable heads volatile (this bench measures layout and speed, not quality).
        pairs = np.concatenate([m[~np.eye(len(m), dtype=bool)] for m in stats.sim_median])
        return heterocache_artifact(stats, mid, tau_sim=float(np.quantile(pairs, 0.9)),
                                    tau_stable=float(np.quantile(stats.stability, 0.1)))
    if kind == "synckv":
        from kvjax.calibration.synckv import synckv_artifact

        return synckv_artifact(stats, mid)
    raise ValueError(f"no calibration for {kind!r}; calibrated kinds: heterocache, synckv, hcattention")


def make_method(name: str, budget: float, model):
    """A method by name at ``budget`` with its artifact: random retaining heads of the model's shape for
    Locret, :func:`calibrate_on_model` for HeteroCache, SyncKV and HCAttention."""
    from kvjax.artifacts import model_identity
    from kvjax.methods import get_method
    from kvjax.retaining_heads import random_heads_artifact

    if name == "full":
        return get_method("full"), None
    if name == "locret":
        c = model.config
        heads = random_heads_artifact(model_identity(c), c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, 64, 0)
        return get_method("locret", budget=budget, chunk=256, local=32), heads
    if name in ("heterocache", "synckv", "hcattention"):
        method = get_method(name, budget=budget)
        if name == "hcattention":
            from kvjax.cache import CacheSpec

            groups = method.key_groups(CacheSpec.for_model(model.config, 1, CALIBRATION_TOKENS, 0, model.dtype))
            if not groups:  # exact keys: no codebooks
                return method, None
            return method, calibrate_on_model(name, model, groups=groups, centroids=method.centroids)
        return method, calibrate_on_model(name, model)
    return get_method(name, budget=budget), None


def run(args) -> dict:
    """Measure every (mesh, method); returns the report."""
    import jax
    import numpy as np

    if args.cpu_devices:
        try:
            jax.config.update("jax_num_cpu_devices", args.cpu_devices)
        except RuntimeError:  # the backend already started (e.g. in-process tests): use what there is
            pass
    from tqdm import tqdm

    from kvjax.api import generate_tokens
    from kvjax.cache import device_bytes_per_device
    from kvjax.models.sharding import shard_model

    base = bench_model()
    rng = np.random.default_rng(0)
    lengths = [args.length - (rng.integers(0, args.length // 8) if b % 2 else 0) for b in range(args.batch)]
    rows = [list(rng.integers(1, base.config.vocab_size, size=int(n))) for n in lengths]
    meshes = [m.strip() for m in args.meshes.split(";") if m.strip()]
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    results = []
    made = {name: make_method(name, args.budget, base) for name in names}  # calibrated once, used on every mesh
    with tqdm(total=len(meshes) * len(names), desc="bench mesh", unit="run", file=sys.stderr) as bar:
        for mesh in meshes:
            model = shard_model(base, mesh)
            weights = device_bytes_per_device(model.params)
            for name in names:
                bar.set_postfix_str(f"{mesh} {name}")
                method, artifact = made[name]
                row = {"mesh": mesh, "method": name, "weights_bytes_per_device": weights}
                try:
                    chunk = 256 if name == "locret" else None
                    for _ in range(2):  # the first run compiles
                        out, count, cache, timings = generate_tokens(model, rows, method=method, artifact=artifact,
                                                                     max_new_tokens=args.new_tokens, chunk_size=chunk)
                    stats = cache.stats()
                    row.update(decode_ms_per_token=timings["decode_ms_per_token"], prefill_s=timings["prefill_s"],
                               device_bytes=stats["device_bytes"], host_bytes=stats["host_bytes"],
                               device_bytes_per_device=stats["device_bytes_per_device"],
                               tokens=np.asarray(out).tolist())
                except ValueError as e:
                    row["error"] = str(e)
                results.append(row)
                bar.update()
    add_ratios(results)
    device = jax.devices()[0]
    return {"command": args.command,
            "date": datetime.date.today().isoformat(), "platform": device.platform,
            "device": getattr(device, "device_kind", device.platform), "devices": len(jax.devices()),
            "model": "random llama, 4 layers, 16 heads / 8 KV heads x 64, hidden 512",
            "batch": args.batch, "length": args.length, "new_tokens": args.new_tokens, "budget": args.budget,
            "rows": results}


def add_ratios(rows: list[dict]) -> None:
    """Ratios against the full cache on the same mesh and the same method on the first mesh; token agreement."""
    by = {(r["mesh"], r["method"]): r for r in rows if "error" not in r}
    first_mesh = rows[0]["mesh"] if rows else None
    for r in rows:
        if "error" in r:
            continue
        full = by.get((r["mesh"], "full"))
        single = by.get((first_mesh, r["method"]))
        if full:
            r["decode_vs_full"] = r["decode_ms_per_token"] / full["decode_ms_per_token"]
            r["bytes_per_device_vs_full"] = r["device_bytes_per_device"] / full["device_bytes_per_device"]
        if single:
            r["decode_vs_one_device"] = r["decode_ms_per_token"] / single["decode_ms_per_token"]
            r["bytes_per_device_vs_one_device"] = r["device_bytes_per_device"] / single["device_bytes_per_device"]
            r["same_tokens_as_one_device"] = r["tokens"] == single["tokens"]


def markdown(report: dict) -> str:
    """The report as a Markdown table."""
    mib = 1024 ** 2
    lines = [f"# Methods on device meshes ({report['devices']} {report['platform']} devices)", "",
             f"Command: `{report['command']}` ({report['date']}).", "",
             f"Model: {report['model']}; batch {report['batch']} (left-padded, longest {report['length']} tokens), "
             f"{report['new_tokens']} new tokens, budget {report['budget']}. Second of two identical runs timed.", ""]
    if report["platform"] == "cpu":
        lines += ["CPU devices are simulated on this machine's cores: the bytes show what each device holds; the "
                  "times show the cost of the partitioned program on one machine, not the speed of a real mesh.", ""]
    head = ["mesh", "method", "decode ms/token", "vs full", "vs one device", "cache MiB (all)", "cache MiB per device",
            "per device vs one device", "host MiB", "weights MiB per device", "same tokens as one device"]
    rows = []
    for r in report["rows"]:
        if "error" in r:
            rows.append([r["mesh"], r["method"], f"error: {r['error']}"] + [""] * 8)
            continue
        rows.append([
            r["mesh"], r["method"], f"{r['decode_ms_per_token']:.1f}", f"{r.get('decode_vs_full', float('nan')):.2f}",
            f"{r.get('decode_vs_one_device', float('nan')):.2f}", f"{r['device_bytes'] / mib:.1f}",
            f"{r['device_bytes_per_device'] / mib:.2f}", f"{r.get('bytes_per_device_vs_one_device', float('nan')):.3f}",
            f"{r.get('host_bytes', 0) / mib:.1f}", f"{r['weights_bytes_per_device'] / mib:.1f}",
            r.get("same_tokens_as_one_device", "")])
    return "\n".join(lines + table(head, rows)) + "\n"


def main(argv=None) -> int:
    """Entry point of ``kvjax bench mesh``; writes the Markdown and JSON reports."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.command = "kvjax bench mesh " + " ".join(argv)
    report = run(args)
    out = args.out or os.path.join("docs", "results", f"bench_mesh_{report['platform']}.md")
    for r in report["rows"]:
        r.pop("tokens", None)
    write_report(out, markdown(report), report)
    print(out)
    return 0 if all("error" not in r for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())

"""``kvjax eval``: methods x budgets x tasks x lengths on the same prompts, results under ``docs/results/<run>``.

For each (task, length) the runner builds the samples of its suite (:mod:`kvjax.evals.suites`: kvjax's tasks or
RULER's, deterministic from the split's seed), batches them, and per batch prefills the prompt **once** into a shared staging cache
(:mod:`kvjax.shared_prefill`): the full cache and every method that can share a prefill are derived
from that one prefill, compressed and decoded greedily; any other method runs its own prefill. Answers are scored by the suite's metric.

Budgets are fractions of the prompt's KV kept on the device (:mod:`kvjax.budgets`), applied to each
row's own prompt length (never to the left padding up to a multiple of the prefill chunk).

Outputs in ``<out_root>/<run_name>/``:
* ``samples.jsonl``: one record per (sample, method, budget), appended and flushed per method and budget of
  each batch, so an interrupted run resumes where it stopped (records already present are skipped; the batch's
  shared prefill runs again). A record's
  ``device_bytes`` is its share of the batch's cache plus the whole artifact (codebooks, trained
  heads: held once whatever the batch; also ``artifact_device_bytes``). Records written before
  this rule divided the artifact by the batch's rows. ``jax`` and ``device`` name what measured it
  (:func:`environment`; records written before 2026-12-07 lack them);
* ``fidelity.jsonl``: one record per (method, budget, length) of the fidelity check (:mod:`kvjax.evals.fidelity`);
* ``config.json`` (the run's settings: a resumed or extended run adds its methods, budgets, tasks, lengths and
  command to those already there), ``summary.json``, ``README.md`` (tables) and PNG plots, rebuilt from the JSONL
  files at the end of every run (:mod:`kvjax.evals.report`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.evals.records import budget_label, method_budgets, read_jsonl, run_split, split_budget, stored_full_name
from kvjax.evals.suites import SPLITS, SUITES, get_suite
from kvjax.evals.tasks import MAX_NEW_TOKENS  # noqa: F401  (the kvjax suite's answer lengths, for scripts)
from kvjax.distributed import add_mesh_args, setup_devices
from kvjax.sharding import place_cache, place_rows

DEFAULT_METHODS = ("snapkv", "streaming_llm", "h2o", "pyramidkv", "hbw", "quest")
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>")
PROTOCOLS = ("query-aware", "query-agnostic")


@dataclasses.dataclass
class EvalConfig:
    """Settings of one evaluation run (saved as ``config.json``; a resumed run must match them)."""

    model: str = "qwen2.5-coder-0.5b"
    dtype: str = "float32"
    methods: tuple[str, ...] = DEFAULT_METHODS
    budgets: tuple[float, ...] = (0.1, 0.25, 0.5)
    tasks: tuple[str, ...] | None = None  # None: the suite's default tasks
    lengths: tuple[int, ...] = (4096,)
    samples: int = 8
    suite: str = "kvjax"
    split: str = "dev"
    seed: int | None = None  # set from the split (the seed its prompts are drawn from)
    batch_size: int = 4
    chunk_size: int = 1024
    run_name: str = "eval"
    out_root: str = os.path.join("docs", "results")
    fidelity_texts: int = 0  # 0 = no fidelity check
    fidelity_prefix: int = 4096
    fidelity_tokens: int = 256
    protocol: str = "query-aware"
    command: str = ""
    mesh: str | None = None  # "data=2,model=4": model and caches split over a device mesh (kvjax.sharding)
    # every method's compressed page pools in this dtype, and the full cache when "full" is in methods (its own row,
    # stored_full_name(kv_dtype)); the reference full cache keeps the model's dtype
    kv_dtype: str | None = None

    def __post_init__(self):
        from kvjax.budgets import check_budget
        from kvjax.methods import METHODS, parse_method_spec

        unknown = [m for m in self.methods if parse_method_spec(m)[0] not in METHODS]
        if unknown:
            raise ValueError(f"unknown methods {unknown}; available: {', '.join(sorted(METHODS))}")
        options = [m for m in self.methods if m != "full" and parse_method_spec(m)[0] == "full"]
        if options:
            raise ValueError(f"{options}: the full cache takes no options in methods; list 'full' (with kv_dtype: the "
                             "full cache stored in that dtype, as its own row beside the reference)")
        for m in self.methods:
            split_budget(m)  # a bad budget inside a spec fails here, before any model is loaded
        suite = get_suite(self.suite)
        suite.check_split(self.split)
        if self.seed is not None and self.seed != suite.seed(self.split):
            raise ValueError(f"the {self.split} split of the {self.suite} suite draws from seed {suite.seed(self.split)}, "
                             f"not {self.seed}: choose prompts by --split")
        self.seed = suite.seed(self.split)
        self.tasks = tuple(suite.default_tasks if self.tasks is None else self.tasks)
        suite.check_tasks(self.tasks)
        for b in self.budgets:
            try:
                check_budget(b)
            except (TypeError, ValueError) as e:
                raise ValueError(f"budgets: {e}") from None
        for name, v in (("samples", self.samples), ("batch_size", self.batch_size), ("chunk_size", self.chunk_size)):
            if v <= 0:
                raise ValueError(f"{name} must be > 0, got {v}")
        if any(n <= 0 for n in self.lengths):
            raise ValueError(f"lengths must be > 0, got {list(self.lengths)}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {self.protocol!r}; allowed: {', '.join(PROTOCOLS)}")
        if not self.tasks and self.fidelity_texts <= 0:
            raise ValueError("nothing to run: give tasks, or fidelity_texts > 0 for the fidelity check alone")
        if self.kv_dtype is not None:
            from kvjax.kv_quantization import check_kv_dtype

            name = check_kv_dtype(self.kv_dtype, self.dtype)
            self.kv_dtype = None if name == jnp.dtype(self.dtype).name else name

    @property
    def out_dir(self) -> str:
        """Directory of this run's outputs."""
        return os.path.join(self.out_root, self.run_name)

    def identity(self) -> dict:
        """Settings a resumed run must share with the records already written."""
        return {"model": self.model, "dtype": self.dtype, "seed": self.seed, "chunk_size": self.chunk_size,
                "protocol": self.protocol, "suite": self.suite, "split": self.split, "kv_dtype": self.kv_dtype}


RECALL_STATS = ("recall_trigger_rate", "bytes_recalled")  # per run of methods that recall from the host tier
SELECTION_STATS = ("selection_ratio", "selection_ratio_per_layer", "value_rows_per_head_per_call",
                   "value_rows_fetched_per_head_per_call", "key_representation")  # per run of methods that select values per step (HCAttention)


def environment() -> dict:
    """What a record was measured with: the jax version and the device (a CPU by its model and usable cores, an
    accelerator by its kind and count)."""
    from kvjax.evals.bench_machine import machine_info

    device = jax.devices()[0]
    if device.platform == "cpu":
        info = machine_info()
        where = f"cpu: {info['cpu']}, {info['usable_cores']} cores"
    else:
        where = f"{device.device_kind} x {len(jax.devices())}"
    return {"jax": jax.__version__, "device": where}


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """EOS plus the chat end-of-turn tokens the vocabulary has (a chat answer ends at either)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    ids.update(int(vocab[t]) for t in END_TOKENS if t in vocab)
    return tuple(sorted(ids))


def method_grid(cfg: EvalConfig) -> list[tuple[str, str, object]]:
    """``(method name, budget label, method instance)`` for the full cache and every method x budget.

    A method whose spec names a budget (``hcattention:budget=0.05``) runs at that budget only (:func:`split_budget`).
    With a ``kv_dtype``, ``full`` in the methods adds the full cache stored in it (:func:`stored_full_name`, budget
    label ``"full"``); the row named ``"full"`` is always the reference, in the model's dtype.
    """
    from kvjax.methods import FullCache, get_method

    grid = [("full", "full", FullCache())]
    stored_full = None if cfg.kv_dtype is None else stored_full_name(cfg.kv_dtype)
    for name, b in method_budgets(cfg.methods, cfg.budgets, cfg.kv_dtype):
        entry = (name, budget_label(b), FullCache() if name == stored_full else get_method(name, budget=b))
        if any(g[:2] == entry[:2] for g in grid):
            raise ValueError(f"method {name!r} at budget {entry[1]} is listed twice")
        grid.append(entry)
    return grid


def batches(samples, batch_size: int, protocol: str) -> list[list]:
    """Batches of at most ``batch_size`` samples; query-agnostic batches share one question length in tokens
    (the question is prefilled as one chunk onto the compressed context)."""
    if protocol == "query-aware":
        return [samples[i:i + batch_size] for i in range(0, len(samples), batch_size)]
    by_len: dict[int, list] = {}
    for s in samples:
        by_len.setdefault(len(s.prompt_ids) - s.question_start, []).append(s)
    return [group[i:i + batch_size] for _, group in sorted(by_len.items()) for i in range(0, len(group), batch_size)]


def _record_key(r: dict) -> tuple:
    return (r["task"], r["length"], r["index"], r["method"], r["budget"])


def merged_grid(old: dict, new: dict) -> tuple[list[str], list]:
    """Methods and budgets of a run directory after a run with ``new`` settings joins one with ``old`` settings:
    every (method, budget) configuration of either, and no other. The old budgets stay; a new method is listed as it
    is where the old budgets are all its budgets, and a configuration at a budget the old grid does not give its method
    as a spec with its own budget (``snapkv:budget=0.5``), so the grid does not grow by configurations neither run
    made."""
    methods, budgets, kv_dtype = list(old.get("methods") or []), list(old.get("budgets") or []), old.get("kv_dtype")
    for spec in new["methods"]:
        if spec == "full":
            if spec not in methods:
                methods.append(spec)
            continue
        name, own = split_budget(spec)
        have = set(method_budgets(methods, budgets, kv_dtype))
        missing = [b for b in ((own,) if own is not None else new["budgets"]) if (name, b) not in have]
        if own is None and budgets and all(b in missing for b in budgets):
            methods.append(name)  # the plain spec: every old budget
            missing = [b for b in missing if b not in budgets]
        methods += [f"{name}:budget={b}" for b in missing]
    return list(dict.fromkeys(methods)), budgets


@contextlib.contextmanager
def _locked(directory: str):
    """An exclusive advisory lock on ``directory`` (``flock``), so processes sharing a run directory read and write its
    ``config.json`` one at a time; no lock where ``fcntl`` is missing (Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def prepare_out_dir(cfg: EvalConfig) -> None:
    """Write the run's ``config.json``; resuming a run checks its identity and keeps what it already held.

    A resumed run (e.g. more methods, or another ``--tasks`` half run by a second process) writes every configuration
    of either run (:func:`merged_grid`), the union of their tasks and lengths, and its command after the old one
    (`` && ``), so the file still describes every record of the directory. The file is replaced atomically under a lock on the directory: processes
    started together on one run directory each add their settings and never leave a half-written file."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    path = os.path.join(cfg.out_dir, "config.json")
    with _locked(cfg.out_dir):
        new = dataclasses.asdict(cfg)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
            old.setdefault("protocol", "query-aware")  # runs written before protocols existed
            old.setdefault("suite", "kvjax")  # runs written before suites and splits existed: kvjax tasks, seed 0 = dev
            old["split"] = run_split(old)
            old.setdefault("kv_dtype", None)  # runs written before kv_dtype existed: the model's dtype
            mismatch = {k: (old.get(k), v) for k, v in cfg.identity().items() if old.get(k) != v}
            if mismatch:
                raise ValueError(f"{cfg.out_dir} holds a run with different settings {mismatch} (old, new); "
                                 "use another --run-name or delete the directory")
            new["methods"], new["budgets"] = merged_grid(old, new)
            for key in ("tasks", "lengths"):
                new[key] = list(dict.fromkeys([*(old.get(key) or []), *new[key]]))
            commands = [c for c in (old.get("command") or "").split(" && ") if c]
            if new["command"] and new["command"] not in commands:
                commands.append(new["command"])
            new["command"] = " && ".join(commands)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=cfg.out_dir, suffix=".tmp", delete=False) as f:
            json.dump(new, f, indent=1)
        os.replace(f.name, path)


def run_tasks(cfg: EvalConfig, model, *, progress: bool = True) -> int:
    """Run every missing (sample, method, budget) record; returns how many records were written."""
    from kvjax.cache import CacheSpec
    from kvjax.decoding import compress, decode_loop, prefill, prefill_prompt
    from kvjax.methods.base import round_up
    from kvjax.methods.kvzip import allocate, reconstruct
    from kvjax.shared_prefill import cache_for, can_share_prefill, init_shared_cache
    from kvjax.models.tokenizer import reconstruction_prompt

    env = environment()
    tok = model.tokenizer
    suite = get_suite(cfg.suite)
    path = os.path.join(cfg.out_dir, "samples.jsonl")
    done = {_record_key(r) for r in read_jsonl(path)}
    grid = method_grid(cfg)
    eos = stop_token_ids(tok)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    work = []  # (task, length, batch of samples, missing configs)
    for length in cfg.lengths:
        for task in cfg.tasks:
            samples = suite.samples(task, tok, length, cfg.samples, cfg.split)
            for batch in batches(samples, cfg.batch_size, cfg.protocol):
                missing = [g for g in grid if any((task, length, s.index, g[0], g[1]) not in done for s in batch)]
                if missing:
                    work.append((task, length, batch, missing))
    total = sum(len(w[3]) for w in work)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"eval {cfg.run_name}", unit="config", file=sys.stderr)
    written = 0
    with open(path, "a", encoding="utf-8") as out:
        for task, length, batch, missing in work:
            agnostic = cfg.protocol == "query-agnostic"
            q_len = len(batch[0].prompt_ids) - batch[0].question_start if agnostic else 0
            L = round_up(length - q_len, cfg.chunk_size)
            rows = [list(s.prompt_ids[:len(s.prompt_ids) - q_len]) for s in batch]
            # no filler rows for a short batch: its longest row is static in the cache spec, so each batch
            # compiles anew anyway, and a filler row would cost a whole prefill
            question = np.asarray([list(s.prompt_ids[len(s.prompt_ids) - q_len:]) for s in batch], np.int32)
            tokens = np.full((len(rows), L), pad_id, np.int32)
            for b, r in enumerate(rows):
                tokens[b, L - len(r):] = r
            pad = np.asarray([L - len(r) for r in rows], np.int32)
            max_new = suite.max_new_tokens(task)
            if bar is not None:
                bar.set_postfix_str(f"{task} {length} prefill")
            spec = CacheSpec.for_model(model.config, len(rows), L, q_len + max_new, model.dtype,
                                       longest_row=max(len(r) for r in rows), mesh=model.mesh)
            # the methods' compressed pools (and the stored full cache) in cfg.kv_dtype; the reference in the model's dtype
            pools = spec if cfg.kv_dtype is None else dataclasses.replace(spec, kv_dtype=cfg.kv_dtype)
            if cfg.kv_dtype is not None:  # a method that cannot store it refuses here, before any prefill
                for name, _, method in missing:
                    if name != "full":
                        jax.eval_shape(lambda m=method: m.init_cache(pools))
            tokens = place_rows(jnp.asarray(tokens), model.mesh)
            shared = [g for g in missing if can_share_prefill(g[2])]
            t0 = time.perf_counter()
            staged = first = None
            reconstructed = {}  # KVzip's reconstructed caches of this batch, by what their scores depend on
            if shared:  # one prefill for the full cache and every method that can share it
                staged = place_cache(init_shared_cache([g[2] for g in shared], spec).replace(pad=jnp.asarray(pad)))
                logits, staged = prefill_prompt(model.graphdef, model.params, tokens, staged, chunk_size=cfg.chunk_size)
                first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
                first.block_until_ready()
            prefill_s = time.perf_counter() - t0
            for name, blabel, method in missing:
                reconstruct_s = None
                if bar is not None:
                    bar.set_postfix_str(f"{task} {length} {name} {blabel}")
                t0 = time.perf_counter()
                mine_spec = spec if name == "full" else pools
                if staged is not None and can_share_prefill(method):
                    cache, method_first = compress(cache_for(staged, method).replace(spec=mine_spec)), first
                elif method.rereads_context():  # KVzip: one prefill + reconstruction for every budget of a batch
                    key = method.reconstruction_key()
                    if key not in reconstructed:
                        own = place_cache(key.init_cache(pools).replace(pad=jnp.asarray(pad)))
                        logits, own = prefill_prompt(model.graphdef, model.params, tokens, own, chunk_size=cfg.chunk_size)
                        jax.block_until_ready(logits)
                        t1 = time.perf_counter()
                        own = reconstruct(model.graphdef, model.params, own, np.asarray(tokens),
                                          reconstruction_prompt(tok, chat=True))
                        jax.block_until_ready(own)
                        reconstructed[key] = (own, jnp.argmax(logits, axis=-1).astype(jnp.int32),
                                              time.perf_counter() - t1)
                    own, method_first, reconstruct_s = reconstructed[key]
                    mine = jax.tree_util.tree_map(jnp.copy, own).replace(method=method)
                    cache = compress(allocate(mine))
                else:  # a method with its own prefill (it evicts while prefilling, or keeps other state)
                    cache = place_cache(method.init_cache(mine_spec).replace(pad=jnp.asarray(pad)))
                    logits, cache = prefill_prompt(model.graphdef, model.params, tokens, cache, chunk_size=cfg.chunk_size)
                    cache, method_first = compress(cache), jnp.argmax(logits, axis=-1).astype(jnp.int32)
                stats = cache.stats()
                # the artifact (codebooks, trained heads) is held once whatever the batch: counted whole in each record's
                # device_bytes and given apart; reports count it as weights, not as cache (evals.report)
                artifact_bytes = stats["artifact_device_bytes"]
                if agnostic:  # the question comes after compression, appended uncompressed
                    logits, cache = prefill(model.graphdef, model.params, place_rows(jnp.asarray(question), model.mesh), cache)
                    method_first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
                gen, count, final = decode_loop(model.graphdef, model.params, method_first, cache, jax.random.PRNGKey(0),
                                                max_new_tokens=max_new, eos_ids=eos)
                final_stats = final.stats()
                recalls = {k: v for k, v in final_stats.items() if k in RECALL_STATS}
                selection = {k: v for k, v in final_stats.items() if k in SELECTION_STATS}
                gen, count = np.asarray(gen), np.asarray(count)
                elapsed = time.perf_counter() - t0
                records = []
                for b, s in enumerate(batch):
                    if (task, length, s.index, name, blabel) in done:
                        continue
                    ids = [int(t) for t in gen[b, : count[b]] if int(t) not in eos]
                    text = tok.decode(ids, skip_special_tokens=True)
                    records.append({
                        "task": task, "length": length, "index": s.index, "depth": s.depth, "haystack": s.haystack,
                        "method": name, "budget": blabel, "kv_dtype": mine_spec.kv_dtype, "protocol": cfg.protocol,
                        "suite": cfg.suite, "split": cfg.split,
                        "prompt_tokens": len(s.prompt_ids), "padded_length": L, "question_tokens": q_len,
                        "answers": list(s.answers), "output": text, "score": suite.score(task, text, s.answers),
                        "device_bytes": (stats["device_bytes"] - artifact_bytes) // len(rows) + artifact_bytes,
                        "artifact_device_bytes": artifact_bytes, "host_bytes": stats["host_bytes"] // len(rows),
                        "prefill_s": prefill_s / len(rows), "compress_decode_s": elapsed / len(rows),
                        # KVzip's reconstruction, once per batch for all its budgets (counted in each record)
                        **({"reconstruct_s": reconstruct_s / len(rows)} if reconstruct_s is not None else {}),
                        **({"recall_trigger_rate": recalls["recall_trigger_rate"],
                            "bytes_recalled": recalls["bytes_recalled"] // len(rows)} if recalls else {}),
                        **selection, **env,
                    })
                for r in records:
                    out.write(json.dumps(r) + "\n")
                out.flush()
                written += len(records)
                if bar is not None:
                    bar.update()
                # A batch's longest row is part of the cache spec (static), so every batch compiles each method
                # anew: drop the executables now (kept, a 4K run of 25 configs grew past 17 GB and was OOM-killed).
                del cache, final
                jax.clear_caches()
            del staged, reconstructed
    if bar is not None:
        bar.close()
    return written


def run_fidelity_checks(cfg: EvalConfig, model, *, progress: bool = True) -> int:
    """Fidelity (KL, top-1, NLL) of every method x budget vs the full cache; returns records written."""
    from kvjax.evals.fidelity import fidelity_texts, run_fidelity

    if cfg.fidelity_texts <= 0:
        return 0
    path = os.path.join(cfg.out_dir, "fidelity.jsonl")
    done = {(r["method"], r["budget"], r["prefix_tokens"]) for r in read_jsonl(path)}
    full_done = ("full", "full", cfg.fidelity_prefix) in done
    missing = [g for g in method_grid(cfg) if g[0] != "full" and (g[0], g[1], cfg.fidelity_prefix) not in done]
    if not missing and full_done:
        return 0
    texts = fidelity_texts(model.tokenizer, cfg.fidelity_texts, cfg.fidelity_prefix, cfg.fidelity_tokens, seed=cfg.seed)
    results = run_fidelity(model, {f"{n}@{b}": m for n, b, m in missing}, texts, cfg.fidelity_prefix,
                           chunk_size=cfg.chunk_size, progress=progress,
                           kv_dtype=cfg.kv_dtype)  # the full cache in the model's dtype is always the reference
    model_dtype = jnp.dtype(cfg.dtype).name
    rows = (([] if full_done else [("full", "full", "full", model_dtype)])
            + [(n, b, f"{n}@{b}", cfg.kv_dtype or model_dtype) for n, b, _ in missing])
    with open(path, "a", encoding="utf-8") as out:
        for name, blabel, label, kv_dtype in rows:
            out.write(json.dumps({"method": name, "budget": blabel, "kv_dtype": kv_dtype, "prefix_tokens": cfg.fidelity_prefix,
                                  "continuation_tokens": cfg.fidelity_tokens, "texts": cfg.fidelity_texts,
                                  **results[label]}) + "\n")
    n = len(rows)
    return n


def run_eval(cfg: EvalConfig, model=None, *, progress: bool = True) -> dict:
    """Run (or resume) an evaluation and rebuild its report; returns the summary."""
    from kvjax.evals.report import write_report

    prepare_out_dir(cfg)
    if model is None:
        import kvjax

        model = kvjax.load(cfg.model, cfg.dtype, progress=progress, mesh=cfg.mesh)
    t0 = time.perf_counter()
    n = run_tasks(cfg, model, progress=progress) if cfg.tasks else 0
    f = run_fidelity_checks(cfg, model, progress=progress)
    print(f"[eval] {n} sample records, {f} fidelity records in {time.perf_counter() - t0:.0f} s -> {cfg.out_dir}",
          file=sys.stderr)
    return write_report(cfg.out_dir)


def _csv(kind):
    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        return tuple(kind(x) for x in items)

    return parse


def build_parser():
    """Arguments of ``kvjax eval``."""
    import argparse

    from kvjax.budgets import parse_budget
    from kvjax.models import DEFAULT_MODEL

    p = argparse.ArgumentParser(prog="kvjax eval", description="accuracy of KV-cache methods on synthetic long-context tasks")
    p.add_argument("--suite", default="kvjax", choices=tuple(SUITES),
                   help="kvjax: kvjax's RULER-style tasks; ruler: RULER's 13 tasks by RULER's own generators and data")
    p.add_argument("--split", default="dev", choices=SPLITS,
                   help="prompts drawn from the dev split (choices are made there) or the held-out test split (reported)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    from kvjax.methods import METHODS, PRESETS

    presets = "; ".join(f"{m}:preset={p} = {':'.join(f'{k}={v}' for k, v in o.items())}"
                        for m, have in PRESETS.items() for p, o in have.items())
    p.add_argument("--methods", type=_csv(str), default=DEFAULT_METHODS,
                   help=f"comma list of {', '.join(sorted(METHODS))} (the full cache, the reference, always runs; "
                   "'full' listed with --kv-dtype adds the full cache stored in that dtype as its own row); "
                   "hyper-parameters as "
                   "name:key=value, e.g. synckv:stride=10; name:budget=B runs that entry at budget B alone instead of at "
                   f"every --budgets entry; presets chosen on the dev split: {presets}")
    p.add_argument("--budgets", type=_csv(parse_budget), default=(0.1, 0.25, 0.5), help="comma list of fractions (or ints: tokens/head)")
    p.add_argument("--tasks", type=_csv(str), default=None,
                   help="comma list (default: kvjax niah_single,passkey; ruler all 13: " + ",".join(SUITES["ruler"].tasks)
                   + "); '' with --fidelity-texts for fidelity only")
    p.add_argument("--lengths", type=_csv(int), default=(2048,), help="target prompt lengths in the model's tokens")
    p.add_argument("--samples", type=int, default=4, help="samples per (task, length)")
    p.add_argument("--batch-size", type=int, default=4, help="samples per shared prefill")
    p.add_argument("--chunk-size", type=int, default=1024, help="prefill chunk (the padded length is a multiple)")
    p.add_argument("--run-name", default=None, help="output directory name under --out-root (default: eval-<model>)")
    p.add_argument("--out-root", default=os.path.join("docs", "results"))
    p.add_argument("--protocol", default="query-aware", choices=PROTOCOLS,
                   help="query-aware: the question is inside the compressed prompt; query-agnostic: the context alone is "
                   "compressed, then the question is prefilled onto it")
    p.add_argument("--kv-dtype", default=None, help="storage dtype of every method's compressed page pools: the --dtype "
                   "(default), bfloat16, int8 or float8_e4m3fn (per-token scales, docs/QUANTIZATION.md); 'full' in "
                   "--methods: the full cache stored in it too, as the row full:kv_dtype=D; the reference full cache "
                   "keeps the --dtype; a method without page pools refuses another")
    p.add_argument("--fidelity-texts", type=int, default=0, help="texts for the KL / top-1 fidelity check (0 = skip)")
    p.add_argument("--fidelity-prefix", type=int, default=4096)
    p.add_argument("--fidelity-tokens", type=int, default=256)
    p.add_argument("--no-progress", action="store_true")
    add_mesh_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvjax eval``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    mesh = setup_devices(args)
    cfg = EvalConfig(
        model=args.model, dtype=args.dtype, methods=tuple(args.methods), budgets=tuple(args.budgets),
        tasks=None if args.tasks is None else tuple(t for t in args.tasks if t), lengths=tuple(args.lengths),
        samples=args.samples, suite=args.suite, split=args.split,
        batch_size=args.batch_size, chunk_size=args.chunk_size,
        run_name=args.run_name or f"eval-{os.path.basename(args.model)}", out_root=args.out_root,
        fidelity_texts=args.fidelity_texts, fidelity_prefix=args.fidelity_prefix, fidelity_tokens=args.fidelity_tokens,
        protocol=args.protocol, command="kvjax eval " + " ".join(argv), mesh=mesh, kv_dtype=args.kv_dtype,
    )
    run_eval(cfg, progress=not args.no_progress)
    print(os.path.join(cfg.out_dir, "README.md"))
    return 0

"""What an evaluation run's records and settings mean, shared by the runner and the reports (which need no jax):
method specs with their budgets, budget labels, and reading JSON-lines records."""

from __future__ import annotations

import json
import os


def budget_label(budget) -> str:
    """``0.25`` -> ``"0.25"``; ``512`` -> ``"512"``; the full cache's budget is ``"full"``."""
    return "full" if budget is None else (f"{budget:g}" if isinstance(budget, float) else str(budget))


def split_budget(spec: str) -> tuple[str, object]:
    """``"snapkv:budget=0.1:window=8"`` -> ``("snapkv:window=8", 0.1)``; a spec without a budget gives ``None``.

    A budget inside a method's spec runs that method at that budget alone instead of at every ``--budgets``
    entry (e.g. HCAttention's memory configurations next to baselines at one budget, sharing one prefill).
    """
    from kvjax.budgets import check_budget
    from kvjax.methods import parse_method_spec

    base, kwargs = parse_method_spec(spec)
    if "budget" not in kwargs:
        return spec, None
    budget = kwargs.pop("budget")
    try:
        check_budget(budget)
    except (TypeError, ValueError) as e:
        raise ValueError(f"budget in method spec {spec!r}: {e}") from None
    return ":".join([base] + [f"{k}={v}" for k, v in kwargs.items()]), budget


def stored_full_name(kv_dtype: str) -> str:
    """The row name of the full cache stored in ``kv_dtype`` (``"full:kv_dtype=int8"``), beside the reference
    ``"full"`` in the model's dtype."""
    return f"full:kv_dtype={kv_dtype}"


def method_budgets(methods, budgets, kv_dtype=None) -> list[tuple[str, object]]:
    """``(method name, budget)`` of every configuration besides the reference full cache: a spec's own budget
    (:func:`split_budget`), else each of ``budgets``. ``full`` listed with a ``kv_dtype`` (a run's other than the
    model's) is the full cache stored in it, ``(stored_full_name(kv_dtype), None)``; listed without, nothing (the
    reference always runs)."""
    pairs = []
    for spec in methods:
        if spec == "full":
            if kv_dtype is not None:
                pairs.append((stored_full_name(kv_dtype), None))
        else:
            name, own = split_budget(spec)
            pairs += [(name, b) for b in (budgets if own is None else (own,))]
    return pairs


def run_split(config: dict) -> str | None:
    """The split a run's ``config.json`` names; for a run written before splits existed, ``"dev"`` when its seed is 0
    (the kvjax suite's dev seed, the only suite then), else None (a seed of neither split)."""
    if "split" in config:
        return config["split"]
    return "dev" if config.get("seed") == 0 else None


RECORD_KEY = ("task", "length", "index", "method", "budget")  # one sample under one configuration


def latest_records(records: list[dict]) -> list[dict]:
    """One record per sample and configuration (:data:`RECORD_KEY`), the last written, in the order of the first.

    A run resumed after an interrupted batch, or written by two processes at once, can hold a sample twice; counted
    twice, it would weigh double in every mean."""
    latest = {}
    for r in records:
        latest[tuple(r[k] for k in RECORD_KEY)] = r
    return list(latest.values())


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSON-lines file ([] when it does not exist); a line cut by an interrupted write is skipped."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by an interrupted write: redo that record
                    continue
    return out

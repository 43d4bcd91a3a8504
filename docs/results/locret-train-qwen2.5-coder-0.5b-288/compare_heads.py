"""Prompt-by-prompt Locret answers of two evaluation runs of different Locret variants, same prompts.

    python docs/results/locret-train-qwen2.5-coder-0.5b-288/compare_heads.py SHIPPED_RUN_DIR NEW_RUN_DIR [LABEL_1 LABEL_2]

Labels name the two runs' columns (default: "shipped", "new").

Both runs' Locret records (method ``locret`` or ``locret:heads=...``) are matched on (task, length,
sample index, budget); the full cache's records must agree too (same prompts, same outputs). Prints a
markdown table: accuracy per (task, budget) for each run and the prompts whose score changed.
"""

import collections
import json
import sys


def records(run_dir):
    """``{(method kind, task, length, index, budget): record}`` of a run's ``samples.jsonl``."""
    out = {}
    with open(f"{run_dir}/samples.jsonl") as f:
        for line in f:
            r = json.loads(line)
            kind = "locret" if r["method"].split(":")[0] == "locret" else r["method"]
            if kind in ("locret", "full"):
                out[(kind, r["task"], r["length"], r["index"], r["budget"])] = r
    return out


old_dir, new_dir = sys.argv[1], sys.argv[2]
label_old, label_new = (sys.argv[3], sys.argv[4]) if len(sys.argv) > 4 else ("shipped", "new")
old, new = records(old_dir), records(new_dir)
shared = sorted(set(old) & set(new))
full_keys = [k for k in shared if k[0] == "full"]
full_same = all(old[k]["output"] == new[k]["output"] for k in full_keys)
locret_keys = [k for k in shared if k[0] == "locret"]
missing = sorted(k for k in old if k[0] == "locret" and k not in new)
print(f"# Locret: `{old_dir}` ({label_old}) vs `{new_dir}` ({label_new})\n")
print(f"{len(locret_keys)} shared Locret records; {len(missing)} of the first run's not in the second. "
      f"Full cache: {len(full_keys)} shared records, outputs identical: {full_same}.\n")
acc = collections.defaultdict(lambda: [0.0, 0.0, 0])
for k in locret_keys:
    cell = acc[(k[1], k[4])]
    cell[0] += old[k]["score"]
    cell[1] += new[k]["score"]
    cell[2] += 1
print(f"| task | budget | prompts | {label_old} % | {label_new} % |\n|---|---|---:|---:|---:|")
for (task, budget), (a, b, n) in sorted(acc.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    print(f"| {task} | {budget} | {n} | {100 * a / n:.1f} | {100 * b / n:.1f} |")
for budget in sorted({k[4] for k in locret_keys}):
    ks = [k for k in locret_keys if k[4] == budget]
    a = sum(old[k]["score"] for k in ks) / len(ks)
    b = sum(new[k]["score"] for k in ks) / len(ks)
    print(f"| **mean** | {budget} | {len(ks)} | **{100 * a:.1f}** | **{100 * b:.1f}** |")
same_output = sum(old[k]["output"] == new[k]["output"] for k in locret_keys)
print(f"\nLocret outputs identical in {same_output} of {len(locret_keys)} records.")
changed = [k for k in locret_keys if old[k]["score"] != new[k]["score"]]
print(f"\n## Prompts whose score changed ({len(changed)})\n")
if changed:
    print(f"| task | budget | needle depth | answer | {label_old} output | {label_new} output |\n|---|---|---:|---|---|---|")
    for k in changed:
        o, n = old[k], new[k]
        print(f"| {k[1]} | {k[4]} | {o['depth']:.2f} | {' '.join(o['answers'])} | "
              f"{o['output'][:40]!r} ({o['score']:.0f}) | {n['output'][:40]!r} ({n['score']:.0f}) |")

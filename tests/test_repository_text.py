"""The repository speaks of the software only: no words about how it was built (work sessions, issue numbers,
plans for a "next session") in any tracked text file: README, docs, docstrings, comments, test names, result files
and their READMEs, script headers. Facts are stated with a date, a device, a jax version or a command instead."""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = (".py", ".md", ".sh", ".txt", ".toml", ".cfg", ".yaml", ".yml", ".json", "")
FORBIDDEN = re.compile(
    r"\bsessions? \d+|\bsessions \d+[–-]\d+|\b(?:this|next|previous|earlier|later|first|second|third|fourth|one) "
    r"session\b|\bsessions? (?:so far|have been lent)|\bissue #?\d+\b|\(issue\b|\bthe issue(?:s'|'s)|\bnext time\b",
    re.IGNORECASE)


def tracked_files() -> list[str]:
    """Tracked files (``git ls-files``), or every file under the root outside hidden and virtual-env folders."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return [f for f in out.splitlines() if f]
    except (OSError, subprocess.CalledProcessError):
        found = []
        for base, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            found += [os.path.relpath(os.path.join(base, f), ROOT) for f in files]
        return found


def offending_lines(paths) -> list[str]:
    """``path:line: text`` of every line that speaks of how the project was built."""
    bad = []
    for rel in paths:
        if os.path.splitext(rel)[1] not in TEXT or rel == os.path.relpath(__file__, ROOT):
            continue
        path = os.path.join(ROOT, rel)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if FORBIDDEN.search(line):
                    bad.append(f"{rel}:{n}: {line.strip()[:160]}")
    return bad


def test_no_words_about_how_the_project_was_built():
    bad = offending_lines(tracked_files())
    assert not bad, "\n".join(bad)


def test_the_check_finds_such_words():
    """The pattern catches the forms that were in the repository, and leaves ordinary uses of the words alone."""
    for text in ("measured in session 46", "Sessions 39-46 timed", "the plan for the next session", "(issue 2)",
                 "The issues' targets are", "Four sessions have been lent a GPU", "Issue 12 oracle:"):
        assert FORBIDDEN.search(text), text
    for text in ('scope="session"', "interactive sessions (``>>>``)", "issued after the scores",
                 "the session's loaded model fixture", "a known issue with XLA",
                 "the launching thread issues 21 launches"):
        assert not FORBIDDEN.search(text), text

"""Every registered method has a page (``docs/methods/<name>.md``) whose hyper-parameter table names each of the
method's fields with its default, in the code's order: the docs match the code."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from kvjax.methods import METHODS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = re.compile(r"^\| `(\w+)` \| `(.*?)` \|", re.M)


def page_table(name: str) -> list[tuple[str, str]]:
    """``(field, default text)`` rows of a method page's hyper-parameter table."""
    with open(os.path.join(ROOT, "docs", "methods", f"{name}.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("## Hyper-parameters", 1)[1].split("\n## ", 1)[0]
    return ROW.findall(table)


def shown(default) -> str:
    """A default as a page shows it: a string in double quotes, anything else as ``repr``."""
    return f'"{default}"' if isinstance(default, str) else repr(default)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_page_lists_every_hyper_parameter_with_its_default(name):
    want = [(f.name, shown(f.default)) for f in dataclasses.fields(METHODS[name])]
    assert page_table(name) == want


def test_the_check_sees_a_wrong_default():
    """A row whose default differs from the code's does not match (the comparison is not vacuous)."""
    row = ROW.findall("| `window` | `31` | observation window |")
    assert row == [("window", "31")] and row != [("window", shown(32))]


def page_section(name: str, title: str) -> str:
    with open(os.path.join(ROOT, "docs", "methods", f"{name}.md"), encoding="utf-8") as f:
        text = f.read()
    if f"\n## {title}" not in text:
        return ""
    return text.split(f"\n## {title}", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_page_lists_its_presets_with_their_options(name):
    """Each page has a Presets section; a preset's row spells every option as ``key=value``, as in a method spec."""
    from kvjax.methods import PRESETS

    section = page_section(name, "Presets")
    assert section.strip(), f"docs/methods/{name}.md has no Presets section"
    for preset, options in PRESETS.get(name, {}).items():
        row = next((line for line in section.splitlines() if line.startswith(f"| `{preset}` |")), None)
        assert row is not None, f"preset {preset} missing from docs/methods/{name}.md"
        spelled = re.findall(r"(\w+)=([\w.]+)", row)
        assert {k: str(v).lower() for k, v in spelled if k in options} == {k: str(v).lower() for k, v in options.items()}

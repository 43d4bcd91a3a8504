"""The command line: `kvjax demo`'s methods and table, specs checked before any model loads, `generate --help`."""

from __future__ import annotations

import pytest

import kvjax
from kvjax.cli import demo_methods, demo_png, demo_table, main as cli_main, methods_help
from kvjax.methods import FullCache, Locret, SnapKV


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model fails loudly: a command that validates first never gets there."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the method spec was checked")

    monkeypatch.setattr(kvjax, "load", refuse)


def test_demo_methods_default_budget_and_spec_budget():
    got = demo_methods(("snapkv", "locret:budget=0.25", "full"))
    assert [label for label, _ in got] == ["full", "snapkv @ 0.1", "locret @ 0.25"]
    assert isinstance(got[0][1], FullCache) and got[1][1] == SnapKV(budget=0.1) and got[2][1] == Locret(budget=0.25)
    # by default: the five seed methods (their presets where they have one) and SnapKV, at 10%
    from kvjax.cli import DEMO_METHODS

    got = demo_methods(DEMO_METHODS)
    assert sorted(m.name for _, m in got) == sorted(["full", "snapkv", "hbw", "heterocache", "synckv", "hcattention",
                                                     "locret"])
    assert all(m.budget == 0.1 for _, m in got[1:])
    assert got[3][1].group_layers == 24 and got[5][1].local == 64  # the presets'


@pytest.mark.parametrize("argv", [
    ["demo", "--methods", "snapkv,nope"],
    ["demo", "--methods", "snapkv:budget=1.5"],
    ["demo", "--methods", "snapkv:windw=3"],
    ["generate", "--prompt", "hi", "--method", "snapkv:windw=3"],
    ["generate", "--prompt", "hi", "--method", "synckv:preset=best"],
])
def test_bad_specs_fail_before_the_model_loads(argv, no_model_load, capsys):
    assert cli_main(argv) == 2
    assert "error" in capsys.readouterr().err


def test_demo_table_rows(tmp_path):
    rows = [{"protocol": "in the prompt", "method": "full", "answer": "60494", "ok": True, "device_bytes": 102 * 2**20,
             "host_bytes": 0, "prefill_s": 25.97, "first_step_s": 3.21, "decode_ms_per_token": 32.44},
            {"protocol": "after compression", "method": "snapkv @ 0.1", "answer": "6049", "ok": False,
             "device_bytes": 10 * 2**20 + 2**19, "host_bytes": 3 * 2**10, "prefill_s": 28.1, "prefill_shared": True,
             "first_step_s": 4.0, "decode_ms_per_token": 21.0}]
    lines = demo_table(rows).splitlines()
    assert len(lines) == 4 and lines[0].split()[:3] == ["question", "method", "answer"]
    assert lines[2].split() == ["in", "the", "prompt", "full", "60494", "yes", "102.0", "MiB", "0", "B", "25.97", "3.21",
                                "32.4"]
    assert lines[3].split() == ["after", "compression", "snapkv", "@", "0.1", "6049", "NO", "10.5", "MiB", "3.0", "KiB",
                                "*28.10", "4.00", "21.0"]
    png = tmp_path / "demo.png"
    demo_png(rows, png, "title")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_generate_help_lists_every_method_its_defaults_and_presets():
    text = methods_help()
    assert "  snapkv: budget=0.25, page_size=16" in text and "window=32" in text
    assert "    preset tuned: kernel=7:group_layers=24:rehearsals=2" in text
    from kvjax.methods import METHODS

    assert all(f"  {name}: " in text for name in METHODS)


def test_heterocache_presets_are_the_dev_choice_and_the_former_ones():
    """``tuned``: the kvjax-suite options, ``lookahead=16``, ``kernel=1`` and ``drift_above_chance`` (RULER dev,
    docs/EVALUATION.md); ``suite-lookahead-unpooled``: the paper's drift check; ``suite-lookahead``: also with pooling;
    ``suite``: neither."""
    from kvjax.methods import get_method

    tuned, unpooled, ahead, suite = (get_method(f"heterocache:preset={p}")
                                     for p in ("tuned", "suite-lookahead-unpooled", "suite-lookahead", "suite"))
    assert (tuned.lookahead, unpooled.lookahead, ahead.lookahead, suite.lookahead) == (16, 16, 16, 0)
    assert (tuned.kernel, unpooled.kernel, ahead.kernel, suite.kernel) == (1, 1, 5, 5)
    assert (tuned.drift_above_chance, unpooled.drift_above_chance, ahead.drift_above_chance,
            suite.drift_above_chance) == (True, False, False, False)
    for m in (tuned, unpooled, ahead, suite, get_method("heterocache:preset=tuned:lookahead=0")):
        assert (m.group_layers, m.reanchor, m.rehearsals, m.prefill_from_pivot) == (24, True, 2, True)
    assert get_method("heterocache:preset=tuned:lookahead=0").lookahead == 0
    assert get_method("synckv:preset=tuned").lookahead == 0  # the look-ahead lost on dev for SyncKV

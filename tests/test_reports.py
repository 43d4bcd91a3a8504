"""kvjax.reports: the Markdown table, the number cell, figures and report files every report writer uses."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvjax.reports import figure, number, save_figure, table, write_report


def test_table_lines():
    lines = table(["method", "budget", "ms"], [["full", None, 1.5], ["snapkv", 0.1, "—"]], align="lcr")
    assert "\n".join(lines) == (
        "| method | budget | ms |\n"
        "|---|:---:|---:|\n"
        "| full | None | 1.5 |\n"
        "| snapkv | 0.1 | — |")


def test_table_aligns_left_by_default_and_may_have_no_rows():
    assert table(["a", "b"], []) == ["| a | b |", "|---|---|"]


@pytest.mark.parametrize("rows", [[["x"]], [["x", "y", "z"]], [["x", "y"], []]])
def test_a_row_with_the_wrong_number_of_cells_is_refused(rows):
    with pytest.raises(ValueError, match="cells, the header 2"):
        table(["a", "b"], rows)


@pytest.mark.parametrize("align", ["l", "lrr", "lx"])
def test_align_needs_one_known_letter_per_column(align):
    with pytest.raises(ValueError, match="align"):
        table(["a", "b"], [], align=align)


def test_number_marks_a_missing_value():
    assert number(1.234) == "1.23"
    assert number(2, "{:.1f}×") == "2.0×"
    assert number(0.0) == "0.00"
    assert number(None) == "—"
    assert number(None, missing="") == ""


def test_write_report_writes_the_markdown_and_the_json_beside_it(tmp_path):
    md = tmp_path / "new" / "folder" / "bench.md"
    paths = write_report(md, "# title\n", {"x": np.float32(0.5), "v": np.arange(2), "n": None})
    assert paths == [str(md), str(tmp_path / "new" / "folder" / "bench.json")]
    assert md.read_text() == "# title\n"
    assert json.loads((tmp_path / "new" / "folder" / "bench.json").read_text()) == {"x": 0.5, "v": [0, 1], "n": None}


def test_write_report_without_data_or_to_a_named_json(tmp_path):
    assert write_report(tmp_path / "a.md", "text") == [str(tmp_path / "a.md")]
    assert not (tmp_path / "a.json").exists()
    paths = write_report(tmp_path / "summary.md", "", {"k": 1}, json_path=tmp_path / "stats.json")
    assert paths[1] == str(tmp_path / "stats.json") and json.loads((tmp_path / "stats.json").read_text()) == {"k": 1}


def test_save_figure_writes_a_png_and_closes_a_pyplot_figure(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(2, 1.5))
    fig.add_subplot().plot([0, 1], [1, 0])
    path = save_figure(fig, tmp_path / "plots" / "p.png", dpi=50)
    assert path == tmp_path / "plots" / "p.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig.number not in plt.get_fignums()


def test_figure_is_drawn_off_screen_and_saved_uncropped(tmp_path):
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    fig = figure((2, 1))
    fig.subplots(1, 2)
    save_figure(fig, tmp_path / "f.png", dpi=40, tight=False)
    assert plt.get_fignums() == before  # never in pyplot's list
    png = (tmp_path / "f.png").read_bytes()
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (80, 40)  # the figure's whole size at 40 dpi

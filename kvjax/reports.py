"""What every report writer shares (the benchmarks, evaluation runs, calibration and training reports, the research
studies): Markdown table lines, a number cell with a mark for a missing value, matplotlib figures saved off-screen,
and a report's Markdown written with its JSON data beside it. One place, so every report reads and is written alike.

matplotlib is imported only when a figure is made or saved: reports without plots, and the library, do without it.
"""

from __future__ import annotations

import json
import os
import sys

MISSING = "—"  # a cell with no value
ALIGN = {"l": "---", "r": "---:", "c": ":---:"}  # Markdown's alignment row, by column letter


def table(head, rows, align: str | None = None) -> list[str]:
    """A Markdown table's lines: the header, the alignment row, one line per row; cells are converted with ``str``.

    ``align`` has one letter per column, ``l`` (left), ``r`` (right) or ``c`` (centred); default all left. A row
    whose number of cells differs from the header's raises ``ValueError``: Markdown would pad or drop cells silently,
    shifting every cell after the gap under another column's title."""
    head = [str(c) for c in head]
    align = align or "l" * len(head)
    if len(align) != len(head) or set(align) - set(ALIGN):
        raise ValueError(f"align {align!r}: one of {''.join(ALIGN)} per column, {len(head)} columns")
    lines = [_row(head), "|" + "|".join(ALIGN[a] for a in align) + "|"]
    for i, r in enumerate(rows):
        r = [str(c) for c in r]
        if len(r) != len(head):
            raise ValueError(f"table row {i} has {len(r)} cells, the header {len(head)}: {r}")
        lines.append(_row(r))
    return lines


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def number(x, fmt: str = "{:.2f}", missing: str = MISSING) -> str:
    """``fmt.format(x)``, or ``missing`` when ``x`` is None (a value not measured, or not applicable)."""
    return missing if x is None else fmt.format(x)


def figure(figsize=None, *, layout: str | None = None):
    """A matplotlib ``Figure`` drawn by the Agg backend, outside pyplot (no window, no global figure list, nothing to
    close); add axes with ``fig.subplots`` or ``fig.add_subplot`` and write it with :func:`save_figure`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig, path, dpi: int = 110, *, tight: bool = True):
    """Write ``fig`` (a PNG for a ``.png`` path), cropped to what it draws unless ``tight`` is False, creating the
    folder; close it if pyplot made it (its figure list would keep it alive). Returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight" if tight else None)
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close(fig)
    return path


def write_report(md_path, markdown: str, data=None, *, json_path=None) -> list[str]:
    """Write ``markdown`` to ``md_path`` and, when ``data`` is given, ``data`` as JSON to ``json_path`` (default: beside
    the Markdown with the same stem), creating the folder; returns the paths written.

    NumPy values in ``data`` are written as numbers or lists, anything else JSON lacks as its ``str``."""
    md_path = os.fspath(md_path)
    os.makedirs(os.path.dirname(os.path.abspath(md_path)), exist_ok=True)
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(markdown)
    written = [md_path]
    if data is not None:
        json_path = os.fspath(json_path) if json_path is not None else os.path.splitext(md_path)[0] + ".json"
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, default=_plain)
            f.write("\n")
        written.append(json_path)
    return written


def _plain(x):
    """JSON for what ``json`` cannot write: NumPy scalars and arrays as numbers and lists, the rest as text."""
    return x.tolist() if hasattr(x, "tolist") else str(x)


__all__ = ["MISSING", "ALIGN", "table", "number", "figure", "save_figure", "write_report"]

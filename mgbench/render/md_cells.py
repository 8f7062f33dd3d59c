"""Cells and tables of report.md, shared by its sections."""

from __future__ import annotations

import shutil
from pathlib import Path


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _num(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _table(headers: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _value(value, width: int = 60) -> str:
    """A manifest value in one cell: lists joined, dicts as compact JSON, cut at `width` characters."""
    import json

    if value is None:
        text = "-"
    elif isinstance(value, list):
        text = ",".join(str(v) for v in value)
    elif isinstance(value, dict):
        text = json.dumps(value, separators=(",", ":"), sort_keys=True)
    else:
        text = str(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _copy_plots(run: Path, out: Path, prefix: str, names) -> list[str]:
    """Copy a run's plots beside report.md (prefixed by the run's index) and link them."""
    lines = []
    for name in names:
        if (run / name).is_file():
            if (run / name).resolve() != (out / f"{prefix}{name}").resolve():
                shutil.copyfile(run / name, out / f"{prefix}{name}")
            lines += [f"![{name}]({prefix}{name})", ""]
    return lines

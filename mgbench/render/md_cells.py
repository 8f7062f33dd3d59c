"""Cells and tables of report.md, shared by its sections."""

from __future__ import annotations


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

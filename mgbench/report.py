"""Terminal reports (rich). Input: summary dicts and small tables from `mgbench.analysis`."""

from __future__ import annotations

import pandas as pd
from rich.console import Console
from rich.table import Table


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def render_flips(console: Console, summary: dict, pads: pd.DataFrame) -> None:
    head = Table(title=f"mgbench flips: {summary['model']} on {summary['dataset']}", show_header=False)
    head.add_column("figure", style="bold")
    head.add_column("value", justify="right")
    rows = [
        ("teacher-forced steps", summary["steps"]),
        ("flips", summary["flips"]),
        ("flip rate", _pct(summary["flip_rate"])),
        ("sequences (free-running)", summary["sequences"]),
        ("sequences diverged", summary["sequences_diverged"]),
        ("sequence-level determinism", _pct(summary["determinism"])),
        ("solo decode tokens/s", _fmt(summary["solo_tokens_per_s"])),
        ("batched decode tokens/s", _fmt(summary["batched_tokens_per_s"])),
        ("prefill", summary["prefill"]),
        ("max new tokens", summary["max_new_tokens"]),
    ]
    for name, value in rows:
        head.add_row(name, str(value))
    console.print(head)

    by_b = Table(title="by batch size")
    for column in ("batch size", "steps", "flips", "flip rate", "sequences", "diverged", "batched tok/s"):
        by_b.add_column(column, justify="right")
    for row in summary["by_batch_size"]:
        by_b.add_row(
            str(row["batch_size"]), str(row["steps"]), str(row["flips"]), _pct(row["flip_rate"]),
            str(row["sequences"]), str(row["sequences_diverged"]),
            _fmt(summary["batched_tokens_per_s_by_batch_size"].get(str(row["batch_size"]))),
        )
    console.print(by_b)

    margins = Table(title="batched top-1/top-2 margin quantiles: flip vs non-flip steps")
    margins.add_column("unit / steps")
    quantile_names = list(summary["margin_logit_quantiles_flip"])
    for q in quantile_names:
        margins.add_column(q, justify="right")
    for unit in ("logit", "ulp"):
        for group in ("flip", "non_flip"):
            values = summary[f"margin_{unit}_quantiles_{group}"]
            margins.add_row(f"{unit} / {group.replace('_', '-')}", *[_fmt(values[q], 3) for q in quantile_names])
    console.print(margins)

    kv = Table(title=f"K/V perturbation before flips (overall median {_fmt(summary['kv_delta_overall_median'], 3)})")
    kv.add_column("offset from flip", justify="right")
    kv.add_column("flips seen", justify="right")
    kv.add_column("median rel. K/V delta", justify="right")
    for row in summary["kv_delta_before_flips"]:
        kv.add_row(str(row["offset"]), str(row["flips"]), _fmt(row["kv_delta_median"], 3))
    console.print(kv)

    pad_table = Table(title="pad lengths per batch")
    pad_table.add_column("batch", justify="right")
    pad_table.add_column("size", justify="right")
    pad_table.add_column("pad lengths by row")
    shown = pads.head(12)
    for row in shown.itertuples():
        pad_table.add_row(str(row.batch_id), str(row.batch_size), " ".join(map(str, row.pad_lens)))
    if len(pads) > len(shown):
        pad_table.add_row("...", "", f"{len(pads) - len(shown)} more batches in sequences.parquet")
    console.print(pad_table)

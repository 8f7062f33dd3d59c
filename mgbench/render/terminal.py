"""Terminal reports (rich). Input: summary dicts and small tables from `mgbench.analysis`."""

from __future__ import annotations

import pandas as pd
from rich.console import Console
from rich.table import Table

from mgbench.analysis.gate import condition_label, varies_more_than_the_batch
from mgbench.runs.schema import FIXED_ORDER_INVARIANT


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def render_flips(console: Console, summary: dict, pads: pd.DataFrame) -> None:
    black_box = summary.get("method") == "first-divergence"
    engine = f" ({summary['engine']})" if summary.get("engine") else ""
    head = Table(title=f"mgbench flips: {summary['model']} on {summary['dataset']}{engine}", show_header=False)
    head.add_column("figure", style="bold")
    head.add_column("value", justify="right")
    rows = [
        ("synchronous steps (to first divergence)" if black_box else "teacher-forced steps", summary["steps"]),
        ("flips", summary["flips"]),
        ("flip rate", _pct(summary["flip_rate"])),
        ("sequences (free-running)", summary["sequences"]),
        ("sequences diverged", summary["sequences_diverged"]),
        ("sequence-level determinism", _pct(summary["determinism"])),
        (
            "steps with logprob drift (same token)",
            f"{summary.get('drift_steps_differing', '-')} / "
            f"{summary.get('drift_steps', '-')} ({_pct(summary.get('drift_share'))})",
        ),
        ("max logprob drift", _fmt(summary.get("max_logprob_drift"), 3)),
    ]
    repeat = summary.get("solo_repeat")
    if repeat:
        rows += [
            (
                "solo vs solo again: requests differing",
                f"{repeat['requests_differing']} / {repeat['requests']}"
                + ("" if not repeat["requests_differing"] else " (NOT deterministic at batch size 1: left out)"),
            ),
            (
                "solo vs solo again: steps with logprob drift",
                f"{repeat['logprob_steps_differing']} / {repeat['steps']} (max {_fmt(repeat['max_logprob_drift'], 3)})",
            ),
        ]
    rows += [
        ("solo tokens/s" if black_box else "solo decode tokens/s", _fmt(summary["solo_tokens_per_s"])),
        ("batched tokens/s" if black_box else "batched decode tokens/s", _fmt(summary["batched_tokens_per_s"])),
        *(
            []
            if black_box
            else [
                ("prefill", summary["prefill"]),
                ("kernels", summary.get("kernels", "stock")),
                ("determinism measured against", reference_label(summary)),
                *_fixed_order_rows(summary.get("fixed_order")),
            ]
        ),
        ("max new tokens", summary["max_new_tokens"]),
    ]
    for name, value in rows:
        head.add_row(name, str(value))
    console.print(head)

    axes = varies_more_than_the_batch(summary["by_batch_size"])
    by_b = Table(title="by axis: what varied against solo" if axes else "by batch size")
    columns = ("axis" if axes else "batch size", "steps", "flips", "flip rate", "sequences", "diverged")
    for column in (*columns, "flip margin med / max", "batched tok/s"):
        by_b.add_column(column, justify="right")
    for row in summary["by_batch_size"]:
        batch = row.get("axis", "batch") == "batch"
        by_b.add_row(
            condition_label(row) if axes else str(row["batch_size"]),
            str(row["steps"]),
            str(row["flips"]),
            _pct(row["flip_rate"]),
            str(row["sequences"]),
            str(row["sequences_diverged"]),
            f"{_fmt(row.get('flip_margin_logit_median'), 3)} / {_fmt(row.get('flip_margin_logit_max'), 3)}",
            _fmt(summary["batched_tokens_per_s_by_batch_size"].get(str(row["batch_size"]))) if batch else "-",
        )
    console.print(by_b)

    margins = Table(title="batched top-1/top-2 margin quantiles: flip vs non-flip steps")
    margins.add_column("unit / steps")
    quantile_names = list(summary["margin_logit_quantiles_flip"])
    for q in quantile_names:
        margins.add_column(q, justify="right")
    for unit in ("logit",) if black_box else ("logit", "ulp"):  # a black box gives no raw logits: no ulps
        for group in ("flip", "non_flip"):
            values = summary[f"margin_{unit}_quantiles_{group}"]
            margins.add_row(f"{unit} / {group.replace('_', '-')}", *[_fmt(values[q], 3) for q in quantile_names])
    console.print(margins)
    if black_box:  # no K/V, no padding through an API
        return

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
    render_oom_splits(console, summary.get("oom_splits") or [])


def render_oom_splits(console: Console, splits: list[dict]) -> None:
    """Batches that ran out of memory were retried smaller: say so, with their sizes."""
    if splits:
        sizes = ", ".join(f"{s['batch_size']} -> {s['retried_as']}" for s in splits)
        console.print(
            f"[bold yellow]out of memory:[/] {len(splits)} batch(es) retried smaller ({sizes}); "
            "their rows record the batch size they ran at"
        )


def render_calibration(console: Console, document: dict) -> None:
    title = (
        f"mgbench calibrate: {document['model']} on {', '.join(document['datasets'])} (batch sizes "
        f"{document['batch_sizes']})"
    )
    units = Table(title=title)
    for column in (
        "unit",
        "flips",
        "max flip",
        "TAU min",
        "trig@min",
        f"TAU {document['safety']}",
        "trig@TAU",
        "oracle",
        "/oracle",
    ):
        units.add_column(column, justify="right")
    for unit, f in document["per_unit"].items():
        chosen = "*" if unit == document["unit"] else ""
        units.add_row(
            f"{unit}{chosen}",
            str(f["flips"]),
            _fmt(f.get("max_flip_margin")),
            _fmt(f["tau_min"]),
            _pct(f["trigger_rate_min"]),
            _fmt(f["tau"]),
            _pct(f["trigger_rate"]),
            _pct(f["oracle_trigger_rate"]),
            _fmt(f["trigger_over_oracle"], 3),
        )
    console.print(units)
    console.print(
        "trig: trigger rate (share of steps verified); oracle: the flip rate, the floor; "
        "*: the unit written to calibration.json (--unit)"
    )
    bound = document["bound"]
    style = "green" if bound.get("enough_flips") else "yellow"
    console.print(f"[{style}]bound:[/] {bound['verdict']}")
    if bound.get("miss_probability_bound") is not None:
        console.print(
            f"  missed flips per step <= {bound['missed_flips_per_step_bound']:.3g}; "
            f"P(a 1000-token sequence has a missed flip) <= {bound['sequence_miss_probability_per_1000_tokens']:.3g}"
        )
    if document["transfer"]:
        transfer = Table(title="transfer: the calibrated TAU on other datasets")
        for column in ("dataset", "unit", "TAU", "steps", "flips", "missed", "recall", "triggers", "miss bound"):
            transfer.add_column(column, justify="right")
        for row in document["transfer"]:
            recall = row["recall"]
            shown = "-" if recall is None else f"[{'green' if recall == 1 else 'bold red'}]{recall:.1%}[/]"
            transfer.add_row(
                row["dataset"],
                row["unit"],
                _fmt(row["tau"]),
                str(row["steps"]),
                str(row["flips"]),
                str(row["missed"]),
                shown,
                _pct(row["trigger_rate"]),
                _pct(row["miss_probability_bound"]),
            )
        console.print(transfer)


def _determinism(value) -> str:
    """Green at 100%, red below: determinism is the figure a reader scans for."""
    return f"[{'green' if value == 1 else 'red'}]{_pct(value)}[/]"


def render_verify(console: Console, summary: dict) -> None:
    table = Table(
        title=f"mgbench verify: {summary['model']} on {summary['dataset']} "
        f"({'needle' if summary['needle'] else 'batches'}, prefill {summary['prefill']}); "
        f"identical to {reference_label(summary)}"
    )
    for column in (
        "policy",
        "batch size",
        "sequences",
        "identical",
        "determinism",
        "against",
        "trigger rate",
        "repairs",
        "decode s",
    ):
        table.add_column(column, justify="right")
    for row in summary["by_batch_size"]:
        table.add_row(
            row["policy"],
            str(row["batch_size"]),
            str(row["sequences"]),
            str(row["identical"]),
            _determinism(row["determinism"]),
            row.get("reference") or summary.get("reference") or "stock solo",  # runs before the field: stock
            _pct(row["trigger_rate"]),
            str(row["repairs"]),
            _fmt(row.get("decode_s"), 3),
        )
    console.print(table)
    for policy in summary["policies"]:
        verdict = {None: "", True: "[green]PASS[/]", False: "[bold red]FAIL[/]"}[policy["passed"]]
        console.print(
            f"{policy['policy']}: determinism {_pct(policy['determinism'])}, trigger rate "
            f"{_pct(policy['trigger_rate'])}, {policy['repairs']} repairs, batch-invariant across sizes "
            f"{policy['batch_invariant_requests']}/{policy['requests']} {verdict}"
        )
    if summary["shortfalls"]:
        short = Table(title="where the reference disagreed with solo (first 10)")
        for column in (
            "policy",
            "B",
            "request",
            "step",
            "solo tok",
            "ref tok",
            "batched margin",
            "ref margin",
            "solo margin",
            "ref-solo max |dlogit| (solo top-5)",
        ):
            short.add_column(column, justify="right")
        for s in summary["shortfalls"][:10]:
            short.add_row(
                s["policy"],
                str(s["batch_size"]),
                str(s["request_id"]),
                str(s["step"]),
                str(s["solo_token"]),
                str(s["reference_token"]),
                _fmt(s["batched_margin"], 3),
                _fmt(s["reference_margin"], 3),
                _fmt(s["solo_margin"], 3),
                # Runs before 2026-12 recorded the distance over the whole vocabulary.
                _fmt(
                    s.get("reference_vs_solo_max_abs_diff_at_solo_top", s.get("reference_vs_solo_max_abs_logit_diff")),
                    3,
                ),
            )
        console.print(short)
    render_oom_splits(console, summary.get("oom_splits") or [])


def render_compare(console: Console, summary: dict) -> None:
    table = Table(
        title=f"mgbench compare: {summary['model']} on {summary['dataset']}, batch size {summary['batch_size']}, "
        f"{summary['sequences']} requests, median of {summary['repeats']}"
    )
    for column in (
        "config",
        "decode s",
        "spread",
        "tok/s",
        "increment",
        "determinism",
        "against",
        "triggers",
        "repairs",
        "replayed/token",
        "verify slots/token",
    ):
        table.add_column(column, justify="right")
    for row in summary["configs"]:
        table.add_row(
            row["config"],
            _fmt(row["seconds"], 3),
            f"{_fmt(row['seconds_min'], 3)}-{_fmt(row['seconds_max'], 3)}",
            _fmt(row["tokens_per_s"], 3),
            _pct(row["increment"]),
            _determinism(row["determinism"]),
            row.get("reference") or summary.get("reference") or "stock solo",  # runs before the field: stock
            _pct(row["trigger_rate"]),
            _fmt(row["repairs"]),
            _fmt(row.get("replayed_per_token"), 3),
            _fmt(row.get("verify_slots_per_token"), 3),
        )
    console.print(table)
    fixed = summary.get("fixed_order")
    if fixed:
        console.print(
            f"fixed-order kernels: {fixed['plan']['attention']}; fixed-order solo equals stock solo on "
            f"{fixed['stock_solo']['identical']}/{fixed['stock_solo']['requests']} sequences"
        )
    for r in summary.get("replay_reductions", []):
        if r["median"] is not None:
            console.print(
                f"increment reduction {r['window']} over {r['gate']} (against fixed-order solo; increments over "
                f"{r.get('base', 'none')}): "
                f"[bold]{r['median']:.2f}x[/] (repeats {r['min']:.2f}-{r['max']:.2f}; paper: 2.23x over LLM-42)"
            )
    for r in summary["reductions"]:
        if r["median"] is not None:
            console.print(
                f"increment reduction always/{r['repair']} over margin/{r['repair']}: "
                f"[bold]{r['median']:.2f}x[/] (repeats {r['min']:.2f}-{r['max']:.2f}; paper: 2.23x on Llama-3.1-8B)"
            )
    console.print(
        f"gate alone (top-2 + decision + sync): {summary['gate_seconds_per_step'] * 1e3:.3f} ms per step, "
        f"{_pct(summary['gate_share_of_step'])} of a plain batched step"
    )
    breakdown = Table(title="where verification time goes (first repeat, seconds)")
    for column in ("config", "gate", "decision sync", "reference forward", "cache ops"):
        breakdown.add_column(column, justify="right")
    for row in summary["breakdown"]:
        breakdown.add_row(
            row["config"],
            *[_fmt(row.get(f"t_{k}"), 3) for k in ("gate", "decision_sync", "reference_forward", "cache_ops")],
        )
    console.print(breakdown)


def _yes(flag: bool) -> str:
    return "[green]yes[/]" if flag else "[bold red]no[/]"


def _spans(values: list[int]) -> str:
    """[1, 2, 3, 5, 9, 10] -> '1-3, 5, 9-10' (what differs, readable at any length)."""
    spans, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            spans.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(spans) or "-"


def reference_label(summary: dict) -> str:
    """What a run's determinism figures are measured against (old runs: stock solo)."""
    if summary.get("kernels") == "fixed-order":
        return "solo decoding through the same fixed-order kernels"
    if summary.get("batch_invariant"):
        return "stock solo (batched rows made to reproduce it: --batch-invariant)"
    return "stock solo"


def _fixed_order_rows(fixed: dict | None) -> list[tuple[str, str]]:
    if not fixed:
        return []
    plan, stock = fixed["plan"], fixed.get("stock_solo")
    modules = ", ".join(f"{n} {form}" for form, n in plan["modules"].items()) or "all as is"
    rows = [("fixed-order attention", plan["attention"]), ("fixed-order row-wise modules", modules)]
    rows.append(("invariant by construction", FIXED_ORDER_INVARIANT))
    rows += [("fixed-order fallback", line) for line in plan["fallbacks"]]
    if stock:
        rows.append(
            (
                "fixed-order solo = stock solo",
                f"{stock['identical']} / {stock['requests']} sequences (changing the reference changes the rest)",
            )
        )
    return rows

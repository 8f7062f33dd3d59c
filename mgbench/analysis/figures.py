"""Analysis as pure functions on tables (pandas in, pandas or plain dicts out; a steps table's
figures from its streamed aggregates, analysis/step_aggregates.py).

Nothing here imports torch or the engine, so run directories recorded elsewhere (a GPU box)
are analysed anywhere.
"""

from __future__ import annotations

import math

import pandas as pd

from mgbench.analysis.step_aggregates import (
    StepAggregates,
    flips_count,
    margin_quantiles,
    steps_by_batch_size,
)
from mgbench.runs.schema import AXES, DEFAULT_AXIS

QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


def _finite(value: float) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def with_axis(sequences: pd.DataFrame) -> pd.DataFrame:
    """Sequences with their `axis` column (a table made without one varied the batch)."""
    return sequences if "axis" in sequences.columns else sequences.assign(axis=DEFAULT_AXIS)


def rates_by_batch_size(steps_per_batch_size: pd.DataFrame, sequences: pd.DataFrame) -> pd.DataFrame:
    """Per axis and batch size (axes in AXES order): teacher-forced steps, flips, flip rate,
    sequences, diverged, determinism. `steps_per_batch_size`: steps and flips, indexed by axis and
    batch size (step_aggregates.steps_by_batch_size)."""
    per_seq = (
        with_axis(sequences)
        .groupby(["axis", "batch_size"])
        .agg(sequences=("identical", "size"), identical=("identical", "sum"))
    )
    table = steps_per_batch_size.join(per_seq, how="outer").fillna(0).astype(int)
    table["flip_rate"] = table["flips"] / table["steps"].where(table["steps"] > 0)
    table["sequences_diverged"] = table["sequences"] - table["identical"]
    table["determinism"] = table["identical"] / table["sequences"].where(table["sequences"] > 0)
    table = table.reset_index()
    order = table["axis"].map(lambda a: AXES.index(a) if a in AXES else len(AXES))
    return (
        table.assign(_order=order).sort_values(["_order", "batch_size"]).drop(columns="_order").reset_index(drop=True)
    )


def flip_margins_by_condition(counts: pd.DataFrame) -> dict[tuple[str, int], dict]:
    """Per (axis, batch size): the median and largest margin at a flip, in logits and ulps (a
    near-tie is numeric noise; a wide margin, a bug); None where nothing flipped."""
    figures = {}
    for (axis, batch_size), part in counts.groupby(["axis", "batch_size"]):
        row = {}
        for column, unit in (("margin", "logit"), ("margin_ulp", "ulp")):
            median, largest = margin_quantiles(part, (0.5, 1.0), column)["flip"]
            row[f"flip_margin_{unit}_median"], row[f"flip_margin_{unit}_max"] = _finite(median), _finite(largest)
        figures[(axis, int(batch_size))] = row
    return figures


def batch_pad_lengths(sequences: pd.DataFrame) -> pd.DataFrame:
    """One row per batch of the batch axis: its size and the pad length of each row, in row order."""
    sequences = with_axis(sequences)
    ordered = sequences[sequences["axis"] == "batch"].sort_values(["batch_id", "row"])
    return ordered.groupby("batch_id").agg(batch_size=("batch_size", "first"), pad_lens=("pad_len", list)).reset_index()


def step_method(steps: StepAggregates) -> str | None:
    """How the run compared steps with solo ("teacher-forced", "first-divergence"; "mixed" for
    concatenated runs of both engines, None when there are no steps)."""
    methods = steps.methods
    return methods[0] if len(methods) == 1 else ("mixed" if methods else None)


def drift_figures(steps: StepAggregates) -> dict:
    """Logprob drift on the steps where solo and batched emit the same token: batch variance that
    has not (yet) flipped a token. Share of those steps whose top-k logprobs differ, and the max."""
    agreeing, differing = steps.drift_steps, steps.drift_steps_differing
    return {
        "drift_steps": agreeing,
        "drift_steps_differing": differing,
        "drift_share": differing / agreeing if agreeing else None,
        "max_logprob_drift": steps.max_logprob_drift,
    }


def first_divergence_figures(sequences: pd.DataFrame) -> dict:
    """Flip rate without teacher forcing, from the free-running sequences: steps up to and
    including the first divergence are synchronous, the divergence is the flip. What an endpoint
    audit measures, so in-process and served engines compare like for like."""
    from mgbench.analysis.divergence import first_divergence, synchronous_steps

    steps = flips = 0
    for solo, batched in zip(sequences["solo_ids"], sequences["batched_ids"]):
        solo, batched = list(solo), list(batched)
        steps += synchronous_steps(solo, batched)
        divergence = first_divergence(solo, batched)
        flips += divergence is not None and divergence < min(len(solo), len(batched))
    return {
        "synchronous_steps": steps,
        "first_divergence_flips": int(flips),
        "first_divergence_flip_rate": flips / steps if steps else None,
    }


def summarize_flips(steps: StepAggregates, sequences: pd.DataFrame) -> dict:
    """The headline figures of a flips run (summary.json and the terminal report), from its steps
    table's aggregates (step_aggregates.aggregate) and its sequences."""
    flips = flips_count(steps)
    rows = steps.rows
    diverged = int((~sequences["identical"]).sum())
    summary = {
        "steps": rows,
        "flips": flips,
        "flip_rate": flips / rows if rows else None,
        "sequences": int(len(sequences)),
        "sequences_diverged": diverged,
        "determinism": 1 - diverged / len(sequences) if len(sequences) else None,
        **drift_figures(steps),
        **first_divergence_figures(sequences),
    }
    for column, unit in (("margin", "logit"), ("margin_ulp", "ulp")):
        for group, values in margin_quantiles(steps.margin_counts, QUANTILES, column).items():
            key = f"margin_{unit}_quantiles_{group.replace('-', '_')}"
            summary[key] = {f"q{int(q * 100):02d}": _finite(v) for q, v in zip(QUANTILES, values)}
    summary["kv_delta_overall_median"] = _finite(steps.kv_overall_median)
    summary["kv_delta_before_flips"] = [
        {"offset": int(r.offset), "flips": int(r.flips), "kv_delta_median": _finite(r.kv_delta_median)}
        for r in steps.kv_before_flips.itertuples()
    ]
    margins_at_flips = flip_margins_by_condition(steps.margin_counts)
    summary["by_batch_size"] = [
        {
            **{k: (v if k == "axis" else _finite(v) if isinstance(v, float) else int(v)) for k, v in row.items()},
            **margins_at_flips.get((row["axis"], int(row["batch_size"])), {}),
        }
        for row in rates_by_batch_size(steps_by_batch_size(steps.margin_counts), sequences).to_dict("records")
    ]
    return summary


def verify_by_policy(sequences: pd.DataFrame, seconds: dict[tuple[str, int], float] | None = None) -> pd.DataFrame:
    """Per (policy, batch size): determinism, trigger rate, repairs and decode throughput."""
    table = (
        sequences.groupby(["policy", "repair", "batch_size"], sort=False)
        .agg(
            sequences=("identical", "size"),
            identical=("identical", "sum"),
            steps=("steps", "sum"),
            triggers=("triggers", "sum"),
            repairs=("repairs", "sum"),
        )
        .reset_index()
    )
    table["determinism"] = table["identical"] / table["sequences"]
    table["trigger_rate"] = table["triggers"] / table["steps"].where(table["steps"] > 0)
    if "replayed" in table:  # tokens replayed by verification per emitted token
        table["replayed_per_token"] = table["replayed"] / table["tokens"].where(table["tokens"] > 0)
    if seconds is not None:
        table["decode_s"] = [seconds.get((p, b), float("nan")) for p, b in zip(table["policy"], table["batch_size"])]
    return table


def batch_invariance(sequences: pd.DataFrame) -> pd.DataFrame:
    """Per policy: requests whose batched output is the same at every batch size tried (solo aside)."""

    def invariant(group: pd.DataFrame) -> bool:
        outputs = {tuple(ids) for ids in group["batched_ids"]}
        return len(outputs) == 1

    per_request = sequences.groupby(["policy", "request_id"], sort=False).apply(invariant, include_groups=False)
    per_request = per_request.rename("invariant").reset_index()
    table = per_request.groupby("policy", sort=False)["invariant"].agg(["size", "sum"]).reset_index()
    return table.rename(columns={"size": "requests", "sum": "invariant_requests"})


def _json_row(row: dict) -> dict:
    """A table row as JSON-safe values: NaN -> None, numpy integers -> int, strings kept."""
    return {k: (_finite(v) if isinstance(v, float) else v if isinstance(v, str) else int(v)) for k, v in row.items()}


def summarize_verify(sequences: pd.DataFrame, seconds: dict, shortfalls: list[dict], required: float | None) -> dict:
    by = verify_by_policy(sequences, seconds)
    overall = (
        sequences.groupby(["policy", "repair"], sort=False)
        .agg(
            sequences=("identical", "size"),
            identical=("identical", "sum"),
            steps=("steps", "sum"),
            triggers=("triggers", "sum"),
            repairs=("repairs", "sum"),
        )
        .reset_index()
    )
    overall["determinism"] = overall["identical"] / overall["sequences"]
    overall["trigger_rate"] = overall["triggers"] / overall["steps"].where(overall["steps"] > 0)
    invariance = batch_invariance(sequences).set_index("policy")
    policies = []
    for row in overall.to_dict("records"):
        inv = invariance.loc[row["policy"]]
        policies.append(
            {
                **_json_row(row),
                "batch_invariant_requests": int(inv["invariant_requests"]),
                "requests": int(inv["requests"]),
                "passed": None if required is None else bool(row["determinism"] >= required),
            }
        )
    return {
        "required_determinism": required,
        "passed": None if required is None else all(p["passed"] for p in policies),
        "policies": policies,
        "by_batch_size": [_json_row(r) for r in by.to_dict("records")],
        "shortfalls": shortfalls,
    }


def latency_increment(seconds: float, baseline: float) -> float:
    """(wall time of a policy - wall time of `none`) / wall time of `none`."""
    return (seconds - baseline) / baseline


def increment_reduction(always_increment: float, gate_increment: float) -> float | None:
    """increment(always) / increment(margin): how much of always-on's overhead MarginGate removes.
    None when MarginGate costs nothing measurable (its increment is at or below zero: noise)."""
    return always_increment / gate_increment if gate_increment > 0 else None


def compare_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per configuration: median wall time and spread over repeats, tokens/s, latency increment over
    `none` (median of the per-repeat increments), determinism, trigger rate, repairs.

    `runs` has one row per (config, repeat) with seconds, tokens, identical, sequences, steps,
    triggers, repairs.
    """
    baseline = runs[runs["config"] == "none"].set_index("repeat")["seconds"]
    runs = runs.assign(increment=[latency_increment(s, baseline[r]) for s, r in zip(runs["seconds"], runs["repeat"])])
    table = (
        runs.groupby("config", sort=False)
        .agg(
            seconds=("seconds", "median"),
            seconds_min=("seconds", "min"),
            seconds_max=("seconds", "max"),
            tokens=("tokens", "first"),
            increment=("increment", "median"),
            increment_min=("increment", "min"),
            increment_max=("increment", "max"),
            sequences=("sequences", "first"),
            identical=("identical", "min"),
            steps=("steps", "first"),
            triggers=("triggers", "median"),
            repairs=("repairs", "median"),
            **({"reference": ("reference", "first")} if "reference" in runs else {}),
            **(
                {"replayed": ("replayed", "median"), "discarded": ("discarded", "median")} if "replayed" in runs else {}
            ),
            **(
                {"verify_forwards": ("verify_forwards", "median"), "verify_slots": ("verify_slots", "median")}
                if "verify_slots" in runs
                else {}
            ),
        )
        .reset_index()
    )
    table["tokens_per_s"] = table["tokens"] / table["seconds"]
    table["determinism"] = table["identical"] / table["sequences"]
    table["trigger_rate"] = table["triggers"] / table["steps"].where(table["steps"] > 0)
    if "replayed" in table:  # tokens replayed by verification per emitted token
        table["replayed_per_token"] = table["replayed"] / table["tokens"].where(table["tokens"] > 0)
    if "verify_slots" in table:  # token slots the verify forwards computed (padding, dummies) per emitted token
        table["verify_slots_per_token"] = table["verify_slots"] / table["tokens"].where(table["tokens"] > 0)
    return table


def reduction_between(runs: pd.DataFrame, baseline: str, gate: str, base: str = "none") -> dict:
    """increment(baseline) / increment(gate) per repeat (both over `base`), with its median and spread."""
    by = runs.set_index(["config", "repeat"])["seconds"]
    values = []
    for repeat in sorted(runs["repeat"].unique()):
        try:
            reference = by[(base, repeat)]
            values.append(
                increment_reduction(
                    latency_increment(by[(baseline, repeat)], reference),
                    latency_increment(by[(gate, repeat)], reference),
                )
            )
        except KeyError:
            continue
    measured = pd.Series([v for v in values if v is not None], dtype=float)
    if measured.empty:
        return {"median": None, "min": None, "max": None, "per_repeat": values}
    return {
        "median": float(measured.median()),
        "min": float(measured.min()),
        "max": float(measured.max()),
        "per_repeat": values,
    }


def reductions(runs: pd.DataFrame, repair: str) -> dict:
    """increment(always/R) / increment(margin/R) per repeat, with its median and spread."""
    gate = next((c for c in runs["config"].unique() if c.startswith("margin") and c.endswith(f"/{repair}")), None)
    if gate is None:
        return {"repair": repair, "median": None, "min": None, "max": None, "per_repeat": []}
    return {"repair": repair, **reduction_between(runs, f"always/{repair}", gate)}

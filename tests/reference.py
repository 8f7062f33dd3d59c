"""Independent computations of what the streamed aggregates compute: the whole steps table in
pandas, as mgbench computed its flips summary and the baseline test before they streamed. The
suite checks the streamed figures against these, bitwise."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from mgbench.analysis import gate
from mgbench.runs import rundir
from mgbench.runs.schema import STEPS_SCHEMA, read_table, schema_read_from

QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
# The flips summary's keys computed from the steps table (step_figures adds steps_by_batch_size).
SUMMARY_KEYS = [
    "steps",
    "flips",
    "flip_rate",
    "drift_steps",
    "drift_steps_differing",
    "drift_share",
    "max_logprob_drift",
    *(f"margin_{u}_quantiles_{g}" for u in ("logit", "ulp") for g in ("flip", "non_flip")),
    "kv_delta_overall_median",
    "kv_delta_before_flips",
]


def _finite(value):
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def whole_steps(run: Path) -> pd.DataFrame:
    """The steps table of a run directory (sharded or not) or of a steps.parquet path, whole, in pandas."""
    table = rundir.read_run_table(run, "steps", STEPS_SCHEMA) if run.is_dir() else read_table(run, STEPS_SCHEMA)
    steps = table.to_pandas()
    steps.attrs["schema_version_read"] = schema_read_from(table)
    return steps


def margin_quantiles(steps: pd.DataFrame, column: str) -> dict[str, dict]:
    groups = {"flip": steps.loc[steps["flipped"], column], "non_flip": steps.loc[~steps["flipped"], column]}
    return {
        name: {f"q{int(q * 100):02d}": _finite(values.quantile(q) if len(values) else float("nan")) for q in QUANTILES}
        for name, values in groups.items()
    }


def kv_before_flips(steps: pd.DataFrame, window: int = 8) -> tuple[list[dict], float | None]:
    level = steps.set_index(["batch_id", "row", "step"])["kv_delta_mean"]
    flips = steps.loc[steps["flipped"], ["batch_id", "row", "step"]]
    rows = []
    for offset in range(-window, 1):
        index = pd.MultiIndex.from_arrays([flips["batch_id"], flips["row"], flips["step"] + offset])
        values = level.reindex(index).dropna()
        rows.append(
            {
                "offset": offset,
                "flips": len(values),
                "kv_delta_median": _finite(values.median() if len(values) else None),
            }
        )
    return rows, _finite(float(steps["kv_delta_mean"].median()) if len(steps) else None)


def drift_figures(steps: pd.DataFrame) -> dict:
    agreeing = steps.loc[~steps["flipped"], "logprob_drift"].dropna()
    differing = int((agreeing > 0).sum())
    return {
        "drift_steps": int(len(agreeing)),
        "drift_steps_differing": differing,
        "drift_share": differing / len(agreeing) if len(agreeing) else None,
        "max_logprob_drift": float(agreeing.max()) if len(agreeing) else None,
    }


def step_figures(steps: pd.DataFrame) -> dict:
    """The steps-table part of a flips summary, from the whole table."""
    flips = int(steps["flipped"].sum())
    figures = {"steps": int(len(steps)), "flips": flips, "flip_rate": flips / len(steps) if len(steps) else None}
    figures.update(drift_figures(steps))
    for column, unit in (("margin", "logit"), ("margin_ulp", "ulp")):
        for group, values in margin_quantiles(steps, column).items():
            figures[f"margin_{unit}_quantiles_{group}"] = values
    profile, overall = kv_before_flips(steps)
    figures["kv_delta_overall_median"] = overall
    figures["kv_delta_before_flips"] = profile
    per = steps.groupby(["axis", "batch_size"]).agg(steps=("flipped", "size"), flips=("flipped", "sum"))
    figures["steps_by_batch_size"] = {(a, int(b)): (int(r.steps), int(r.flips)) for (a, b), r in per.iterrows()}
    return figures


def paired_test(current: pd.DataFrame, baseline: pd.DataFrame) -> dict:
    """The flip-rate test over steps matched on (request, batch size, step), by a join of the rows."""
    keys = ["request_id", "batch_size", "step"]
    pairs = current[keys + ["flipped"]].merge(baseline[keys + ["flipped"]], on=keys, suffixes=("", "_baseline"))
    now, then = pairs["flipped"].astype(bool), pairs["flipped_baseline"].astype(bool)
    worse, better = int((now & ~then).sum()), int((~now & then).sum())
    return {
        "pairs": len(pairs),
        "rate": float(now.mean()) if len(pairs) else None,
        "baseline_rate": float(then.mean()) if len(pairs) else None,
        "newly_bad": worse,
        "newly_good": better,
        "p_value": gate.sign_test_p(worse, better),
        "unpaired": len(current) - len(pairs),
    }

"""Analysis as pure functions on tables (pandas in, pandas or plain dicts out).

Nothing here imports torch or the engine, so run directories recorded elsewhere (a GPU box)
are analysed anywhere.
"""

from __future__ import annotations

import math

import pandas as pd

QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
KV_WINDOW = 8


def _finite(value: float) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def margin_quantiles(steps: pd.DataFrame, column: str = "margin") -> pd.DataFrame:
    """Quantiles of a margin column at flip and at non-flip steps: rows flip/non-flip, columns q."""
    groups = {"flip": steps.loc[steps["flipped"], column], "non-flip": steps.loc[~steps["flipped"], column]}
    table = pd.DataFrame(
        {
            name: [values.quantile(q) if len(values) else float("nan") for q in QUANTILES]
            for name, values in groups.items()
        },
        index=[f"q{int(q * 100):02d}" for q in QUANTILES],
    ).T
    table["count"] = [len(v) for v in groups.values()]
    return table


def rates_by_batch_size(steps: pd.DataFrame, sequences: pd.DataFrame) -> pd.DataFrame:
    """Per batch size: teacher-forced steps, flips, flip rate, sequences, diverged, determinism."""
    per_steps = steps.groupby("batch_size").agg(steps=("flipped", "size"), flips=("flipped", "sum"))
    per_seq = sequences.groupby("batch_size").agg(sequences=("identical", "size"), identical=("identical", "sum"))
    table = per_steps.join(per_seq, how="outer").fillna(0).astype(int)
    table["flip_rate"] = table["flips"] / table["steps"].where(table["steps"] > 0)
    table["sequences_diverged"] = table["sequences"] - table["identical"]
    table["determinism"] = table["identical"] / table["sequences"].where(table["sequences"] > 0)
    return table.reset_index()


def kv_before_flips(steps: pd.DataFrame, window: int = KV_WINDOW) -> pd.DataFrame:
    """K/V perturbation at each offset (-window..0) from every flip, against the run's overall level.

    Answers "does the K/V drift before a flip, or stay flat?": a flat profile near the overall
    median means the flip is not announced by the cache.
    """
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
                "kv_delta_mean": values.mean() if len(values) else float("nan"),
                "kv_delta_median": values.median() if len(values) else float("nan"),
            }
        )
    table = pd.DataFrame(rows)
    table.attrs["overall_mean"] = float(steps["kv_delta_mean"].mean()) if len(steps) else float("nan")
    table.attrs["overall_median"] = float(steps["kv_delta_mean"].median()) if len(steps) else float("nan")
    return table


def batch_pad_lengths(sequences: pd.DataFrame) -> pd.DataFrame:
    """One row per batch: its size and the pad length of each row, in row order."""
    ordered = sequences.sort_values(["batch_id", "row"])
    return ordered.groupby("batch_id").agg(batch_size=("batch_size", "first"), pad_lens=("pad_len", list)).reset_index()


def step_method(steps: pd.DataFrame) -> str | None:
    """How the run compared steps with solo ("teacher-forced", "first-divergence"; "mixed" for
    concatenated runs of both engines, None when there are no steps)."""
    methods = sorted(steps["method"].dropna().unique()) if "method" in steps else []
    return methods[0] if len(methods) == 1 else ("mixed" if methods else None)


def drift_figures(steps: pd.DataFrame) -> dict:
    """Logprob drift on the steps where solo and batched emit the same token: batch variance that
    has not (yet) flipped a token. Share of those steps whose top-k logprobs differ, and the max."""
    agreeing = steps.loc[~steps["flipped"], "logprob_drift"].dropna()
    differing = int((agreeing > 0).sum())
    return {
        "drift_steps": int(len(agreeing)),
        "drift_steps_differing": differing,
        "drift_share": differing / len(agreeing) if len(agreeing) else None,
        "max_logprob_drift": float(agreeing.max()) if len(agreeing) else None,
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


def summarize_flips(steps: pd.DataFrame, sequences: pd.DataFrame) -> dict:
    """The headline figures of a flips run (summary.json and the terminal report)."""
    flips = int(steps["flipped"].sum())
    diverged = int((~sequences["identical"]).sum())
    summary = {
        "steps": int(len(steps)),
        "flips": flips,
        "flip_rate": flips / len(steps) if len(steps) else None,
        "sequences": int(len(sequences)),
        "sequences_diverged": diverged,
        "determinism": 1 - diverged / len(sequences) if len(sequences) else None,
        **drift_figures(steps),
        **first_divergence_figures(sequences),
    }
    for column, unit in (("margin", "logit"), ("margin_ulp", "ulp")):
        quantiles = margin_quantiles(steps, column)
        for group in quantiles.index:
            key = f"margin_{unit}_quantiles_{group.replace('-', '_')}"
            summary[key] = {q: _finite(quantiles.loc[group, q]) for q in quantiles.columns if q != "count"}
    kv = kv_before_flips(steps)
    summary["kv_delta_overall_median"] = _finite(kv.attrs["overall_median"])
    summary["kv_delta_before_flips"] = [
        {"offset": int(r.offset), "flips": int(r.flips), "kv_delta_median": _finite(r.kv_delta_median)}
        for r in kv.itertuples()
    ]
    summary["by_batch_size"] = [
        {k: (_finite(v) if isinstance(v, float) else int(v)) for k, v in row.items()}
        for row in rates_by_batch_size(steps, sequences).to_dict("records")
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
        )
        .reset_index()
    )
    table["tokens_per_s"] = table["tokens"] / table["seconds"]
    table["determinism"] = table["identical"] / table["sequences"]
    table["trigger_rate"] = table["triggers"] / table["steps"].where(table["steps"] > 0)
    return table


def reductions(runs: pd.DataFrame, repair: str) -> dict:
    """increment(always/R) / increment(margin/R) per repeat, with its median and spread."""
    by = runs.set_index(["config", "repeat"])["seconds"]
    values = []
    for repeat in sorted(runs["repeat"].unique()):
        try:
            base = by[("none", repeat)]
            always = latency_increment(by[(f"always/{repair}", repeat)], base)
            gate = latency_increment(
                by[
                    (
                        next(c for c in runs["config"].unique() if c.startswith("margin") and c.endswith(f"/{repair}")),
                        repeat,
                    )
                ],
                base,
            )
        except (KeyError, StopIteration):
            continue
        values.append(increment_reduction(always, gate))
    measured = pd.Series([v for v in values if v is not None], dtype=float)
    if measured.empty:
        return {"repair": repair, "median": None, "min": None, "max": None, "per_repeat": values}
    return {
        "repair": repair,
        "median": float(measured.median()),
        "min": float(measured.min()),
        "max": float(measured.max()),
        "per_repeat": values,
    }

"""Threshold calibration on step tables: the minimal safe TAU, its cost, curves, transfer, bounds.

Pure functions on pandas/numpy (no torch). Margins take discrete values (differences of BF16
logits), so everything is computed exactly from counts per distinct margin (`counts_of` turns a
steps table into them; `runs/scan.py` streams them from Parquet without loading the table), with
integer sums and `searchsorted`, never on a grid. The gate verifies a step when margin < TAU
(strict).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from mgbench.errors import UserError

UNITS = {"logit": "margin", "ulp": "margin_ulp"}
REQUIRED_COLUMNS = ("model", "dataset", "batch_size", "flipped", "margin", "margin_ulp")
COUNT = "count"  # steps per distinct (REQUIRED_COLUMNS) key in a counts table
DEFAULT_SAFETY = "x1.5"
# Flips needed before the zero-miss bound drops to 1% at 95% confidence: ln(0.05)/ln(0.99).
FLIPS_FOR_ONE_PERCENT = 299


@dataclass(frozen=True)
class SafetyRule:
    """Widening of the minimal TAU: multiply (`x1.5`) or add (`+0.125`, in the unit calibrated)."""

    kind: str  # "x" or "+"
    value: float

    @classmethod
    def parse(cls, text: str) -> "SafetyRule":
        try:
            kind, value = text[0], float(text[1:])
        except (IndexError, ValueError):
            kind, value = "?", float("nan")
        if kind not in "x+" or not math.isfinite(value) or (kind == "x" and value < 1) or (kind == "+" and value < 0):
            raise UserError(f"--safety {text!r}: use xF with F >= 1 (multiply TAU) or +D with D >= 0 (add to TAU)")
        return cls(kind, value)

    def apply(self, tau: float) -> float:
        return tau * self.value if self.kind == "x" else tau + self.value

    def __str__(self) -> str:
        return f"{self.kind}{self.value:g}"


def counts_of(steps: pd.DataFrame) -> pd.DataFrame:
    """A steps table as counts per distinct REQUIRED_COLUMNS key (a counts table passes through)."""
    if COUNT in steps.columns:
        return steps
    missing = [c for c in REQUIRED_COLUMNS if c not in steps.columns]
    if missing:
        raise UserError(f"steps table lacks columns {', '.join(missing)}")
    counts = steps.groupby(list(REQUIRED_COLUMNS), dropna=False, sort=False).size().reset_index(name=COUNT)
    counts.attrs = dict(steps.attrs)
    return counts


def weights(counts: pd.DataFrame) -> np.ndarray:
    return counts[COUNT].to_numpy(dtype=np.int64)


def measured_units(steps: pd.DataFrame) -> list[str]:
    """Units whose margin column the run measured: an endpoint run's ulp column is all null (an
    API gives logprobs, not the top-1 logit the ulp needs)."""
    return [unit for unit, column in UNITS.items() if column in steps and steps[column].notna().any()]


def validate_steps(steps: pd.DataFrame, source: str) -> pd.DataFrame:
    """The counts of a steps (or counts) table, refused in one line when they cannot calibrate."""
    missing = [c for c in REQUIRED_COLUMNS if c not in steps.columns]
    if missing:
        raise UserError(f"{source}: steps table lacks columns {', '.join(missing)}")
    counts = counts_of(steps)
    w = weights(counts)
    for column in ("margin", "margin_ulp"):
        values = counts[column].to_numpy(dtype=np.float64)
        if column == "margin_ulp" and len(values) and np.isnan(values).all():
            continue  # not measured (an endpoint run); calibrate refuses the ulp unit for it
        if np.isnan(values).any():
            raise UserError(f"{source}: column {column} has {int(w[np.isnan(values)].sum())} NaN values")
        if (values < 0).any():
            raise UserError(f"{source}: column {column} has negative margins (top-1 minus top-2 is never negative)")
    if not int(w.sum()):
        raise UserError(f"{source}: steps table is empty")
    return counts


def count_below(sorted_values: np.ndarray, tau: float | np.ndarray) -> np.ndarray:
    """How many values are < tau (strict), for sorted values."""
    return np.searchsorted(sorted_values, tau, side="left")


def minimal_tau(margins: np.ndarray, flipped: np.ndarray) -> float | None:
    """Smallest TAU with every flip's margin < TAU: the next distinct observed margin above the
    largest flip margin (no step lies in between, so any smaller TAU above it costs the same).
    Repeated values change nothing, so distinct margins with their flip flags are enough."""
    if not flipped.any():
        return None
    worst = float(margins[flipped].max())
    above = margins[margins > worst]
    return float(above.min()) if len(above) else float(np.nextafter(np.float32(worst), np.float32(np.inf)))


def miss_bound(flips: int, misses: int, confidence: float) -> float:
    """One-sided Clopper-Pearson upper bound on the probability that a flip is missed."""
    if flips == 0:
        return 1.0
    if misses == 0:
        return 1.0 - (1.0 - confidence) ** (1.0 / flips)  # closed form of the beta quantile at k = 0
    from scipy.stats import beta

    return 1.0 if misses >= flips else float(beta.ppf(confidence, misses + 1, flips - misses))


def _unit_arrays(steps: pd.DataFrame, unit: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(margins, flipped, step counts) of a steps or counts table."""
    counts = counts_of(steps)
    return counts[UNITS[unit]].to_numpy(dtype=np.float64), counts["flipped"].to_numpy(dtype=bool), weights(counts)


def gate_figures(steps: pd.DataFrame, unit: str, tau: float) -> dict:
    """Recall of flips and trigger rate of the gate `margin < tau` on a steps (or counts) table."""
    margins, flipped, w = _unit_arrays(steps, unit)
    total = int(w.sum())
    caught = int(w[flipped & (margins < tau)].sum())
    flips = int(w[flipped].sum())
    return {
        "steps": total,
        "flips": flips,
        "caught": caught,
        "missed": flips - caught,
        "recall": caught / flips if flips else None,
        "trigger_rate": float(np.int64(w[margins < tau].sum()) / np.int64(total)),
        "flip_rate": flips / total if total else None,
    }


def _cumulative(margins: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct sorted margins, steps below each index: cum[i] = steps with margin < values[i])."""
    values, inverse = np.unique(margins, return_inverse=True)
    per_value = np.zeros(len(values), np.int64)
    np.add.at(per_value, inverse, w)
    return values, np.concatenate([[0], np.cumsum(per_value)])


def curve(steps: pd.DataFrame, unit: str) -> pd.DataFrame:
    """Recall and trigger rate at every distinct observed margin used as TAU (plus one past the max)."""
    margins, flipped, w = _unit_arrays(steps, unit)
    taus, below = _cumulative(margins, w)
    flip_values, flips_below = _cumulative(margins[flipped], w[flipped])
    taus = np.append(taus, np.nextafter(taus[-1], np.inf))
    flips, total = int(flips_below[-1]), int(below[-1])
    return pd.DataFrame(
        {
            "unit": unit,
            "tau": taus,
            "recall": flips_below[count_below(flip_values, taus)] / flips if flips else np.nan,
            "trigger_rate": below[count_below(taus[:-1], taus)] / total,
        }
    )


def calibrate_unit(steps: pd.DataFrame, unit: str, safety: SafetyRule, confidence: float) -> dict:
    margins, flipped, w = _unit_arrays(steps, unit)
    tau_min = minimal_tau(margins, flipped)
    flips, total = int(w[flipped].sum()), int(w.sum())
    result = {"unit": unit, "flips": flips, "steps": total, "oracle_trigger_rate": flips / total}
    if tau_min is None:
        return {
            **result,
            "tau_min": None,
            "tau": None,
            "trigger_rate_min": None,
            "trigger_rate": None,
            "trigger_over_oracle": None,
        }
    tau = safety.apply(tau_min)
    at_min, at_tau = gate_figures(steps, unit, tau_min), gate_figures(steps, unit, tau)
    return {
        **result,
        "max_flip_margin": float(margins[flipped].max()),
        "tau_min": tau_min,
        "trigger_rate_min": at_min["trigger_rate"],
        "tau": tau,
        "trigger_rate": at_tau["trigger_rate"],
        "trigger_over_oracle": at_tau["trigger_rate"] / result["oracle_trigger_rate"],
    }


def bound_figures(flips: int, steps: int, confidence: float) -> dict:
    """What zero misses among `flips` calibration flips promises, per flip, per step, per sequence."""
    if flips == 0:
        # No flip seen: only the flip rate itself can be bounded.
        flip_rate_bound = 1.0 - (1.0 - confidence) ** (1.0 / steps)
        return {
            "confidence": confidence,
            "flips": 0,
            "miss_probability_bound": None,
            "flip_rate_bound": flip_rate_bound,
            "enough_flips": False,
            "verdict": f"no flips in {steps} steps: no threshold can be derived; "
            f"the flip rate is below {flip_rate_bound:.3g} at {confidence:.0%} confidence",
        }
    p_miss = miss_bound(flips, 0, confidence)
    flip_rate = flips / steps
    per_step = flip_rate * p_miss
    per_sequence = 1.0 - (1.0 - per_step) ** 1000
    enough = flips >= FLIPS_FOR_ONE_PERCENT
    verdict = (
        f"with {flips} flips and none missed, at most {p_miss:.2%} of future flips land above TAU "
        f"({confidence:.0%} confidence)"
    )
    if not enough:
        verdict += (
            f"; too few flips to promise better than that: about {FLIPS_FOR_ONE_PERCENT} are needed for a 1% bound"
        )
    return {
        "confidence": confidence,
        "flips": flips,
        "miss_probability_bound": p_miss,
        "missed_flips_per_step_bound": per_step,
        "sequence_miss_probability_per_1000_tokens": per_sequence,
        "enough_flips": enough,
        "verdict": verdict,
    }


def transfer_table(tables: dict[str, pd.DataFrame], unit: str, tau: float, confidence: float) -> pd.DataFrame:
    """Recall and trigger rate of a calibrated TAU on other datasets' steps."""
    rows = []
    for name, steps in tables.items():
        figures = gate_figures(steps, unit, tau)
        figures["miss_probability_bound"] = miss_bound(figures["flips"], figures["missed"], confidence)
        rows.append({"dataset": name, **figures})
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class CalibrateOptions:
    safety: SafetyRule
    unit: str = "logit"
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise UserError(f"--unit {self.unit!r}: choose one of {', '.join(UNITS)}")
        if not 0.5 <= self.confidence < 1:
            raise UserError(f"--confidence {self.confidence}: use a level in [0.5, 1), e.g. 0.95")


def read_calibration_threshold(path: Path, model: str) -> tuple[float, str]:
    """(TAU, unit) from a calibration.json, refused when it was made for another model."""
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--threshold-from {path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(document, dict) or document.get("kind") != "mgbench.calibration":
        raise UserError(f"--threshold-from {path}: not a calibration.json written by `mgbench calibrate`")
    if document.get("model") != model:
        raise UserError(
            f"--threshold-from {path}: calibrated for model {document.get('model')!r}, not {model!r}; "
            "calibrate this model first"
        )
    if document.get("tau") is None:
        raise UserError(f"--threshold-from {path}: the calibration saw no flips and holds no threshold")
    return float(document["tau"]), document.get("unit", "logit")

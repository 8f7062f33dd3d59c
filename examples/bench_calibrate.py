"""Time `mgbench calibrate`'s analysis on 10 million synthetic step rows (no model involved).

Margins sit on a 1/64 grid like BF16 logit differences; about 1% of steps flip, all at small
margins. Prints the time of the full calibration (both units, curves, bound) and its TAU.

    .venv/bin/python examples/bench_calibrate.py --rows 10000000
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

from mgbench.analysis.calibration import CalibrateOptions, SafetyRule
from mgbench.pipelines.calibrate import calibrate


def synthetic_steps(rows: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    margin = np.round(rng.exponential(2.0, rows) * 64) / 64
    flipped = (margin <= 0.25) & (rng.random(rows) < 0.08)
    top1 = rng.uniform(10, 30, rows)
    ulp = 2.0 ** (np.floor(np.log2(top1)) - 7)
    return pd.DataFrame(
        {
            "model": "synthetic",
            "dataset": "synthetic",
            "batch_size": np.full(rows, 8, np.int32),
            "flipped": flipped,
            "margin": margin.astype(np.float32),
            "margin_ulp": (margin / ulp).astype(np.float32),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    args = parser.parse_args()
    steps = synthetic_steps(args.rows)
    start = time.perf_counter()
    document, curves = calibrate(steps, {}, CalibrateOptions(SafetyRule.parse("x1.5")), ["synthetic"])
    seconds = time.perf_counter() - start
    print(f"rows: {args.rows:,}  flips: {document['flips']:,}  curve points: {len(curves):,}")
    print(
        f"TAU (logit, x1.5): {document['tau']:.4g}  trigger rate: {document['trigger_rate']:.2%}  "
        f"oracle: {document['oracle_trigger_rate']:.2%}"
    )
    print(f"calibration time: {seconds:.2f} s (target: under 10 s)")


if __name__ == "__main__":
    main()

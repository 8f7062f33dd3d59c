"""`mgbench calibrate RUN --unit logit` on synthetic steps tables of fleet scale: wall time and peak memory.

Writes a run directory per size (this version's full steps schema, written in chunks; margins on a
1/8-logit grid, flips only at margins <= 0.25), runs the real command on it under /usr/bin/time,
and checks the TAU it wrote against an independent count over the generator's own arrays.

    .venv/bin/python examples/bench_tables.py --rows 10000000,50000000,100000000 --dir /tmp/mgbench-tables
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mgbench.runs.schema import STEPS_SCHEMA

CHUNK = 5_000_000


def chunk_arrays(rows: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    margin = (np.round(rng.exponential(1.0, rows) * 8) / 8).astype(np.float32)
    flipped = (margin <= 0.25) & (rng.random(rows) < 0.05)
    return {"margin": margin, "flipped": flipped}


def write_run(path: Path, rows: int) -> tuple[float, int, int]:
    """(largest flip margin, steps below the expected TAU, flips), counted from the generated arrays."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    worst, flips, margins_seen = -1.0, 0, {}
    with pq.ParquetWriter(path / "steps.parquet", STEPS_SCHEMA) as writer:
        for index, start in enumerate(range(0, rows, CHUNK)):
            n = min(CHUNK, rows - start)
            arrays = chunk_arrays(n, index)
            margin, flipped = arrays["margin"], arrays["flipped"]
            worst = max(worst, float(margin[flipped].max()) if flipped.any() else -1.0)
            flips += int(flipped.sum())
            values, counts = np.unique(margin, return_counts=True)
            for value, count in zip(values.tolist(), counts.tolist()):
                margins_seen[value] = margins_seen.get(value, 0) + count
            zeros = np.zeros(n, np.float32)
            columns = {
                "model": pa.array(["synthetic"] * n, pa.string()),
                "dataset": pa.array(["synthetic"] * n, pa.string()),
                "request_id": np.arange(start, start + n, dtype=np.int64) // 64,
                "batch_id": (np.arange(start, start + n) // 512).astype(np.int32),
                "row": (np.arange(n) % 8).astype(np.int32),
                "batch_size": np.full(n, 8, np.int32),
                "pad_len": np.zeros(n, np.int32),
                "method": pa.array(["teacher-forced"] * n, pa.string()),
                "step": (np.arange(n) % 64).astype(np.int32),
                "solo_token": np.ones(n, np.int64),
                "batched_token": np.ones(n, np.int64),
                "flipped": flipped,
                "margin": margin,
                "margin_ulp": margin * np.float32(8),
                "solo_margin": margin,
                "max_abs_logit_diff": zeros,
                "logprob_drift": zeros,
                "kv_delta_mean": zeros,
                "kv_delta_max": zeros,
            }
            writer.write_table(pa.table(columns, schema=STEPS_SCHEMA))
    (path / "manifest.json").write_text(json.dumps({"command": "flips", "synthetic": True}))
    (path / "summary.json").write_text(json.dumps({"synthetic": True}))
    tau = min(v for v in margins_seen if v > worst)  # the next observed margin above the largest flip margin
    below = sum(c for v, c in margins_seen.items() if v < tau)
    return tau, below, flips


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="10000000,50000000,100000000")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mgbench-tables"))
    args = parser.parse_args()
    mgbench = Path(sys.executable).with_name("mgbench")
    print(f"{'rows':>12} {'parquet MB':>10} {'calibrate wall s':>16} {'peak MB':>8}  TAU (expected)  trigger rate")
    for rows in [int(r) for r in args.rows.split(",")]:
        run = args.dir / f"steps-{rows}"
        started = time.perf_counter()
        tau, below, flips = write_run(run, rows)
        written = time.perf_counter() - started
        out = args.dir / f"calibrate-{rows}"
        shutil.rmtree(out, ignore_errors=True)
        timed = subprocess.run(
            [
                "/usr/bin/time",
                "-v",
                str(mgbench),
                "calibrate",
                str(run),
                "--unit",
                "logit",
                "--safety",
                "x1",
                "--json",
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
        )
        if timed.returncode != 0:
            raise SystemExit(timed.stderr[-2000:])
        document = json.loads(timed.stdout)
        wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", timed.stderr).group(1)
        seconds = sum(float(part) * 60**i for i, part in enumerate(reversed(wall.split(":"))))
        peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", timed.stderr).group(1)) / 1024
        agree = document["tau_min"] == tau and document["flips"] == flips
        rate = document["per_unit"]["logit"]["trigger_rate_min"]
        agree &= rate == below / rows
        size = (run / "steps.parquet").stat().st_size / 1e6
        print(
            f"{rows:>12,} {size:>10.0f} {seconds:>16.1f} {peak:>8.0f}  {document['tau_min']} ({tau})"
            f"  {rate:.4%}  {'agrees' if agree else 'DIFFERS'} (written in {written:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()

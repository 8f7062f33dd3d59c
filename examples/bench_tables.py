"""Commands that read steps tables, on synthetic run directories of fleet scale: wall time and peak memory.

Writes a flips run directory per size (this version's full steps schema, written in chunks: 64
steps per sequence, 8 sequences per batch; margins on a 1/8-logit grid, flips only at margins
<= 0.25; K/V levels random), then times each reader in its own process under /usr/bin/time:

- calibrate: `mgbench calibrate RUN --unit logit`, its TAU checked against an independent count
  over the generator's own arrays;
- flips summary: what a sharded run's finish computes from the shards' files (steps, flips, the
  largest flip margin checked against the generator); it writes the run's summary.json;
- report: `mgbench report RUN` (the margins plot from streamed counts);
- gate: the baseline loaded and tested against itself as `--baseline` does (every step paired,
  p = 1).

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

from mgbench.runs.schema import SEQUENCES_SCHEMA, STEPS_SCHEMA

CHUNK = 5_000_000


STEPS_PER_SEQUENCE, ROWS_PER_BATCH = 64, 8

SUMMARY = """
import json, sys
from pathlib import Path
import pandas as pd
from mgbench.analysis import figures
from mgbench.analysis.step_aggregates import aggregate
from mgbench.runs import rundir, schema
run = Path(sys.argv[1])
sequences = rundir.read_run_table(run, "sequences", schema.SEQUENCES_SCHEMA).to_pandas()
summary = figures.summarize_flips(aggregate(rundir.table_files(run, "steps")), sequences)
summary.update(solo_tokens_per_s=None, batched_tokens_per_s=None, engine="synthetic")
(run / "summary.json").write_text(json.dumps(summary))
print(json.dumps(summary))
"""

GATE = """
import json, sys
from pathlib import Path
from mgbench.analysis import gate
baseline = gate.load_baseline(Path(sys.argv[1]), "flips")
tested = gate.regression(baseline.steps, baseline.sequences, baseline.steps, baseline.sequences, alpha=0.01)
print(json.dumps(tested["tests"]["flip_rate"]))
"""


def chunk_arrays(rows: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    margin = (np.round(rng.exponential(1.0, rows) * 8) / 8).astype(np.float32)
    flipped = (margin <= 0.25) & (rng.random(rows) < 0.05)
    return {"margin": margin, "flipped": flipped, "kv": rng.random(rows, np.float32) * np.float32(1e-3)}


def write_run(path: Path, rows: int) -> dict:
    """The run directory, and what an independent count over the generated arrays says: TAU (the
    next observed margin above the largest flip margin), steps below it, flips, the largest flip margin."""
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
            index_ = np.arange(start, start + n, dtype=np.int64)
            sequence = index_ // STEPS_PER_SEQUENCE
            columns = {
                "model": pa.array(["synthetic"] * n, pa.string()),
                "dataset": pa.array(["synthetic"] * n, pa.string()),
                "request_id": sequence,
                "batch_id": (sequence // ROWS_PER_BATCH).astype(np.int32),
                "row": (sequence % ROWS_PER_BATCH).astype(np.int32),
                "batch_size": np.full(n, ROWS_PER_BATCH, np.int32),
                "pad_len": np.zeros(n, np.int32),
                "method": pa.array(["teacher-forced"] * n, pa.string()),
                "step": (index_ % STEPS_PER_SEQUENCE).astype(np.int32),
                "solo_token": np.ones(n, np.int64),
                "batched_token": np.ones(n, np.int64),
                "flipped": flipped,
                "margin": margin,
                "margin_ulp": margin * np.float32(8),
                "solo_margin": margin,
                "max_abs_logit_diff": zeros,
                "logprob_drift": zeros,
                "kv_delta_mean": arrays["kv"],
                "kv_delta_max": arrays["kv"],
            }
            writer.write_table(pa.table(columns, schema=STEPS_SCHEMA))
    pq.write_table(SEQUENCES_SCHEMA.empty_table(), path / "sequences.parquet")  # the readers' sequences part
    (path / "manifest.json").write_text(json.dumps({"command": "flips", "synthetic": True, "options": {}}))
    (path / "summary.json").write_text(json.dumps({"synthetic": True}))
    tau = min(v for v in margins_seen if v > worst)
    below = sum(c for v, c in margins_seen.items() if v < tau)
    return {"tau": tau, "below": below, "flips": flips, "worst": worst}


def timed(command: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak resident MB, stdout) of one command under /usr/bin/time -v."""
    done = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:3])}: {done.stderr[-2000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", done.stderr).group(1)
    seconds = sum(float(part) * 60**i for i, part in enumerate(reversed(wall.split(":"))))
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1)) / 1024
    return seconds, peak, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="10000000,50000000,100000000")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mgbench-tables"))
    args = parser.parse_args()
    mgbench, python = str(Path(sys.executable).with_name("mgbench")), sys.executable
    print(f"{'rows':>12} {'MB':>5}  {'reader':<14} {'wall s':>7} {'peak MB':>8}  checked against the generator")
    for rows in [int(r) for r in args.rows.split(",")]:
        run = args.dir / f"steps-{rows}"
        started = time.perf_counter()
        expected = write_run(run, rows)
        written = time.perf_counter() - started
        size = (run / "steps.parquet").stat().st_size / 1e6
        out = args.dir / f"calibrate-{rows}"
        shutil.rmtree(out, ignore_errors=True)
        calibrate = [mgbench, "calibrate", str(run), "--unit", "logit", "--safety", "x1", "--json", "--out", str(out)]
        seconds, peak, stdout = timed(calibrate)
        document = json.loads(stdout)
        rate = document["per_unit"]["logit"]["trigger_rate_min"]
        agree = document["tau_min"] == expected["tau"] and document["flips"] == expected["flips"]
        agree &= rate == expected["below"] / rows
        lines = [
            ("calibrate", seconds, peak, f"TAU {document['tau_min']} ({expected['tau']}), triggers {rate:.4%}", agree)
        ]
        seconds, peak, stdout = timed([python, "-c", SUMMARY, str(run)])
        summary = json.loads(stdout)
        agree = (summary["steps"], summary["flips"]) == (rows, expected["flips"])
        agree &= summary["margin_logit_quantiles_flip"]["q100"] == expected["worst"]
        note = f"{summary['flips']:,} flips ({expected['flips']:,}), max flip margin {expected['worst']}"
        lines.append(("flips summary", seconds, peak, note, agree))
        report = args.dir / f"report-{rows}"
        shutil.rmtree(report, ignore_errors=True)
        seconds, peak, _ = timed([mgbench, "report", str(run), "--out", str(report)])
        agree = (report / "0-margins.png").is_file() and f"| {rows} |" in (report / "report.md").read_text()
        lines.append(("report", seconds, peak, "report.md and margins plot", agree))
        seconds, peak, stdout = timed([python, "-c", GATE, str(run)])
        tested = json.loads(stdout)
        agree = tested["pairs"] == rows and tested["p_value"] == 1.0 and tested["newly_bad"] == 0
        lines.append(("gate", seconds, peak, f"{tested['pairs']:,} pairs, p = {tested['p_value']}", agree))
        for reader, seconds, peak, note, agree in lines:
            print(
                f"{rows:>12,} {size:>5.0f}  {reader:<14} {seconds:>7.1f} {peak:>8.0f}  {note}: "
                f"{'agrees' if agree else 'DIFFERS'}",
                flush=True,
            )
        print(f"{'':>12} (written in {written:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

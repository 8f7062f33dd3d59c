"""The streamed aggregates of a steps table (flips summary, baseline gate) against the whole table
in pandas (tests/reference.py), bitwise: on synthetic tables with known answers and awkward
shapes (NaN and null margins, even and odd counts, no flips, several files, an older schema), and
on a real run of the default model recorded by an earlier release."""

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import reference

from mgbench.analysis import figures, gate, step_aggregates
from mgbench.analysis.step_aggregates import ExactMedian, aggregate, key_values, order_keys
from mgbench.errors import UserError
from mgbench.runs import rundir, scan
from mgbench.runs.schema import STEPS_SCHEMA

V1_RUN = Path(__file__).parent / "fixtures" / "v1-flips-run"
SEQUENCES = pd.DataFrame(
    {
        "batch_size": pd.Series([], dtype="int32"),
        "identical": pd.Series([], dtype=bool),
        "solo_ids": [],
        "batched_ids": [],
    }
)


def synthetic_steps(sequences: int, steps: int, seed: int, flip_share: float = 0.05) -> pa.Table:
    """`sequences` rows of `steps` steps at batch sizes 2 and 4; margins on a 1/8 grid with some
    NaN and null; K/V levels with repeats; flips only at low margins."""
    rng = np.random.default_rng(seed)
    n = sequences * steps
    seq = np.repeat(np.arange(sequences), steps)
    margin = (np.round(rng.exponential(1.0, n) * 8) / 8).astype(np.float32)
    flipped = (margin <= 0.5) & (rng.random(n) < flip_share * 4)
    margin[rng.random(n) < 0.01] = np.nan
    kv = np.round(rng.random(n) * 50).astype(np.float32) / np.float32(7)
    drift = (rng.random(n) * (rng.random(n) < 0.3)).astype(np.float32)
    nulls = rng.random(n) < 0.02
    columns = {
        "model": pa.array(["m"] * n),
        "dataset": pa.array(["d"] * n),
        "request_id": (seq // 2).astype(np.int64),
        "batch_id": (seq // 4).astype(np.int32),
        "row": (seq % 4).astype(np.int32),
        "batch_size": np.where(seq % 2, 4, 2).astype(np.int32),
        "pad_len": np.zeros(n, np.int32),
        "axis": pa.array(np.where(seq % 5 == 0, "prefix-cache", "batch")),  # two axes: grouped apart
        "method": pa.array(["teacher-forced"] * n),
        "step": np.tile(np.arange(steps), sequences).astype(np.int32),
        "solo_token": np.ones(n, np.int64),
        "batched_token": np.ones(n, np.int64),
        "flipped": flipped,
        "margin": margin,
        "margin_ulp": pa.array(margin * 8, mask=nulls),
        "solo_margin": margin,
        "max_abs_logit_diff": np.zeros(n, np.float32),
        "logprob_drift": pa.array(drift, mask=nulls),
        "kv_delta_mean": pa.array(kv, mask=rng.random(n) < 0.02),
        "kv_delta_max": kv,
    }
    return pa.table(columns, schema=STEPS_SCHEMA)


def streamed_step_figures(source) -> dict:
    """The steps-table part of the flips summary, as the pipeline computes it (streamed)."""
    aggregates = aggregate(source)
    summary = figures.summarize_flips(aggregates, SEQUENCES)
    out = {k: summary[k] for k in reference.SUMMARY_KEYS}
    per = step_aggregates.steps_by_batch_size(aggregates.margin_counts)
    out["steps_by_batch_size"] = {(a, int(b)): (int(r.steps), int(r.flips)) for (a, b), r in per.iterrows()}
    return out


def small_batches(monkeypatch, rows: int = 997) -> None:
    """Many record batches and merges, so a table of thousands of rows exercises the streaming."""
    monkeypatch.setattr(scan, "BATCH_ROWS", rows)
    monkeypatch.setattr(step_aggregates, "MERGE_EVERY", 3)


@pytest.mark.parametrize("sequences,steps,seed", [(40, 50, 0), (41, 49, 1), (3, 7, 2), (1, 1, 3)])
def test_streamed_summary_equals_the_whole_table_in_pandas(sequences, steps, seed, monkeypatch):
    small_batches(monkeypatch)
    table = synthetic_steps(sequences, steps, seed)
    assert streamed_step_figures(table) == reference.step_figures(table.to_pandas())


def test_streamed_summary_without_flips_and_without_steps(monkeypatch):
    small_batches(monkeypatch)
    table = synthetic_steps(20, 30, 4, flip_share=0.0)
    streamed = streamed_step_figures(table)
    assert streamed == reference.step_figures(table.to_pandas())
    assert streamed["flips"] == 0 and streamed["margin_logit_quantiles_flip"]["q50"] is None
    empty = streamed_step_figures(STEPS_SCHEMA.empty_table())
    assert empty["steps"] == 0 and empty["kv_delta_overall_median"] is None
    assert [r["flips"] for r in empty["kv_delta_before_flips"]] == [0] * 9


def test_parts_on_disk_stream_as_the_table_in_memory(tmp_path, monkeypatch):
    small_batches(monkeypatch)
    table = synthetic_steps(30, 40, 5)
    files = []
    for index, start in enumerate((0, 500, 1100)):
        files.append(tmp_path / f"part-{index}.parquet")
        pq.write_table(table.slice(start, {0: 500, 1: 600, 2: None}[index]), files[-1])
    assert streamed_step_figures(files) == streamed_step_figures(table) == reference.step_figures(table.to_pandas())


def test_exact_median_matches_pandas_on_awkward_values():
    rng = np.random.default_rng(7)
    cases = [
        rng.standard_normal(1001).astype(np.float32),
        np.float32([3.0] * 50 + [1.0] * 50),  # two middle values in different bins
        np.float32([-1.5, np.nan, 2.0, -0.0, 0.0, np.inf, -np.inf, 7e-42]),
        np.repeat(np.float32(0.25), 10),
        np.float32([np.nan, np.nan]),
    ]
    for values in cases:
        keys = order_keys(values[~np.isnan(values)])
        assert (key_values(keys) == values[~np.isnan(values)]).all() and (np.diff(np.sort(keys)) >= 0).all()
        median = ExactMedian()
        for half in np.array_split(values, 3):
            median.first_pass(half)
        for half in np.array_split(values, 2):
            median.second_pass(half)
        expected = pd.Series(values).median()
        assert np.isnan(expected) if np.isnan(median.value()) else median.value() == float(expected)


def streamed_flip_test(current: pa.Table, baseline: pa.Table) -> dict:
    """As a flips run with --baseline computes it: the run's full aggregates, the baseline's pairs only."""
    return gate.paired_flip_test(aggregate(current), aggregate(baseline, figures=False))


def test_streamed_paired_test_equals_the_join(monkeypatch):
    small_batches(monkeypatch)
    current, baseline = synthetic_steps(40, 30, 8), synthetic_steps(40, 30, 9)
    pandas_current, pandas_baseline = current.to_pandas(), baseline.to_pandas()
    assert streamed_flip_test(current, baseline) == reference.paired_test(pandas_current, pandas_baseline)
    # Shorter baseline sequences and a request missing: pairs are the steps both runs have.
    kept = pa.compute.and_(pa.compute.less(baseline["step"], 17), pa.compute.not_equal(baseline["request_id"], 3))
    shorter = baseline.filter(kept)
    streamed = streamed_flip_test(current, shorter)
    assert streamed == reference.paired_test(pandas_current, shorter.to_pandas())
    assert streamed["unpaired"] > 0
    same = streamed_flip_test(current, current)  # a run against itself: no discordant pair, p = 1
    assert (same["newly_bad"], same["newly_good"], same["p_value"], same["pairs"]) == (0, 0, 1.0, current.num_rows)


def test_the_paired_test_refuses_steps_it_cannot_pair():
    table = synthetic_steps(4, 5, 10)
    doubled = pa.concat_tables([table, table.filter(pa.compute.equal(table["request_id"], 0))])
    with pytest.raises(UserError, match="request 0 at batch size 2 are not one contiguous run"):
        streamed_flip_test(doubled, table)


def test_a_real_run_streams_as_pandas_reads_it():
    """The default model's run recorded by an earlier release (schema 1, upgraded batch by batch)."""
    files = rundir.table_files(V1_RUN, "steps")
    whole = reference.whole_steps(V1_RUN)
    assert streamed_step_figures(files) == reference.step_figures(whole)
    baseline = gate.load_baseline(V1_RUN, "flips")
    assert gate.paired_flip_test(baseline.steps, baseline.steps) == reference.paired_test(whole, whole)

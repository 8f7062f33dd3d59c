"""Calibration on synthetic step tables with known answers, edge cases, and the CLI on run dirs."""

import json

import numpy as np
import pandas as pd
import pytest
import reference
from typer.testing import CliRunner

from mgbench.analysis import calibration
from mgbench.analysis.calibration import CalibrateOptions
from mgbench.cli import app
from mgbench.errors import UserError
from mgbench.pipelines.calibrate import calibrate
from mgbench.runs import rundir, schema

runner = CliRunner()


def steps_frame(margins, flipped, ulps=None, model="m", dataset="d"):
    n = len(margins)
    return pd.DataFrame(
        {
            "model": model,
            "dataset": dataset,
            "request_id": np.arange(n),
            "batch_id": 0,
            "row": 0,
            "batch_size": 8,
            "pad_len": 3,
            "axis": "batch",
            "method": "teacher-forced",
            "step": np.arange(n),
            "solo_token": 1,
            "batched_token": 1,
            "flipped": np.array(flipped, bool),
            "margin": np.array(margins, np.float32),
            "margin_ulp": np.array(ulps if ulps is not None else margins, np.float32) * (1 if ulps is not None else 8),
            "solo_margin": np.array(margins, np.float32),
            "max_abs_logit_diff": 0.0,
            "logprob_drift": 0.0,
            "kv_delta_mean": 0.0,
            "kv_delta_max": 0.0,
        }
    )


MARGINS = [0.0625, 0.125, 0.25, 0.25, 0.5, 1.0, 2.0, 4.0]
FLIPS = [False, True, True, False, False, False, False, False]


def test_minimal_tau_is_next_observed_margin_above_the_worst_flip():
    margins, flipped = np.array(MARGINS), np.array(FLIPS)
    assert calibration.minimal_tau(margins, flipped) == 0.5
    figures = calibration.gate_figures(steps_frame(MARGINS, FLIPS), "logit", 0.5)
    # strict: the non-flip step at exactly 0.25 is verified too
    assert figures["trigger_rate"] == pytest.approx(4 / 8) and figures["recall"] == 1.0
    assert calibration.gate_figures(steps_frame(MARGINS, FLIPS), "logit", 0.25)["recall"] == 0.5


def test_flips_at_exact_ties_still_give_a_threshold():
    margins, flipped = np.array([0.0, 0.0, 0.0078125, 1.0]), np.array([True, False, False, False])
    assert calibration.minimal_tau(margins, flipped) == 0.0078125
    only = np.array([0.0]), np.array([True])
    assert 0 < calibration.minimal_tau(*only) < 1e-30  # no step above: the next float


def test_safety_rules():
    assert calibration.SafetyRule.parse("x1.5").apply(0.5) == 0.75
    assert calibration.SafetyRule.parse("+0.25").apply(0.5) == 0.75
    for bad in ("1.5", "x0.5", "+-1", "xnan", ""):
        with pytest.raises(UserError):
            calibration.SafetyRule.parse(bad)


def test_calibrate_unit_figures():
    figures = calibration.calibrate_unit(steps_frame(MARGINS, FLIPS), "logit", calibration.SafetyRule("x", 2.0), 0.95)
    assert figures["tau_min"] == 0.5 and figures["tau"] == 1.0
    assert figures["trigger_rate_min"] == pytest.approx(0.5) and figures["trigger_rate"] == pytest.approx(5 / 8)
    assert figures["oracle_trigger_rate"] == pytest.approx(2 / 8)
    assert figures["trigger_over_oracle"] == pytest.approx(2.5)


def test_clopper_pearson_bounds():
    assert calibration.miss_bound(32, 0, 0.95) == pytest.approx(1 - 0.05 ** (1 / 32))
    assert calibration.miss_bound(32, 0, 0.95) == pytest.approx(0.0894, abs=1e-4)
    assert calibration.miss_bound(299, 0, 0.95) < 0.01 < calibration.miss_bound(298, 0, 0.95) + 0.0001
    assert calibration.miss_bound(10, 1, 0.95) == pytest.approx(0.3942, abs=1e-4)
    assert calibration.miss_bound(0, 0, 0.95) == 1.0


def test_bound_verdicts():
    few = calibration.bound_figures(32, 2000, 0.95)
    assert not few["enough_flips"] and "too few flips" in few["verdict"]
    assert few["missed_flips_per_step_bound"] == pytest.approx(32 / 2000 * few["miss_probability_bound"])
    none = calibration.bound_figures(0, 1000, 0.95)
    assert none["miss_probability_bound"] is None and none["flip_rate_bound"] == pytest.approx(1 - 0.05 ** (1 / 1000))
    assert "no threshold" in none["verdict"]


def test_curve_is_monotone_and_reaches_full_recall_at_tau_min():
    curve = calibration.curve(steps_frame(MARGINS, FLIPS), "logit")
    assert (np.diff(curve["recall"]) >= 0).all() and (np.diff(curve["trigger_rate"]) >= 0).all()
    at = curve.set_index("tau").loc[0.5]
    assert at["recall"] == 1.0 and at["trigger_rate"] == pytest.approx(0.5)
    assert curve["trigger_rate"].iloc[-1] == 1.0


def test_transfer_shows_misses():
    other = steps_frame([0.1, 0.7, 2.0, 3.0], [False, True, False, False], dataset="other")
    document, _ = calibrate(
        steps_frame(MARGINS, FLIPS), {"other": other}, CalibrateOptions(calibration.SafetyRule("x", 1.0)), ["s"]
    )
    row = next(r for r in document["transfer"] if r["unit"] == "logit")
    assert row["recall"] == 0.0 and row["missed"] == 1 and row["trigger_rate"] == pytest.approx(0.25)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda f: f.assign(margin=np.where(f.index == 2, np.nan, f["margin"])), "NaN"),
        (lambda f: f.drop(columns=["margin_ulp"]), "lacks columns"),
        (lambda f: f.assign(margin=-f["margin"]), "negative"),
    ],
)
def test_invalid_tables(mutate, message):
    with pytest.raises(UserError, match=message):
        calibration.validate_steps(mutate(steps_frame(MARGINS, FLIPS)), "t")


def test_mixed_models_are_refused():
    with pytest.raises(UserError, match="mix models"):
        calibrate(
            steps_frame(MARGINS, FLIPS),
            {"o": steps_frame(MARGINS, FLIPS, model="other")},
            CalibrateOptions(calibration.SafetyRule("x", 1.5)),
            [],
        )


def write_run(path, frame):
    table = rundir.pa.Table.from_pandas(
        frame[schema.STEPS_SCHEMA.names], schema=schema.STEPS_SCHEMA, preserve_index=False
    )
    rundir.publish_run(path, {"steps": table}, {})
    return path


def test_cli_on_run_dirs_writes_calibration(tmp_path):
    run = write_run(tmp_path / "run", steps_frame(MARGINS, FLIPS))
    other = write_run(tmp_path / "other", steps_frame([0.1, 0.7, 2.0, 3.0], [False, True, False, False]))
    out = tmp_path / "cal"
    result = runner.invoke(app, ["calibrate", str(run), "--transfer", str(other), "--safety", "x2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    document = json.loads((out / "calibration.json").read_text())
    assert document["tau"] == 1.0 and document["unit"] == "logit" and document["model"] == "m"
    assert document["trigger_rate"] == pytest.approx(5 / 8)
    assert {p.name for p in out.iterdir()} >= {"calibration.json", "curve.parquet", "curve.png", "margins.png"}
    assert "transfer" in result.output
    curve = pd.read_parquet(out / "curve.parquet")
    assert set(curve["unit"]) == {"logit", "ulp"}


def test_cli_no_flips_exits_1_only_when_required(tmp_path):
    run = write_run(tmp_path / "run", steps_frame(MARGINS, [False] * len(MARGINS)))
    ok = runner.invoke(app, ["calibrate", str(run), "--out", str(tmp_path / "a")])
    assert ok.exit_code == 0 and "no threshold" in ok.output
    strict = runner.invoke(app, ["calibrate", str(run), "--require-flips", "--out", str(tmp_path / "b")])
    assert strict.exit_code == 1


def test_cli_bad_tables_exit_2(tmp_path):
    nan = steps_frame(MARGINS, FLIPS)
    nan.loc[1, "margin"] = np.nan
    run = write_run(tmp_path / "nan", nan)
    result = runner.invoke(app, ["calibrate", str(run), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "NaN" in result.stderr
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    pd.DataFrame({"a": [1]}).to_parquet(foreign / "steps.parquet")
    result = runner.invoke(app, ["calibrate", str(foreign), "--out", str(tmp_path / "o2")])
    assert result.exit_code == 2 and "not written by mgbench" in result.stderr
    result = runner.invoke(app, ["calibrate", str(tmp_path / "nan"), "--unit", "bits", "--out", str(tmp_path / "o3")])
    assert result.exit_code == 2 and "--unit" in result.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "o3").exists()


@pytest.mark.slow
@pytest.mark.full  # `python -m mgbench` twice on the default model, about 30 s; the traces' reuse is
# checked every run by the planted test below, in process
def test_calibrate_records_real_traces_then_reuses_them(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "MGBENCH_TRACES": str(tmp_path / "traces")}
    command = [
        sys.executable,
        "-m",
        "mgbench",
        "calibrate",
        "--dataset",
        "math500",
        "--limit",
        "4",
        "--batch-size",
        "4",
        "--max-new-tokens",
        "12",
        "--transfer",
        "gsm8k",  # shorter prompts than humaneval's: the transfer mechanism is the same
    ]
    first = subprocess.run(
        [*command, "--out", str(tmp_path / "a")], capture_output=True, text=True, env=env, timeout=900
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert "math500: recorded traces" in first.stderr and "gsm8k: recorded traces" in first.stderr
    document = json.loads((tmp_path / "a" / "calibration.json").read_text())
    assert document["model"] == "smollm2-135m" and document["datasets"] == ["math500"]
    assert document["steps"] > 0 and document["batch_sizes"] == [4]
    # What this machine does is reported, and asserted only as agreement with the recorded traces.
    traces = [pd.read_parquet(path) for path in (tmp_path / "traces").rglob("steps.parquet")]
    math500 = [t for t in traces if (t["dataset"] == "math500").all()]
    assert document["flips"] == sum(int(t["flipped"].sum()) for t in math500)
    print(f"\n[this machine] default model, math500 4x12 tokens at batch 4: {document['flips']} flips")
    second = subprocess.run(
        [*command, "--out", str(tmp_path / "b")], capture_output=True, text=True, env=env, timeout=900
    )
    assert second.returncode == 0 and "math500: reused cached traces" in second.stderr
    assert json.loads((tmp_path / "b" / "calibration.json").read_text())["tau"] == document["tau"]


@pytest.mark.slow
def test_calibrate_on_planted_flips_puts_tau_above_every_flip(tmp_path, monkeypatch):
    """Positive control on the real default model and datasets: a planted head moves the argmax to
    the runner-up wherever the batched margin is below 0.5 logit, so flips are certain and sit at
    known margins; TAU must clear every one, and the transfer datasets are scored."""
    from helpers import plant_every_loaded_model

    plant_every_loaded_model(monkeypatch, delta=0.5)
    monkeypatch.setenv("MGBENCH_TRACES", str(tmp_path / "traces"))
    # 3 requests x 8 steps per dataset: 18% of the default model's math500 steps have a margin
    # below 0.5 (reports/example/runs/flips-plain), and 15 of its 16 requests one in their first 8.
    audit = ["calibrate", "--dataset", "math500", "--limit", "3", "--batch-size", "3", "--max-new-tokens", "8"]
    audit += ["--transfer", "gsm8k"]
    result = runner.invoke(app, [*audit, "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "a" / "calibration.json").read_text())
    assert document["flips"] > 0
    assert document["per_unit"]["logit"]["max_flip_margin"] < 0.5
    assert document["tau"] > document["per_unit"]["logit"]["max_flip_margin"]
    assert [r["dataset"] for r in document["transfer"]] == ["gsm8k", "gsm8k"]
    again = runner.invoke(app, [*audit, "--out", str(tmp_path / "b")])  # the same audit: its traces are reused
    assert again.exit_code == 0 and "math500: reused cached traces" in again.stderr, again.output
    assert json.loads((tmp_path / "b" / "calibration.json").read_text())["tau"] == document["tau"]


def sorted_counts(counts):
    return counts.sort_values(list(calibration.REQUIRED_COLUMNS)).reset_index(drop=True)


def grid_steps(rows: int, seed: int = 3) -> pd.DataFrame:
    """A known answer: margins on a 1/8 grid, flips only at margins <= 0.25 (some at exactly 0.25),
    two datasets and two batch sizes."""
    rng = np.random.default_rng(seed)
    margins = np.round(rng.exponential(1.0, rows) * 8) / 8
    flipped = (margins <= 0.25) & (rng.random(rows) < 0.3)
    flipped[np.flatnonzero(margins == 0.25)[:1]] = True
    frame = steps_frame(margins, flipped)
    frame["dataset"] = np.where(np.arange(rows) % 2 == 0, "a", "b")
    frame["batch_size"] = np.where(np.arange(rows) % 3 == 0, 16, 8)
    return frame


def test_streamed_counts_equal_the_in_memory_table_and_give_the_known_tau(tmp_path, monkeypatch):
    import mgbench.runs.scan as scan

    monkeypatch.setattr(scan, "BATCH_ROWS", 1000)  # many record batches and merges on a small table
    monkeypatch.setattr(scan, "MERGE_EVERY", 3)
    frame = grid_steps(20_000)
    run = write_run(tmp_path / "run", frame)
    streamed = scan.margin_counts(run)
    in_memory = calibration.counts_of(reference.whole_steps(run))
    pd.testing.assert_frame_equal(sorted_counts(streamed), sorted_counts(in_memory), check_dtype=False)
    options = CalibrateOptions(calibration.SafetyRule("x", 1.0))
    from_stream, curve_stream = calibrate(streamed, {}, options, ["s"])
    from_table, curve_table = calibrate(reference.whole_steps(run), {}, options, ["s"])
    assert from_stream == from_table
    pd.testing.assert_frame_equal(curve_stream, curve_table)
    # Independent answer: the next grid value above the largest flip margin (0.25), and the share
    # of steps below it, from the raw arrays.
    assert from_stream["tau_min"] == 0.375 and from_stream["flips"] == int(frame["flipped"].sum())
    assert from_stream["per_unit"]["logit"]["trigger_rate_min"] == float((frame["margin"] < 0.375).mean())


def test_streamed_counts_of_a_real_old_run_equal_its_upgraded_table():
    from pathlib import Path

    import mgbench.runs.scan as scan

    run = Path(__file__).parent / "fixtures" / "v1-flips-run"
    streamed = scan.margin_counts(run)
    assert streamed.attrs["schema_version_read"] == "1"
    in_memory = calibration.counts_of(reference.whole_steps(run))
    pd.testing.assert_frame_equal(sorted_counts(streamed), sorted_counts(in_memory), check_dtype=False)

"""compare: ratio arithmetic on synthetic runs, the timing harness on a tiny model, and report
rendering from recorded run directories."""

import json
import struct

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from mgbench.analysis import figures
from mgbench.cli import app

runner = CliRunner()


def synthetic_runs():
    rows = []
    # repeat 0 and 1 (2 is an outlier for `none`): medians must ignore it
    for repeat, (none, always, margin) in enumerate([(10.0, 30.0, 14.0), (10.0, 34.0, 15.0), (20.0, 30.0, 14.0)]):
        for config, seconds, triggers in (
            ("none", none, 0),
            ("always/exact", always, 100),
            ("margin<0.5/exact", margin, 15),
        ):
            rows.append(
                {
                    "config": config,
                    "repeat": repeat,
                    "seconds": seconds,
                    "tokens": 200,
                    "sequences": 4,
                    "identical": 4 if config != "none" else 2,
                    "steps": 100,
                    "triggers": triggers,
                    "repairs": 1,
                }
            )
    return pd.DataFrame(rows)


def test_increment_and_reduction_arithmetic():
    assert figures.latency_increment(15.0, 10.0) == pytest.approx(0.5)
    assert figures.increment_reduction(2.0, 0.5) == pytest.approx(4.0)
    assert figures.increment_reduction(2.0, 0.0) is None and figures.increment_reduction(2.0, -0.1) is None


def test_compare_table_medians_and_increments():
    table = figures.compare_table(synthetic_runs()).set_index("config")
    assert table.loc["none", "seconds"] == 10.0  # median of 10, 10, 20
    # per-repeat increments of always: 2.0, 2.4, 0.5 -> median 2.0
    assert table.loc["always/exact", "increment"] == pytest.approx(2.0)
    assert table.loc["always/exact", "increment_min"] == pytest.approx(0.5)
    assert table.loc["margin<0.5/exact", "increment"] == pytest.approx(0.4)
    assert table.loc["none", "determinism"] == 0.5 and table.loc["always/exact", "trigger_rate"] == 1.0
    assert table.loc["always/exact", "tokens_per_s"] == pytest.approx(200 / 30.0)


def test_reductions_per_repeat():
    result = figures.reductions(synthetic_runs(), "exact")
    # repeat 0: 2.0/0.4 = 5; repeat 1: 2.4/0.5 = 4.8; repeat 2: margin faster than none -> not measurable
    assert result["per_repeat"][:2] == pytest.approx([5.0, 4.8]) and result["per_repeat"][2] is None
    assert result["median"] == pytest.approx(4.9) and result["min"] == pytest.approx(4.8)
    assert figures.reductions(synthetic_runs(), "column")["median"] is None


@pytest.fixture(scope="module")
def compare_run_dir(planted_compare_run):
    return planted_compare_run[0]


def test_compare_harness_excludes_warmup_and_reports_every_config(compare_run_dir):
    runs = pd.read_parquet(compare_run_dir / "compare.parquet")
    configs = [
        "none",
        "always/column",
        "always/exact",
        "margin<0.05/column",
        "margin<0.05/exact",
        "oracle/column",
        "oracle/exact",
        "fixed-order kernels",
        "none (start-aligned)",
        "window W=64/replay N=8",
        "window W=64/replay N=16",
        "window W=64/replay per row",
        "window W=32/replay N=8",
        "window W=32/replay N=16",
        "window W=32/replay per row",
        "margin<0.05/replay N=8",
        "margin<0.05/replay N=8 (waits)",
        "margin<0.05/replay N=8 (no end check)",
        "margin<0.05/replay per row",
        "batch-invariant",
        "solo",
    ]
    assert list(runs["config"].unique()) == configs
    assert sorted(runs["repeat"].unique()) == [0, 1]  # the warm-up pass is not recorded
    assert len(runs) == len(configs) * 2
    summary = json.loads((compare_run_dir / "summary.json").read_text())
    by = {c["config"]: c for c in summary["configs"]}
    assert by["none"]["seconds"] == pytest.approx(runs[runs["config"] == "none"]["seconds"].median())
    assert by["none"]["determinism"] < 1.0, "positive control: the planted head flips plain batched decoding"
    for config in ("always/exact", "oracle/exact", "solo"):
        assert by[config]["determinism"] == 1.0
    assert by["always/exact"]["repairs"] > 0 and by["oracle/exact"]["repairs"] > 0, "determinism restored, not 0 == 0"
    assert by["oracle/exact"]["triggers"] == by["oracle/exact"]["repairs"]
    # The gate's share of a plain batched step, recomputed: one batch (2 requests at batch size 2)
    # of full-length outputs, so each plain pass ran max_new_tokens - 1 decode iterations.
    none = runs[runs["config"] == "none"]
    assert summary["batch_size"] == summary["sequences"] == 2
    assert (none["steps"] == none["sequences"] * summary["max_new_tokens"]).all(), "no output ended early"
    plain_step = none["seconds"].median() / (summary["max_new_tokens"] - 1)
    assert summary["plain_batched_step_seconds"] == pytest.approx(plain_step)
    assert summary["gate_seconds_per_step"] > 0
    assert summary["gate_share_of_step"] == pytest.approx(summary["gate_seconds_per_step"] / plain_step)
    # The time breakdown: the first repeat's timed sections, of every configuration that has them.
    breakdown = {row["config"]: row for row in summary["breakdown"]}
    first = runs[(runs["repeat"] == 0) & runs["t_gate"].notna()].set_index("config")
    assert set(breakdown) == set(first.index) >= {"none", "always/exact", "margin<0.05/column"}
    for config, row in breakdown.items():
        assert row["t_reference_forward"] == pytest.approx(first.loc[config, "t_reference_forward"])
    for name in ("latency_increment.png", "determinism_vs_triggers.png"):
        width, height = png_size(compare_run_dir / name)
        assert 300 <= height <= width <= 4000, (name, width, height)
        pixels = matplotlib.image.imread(compare_run_dir / name)
        assert pixels.shape[:2] == (height, width) and pixels.std() > 0, name  # drawn, not blank


def png_size(path) -> tuple[int, int]:
    """(width, height) from the PNG signature and its IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def test_batch_invariant_baseline_is_exact(compare_run_dir):
    summary = json.loads((compare_run_dir / "summary.json").read_text())
    by = {c["config"]: c for c in summary["configs"]}
    assert by["none"]["determinism"] < 1.0, "the planted head varies with the row count"
    assert by["batch-invariant"]["determinism"] == 1.0, "the probe plans the planted head per row"
    # The planted head differs at every row count above one: "never one row" runs it exact, and the
    # fixed-order configuration is measured against its own reference (solo through the same kernels).
    fixed = by["fixed-order kernels"]
    assert fixed["determinism"] == 1.0 and fixed["reference"] == "fixed-order solo"
    fixed_order_configs = {"fixed-order kernels", "none (start-aligned)"} | {
        c for c in by if "replay" in c or "window" in c
    }
    assert {by[c]["reference"] for c in by if c not in fixed_order_configs} == {"stock solo"}
    assert {by[c]["reference"] for c in fixed_order_configs} == {"fixed-order solo"}
    assert summary["fixed_order"]["stock_solo"]["requests"] == summary["sequences"]
    # Replay verification against the fixed-order reference: exact with the end check, by construction.
    replays = [c for c in by if c.startswith("window") or c.startswith("margin") and "/replay" in c]
    exact = [c for c in replays if "no end check" not in c]
    assert len(exact) == 9
    for config in exact:
        assert by[config]["determinism"] == 1.0 and by[config]["reference"] == "fixed-order solo"
        assert by[config]["replayed"] > 0
    # Packed: every verify forward computed exactly N rows of W tokens (dummies and padding included).
    recorded = pd.read_parquet(compare_run_dir / "compare.parquet")
    runs_first = recorded[recorded["repeat"] == 0].set_index("config")
    for config, n, w in (("window W=64/replay N=8", 8, 64), ("window W=32/replay N=16", 16, 32)):
        assert runs_first.loc[config, "verify_slots"] == runs_first.loc[config, "verify_forwards"] * n * w
    pairs = {(r["window"], r["gate"]) for r in summary["replay_reductions"]}
    assert ("window W=64/replay N=8", "margin<0.05/replay N=8") in pairs
    assert ("window W=64/replay per row", "margin<0.05/replay per row") in pairs
    assert ("window W=64/replay N=8", "margin<0.05/replay per row") not in pairs  # same N only
    # Per sequence (first repeat): the replay counts add up to the configuration's row.
    sequences = pd.read_parquet(compare_run_dir / "replay_sequences.parquet")
    runs = pd.read_parquet(compare_run_dir / "compare.parquet")
    first = runs[runs["repeat"] == 0].set_index("config")
    for config, group in sequences.groupby("config"):
        assert len(group) == summary["sequences"]
        assert group["replayed"].sum() == first.loc[config, "replayed"]
        assert group["rollbacks"].sum() == first.loc[config, "repairs"]
        assert group["replays"].sum() == first.loc[config, "triggers"]
    assert sequences.loc[sequences["config"] == "window W=64/replay N=8", "first_divergence"].isna().all()
    assert summary["batch_invariant"]["exact_on_probe"] is True


def test_report_renders_recorded_runs(compare_run_dir, tmp_path):
    result = runner.invoke(app, ["report", str(compare_run_dir), "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "report" / "report.md").read_text()
    assert text.startswith("# mgbench report\n\n## compare: compare\n")
    # Each increment reduction, recomputed from compare.parquet: per repeat, increment(always/R) over
    # increment(margin/R) (both over `none` of that repeat; unmeasurable where MarginGate's is <= 0).
    by = pd.read_parquet(compare_run_dir / "compare.parquet").set_index(["config", "repeat"])["seconds"]
    for repair in ("column", "exact"):
        measured = []
        for repeat in (0, 1):
            always, gate = (
                by[config, repeat] / by["none", repeat] - 1 for config in (f"always/{repair}", f"margin<0.05/{repair}")
            )
            measured += [always / gate] if gate > 0 else []
        line = f"- increment reduction always/{repair} over margin/{repair}: "
        (shown,) = [x[len(line) :] for x in text.splitlines() if x.startswith(line)]
        median, _, spread = shown.partition(" ")
        if measured:
            assert float(median.removesuffix("x")) == pytest.approx(float(np.median(measured)), rel=6e-4)
            low, high = (float(x) for x in spread.strip("()").split("-"))
            assert (low, high) == (pytest.approx(min(measured), rel=6e-4), pytest.approx(max(measured), rel=6e-4))
        else:
            assert shown == "-x (-)"
    assert (tmp_path / "report" / "0-latency_increment.png").read_bytes() == (
        compare_run_dir / "latency_increment.png"
    ).read_bytes()
    bad = runner.invoke(app, ["report", str(tmp_path), "--out", str(tmp_path / "r2")])
    assert bad.exit_code == 2 and "not an mgbench run directory" in bad.stderr


def test_only_selects_by_prefix_and_wildcard():
    from mgbench.errors import UserError
    from mgbench.pipelines.compare_configs import configurations

    names = lambda *only: [c.name for c in configurations(0.25, "logit", only)]  # noqa: E731
    assert names("margin*/exact", "oracle") == ["none", "margin<0.25/exact", "oracle/column", "oracle/exact"]
    replays = names("margin")  # a prefix alone takes MarginGate's replays too, and their unverified base
    assert "margin<0.25/replay per row" in replays and "none (start-aligned)" in replays
    with pytest.raises(UserError, match="no configuration starts with it"):  # a bracket is literal, not a set
        names("window W=64/replay N=[8]")

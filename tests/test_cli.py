"""The CLI end to end: bad option values exit 2 with one line (the full list of bad input is in
test_bad_input); a real run writes the contract's files, and an identical rerun identical bytes."""

import json
import subprocess
import sys

import pandas as pd
import pytest
import reference
from helpers import default_model_flips_args
from typer.testing import CliRunner

from mgbench.cli import app

runner = CliRunner()

STEP_COLUMNS = [
    "request_id",
    "batch_id",
    "row",
    "batch_size",
    "pad_len",
    "method",
    "step",
    "solo_token",
    "batched_token",
    "flipped",
    "margin",
    "margin_ulp",
    "solo_margin",
    "max_abs_logit_diff",
    "logprob_drift",
    "kv_delta_mean",
    "kv_delta_max",
]
SEQUENCE_COLUMNS = ["request_id", "dataset", "prompt_ids", "solo_ids", "batched_ids", "first_divergence", "identical"]
SUMMARY_KEYS = [
    "steps",
    "flips",
    "flip_rate",
    "sequences",
    "sequences_diverged",
    "solo_tokens_per_s",
    "batched_tokens_per_s",
    "margin_logit_quantiles_flip",
    "margin_logit_quantiles_non_flip",
]


def bad(args, message):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["--batch-size", "0"], "batch size must be at least 1"),
        (["--batch-sizes", "4,x"], "comma-separated integers"),
        (["--limit", "0"], "--limit must be at least 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["--prefill", "sideways"], "--prefill"),
        (["--dtype", "int3"], "--dtype"),
    ],
)
def test_bad_option_values(tmp_path, args, message):
    bad(["flips", *args, "--out", str(tmp_path / "o")], message)


def test_non_empty_out_dir(tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep").write_text("x")
    bad(["flips", "--limit", "1", "--out", str(tmp_path / "o")], "not empty")


def test_listings():
    assert "smollm2-135m" in runner.invoke(app, ["models"]).output
    listing = runner.invoke(app, ["datasets"])
    assert listing.exit_code == 0 and "sharegpt" in listing.output


@pytest.mark.slow
def test_flips_end_to_end_on_default_model_is_reproducible(default_model_run, tmp_path):
    """The command a user types, in a fresh process: the contract's files, and the bytes of the same
    run made in-process (conftest's default_model_run: same inputs, same environment)."""
    command = [sys.executable, "-m", "mgbench", *default_model_flips_args("alone", tmp_path / "a")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "flip rate" in done.stdout
    steps_a = pd.read_parquet(tmp_path / "a" / "steps.parquet")
    assert set(STEP_COLUMNS) <= set(steps_a.columns)
    assert len(steps_a) > 0
    for table in ("steps.parquet", "sequences.parquet"):
        assert (tmp_path / "a" / table).read_bytes() == (default_model_run / table).read_bytes()
    sequences = pd.read_parquet(tmp_path / "a" / "sequences.parquet")
    assert set(SEQUENCE_COLUMNS) <= set(sequences.columns) and len(sequences) == 4
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert set(SUMMARY_KEYS) <= set(summary)
    assert summary["steps"] == len(steps_a) and summary["flips"] == int(steps_a["flipped"].sum())
    # the streamed summary, bitwise as the whole table in pandas computes it (tests/reference.py)
    whole = reference.step_figures(steps_a)
    assert {k: summary[k] for k in reference.SUMMARY_KEYS} == {k: whole[k] for k in reference.SUMMARY_KEYS}
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    for key in ("torch", "transformers", "device", "dtype", "attn", "argv", "git_revision", "options"):
        assert key in manifest
    report = runner.invoke(app, ["report", str(tmp_path / "a"), "--out", str(tmp_path / "report")])
    assert report.exit_code == 0, report.output
    assert "## flips" in (tmp_path / "report" / "report.md").read_text()
    assert (tmp_path / "report" / "0-margins.png").is_file()

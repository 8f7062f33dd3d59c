"""The determinism gate for CI: thresholds, the paired baseline test, JUnit, --json on every
command, logs at full width, the GitHub step summary."""

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import cli_args
from typer.testing import CliRunner

from mgbench.analysis import gate
from mgbench.analysis.step_aggregates import aggregate
from mgbench.cli import app

runner = CliRunner()


def test_sign_test_and_paired_test():
    assert gate.sign_test_p(0, 0) == 1.0
    assert gate.sign_test_p(7, 0) == pytest.approx(0.5**7)
    assert gate.sign_test_p(3, 3) > 0.5
    steps = pd.DataFrame(
        {
            "request_id": [1, 1, 2, 2],
            "batch_id": 0,
            "row": [0, 0, 1, 1],
            "batch_size": 4,
            "step": [0, 1, 0, 1],
            "flipped": [True, False, False, True],
            "margin": 1.0,
            "margin_ulp": 8.0,
            "kv_delta_mean": 0.0,
        }
    )
    same = gate.paired_flip_test(aggregate(steps), aggregate(steps))
    assert same["p_value"] == 1.0 and same["newly_bad"] == same["newly_good"] == 0 and same["pairs"] == 4
    clean = steps.assign(flipped=False)
    worse = gate.paired_flip_test(aggregate(steps), aggregate(clean))
    assert worse["newly_bad"] == 2 and worse["p_value"] == pytest.approx(0.25)


def test_threshold_failures_say_by_how_much():
    thresholds = gate.Thresholds(require_determinism=1.0, max_flip_rate=0.01)
    failures = gate.threshold_failures({"determinism": 0.75, "flip_rate": 0.02}, thresholds, "batch size 8")
    assert [f["check"] for f in failures] == ["require-determinism", "max-flip-rate"]
    assert failures[0]["by"] == pytest.approx(0.25) and failures[1]["by"] == pytest.approx(0.01)
    assert "off by 25.00%" in gate.describe_failure(failures[0])
    assert gate.threshold_failures({"determinism": 1.0, "flip_rate": 0.0}, thresholds) == []


def test_help_examples_fit_an_80_column_terminal():
    for command in app.registered_commands:
        doc = command.callback.__doc__ or ""
        examples = doc.split("Examples:")[1] if "Examples:" in doc else ""
        for line in examples.splitlines():
            assert len(line.strip()) <= 74, f"{command.callback.__name__}: {line.strip()}"


def junit_cases(path: Path) -> tuple[ET.Element, dict[str, ET.Element]]:
    """A JUnit file read by an XML parser: the testsuite and its test cases by name, with the
    suite's counts checked against the cases it holds."""
    suite = ET.parse(path).getroot()
    assert suite.tag == "testsuite"
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    assert int(suite.get("tests")) == len(cases) == len(suite.findall("testcase"))
    assert int(suite.get("failures")) == sum(case.find("failure") is not None for case in cases.values())
    return suite, cases


def flips_args(folder, out, *extra):
    return cli_args("flips", folder, out, *extra, limit=8, batch=8, tokens=24)


@pytest.fixture(scope="module")
def base_run(planted_model_dir, tmp_path_factory):
    """An audit of the planted model: every multi-row step flips, on any machine."""
    out = tmp_path_factory.mktemp("gate") / "base"
    result = runner.invoke(app, flips_args(planted_model_dir, out))
    assert result.exit_code == 0, result.output
    return out


def test_thresholds_exit_1_with_a_failing_junit_case(planted_model_dir, base_run, tmp_path):
    summary = json.loads((base_run / "summary.json").read_text())
    assert summary["determinism"] < 1.0 and summary["flips"] > 0, "positive control: the planted head flips"
    strict = runner.invoke(
        app,
        flips_args(
            planted_model_dir,
            tmp_path / "strict",
            "--require-determinism",
            "1.0",
            "--junit",
            str(tmp_path / "strict.xml"),
        ),
    )
    assert strict.exit_code == 1, strict.output
    assert "require-determinism needs >= 100.00%" in strict.stderr
    strict_summary = json.loads((tmp_path / "strict" / "summary.json").read_text())
    gated = strict_summary["gate"]
    assert gated["passed"] is False and gated["failures"][0]["by"] == pytest.approx(1 - summary["determinism"])
    # JUnit: one case per batch size; the case fails with the determinism the run measured there.
    suite, cases = junit_cases(tmp_path / "strict.xml")
    (row,) = strict_summary["by_batch_size"]
    assert (suite.get("name"), list(cases)) == ("mgbench.flips", [f"batch_size={row['batch_size']}"])
    assert suite.get("tests") == "1" and suite.get("failures") == "1"
    failure = cases["batch_size=8"].find("failure")
    determinism = row["identical"] / row["sequences"]
    assert failure.get("message") == (
        f"all batch sizes: require-determinism needs >= 100.00%, measured {determinism:.2%} "
        f"(off by {1 - determinism:.2%})"
    )
    assert failure.text.startswith(f"{row['flips']} flips / {row['steps']} steps")
    assert f"{row['sequences'] - row['identical']}/{row['sequences']} sequences diverged" in failure.text
    # Negative control, clean by construction: the batch-invariant mode runs the planted head per row.
    exact = runner.invoke(
        app,
        flips_args(
            planted_model_dir,
            tmp_path / "exact",
            "--batch-invariant",
            "--require-determinism",
            "1.0",
            "--junit",
            str(tmp_path / "exact.xml"),
        ),
    )
    assert exact.exit_code == 0, exact.output
    suite, cases = junit_cases(tmp_path / "exact.xml")
    (row,) = json.loads((tmp_path / "exact" / "summary.json").read_text())["by_batch_size"]
    assert list(cases) == ["batch_size=8"] and suite.get("failures") == "0" and row["identical"] == row["sequences"]
    assert cases["batch_size=8"].find("system-out").text.startswith(f"{row['flips']} flips / {row['steps']} steps")
    lenient = runner.invoke(
        app,
        flips_args(
            planted_model_dir, tmp_path / "lenient", "--require-determinism", "0", "--max-flip-rate", "1", "--json"
        ),
    )
    assert lenient.exit_code == 0, lenient.output
    assert json.loads(lenient.stdout)["gate"]["passed"] is True


def test_baseline_of_itself_passes_with_p_1(planted_model_dir, base_run, tmp_path):
    result = runner.invoke(
        app,
        flips_args(
            planted_model_dir,
            tmp_path / "again",
            "--baseline",
            str(base_run),
            "--junit",
            str(tmp_path / "j.xml"),
            "--json",
        ),
    )
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    tests = printed["gate"]["baseline"]["tests"]
    assert tests["flip_rate"]["p_value"] == 1.0 and tests["diverged"]["p_value"] == 1.0
    assert tests["flip_rate"]["pairs"] == json.loads((base_run / "summary.json").read_text())["steps"]
    # JUnit: a passing case per batch size, then the baseline test with its rates and p-values.
    suite, cases = junit_cases(tmp_path / "j.xml")
    sizes = [f"batch_size={r['batch_size']}" for r in printed["by_batch_size"]]
    assert list(cases) == [*sizes, "baseline regression"] and suite.get("failures") == "0"
    text = cases["baseline regression"].find("system-out").text
    for name, test in tests.items():
        assert f"{name}: {test['rate']:.2%} vs baseline {test['baseline_rate']:.2%}, p = 1" in text


def plant_clean_baseline(base_run: Path, target: Path) -> Path:
    """PLANTED BASELINE: the recorded run with every flip and divergence erased, as if an earlier
    kernel stack had been batch-invariant. Labelled as such in its summary."""
    shutil.copytree(base_run, target)
    steps = pq.read_table(target / "steps.parquet")
    steps = steps.set_column(steps.schema.get_field_index("flipped"), "flipped", pa.array([False] * len(steps)))
    pq.write_table(steps, target / "steps.parquet")
    sequences = pq.read_table(target / "sequences.parquet").to_pandas()
    sequences["identical"] = True
    sequences["first_divergence"] = None
    schema = pq.read_schema(target / "sequences.parquet")
    pq.write_table(pa.Table.from_pandas(sequences, schema=schema, preserve_index=False), target / "sequences.parquet")
    summary = json.loads((target / "summary.json").read_text())
    (target / "summary.json").write_text(json.dumps({**summary, "flips": 0, "planted": "clean baseline (test)"}))
    return target


def test_regression_against_a_cleaner_baseline_exits_1(planted_model_dir, base_run, tmp_path):
    summary = json.loads((base_run / "summary.json").read_text())
    assert summary["flips"] >= 3, "the planted head flips every multi-row step: enough to bite"
    clean = plant_clean_baseline(base_run, tmp_path / "clean")
    result = runner.invoke(
        app, flips_args(planted_model_dir, tmp_path / "now", "--baseline", str(clean), "--alpha", "0.2", "--json")
    )
    assert result.exit_code == 1, f"{summary['flips']} flips against none; {result.output}"
    verdict = json.loads(result.stdout)["gate"]
    assert "flip_rate" in verdict["baseline"]["regressed"]
    assert verdict["baseline"]["tests"]["flip_rate"]["baseline_rate"] == 0.0
    assert verdict["baseline"]["tests"]["flip_rate"]["newly_bad"] == summary["flips"]
    assert "regression against the baseline: flip rate" in result.stderr


def test_baseline_of_other_prompts_or_model_is_refused(planted_model_dir, base_run, tmp_path):
    other = runner.invoke(
        app, flips_args(planted_model_dir, tmp_path / "o", "--seed", "3", "--baseline", str(base_run))
    )
    assert other.exit_code == 2 and "is not the same audit" in other.stderr and "requests" in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
    longer = runner.invoke(
        app, flips_args(planted_model_dir, tmp_path / "l", "--max-new-tokens", "8", "--baseline", str(base_run))
    )
    assert longer.exit_code == 2 and "max_new_tokens" in longer.stderr
    wrong_kind = runner.invoke(app, flips_args(planted_model_dir, tmp_path / "w", "--baseline", str(tmp_path)))
    assert wrong_kind.exit_code == 2 and "not a finished mgbench run directory" in wrong_kind.stderr


def test_verify_baseline_of_itself_passes(planted_model_dir, tmp_path):
    args = [
        "verify",
        "--model",
        str(planted_model_dir),
        "--dataset",
        "gsm8k",
        "--limit",
        "4",
        "--batch-sizes",
        "4",
        "--max-new-tokens",
        "12",
        "--policy",
        "none",
    ]
    first = runner.invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert first.exit_code == 0, first.output
    second = runner.invoke(app, [*args, "--out", str(tmp_path / "b"), "--baseline", str(tmp_path / "a"), "--json"])
    assert second.exit_code == 0, second.output
    assert json.loads(second.stdout)["gate"]["baseline"]["tests"]["diverged"]["p_value"] == 1.0
    other_policy = runner.invoke(
        app, [*args[:-1], "always", "--out", str(tmp_path / "c"), "--baseline", str(tmp_path / "a")]
    )
    assert other_policy.exit_code == 2 and "policies" in other_policy.stderr


def test_piped_logs_at_full_width(base_run, tmp_path):
    """Piped output: no ellipsis, no cut header. (Each command's --json: tests/test_outputs.py.)"""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    piped = subprocess.run(
        [sys.executable, "-m", "mgbench", "calibrate", str(base_run), "--out", str(tmp_path / "cal2")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert piped.returncode == 0, piped.stderr
    assert "…" not in piped.stdout and "trig@…" not in piped.stdout and "TAU min" in piped.stdout


def test_github_step_summary_gets_the_run_section(planted_model_dir, base_run, tmp_path, monkeypatch):
    step_summary = tmp_path / "step-summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step_summary))
    result = runner.invoke(app, flips_args(planted_model_dir, tmp_path / "s", "--baseline", str(base_run)))
    assert result.exit_code == 0, result.output
    text = step_summary.read_text()
    assert text.startswith("## flips: s") and "Determinism gate: PASS" in text and "![" not in text

"""README's tour and reports/example/report.md are what the code prints from the runs that ship in
reports/example/runs/, and the commands README tells a new user to try work on those runs."""

import importlib.util
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from mgbench import SCHEMA_VERSION
from mgbench.cli import app

ROOT = Path(__file__).parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def tour():
    spec = importlib.util.spec_from_file_location("tour", ROOT / "examples" / "tour.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_tour_and_example_report_match_the_shipped_runs(tour):
    diffs = tour.stale()
    assert not diffs, "run `.venv/bin/python examples/tour.py render` and commit:\n" + "".join(diffs)[:6000]


def test_a_stale_readme_block_or_report_is_caught(tour, tmp_path, monkeypatch):
    """Planted: one figure of README's flips block changed, then one line of report.md."""
    readme = tmp_path / "README.md"
    text = tour.README.read_text()
    block = text.index("<!-- tour flips-plain -->")
    row = text.index("| 1.56% |", block)  # the flip rate of the shipped plain run
    readme.write_text(text[:row] + "| 1.57% |" + text[row + len("| 1.56% |") :])
    monkeypatch.setattr(tour, "README", readme)
    stale = tour.stale()
    changed = [line for line in stale[0].splitlines() if line.startswith(("-|", "+|"))] if stale else []
    assert len(stale) == 1 and len(changed) == 2
    assert "| 1.57% |" in changed[0] and "| 1.56% |" in changed[1]
    monkeypatch.setattr(tour, "README", ROOT / "README.md")
    example = tmp_path / "example"
    shutil.copytree(tour.EXAMPLE, example, ignore=shutil.ignore_patterns("runs", "*.png"))
    (example / "report.md").write_text((example / "report.md").read_text().replace("## compare:", "## compared:"))
    monkeypatch.setattr(tour, "EXAMPLE", example)
    stale = tour.stale()
    assert len(stale) == 1 and "-## compared:" in stale[0]


def test_every_readme_block_names_a_shipped_run(tour):
    names = {name for name, _, _ in tour.tour({})} | {"machine"}
    text = tour.README.read_text()
    blocks = [line.split()[2] for line in text.splitlines() if line.startswith("<!-- tour ")]
    assert set(blocks) == names and len(blocks) == len(names)
    for run in tour.shipped_runs():
        manifest = json.loads((run / "manifest.json").read_text())
        assert manifest["schema_version"] == SCHEMA_VERSION, run  # recorded with the current schema


def test_calibrate_and_diff_on_the_shipped_runs_reproduce_the_shipped_ones(tour, tmp_path):
    runs = tour.SHIPPED
    done = runner.invoke(app, ["calibrate", str(runs / "flips-plain"), "--out", str(tmp_path / "cal"), "--json"])
    assert done.exit_code == 0, done.output
    shipped = json.loads((runs / "cal" / "calibration.json").read_text())
    assert json.loads(done.stdout)["per_unit"] == shipped["per_unit"]
    other = str(runs / "flips-other-family")
    done = runner.invoke(app, ["diff", str(runs / "flips-plain"), other, "--out", str(tmp_path / "diff")])
    assert done.exit_code == 0, done.output
    columns = ["request", "identical", "first_divergence", "token_a", "token_b", "margin_a", "margin_b"]
    again, shipped = (pd.read_parquet(p / "diff.parquet")[columns] for p in (tmp_path / "diff", runs / "diff"))
    pd.testing.assert_frame_equal(again, shipped)
    report = runner.invoke(app, ["report", *map(str, tour.shipped_runs()), "--out", str(tmp_path / "report")])
    assert report.exit_code == 0, report.output
    assert (tmp_path / "report" / "report.md").read_text() == (tour.EXAMPLE / "report.md").read_text()

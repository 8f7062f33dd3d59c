"""Runs recorded by an earlier release stay usable: the committed schema-1 run (tests/fixtures)
calibrates, reports and serves as a --baseline; a run from a newer release is refused in one line."""

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import reference
from typer.testing import CliRunner

from mgbench.analysis import gate
from mgbench.cli import app
from mgbench.runs import schema

V1_RUN = Path(__file__).parent / "fixtures" / "v1-flips-run"
V1_AUDIT = ["flips", "--dataset", "math500", "--limit", "6", "--batch-size", "6", "--max-new-tokens", "8"]
runner = CliRunner()


def test_the_fixture_is_schema_1():
    assert pq.read_schema(V1_RUN / "steps.parquet").metadata[schema.SCHEMA_KEY] == b"1"
    assert json.loads((V1_RUN / "manifest.json").read_text())["schema_version"] == "1"


def test_v1_steps_are_upgraded_on_read():
    steps = reference.whole_steps(V1_RUN)
    assert len(steps) == 48 and (steps["method"] == "teacher-forced").all()
    assert steps["logprob_drift"].isna().all()
    assert steps.attrs["schema_version_read"] == "1"


def test_v1_run_calibrates_and_the_manifest_says_which_version_was_read(tmp_path):
    result = runner.invoke(app, ["calibrate", str(V1_RUN), "--out", str(tmp_path / "cal")])
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    flipped = int(pq.read_table(V1_RUN / "steps.parquet").column("flipped").to_numpy().sum())
    assert document["steps"] == 48 and document["flips"] == flipped
    inputs = json.loads((tmp_path / "cal" / "manifest.json").read_text())["inputs"]
    assert [(Path(i["path"]).name, i["schema_version_read"]) for i in inputs] == [("v1-flips-run", "1")]


def test_v1_run_reports(tmp_path):
    result = runner.invoke(app, ["report", str(V1_RUN), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    assert f"schema 1 (read as {schema.SCHEMA_VERSION})" in (tmp_path / "rep" / "report.md").read_text()


def test_v1_run_against_itself_passes_the_gate():
    """Negative control by construction: a run compared with itself has no newly bad pair."""
    baseline = gate.load_baseline(V1_RUN, "flips")
    tested = gate.regression(baseline.steps, baseline.sequences, baseline.steps, baseline.sequences, alpha=0.05)
    assert tested["tests"]["flip_rate"]["p_value"] == 1.0 and tested["tests"]["flip_rate"]["pairs"] == 48
    assert baseline.schema_version == "1"


@pytest.mark.slow
def test_v1_run_as_baseline_catches_a_planted_regression(tmp_path, monkeypatch):
    """Positive control: the same audit on the default model with a planted head (flips wherever the
    batched margin is below 1 logit) regresses against the v1 baseline on any machine."""
    from helpers import plant_every_loaded_model

    plant_every_loaded_model(monkeypatch, delta=1.0)
    result = runner.invoke(app, [*V1_AUDIT, "--baseline", str(V1_RUN), "--out", str(tmp_path / "now"), "--json"])
    assert result.exit_code == 1, result.output
    verdict = json.loads(result.stdout)["gate"]["baseline"]
    assert verdict["schema_version_read"] == "1" and "flip_rate" in verdict["regressed"]
    assert verdict["tests"]["flip_rate"]["pairs"] == 48
    inputs = json.loads((tmp_path / "now" / "manifest.json").read_text())["inputs"]
    assert inputs[0]["role"] == "baseline" and inputs[0]["schema_version_read"] == "1"


def test_v1_and_v2_sequences_gain_null_solo_margins_on_read(tmp_path):
    """Schema 3 added sequences.solo_margins: older runs read it as null (unknown), nothing else moves."""
    upgraded = schema.read_table(V1_RUN / "sequences.parquet", schema.SEQUENCES_SCHEMA)
    assert upgraded.column("solo_margins").null_count == upgraded.num_rows == 6
    assert upgraded.schema.names == schema.SEQUENCES_SCHEMA.names
    v2 = upgraded.drop_columns(["solo_margins"])
    pq.write_table(v2.replace_schema_metadata({schema.SCHEMA_KEY: b"2"}), tmp_path / "v2.parquet")
    back = schema.read_table(tmp_path / "v2.parquet", schema.SEQUENCES_SCHEMA)
    assert back.column("solo_margins").null_count == 6 and schema.schema_read_from(back) == "2"
    assert back.column("solo_ids").equals(upgraded.column("solo_ids"))


def test_a_schema_3_verify_sequences_table_gains_null_replay_records(tmp_path):
    names = [name for name, _ in schema.REPLAY_RECORD_FIELDS]
    v3_schema = pa.schema([f for f in schema.VERIFY_SEQUENCES_SCHEMA if f.name not in names])
    v3 = pa.Table.from_pylist([{"policy": "none", "repair": "none", "steps": 4}] * 3, schema=v3_schema)
    pq.write_table(v3.replace_schema_metadata({schema.SCHEMA_KEY: b"3"}), tmp_path / "v3.parquet")
    back = schema.read_table(tmp_path / "v3.parquet", schema.VERIFY_SEQUENCES_SCHEMA)
    assert back.schema.names == schema.VERIFY_SEQUENCES_SCHEMA.names and schema.schema_read_from(back) == "3"
    assert all(back.column(name).null_count == 3 for name in names)


def test_schema_4_flips_tables_read_as_the_batch_axis(tmp_path):
    """Schema 5 added the flips tables' `axis`: every earlier run varied the batch alone, so an older
    table reads as axis "batch" (not null), in place, and its figures group as before."""
    for name, expected in (("steps", schema.STEPS_SCHEMA), ("sequences", schema.SEQUENCES_SCHEMA)):
        upgraded = schema.read_table(V1_RUN / f"{name}.parquet", expected)
        assert upgraded.schema.names == expected.names
        assert set(upgraded.column("axis").to_pylist()) == {"batch"}
        v4 = upgraded.drop_columns(["axis"])
        pq.write_table(v4.replace_schema_metadata({schema.SCHEMA_KEY: b"4"}), tmp_path / f"{name}.parquet")
        back = schema.read_table(tmp_path / f"{name}.parquet", expected)
        assert back.column("axis").to_pylist() == ["batch"] * back.num_rows and schema.schema_read_from(back) == "4"


def test_a_run_from_a_newer_release_is_refused_in_one_line(tmp_path):
    future = tmp_path / "future"
    shutil.copytree(V1_RUN, future)
    table = pq.read_table(future / "steps.parquet")
    newer = str(int(schema.SCHEMA_VERSION) + 1)
    pq.write_table(
        table.replace_schema_metadata({**table.schema.metadata, schema.SCHEMA_KEY: newer.encode()}),
        future / "steps.parquet",
    )
    result = runner.invoke(app, ["calibrate", str(future), "--out", str(tmp_path / "cal")])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert f"schema version {newer}, newer than this mgbench" in result.stderr and not (tmp_path / "cal").exists()

"""Bad input, for every command: one line naming the problem and the fix, exit code 2, no
traceback (unless --debug), and nothing written (no run directory, no staging folder)."""

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from mgbench.cli import app

runner = CliRunner()
COMMANDS = ("flips", "verify", "compare", "calibrate")
FAST = {
    "flips": ["--limit", "2", "--max-new-tokens", "4"],
    "verify": ["--limit", "2", "--max-new-tokens", "4", "--threshold", "0.5"],
    "compare": ["--limit", "2", "--max-new-tokens", "4", "--threshold", "0.5"],
    "calibrate": ["--limit", "2", "--max-new-tokens", "4"],
}


def tree(root):
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def assert_bad(tmp_path, args, message, monkeypatch=None):
    """The command exits 2 with one line containing `message`, and adds nothing under tmp_path."""
    before = tree(tmp_path)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert tree(tmp_path) == before, "a failed command left files behind"
    return result


@pytest.fixture(autouse=True)
def private_traces(tmp_path_factory, monkeypatch):
    # calibrate records traces into a cache: keep it out of tmp_path, whose tree is compared, and
    # check that a failed recording leaves no staging folder there either.
    traces = tmp_path_factory.mktemp("traces")
    monkeypatch.setenv("MGBENCH_TRACES", str(traces))
    yield
    assert not list(traces.rglob("*")), "a failed recording left files in the trace cache"


@pytest.mark.parametrize("command", COMMANDS)
def test_unknown_model_alias(tmp_path, command):
    assert_bad(
        tmp_path,
        [command, "--model", "no-such-model", *FAST[command], "--out", str(tmp_path / "o")],
        "unknown model 'no-such-model'",
    )


@pytest.mark.parametrize("command", ("flips", "verify", "compare"))
def test_hub_id_unavailable_offline(tmp_path, command):
    assert_bad(
        tmp_path,
        [command, "--model", "nobody/not-in-the-cache", *FAST[command], "--out", str(tmp_path / "o")],
        "offline",
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_unknown_dataset(tmp_path, command):
    assert_bad(
        tmp_path,
        [command, "--dataset", "no-such-dataset", *FAST[command], "--out", str(tmp_path / "o")],
        "unknown dataset 'no-such-dataset'",
    )


@pytest.fixture
def configs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("configs")
    (folder / "malformed.toml").write_text('name = "m"\n[source\nkind = "file"\n')
    (folder / "gone.toml").write_text(
        'name = "gone"\n[source]\nkind = "file"\npath = "gone.jsonl"\n[prompt]\nfield = "q"\n'
    )
    (folder / "empty.jsonl").write_text("")
    (folder / "empty.toml").write_text(
        'name = "empty"\n[source]\nkind = "file"\npath = "empty.jsonl"\n[prompt]\nfield = "q"\n'
    )
    return folder


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "config,message",
    [
        ("malformed.toml", "malformed"),
        ("gone.toml", "does not exist"),
        ("empty.toml", "has no records"),
        ("missing.toml", "unknown dataset"),
    ],
)
def test_bad_dataset_config_or_file(tmp_path, configs, command, config, message):
    assert_bad(
        tmp_path, [command, "--dataset", str(configs / config), *FAST[command], "--out", str(tmp_path / "o")], message
    )


@pytest.mark.parametrize("command", ("flips", "verify"))
def test_shard_without_requests(tmp_path, command):
    # 2 requests at batch size 8 are one group: a second shard would decode nothing.
    assert_bad(
        tmp_path,
        [command, *FAST[command], "--shard", "1/2", "--out", str(tmp_path / "o")],
        "shard 1/2 gets no requests",
    )


@pytest.mark.parametrize("command", ("flips", "verify"))
@pytest.mark.parametrize("shard,message", [("3", "expected I/N"), ("2/2", "0 <= I < N"), ("0/0", "0 <= I < N")])
def test_bad_shard(tmp_path, command, shard, message):
    assert_bad(tmp_path, [command, *FAST[command], "--shard", shard, "--out", str(tmp_path / "o")], message)


@pytest.mark.parametrize("command", ("flips", "verify"))
@pytest.mark.parametrize("args", [["--shard", "0/2"], ["--resume"]])
def test_shard_and_resume_need_out(tmp_path, monkeypatch, command, args):
    monkeypatch.chdir(tmp_path)
    assert_bad(tmp_path, [command, *FAST[command], *args], "needs --out")


@pytest.mark.parametrize("command", COMMANDS)
def test_zero_batch_size_and_tokens(tmp_path, command):
    size = "--batch-sizes" if command == "verify" else "--batch-size"
    assert_bad(
        tmp_path, [command, *FAST[command], size, "0", "--out", str(tmp_path / "o")], "batch size must be at least 1"
    )
    assert_bad(
        tmp_path,
        [command, *FAST[command], "--max-new-tokens", "0", "--out", str(tmp_path / "o")],
        "--max-new-tokens must be at least 1",
    )


@pytest.mark.parametrize("command", ("verify", "compare"))
@pytest.mark.parametrize("threshold", ["nan", "-1", "0", "1e9", "inf"])
def test_bad_threshold(tmp_path, command, threshold):
    args = [command, "--limit", "2", "--threshold", threshold, "--out", str(tmp_path / "o")]
    if command == "verify":
        args += ["--policy", "margin"]
    assert_bad(tmp_path, args, "use a finite margin above 0")


@pytest.mark.parametrize("command", ("verify", "compare"))
def test_calibration_for_another_model(tmp_path, command):
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"kind": "mgbench.calibration", "model": "llama-3.1-8b", "tau": 0.5}))
    assert_bad(
        tmp_path,
        [command, "--limit", "2", "--threshold-from", str(calibration), "--out", str(tmp_path / "o")],
        "calibrated for model 'llama-3.1-8b', not 'smollm2-135m'; calibrate this model first",
    )


@pytest.mark.parametrize("command", ("verify", "compare"))
def test_calibration_file_that_is_not_one(tmp_path, command):
    (tmp_path / "c.json").write_text("{not json")
    assert_bad(
        tmp_path,
        [command, "--threshold-from", str(tmp_path / "c.json"), "--out", str(tmp_path / "o")],
        "cannot read it as JSON",
    )


@pytest.mark.parametrize("command", [*COMMANDS, "report"])
def test_unwritable_out(tmp_path, command):
    (tmp_path / "a-file").write_text("x")
    out = tmp_path / "a-file" / "run"
    if command == "report":
        run = tmp_path / "run"
        run.mkdir()
        (run / "manifest.json").write_text(json.dumps({"command": "verify"}))
        (run / "summary.json").write_text(json.dumps({"by_batch_size": []}))
        assert_bad(tmp_path, ["report", str(run), "--out", str(out)], "cannot create it")
    else:
        assert_bad(tmp_path, [command, *FAST[command], "--out", str(out)], "cannot write in")


def test_out_is_a_file(tmp_path):
    (tmp_path / "a-file").write_text("x")
    assert_bad(tmp_path, ["flips", *FAST["flips"], "--out", str(tmp_path / "a-file")], "is a file")


@pytest.mark.parametrize("command", ["calibrate", "report"])
def test_corrupt_and_foreign_parquet(tmp_path, command):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "steps.parquet").write_bytes(b"PAR1 this is not parquet")
    (corrupt / "manifest.json").write_text(json.dumps({"command": "flips"}))
    (corrupt / "summary.json").write_text(json.dumps({}))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    pd.DataFrame({"a": np.arange(3)}).to_parquet(foreign / "steps.parquet")
    (foreign / "manifest.json").write_text(json.dumps({"command": "flips"}))
    if command == "calibrate":
        assert_bad(tmp_path, ["calibrate", str(corrupt), "--out", str(tmp_path / "o")], "not a readable Parquet file")
        assert_bad(tmp_path, ["calibrate", str(foreign), "--out", str(tmp_path / "o")], "not written by mgbench")
    else:
        assert_bad(tmp_path, ["report", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")], "not an mgbench run")


def test_debug_shows_the_traceback(tmp_path):
    result = runner.invoke(app, ["flips", "--model", "no-such-model", "--debug", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "Traceback" in result.stderr and "unknown model" in result.stderr


def test_compare_under_torchrun_without_tensor_parallelism(tmp_path, monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    assert_bad(tmp_path, ["compare", *FAST["compare"], "--out", str(tmp_path / "o")], "compare times one process")

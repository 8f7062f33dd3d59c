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
        ("missing.toml", "not found (no such file)"),
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


# A flips summary with every figure report.md shows: the report then reaches the steps table.
FLIPS_SUMMARY = {
    "steps": 4,
    "flips": 0,
    "flip_rate": 0.0,
    "sequences": 1,
    "sequences_diverged": 0,
    "determinism": 1.0,
    "solo_tokens_per_s": 1.0,
    "batched_tokens_per_s": 1.0,
    "margin_logit_quantiles_flip": {},
    "margin_logit_quantiles_non_flip": {"q50": 1.0},
}


@pytest.mark.parametrize("command", ["calibrate", "report"])
@pytest.mark.parametrize(
    "folder,messages",
    [  # what calibrate (it reads only the steps table) and report say
        ("corrupt", ("not a readable Parquet file", "not a readable Parquet file")),
        ("foreign", ("not written by mgbench", "not written by mgbench")),
        ("no-summary", ("not written by mgbench", "summary.json: cannot read")),
        ("empty-summary", ("not written by mgbench", "a run document lacks 'steps'")),
        ("nowhere", ("does not exist", "does not exist")),
    ],
)
def test_corrupt_and_foreign_runs(tmp_path, command, folder, messages):
    run = tmp_path / folder
    if folder != "nowhere":
        run.mkdir()
        (run / "manifest.json").write_text(json.dumps({"command": "flips"}))
        if folder == "corrupt":
            (run / "steps.parquet").write_bytes(b"PAR1 this is not parquet")
        else:
            pd.DataFrame({"a": np.arange(3)}).to_parquet(run / "steps.parquet")
        if folder != "no-summary":
            (run / "summary.json").write_text(json.dumps({} if folder == "empty-summary" else FLIPS_SUMMARY))
    # report: an out folder two levels deep, neither of which a failed report leaves behind.
    out = tmp_path / "new" / "o" if command == "report" else tmp_path / "o"
    message = messages[0] if command == "calibrate" else messages[1]
    assert_bad(tmp_path, [command, str(run), "--out", str(out)], message)


ENDPOINT = ["--endpoint", "http://127.0.0.1:9/v1"]  # never contacted: the options are refused first


@pytest.mark.parametrize(
    "args,message",
    [
        (["flips", *FAST["flips"], "--alpha", "0"], "--alpha 0.0: use a significance level in (0, 1)"),
        (["verify", *FAST["verify"], "--alpha", "1.5"], "--alpha 1.5: use a significance level in (0, 1)"),
        (["calibrate", *FAST["calibrate"], "--confidence", "1"], "--confidence 1.0: use a level in [0.5, 1)"),
        (["calibrate", *FAST["calibrate"], "--confidence", "0.2"], "--confidence 0.2: use a level in [0.5, 1)"),
        (["compare", *FAST["compare"], "--repeats", "0"], "--repeats must be at least 1 (got 0)"),
        (["flips", *FAST["flips"], *ENDPOINT, "--top-logprobs", "1"], "--top-logprobs 1: the margin needs the top 2"),
        (["flips", *FAST["flips"], *ENDPOINT, "--top-logprobs", "-3"], "--top-logprobs -3: the margin needs"),
        (["flips", *FAST["flips"], *ENDPOINT, "--request-timeout", "0"], "--request-timeout 0.0: use a positive"),
        (["flips", *FAST["flips"], *ENDPOINT, "--request-timeout", "-5"], "--request-timeout -5.0: use a positive"),
        (["flips", *FAST["flips"], *ENDPOINT, "--request-timeout", "nan"], "--request-timeout nan: use a positive"),
        (["flips", *FAST["flips"], "--top-logprobs", "5"], "--top-logprobs only apply with --endpoint URL"),
        (["flips", *FAST["flips"], "--endpoint", "ftp://host/v1"], "give the server's base URL"),
        (["flips", *FAST["flips"], *ENDPOINT, "--kernels", "fixed-order"], "cannot apply to --endpoint"),
        (["verify", *FAST["verify"], "--policy", "sometimes"], "--policy 'sometimes': choose from none, always"),
        (["verify", *FAST["verify"], "--policy", ","], "--policy and --repair need at least one value each"),
        (["verify", "--limit", "2", "--policy", "margin"], "--policy margin needs --threshold TAU or --threshold-from"),
        (["verify", *FAST["verify"], "--repair", "row"], "--repair 'row': choose from"),
        (["verify", *FAST["verify"], "--threshold-unit", "bits"], "--threshold-unit 'bits': choose logit or ulp"),
        (["verify", *FAST["verify"], "--threshold-from", "c.json"], "give --threshold or --threshold-from, not both"),
        (["compare", *FAST["compare"], "--threshold-from", "c.json"], "give --threshold or --threshold-from, not both"),
        (["verify", *FAST["verify"], "--require-determinism", "1.5"], "--require-determinism 1.5: use a fraction"),
        (["flips", *FAST["flips"], "--max-flip-rate", "-0.1"], "--max-flip-rate -0.1: use a fraction in [0, 1]"),
        (["flips", *FAST["flips"], "--baseline", "nowhere"], "not a finished mgbench run directory"),
        (["flips", *FAST["flips"], "--batch-sizes", ","], "--batch-sizes is empty"),
        (["verify", *FAST["verify"], "--batch-sizes", ""], "--batch-sizes is empty"),
        (["calibrate", *FAST["calibrate"], "--batch-sizes", " , "], "--batch-sizes is empty"),
        (["flips", *FAST["flips"], "--batch-sizes", "2,4,2"], "--batch-sizes repeats a value: 2, 4, 2"),
        (["verify", *FAST["verify"], "--batch-sizes", "4,4"], "--batch-sizes repeats a value: 4, 4"),
        (["flips", *FAST["flips"], "--device", "gpu"], "--device 'gpu': use auto, cpu, cuda or cuda:N"),
        (["probe", "--device", "cuda:x", "--rows", "2"], "--device 'cuda:x': use auto, cpu, cuda or cuda:N"),
        (["flips", *FAST["flips"], "--attn", "flash"], "--attn 'flash': choose one of sdpa, eager"),
        (["flips", *FAST["flips"], "--kernels", "fast"], "--kernels 'fast': choose one of stock, fixed-order"),
        (["flips", *FAST["flips"], "--tp-plan", "rows"], "--tp-plan 'rows': the only plan is auto"),
        (["flips", *FAST["flips"], "--batch-invariant", "--prefill", "batched"], "drop --prefill batched"),
        (["flips", *FAST["flips"], "--batch-invariant", "--kernels", "fixed-order"], "choose one"),
        (["verify", *FAST["verify"], "--kernels", "fixed-order", "--policy", "oracle"], "choose from none, window"),
        (["verify", *FAST["verify"], "--policy", "window"], "add --kernels fixed-order"),
        (["verify", *FAST["verify"], "--kernels", "fixed-order", "--policy", "window", "--window", "0"], "--window 0"),
        (["calibrate", *FAST["calibrate"], "--safety", "x0.5"], "--safety 'x0.5': use xF with F >= 1"),
        (["calibrate", *FAST["calibrate"], "--unit", "bits"], "--unit 'bits': choose one of logit, ulp"),
        (["calibrate", *FAST["calibrate"], "--transfer", "no-such-dataset"], "unknown dataset 'no-such-dataset'"),
        (["calibrate", *FAST["calibrate"], "--transfer", "gsm8k,nowhere/"], "dataset config nowhere/ not found"),
        (["compare", *FAST["compare"], "--only", " , "], "--only is empty"),
        (["flips", *FAST["flips"], "--tile-rows", "32"], "--tile-rows sets the fixed-order kernels' tile"),
        (["flips", *FAST["flips"], "--kernels", "fixed-order", "--tile-rows", "0"], "--tile-rows must be between 1"),
        (["probe", "--kernels", "fixed-order", "--tile-rows", "5000"], "--tile-rows must be between 1 and 4096"),
        (["compare", *FAST["compare"], "--tile-rows", "-2"], "--tile-rows must be between 1 and 4096 (got -2)"),
        (["compare", *FAST["compare"], "--only", "always", "--tile-rows", "8"], "--only leaves no fixed-order"),
        (["probe", "--rows", "1"], "--rows must be at least 2 (got 1)"),
        (["diff", "one-run"], "give two run directories or more to compare"),
        (["diff", "a", "b", "--show", "-1"], "--show -1: a count of divergences, 0 or more"),
        (["diff", "a", "b", "--require-identical", "1.5"], "--require-identical 1.5: a share between 0 and 1"),
        # Rich markup and emoji codes in a value are printed as given, not styled away.
        (["flips", "--model", "no-[bold]such[/]:x:", *FAST["flips"]], "cannot load model 'no-[bold]such[/]:x:'"),
    ],
)
def test_bad_option_value(tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)  # relative paths (c.json, nowhere) name nothing there
    assert_bad(tmp_path, [*args, "--out", str(tmp_path / "o")], message)


@pytest.mark.parametrize("command", ("flips", "verify", "diff"))
@pytest.mark.parametrize("where,message", [("a-file/x.xml", "a-file is a file"), (".", "is a directory")])
def test_unwritable_junit_is_refused_before_the_run(tmp_path, command, where, message):
    (tmp_path / "a-file").write_text("x")
    args = ["diff", "a", "b"] if command == "diff" else [command, *FAST[command]]
    assert_bad(tmp_path, [*args, "--junit", str(tmp_path / where), "--out", str(tmp_path / "o")], message)


def test_transfer_run_that_is_not_one_is_refused_before_recording(tmp_path):
    (tmp_path / "empty-run").mkdir()
    assert_bad(
        tmp_path,
        ["calibrate", *FAST["calibrate"], "--transfer", str(tmp_path / "empty-run"), "--out", str(tmp_path / "o")],
        "is not a run directory (no steps.parquet)",
    )


@pytest.mark.parametrize("command", ("flips", "verify"))
def test_cuda_asked_where_there_is_none(tmp_path, tiny_model_dir, command):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert_bad(
        tmp_path,
        [command, "--model", str(tiny_model_dir), *FAST[command], "--device", "cuda", "--out", str(tmp_path / "o")],
        "--device cuda: CUDA is not available on this machine; use --device cpu",
    )


@pytest.mark.slow  # fresh Python processes that import torch
def test_a_second_writer_on_a_live_run_is_refused(tmp_path, tmp_path_factory, tiny_model_dir):
    """A real run is stopped (SIGSTOP) once it holds its run directory (its staging folder's lock is
    taken before run.json is written); a second run on the same --out is refused in one line and
    changes nothing, the first run's staging folder included."""
    import os
    import signal
    import subprocess
    import sys
    import time

    args = ["flips", "--model", str(tiny_model_dir), "--dataset", "gsm8k", "--limit", "2", "--batch-size", "2"]
    args += ["--max-new-tokens", "4", "--out", str(tmp_path / "o")]
    with open(tmp_path_factory.mktemp("log") / "first.log", "w") as output:  # outside the tree compared
        first = subprocess.Popen([sys.executable, "-m", "mgbench", *args], stdout=output, stderr=output)
    try:
        record = tmp_path / ".o.partial" / "run.json"
        deadline = time.monotonic() + 300
        while not record.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(first.pid, signal.SIGSTOP)
        assert record.exists() and not (tmp_path / "o").exists(), "the first run was not stopped while writing"
        assert_bad(tmp_path, args, "another mgbench process is writing")
    finally:
        first.kill()
        first.wait(timeout=60)
    assert record.exists()  # the refused writer left the live run's staging folder alone


def test_debug_shows_the_traceback(tmp_path):
    result = runner.invoke(app, ["flips", "--model", "no-such-model", "--debug", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "Traceback" in result.stderr and "unknown model" in result.stderr


def test_compare_under_torchrun_without_tensor_parallelism(tmp_path, monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    assert_bad(tmp_path, ["compare", *FAST["compare"], "--out", str(tmp_path / "o")], "compare times one process")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["flips", "--batch-size", "abc"], "Invalid value for '--batch-size'"),
        (["verify", "--no-such-option"], "No such option: --no-such-option"),
        (["compare", "--repeats"], "Option '--repeats' requires an argument"),
        (["no-such-command"], "No such command 'no-such-command'"),
        (["diff"], "Missing argument"),
    ],
)
def test_usage_errors_of_the_parser_are_one_line_too(tmp_path, args, message):
    result = assert_bad(tmp_path, args, message)
    assert result.stderr.startswith("error: ") and "--help" in result.stderr


def test_version_names_the_code_and_its_torch():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    line = result.stdout.strip()
    assert line.startswith("mgbench ") and ", torch " in line and ", transformers " in line and "\n" not in line


def test_help_fits_80_columns_with_nothing_cut(monkeypatch):
    """Every command's --help in an 80-column terminal: no option name, default or example cut
    with "…" (rich's panels cut them), and the command list gives each summary whole."""
    from typer.main import get_command

    monkeypatch.setenv("COLUMNS", "80")
    group = get_command(app)
    for call in [[], *([name] for name in sorted(group.commands))]:
        result = runner.invoke(app, [*call, "--help"], terminal_width=80)
        assert result.exit_code == 0 and "…" not in result.stdout, (call, result.stdout)
        assert max(len(line) for line in result.stdout.splitlines() if not line.startswith("      ")) <= 80
    listed = " ".join(runner.invoke(app, ["--help"], terminal_width=80).stdout.split())
    for command in group.commands.values():
        assert " ".join(command.short_help.split()) in listed


def test_missing_files_and_folders_are_named_as_missing(tmp_path):
    missing = tmp_path / "no-such-run"
    assert_bad(tmp_path, ["report", str(missing), "--out", str(tmp_path / "r")], f"{missing} does not exist")
    assert_bad(tmp_path, ["diff", str(missing), str(tmp_path)], f"{missing} does not exist")
    config = tmp_path / "mine.toml"
    assert_bad(tmp_path, ["flips", "--dataset", str(config), "--out", str(tmp_path / "o")], "not found (no such file)")


def test_report_refuses_a_non_empty_out_and_diff_says_a_run_given_twice(tmp_path):
    from pathlib import Path

    run = Path(__file__).parent / "fixtures" / "v1-flips-run"
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "old-plot.png").write_bytes(b"")
    assert_bad(tmp_path, ["report", str(run), "--out", str(taken)], "already exists and is not empty")
    itself = runner.invoke(app, ["diff", str(run), str(run)])
    assert itself.exit_code == 0 and "same run, identical by construction" in itself.stderr

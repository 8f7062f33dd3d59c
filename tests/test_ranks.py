"""Ranks of a multi-process run: every rank fingerprints the run alike, a finished shard resumes
as done (exit 0), a torchrun run survives kill -9 of one rank, ranks agree on out-of-memory splits
under tensor parallelism, and a process group that fails to start is said as such. CPU only."""

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
from helpers import cli_args
from typer.testing import CliRunner

from mgbench.assets import models
from mgbench.cli import app
from mgbench.errors import UserError
from mgbench.pipelines import session
from mgbench.pipelines.prepared import fingerprint, prepare
from mgbench.runs import oom, rundir
from mgbench.runs.shards import Shard

runner = CliRunner()
TABLES = ("steps", "sequences")


def flips_args(model, out, *extra, limit: int = 8):
    # Batches of 2: `limit` / 2 groups, dealt round-robin to the shards (8 requests: 2 groups each of 2).
    return cli_args("flips", model, out, *extra, limit=limit, batch=2, tokens=8)


def files_of(run: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under a run directory: (content, modification time in ns)."""
    return {
        str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run.rglob("*")) if p.is_file()
    }


# -- the run's identity is the same on every rank ------------------------------------------------


def options_on_rank(monkeypatch, tmp_path, local_rank: int):
    """The RunOptions and Placement `mgbench flips --device cuda` builds on torchrun rank `local_rank`
    of 2 (CUDA faked available: nothing is loaded)."""
    from mgbench.pipelines import flips

    for key, value in {"RANK": local_rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": 2}.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    built = {}
    monkeypatch.setattr(
        flips, "run_flips", lambda options, placement, *a, **k: built.update(o=options, p=placement) or True
    )
    args = ["flips", "--device", "cuda", "--dataset", "gsm8k", "--limit", "4", "--batch-size", "2"]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    return built["o"], built["p"]


def test_every_rank_fingerprints_the_run_alike(monkeypatch, tmp_path):
    """`--device cuda` stays the run's device; cuda:LOCAL_RANK is where a rank loads the model."""
    prints, loaded_on = [], []
    monkeypatch.setattr(models, "load_model", lambda name, dtype, device, *a: loaded_on.append(device))
    for rank in (0, 1):
        options, placement = options_on_rank(monkeypatch, tmp_path, rank)
        assert options.device == "cuda" and str(placement.shard) == f"{rank}/2"
        prints.append(fingerprint("flips", prepare(options, placement.shard, resume=True)))
        session.load_with_status(options)
    assert prints[0] == prints[1] and prints[0]["options"]["device"] == "cuda"
    assert loaded_on == ["cuda:0", "cuda:1"]


# -- a finished shard given --resume -------------------------------------------------------------


def test_a_finished_shard_resumes_as_done_and_writes_nothing(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = flips_args(tiny_model_dir, out, "--shard", "0/2", limit=4)
    assert runner.invoke(app, args).exit_code == 0
    before = files_of(out)
    resumed = runner.invoke(app, [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert (
        "shard 0/2" in resumed.stderr
        and "already complete" in resumed.stderr
        and "waiting for shard 1/2" in resumed.stderr
    )
    assert len(resumed.stderr.strip().splitlines()) == 1 and files_of(out) == before
    # Without --resume, the same command is still a mistake (exit 2).
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "already complete" in again.stderr

    other = flips_args(tiny_model_dir, out, "--shard", "1/2", limit=4)
    assert runner.invoke(app, other).exit_code == 0
    complete = files_of(out)
    for shard_args in (args, other):  # the whole run is complete: every shard resumes as done
        resumed = runner.invoke(app, [*shard_args, "--resume"])
        assert resumed.exit_code == 0 and "already complete" in resumed.stderr, resumed.output
    assert files_of(out) == complete
    # Resumed with other options, a finished shard is still refused as another run's.
    changed = runner.invoke(
        app, [*flips_args(tiny_model_dir, out, "--shard", "0/2", "--seed", "3", limit=4), "--resume"]
    )
    assert changed.exit_code == 2 and "shards of a different run" in changed.stderr


# -- torchrun: kill -9 one rank, resume every rank ------------------------------------------------

# Rank 1 stops (alive) after committing its first group; the test then kill -9s it.
RANK_1_STALLS = """
import os, sys, time
from pathlib import Path
from mgbench.runs import parts

commit = parts.RunWriter.commit

def commit_then_stall(self, group, tables, record):
    commit(self, group, tables, record)
    if os.environ["RANK"] == "1":
        Path(os.environ["MGBENCH_TEST_STALLED"]).write_text(str(os.getpid()))
        time.sleep(600)

parts.RunWriter.commit = commit_then_stall
from mgbench.cli import app
app(sys.argv[1:], prog_name="mgbench")
"""


@contextmanager
def started(command: list[str], **kwargs):
    """A process in a session of its own, killed with its children if the test leaves it running."""
    process = subprocess.Popen(command, start_new_session=True, **kwargs)
    try:
        yield process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def torchrun(*args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.slow  # fresh Python processes that import torch
def test_torchrun_rank_killed_then_resumed_equals_an_uninterrupted_run(tiny_model_dir, tmp_path):
    """Rank 0 finishes its shard, rank 1 is killed -9 after its first group: torchrun fails. The
    same command with --resume: rank 0 says its shard is done (exit 0, writes nothing), rank 1
    decodes its last group, and the merged tables equal an uninterrupted one-process run's."""
    reference = tmp_path / "reference"
    assert runner.invoke(app, flips_args(tiny_model_dir, reference)).exit_code == 0
    out, stalled, log = tmp_path / "run", tmp_path / "rank-1.pid", tmp_path / "killed.log"
    script = tmp_path / "rank_1_stalls.py"
    script.write_text(RANK_1_STALLS)
    env = {**os.environ, "MGBENCH_TEST_STALLED": str(stalled)}
    rank_0_done, rank_0_staging = rundir.shard_marker(out, Shard(0, 2)), out / ".shard-0-of-2.partial"
    rank_1_parts = out / ".shard-1-of-2.partial" / "parts"

    def ready() -> bool:
        return stalled.exists() and rank_0_done.exists() and not rank_0_staging.exists()

    with (
        open(log, "w") as output,
        started(
            torchrun(str(script), *flips_args(tiny_model_dir, out)), env=env, cwd=tmp_path, stdout=output, stderr=output
        ) as run,
    ):
        wait_for(lambda: ready() or run.poll() is not None, 300, "rank 0's shard and rank 1's first group")
        assert run.poll() is None, log.read_text()[-3000:]
        assert sorted(p.name for p in rank_1_parts.glob("group-*.json")) == ["group-00001.json"]
        os.kill(int(stalled.read_text()), signal.SIGKILL)
        run.wait(timeout=120)
    assert run.returncode != 0, log.read_text()[-3000:]
    assert not (out / "manifest.json").exists() and (rank_1_parts / "group-00001.json").exists()
    rank_0_files = {k: v for k, v in files_of(out).items() if "0-of-2" in k}

    resume = torchrun("-m", "mgbench", *flips_args(tiny_model_dir, out, "--resume"))
    with started(resume, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as resumed:
        stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-3000:]
    assert "shard 0/2" in stderr and "already complete" in stderr  # rank 0: done, exit 0
    assert "all shards are in" in stdout
    assert {k: v for k, v in files_of(out).items() if "0-of-2" in k} == rank_0_files  # rank 0 wrote nothing
    for name in TABLES:
        expected = pq.read_table(reference / f"{name}.parquet")
        assert rundir.read_run_table(out, name, expected.schema).equals(expected)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [m["options"]["shard"] for m in manifest["shard_manifests"]] == ["0/2", "1/2"]
    assert not list(out.glob(".shard-*"))


# -- out of memory under tensor parallelism: the ranks agree -------------------------------------


def fake_process_group(monkeypatch, other_rank_out_of_memory):
    """A 2-rank gloo group whose all_reduce(MAX) meets this rank's flag with the other rank's
    (`other_rank_out_of_memory(call index)`); returns the flags this rank sent."""
    sent = []

    def all_reduce(tensor, op=None, group=None):
        assert op == dist.ReduceOp.MAX and tensor.device.type == "cpu"
        sent.append(bool(tensor.item()))
        tensor.fill_(max(int(tensor.item()), int(other_rank_out_of_memory(len(sent) - 1))))

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return sent


def out_of_memory_above(limit: int, ran: list):
    def run_batch(members):
        ran.append(list(members))
        if len(members) > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return f"result of {''.join(members)}"

    return run_batch


def test_a_rank_that_succeeded_splits_with_the_rank_that_ran_out_of_memory(monkeypatch):
    # The other rank runs out of memory at batch size 4 only; this one never does.
    sent = fake_process_group(monkeypatch, lambda call: call == 0)
    ran, splits = [], []
    results = oom.run_splitting_on_oom(list("abcd"), out_of_memory_above(99, ran), lambda b, h: splits.append((b, h)))
    assert ran == [list("abcd"), list("ab"), list("cd")]  # the batch of 4 ran here, and was discarded
    assert [(list(m), r) for m, r in results] == [(list("ab"), "result of ab"), (list("cd"), "result of cd")]
    assert splits == [(4, 2)] and sent == [False, False, False]


def test_a_rank_out_of_memory_tells_the_others_and_all_stop_at_batch_size_1(monkeypatch):
    sent = fake_process_group(monkeypatch, lambda call: False)
    ran = []
    results = oom.run_splitting_on_oom(list("ab"), out_of_memory_above(1, ran), lambda b, h: None)
    assert [r for _, r in results] == ["result of a", "result of b"] and sent == [True, False, False]
    # The other rank runs out of memory whatever the size: every rank stops with the one-line error.
    fake_process_group(monkeypatch, lambda call: True)
    with pytest.raises(UserError, match=r"out of memory at batch size 1 \(out of memory on another rank\)"):
        oom.run_splitting_on_oom(list("ab"), out_of_memory_above(99, []), lambda b, h: None)
    # Benchmarks shrink together too.
    fake_process_group(monkeypatch, lambda call: call == 0)
    assert oom.run_shrinking_on_oom(4, lambda size: size, lambda b, h: None) == (2, 2)


def test_without_a_process_group_no_rank_is_asked(monkeypatch):
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("no process group: nothing to agree"))
    assert oom.run_splitting_on_oom(list("ab"), out_of_memory_above(1, []), lambda b, h: None)


# -- a process group that fails to start ----------------------------------------------------------


def failing_from_pretrained(monkeypatch, error: BaseException):
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: object())

    def from_pretrained(*args, **kwargs):
        raise error

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)


def failed_init() -> OSError:
    """What transformers raises when its init_process_group fails (the torch error as the cause)."""
    try:
        try:
            raise dist.DistNetworkError(
                "The client socket has timed out after 600000ms while trying to connect to (127.0.0.1, 29500).\n"
                "Exception raised from ..."
            )
        except dist.DistNetworkError as cause:
            raise OSError(
                "We tried to initialize torch.distributed for you, but it failed. Make sure you init torch "
                "distributed in your script to use distributed training."
            ) from cause
    except OSError as exc:
        return exc


def test_a_failed_process_group_start_is_said_as_such(monkeypatch, tmp_path):
    failing_from_pretrained(monkeypatch, failed_init())
    with pytest.raises(UserError) as raised:
        models.load_model(str(tmp_path), "bf16", "cpu", "sdpa", "auto")
    message = str(raised.value)
    assert "process group failed" in message and "client socket has timed out" in message
    assert "download it first" not in message and "\n" not in message

    out = tmp_path / "run"
    result = runner.invoke(app, flips_args(tmp_path, out, "--tp-plan", "auto", limit=2))
    assert result.exit_code == 2 and "process group failed" in result.stderr, result.output
    assert not out.exists()
    # Without tensor parallelism, and for a missing model, the offline-download advice stands.
    failing_from_pretrained(monkeypatch, OSError("Can't load the configuration of 'x'"))
    with pytest.raises(UserError, match="download it first"):
        models.load_model(str(tmp_path), "bf16", "cpu", "sdpa", "auto")

"""Runs that survive: kill -9 and --resume, shards (and torchrun ranks) merged into one run,
out-of-memory retries, and byte-identical tables from identical runs. Tiny random-init model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
from helpers import cli_args
from typer.testing import CliRunner

from mgbench.assets.models import placement_kwargs
from mgbench.cli import app
from mgbench.errors import UserError
from mgbench.pipelines import verify
from mgbench.runs import oom, rundir
from mgbench.runs.placement import Placement
from mgbench.runs.rundir import missing_shards
from mgbench.runs.shards import Shard, resolve_shard

runner = CliRunner()
TABLES = ("steps", "sequences")


def flips_args(model, out, *extra):
    # 6 requests at batch size 2: three groups, so a run can stop between them.
    return cli_args("flips", model, out, *extra, limit=6, batch=2, tokens=16)


def verify_args(model, out, *extra):
    return cli_args(
        "verify", model, out, "--policy", "none,margin", "--threshold", "0.5", *extra, limit=4, batch="1,2", tokens=8
    )


def invoke(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result


def parquet_bytes(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*.parquet"))}


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """One uninterrupted, unsharded flips run: what every other way of running must reproduce."""
    out = tmp_path_factory.mktemp("reference") / "run"
    invoke(flips_args(tiny_model_dir, out))
    return out


def test_identical_runs_write_identical_parquet(reference, tiny_model_dir, tmp_path):
    invoke(flips_args(tiny_model_dir, tmp_path / "again"))
    assert parquet_bytes(tmp_path / "again") == parquet_bytes(reference)
    invoke(verify_args(tiny_model_dir, tmp_path / "v1"))
    invoke(verify_args(tiny_model_dir, tmp_path / "v2"))
    assert parquet_bytes(tmp_path / "v1") == parquet_bytes(tmp_path / "v2") != {}
    for name in ("c1", "c2"):
        invoke(["calibrate", str(reference), "--out", str(tmp_path / name)])
    assert parquet_bytes(tmp_path / "c1") == parquet_bytes(tmp_path / "c2") != {}
    # Manifests differ only where they must (the time of the run, the memory it peaked at).
    m1, m2 = (json.loads((tmp_path / v / "manifest.json").read_text()) for v in ("v1", "v2"))
    assert {k for k in m1 if m1[k] != m2[k]} <= {"created_utc", "argv", "peak_memory"}


CRASHING_MAIN = """
import os, signal, sys
from mgbench.runs import parts
write_json = parts._write_json

def crash_while_committing_group_1(document, path):
    # The group's table parts are on disk, its record is not: a crash in mid-commit.
    if path.name == "group-00001.json":
        os.kill(os.getpid(), signal.SIGKILL)
    write_json(document, path)

parts._write_json = crash_while_committing_group_1
from mgbench.cli import app
app(sys.argv[1:], prog_name="mgbench")
"""


@pytest.mark.slow  # fresh Python processes that import torch
def test_kill_9_then_resume_equals_an_uninterrupted_run(reference, tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    killed = subprocess.run(
        [sys.executable, "-c", CRASHING_MAIN, *flips_args(tiny_model_dir, out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not out.exists()  # nothing published
    staging = tmp_path / ".run.partial"
    assert sorted(p.name for p in (staging / "parts").glob("group-*.json")) == ["group-00000.json"]

    rerun = runner.invoke(app, flips_args(tiny_model_dir, out))  # without --resume: refused, kept
    assert rerun.exit_code == 2 and "add --resume" in rerun.stderr and staging.exists()
    other = runner.invoke(app, flips_args(tiny_model_dir, out, "--max-new-tokens", "9", "--resume"))
    assert other.exit_code == 2 and "other options" in other.stderr and "max_new_tokens 16 -> 9" in other.stderr

    from mgbench.engines.inprocess import audit

    decoded = []  # requests decoded (alone, in lockstep with their batch)
    forced = audit.run_teacher_forced
    monkeypatch.setattr(audit, "run_teacher_forced", lambda m, p, *a, **k: decoded.extend(p) or forced(m, p, *a, **k))
    invoke(flips_args(tiny_model_dir, out, "--resume"))
    assert len(decoded) == 4  # groups 1 and 2 only: group 0 came from its part files
    assert parquet_bytes(out) == parquet_bytes(reference)
    assert not staging.exists()
    again = runner.invoke(app, flips_args(tiny_model_dir, out, "--resume"))
    assert again.exit_code == 2 and "already complete" in again.stderr


@pytest.mark.slow  # fresh Python processes that import torch
def test_two_torchrun_ranks_merge_into_the_one_process_run(reference, tiny_model_dir, tmp_path):
    out = tmp_path / "sharded"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "mgbench", *flips_args(tiny_model_dir, out)],
            env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outputs = [rank.communicate(timeout=600) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], [e[-2000:] for _, e in outputs]
    assert any("all shards are in" in stdout for stdout, _ in outputs)
    assert sorted(p.name for p in (out / "steps").iterdir()) == ["part-0-of-2.parquet", "part-1-of-2.parquet"]
    for name in TABLES:
        expected = pq.read_table(reference / f"{name}.parquet")
        assert rundir.read_run_table(out, name, expected.schema).equals(expected)
        # The parts are one pyarrow dataset, readable by pandas and DuckDB without glue.
        assert ds.dataset(out / name).count_rows() == expected.num_rows
        assert len(pd.read_parquet(out / name)) == expected.num_rows
    one, merged = (json.loads((run / "summary.json").read_text()) for run in (reference, out))
    timing = {"solo_tokens_per_s", "batched_tokens_per_s", "batched_tokens_per_s_by_batch_size"}
    assert {k: v for k, v in one.items() if k not in timing} == {k: v for k, v in merged.items() if k not in timing}

    # Commands that read runs take the sharded directory as it is.
    calibrated = runner.invoke(app, ["calibrate", str(out), "--out", str(tmp_path / "cal")])
    assert calibrated.exit_code == 0, calibrated.output
    document = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert document["steps"] == one["steps"] and document["flips"] == one["flips"]
    # report.md of the sharded run shows the one-process run's figures (all but the throughput).
    tables = {}
    for run in (reference, out):
        invoke(["report", str(run), "--out", str(tmp_path / f"report-{run.name}")])
        text = (tmp_path / f"report-{run.name}" / "report.md").read_text()
        header, _, row = [line for line in text.splitlines() if line.startswith("|")][:3]
        tables[run] = dict(zip(header.split(" | "), row.split(" | ")))
    assert tables[reference].keys() == tables[out].keys() >= {"steps", "flips", "flip rate", "determinism"}
    figures = [k for k in tables[reference] if "tok/s" not in k]
    assert [tables[out][k] for k in figures] == [tables[reference][k] for k in figures]
    assert tables[out]["steps"] == str(one["steps"]) and tables[out]["flips"] == str(one["flips"])


def test_incomplete_sharded_run_is_refused_by_readers(tiny_model_dir, tmp_path):
    out = tmp_path / "half"
    invoke(flips_args(tiny_model_dir, out, "--shard", "2/3"))
    assert not (out / "manifest.json").exists()
    for args in (
        ["calibrate", str(out), "--out", str(tmp_path / "c")],
        ["report", str(out), "--out", str(tmp_path / "r")],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "unfinished shards: 0/3, 1/3" in result.stderr, result.output
    again = runner.invoke(app, flips_args(tiny_model_dir, out, "--shard", "2/3"))
    assert again.exit_code == 2 and "already complete" in again.stderr
    mismatched = runner.invoke(app, flips_args(tiny_model_dir, out, "--shard", "0/3", "--seed", "5"))
    assert mismatched.exit_code == 2 and "shards of a different run" in mismatched.stderr


def test_sharded_run_gated_on_a_baseline_streams_the_shards_parts(reference, tiny_model_dir, tmp_path):
    """The last shard computes the whole run's summary and the --baseline test from the shards'
    part files (streamed, not merged): the same figures as the one-process run, and against that
    run as its baseline (negative control by construction: the same audit) every step pairs, p = 1."""
    out = tmp_path / "sharded"
    invoke(flips_args(tiny_model_dir, out, "--shard", "1/2", "--baseline", str(reference)))
    assert not (out / "summary.json").exists()
    invoke(flips_args(tiny_model_dir, out, "--shard", "0/2", "--baseline", str(reference)))
    assert sorted(p.name for p in (out / "steps").iterdir()) == ["part-0-of-2.parquet", "part-1-of-2.parquet"]
    one, merged = (json.loads((run / "summary.json").read_text()) for run in (reference, out))
    steps = len(pq.read_table(reference / "steps.parquet"))
    tested = merged.pop("gate")
    assert tested["passed"] and tested["baseline"]["tests"]["flip_rate"]["pairs"] == steps == one["steps"]
    assert tested["baseline"]["tests"]["flip_rate"]["p_value"] == 1.0
    timing = {"solo_tokens_per_s", "batched_tokens_per_s", "batched_tokens_per_s_by_batch_size"}
    assert {k: v for k, v in one.items() if k not in timing} == {k: v for k, v in merged.items() if k not in timing}


def test_verify_shards_merge_into_the_one_process_run(tiny_model_dir, tmp_path):
    invoke(verify_args(tiny_model_dir, tmp_path / "one"))
    for shard in ("1/2", "0/2"):
        invoke(verify_args(tiny_model_dir, tmp_path / "sharded", "--shard", shard))
    for name, schema in verify.SCHEMAS.items():
        expected = pq.read_table(tmp_path / "one" / f"{name}.parquet")
        assert rundir.read_run_table(tmp_path / "sharded", name, schema).equals(expected)
    one, merged = (json.loads((tmp_path / run / "summary.json").read_text()) for run in ("one", "sharded"))
    assert one["policies"] == merged["policies"] and one["passed"] == merged["passed"]


def out_of_memory_above(limit, run):
    """Wrap `run(model, prompts, ...)` to fail like the CUDA allocator on batches above `limit`."""

    def wrapped(model, prompts, *args, **kwargs):
        if len(prompts) > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return run(model, prompts, *args, **kwargs)

    return wrapped


def test_out_of_memory_retries_smaller_batches_and_says_so(planted_model_dir, tmp_path, monkeypatch):
    from mgbench.engines.inprocess import audit

    planted = invoke(flips_args(planted_model_dir, tmp_path / "planted"))
    assert json.loads((tmp_path / "planted" / "summary.json").read_text())["flips"] > 0, planted.output
    monkeypatch.setattr(audit, "run_teacher_forced", out_of_memory_above(1, audit.run_teacher_forced))
    result = invoke(flips_args(planted_model_dir, tmp_path / "run"))
    assert "out of memory at batch size 2: retrying it as batches of 1" in result.stderr
    sequences = pd.read_parquet(tmp_path / "run" / "sequences.parquet")
    assert set(sequences["batch_size"]) == {1} and len(sequences) == 6
    assert not sequences.duplicated(["batch_id", "row"]).any()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["oom_splits"] == [{"batch_size": 2, "retried_as": 1}] * 3
    # Batch size 1 is solo decoding: the planted head, which flips the batches of 2 above, cannot
    # act on batches of one, so the retried run has no flips by construction.
    assert summary["flips"] == 0


def test_out_of_memory_at_batch_size_1_is_a_clear_error(tiny_model_dir, tmp_path, monkeypatch):
    from mgbench.engines.inprocess import audit

    monkeypatch.setattr(audit, "run_teacher_forced", out_of_memory_above(0, audit.run_teacher_forced))
    result = runner.invoke(app, flips_args(tiny_model_dir, tmp_path / "run"))
    assert result.exit_code == 2 and "out of memory at batch size 1" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_verify_and_compare_retry_after_out_of_memory(tiny_model_dir, tmp_path, monkeypatch):
    from mgbench.pipelines import compare

    monkeypatch.setattr(verify, "run_free", out_of_memory_above(1, verify.run_free))
    result = invoke(verify_args(tiny_model_dir, tmp_path / "v"))
    assert "out of memory at batch size 2" in result.stderr
    assert set(pd.read_parquet(tmp_path / "v" / "sequences.parquet")["batch_size"]) == {1}
    monkeypatch.setattr(compare, "run_free", out_of_memory_above(1, compare.run_free))
    result = invoke(
        [
            "compare",
            "--model",
            str(tiny_model_dir),
            "--limit",
            "2",
            "--batch-size",
            "2",
            "--max-new-tokens",
            "4",
            "--threshold",
            "0.5",
            "--repeats",
            "1",
            # the retry wraps every configuration alike: one verified configuration shows it
            "--only",
            "always/exact",
            "--out",
            str(tmp_path / "c"),
        ]
    )
    assert "out of memory at batch size 2" in result.stderr
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert summary["batch_size"] == 1 and summary["requested_batch_size"] == 2


def test_out_of_memory_is_recognised_only_for_memory_errors():
    assert oom.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert oom.is_out_of_memory(
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")
    )
    assert not oom.is_out_of_memory(RuntimeError("shape mismatch"))
    with pytest.raises(ValueError):
        oom.run_splitting_on_oom([1, 2], lambda m: (_ for _ in ()).throw(ValueError("bug")), lambda b, h: None)


def test_shards_split_whole_groups_round_robin():
    shards = [Shard(i, 3) for i in range(3)]
    assert [[g for g in range(7) if s.owns(g)] for s in shards] == [[0, 3, 6], [1, 4], [2, 5]]
    assert Shard.parse(" 1 / 4 ") == Shard(1, 4)
    with pytest.raises(UserError):
        Shard.parse("1-4")


def test_torchrun_environment_sets_the_shard_except_under_tensor_parallelism(monkeypatch):
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    assert resolve_shard(None, environ=env) == Shard(3, 4)
    assert resolve_shard("0/2", environ=env) == Shard(0, 2)  # --shard wins
    assert resolve_shard(None, tensor_parallel=True, environ=env) == Shard()
    assert resolve_shard(None, environ={}) == Shard()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # Tensor parallel: every rank computes, rank 0 alone writes.
    assert Placement.resolve(None, False, "auto", Path("o")).writes is False
    assert Placement.resolve(None, False, None, Path("o")).shard == Shard(3, 4)
    tensor_parallel = placement_kwargs("cuda:1", "auto")
    assert "device_map" not in tensor_parallel
    assert getattr(tensor_parallel.get("distributed_config"), "tp_plan", tensor_parallel.get("tp_plan")) == "auto"
    assert placement_kwargs("cpu", None) == {"device_map": "cpu"}


def first_difference(a, b) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.slow  # fresh Python processes that import torch
def test_tensor_parallel_under_torchrun_writes_one_run(reference, tiny_model_dir, tmp_path):
    """The documented command, on CPU (gloo): both ranks hold half of each layer, rank 0 publishes.

    Against the one-process run on the same requests (the reference's rows of them: the same
    batches, rows and pads), the tables share their schema and every column that says what was
    decoded. Their figures cannot be equal by construction: the row-parallel layers (o_proj,
    down_proj) sum each rank's bf16 partial result in an all-reduce, another rounding than one
    full GEMM, so the logits move by a few ulps; and this model's planted near-ties (every step's
    top-2 within about 0.012 logit) turn that into other greedy tokens, solo ones included. What
    must hold: each request's solo tokens agree until the first step where they differ, and there
    the two tokens are a planted near-tie pair (lm_head rows 2k and 2k+1)."""
    out = tmp_path / "tp"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "-m",
            "mgbench",
            *flips_args(tiny_model_dir, out, "--limit", "2", "--tp-plan", "auto", "--device", "cpu"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tp"]  # rank 1 wrote nothing
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"]["tp_plan"] == "auto" and manifest["options"]["shard"] == "0/1"
    # Rank 0's cache holds its half of the K/V heads: the steps table's K/V deltas are labelled so.
    assert manifest["tensor_parallel"]["kv_delta_heads"] == "rank 0's kv heads only"
    assert manifest["tensor_parallel"]["ranks"] == 2
    for name in TABLES:
        assert pq.read_schema(out / f"{name}.parquet").equals(pq.read_schema(reference / f"{name}.parquet"))
    tp = pd.read_parquet(out / "sequences.parquet")
    one = pd.read_parquet(reference / "sequences.parquet")
    one = one[one["request_id"].isin(tp["request_id"])].reset_index(drop=True)
    assert len(tp) == len(one) == 2
    decoded = ["model", "dataset", "request_id", "row", "batch_size", "pad_len", "prompt_len", "policy"]
    pd.testing.assert_frame_equal(tp[decoded], one[decoded])
    assert [list(p) for p in tp["prompt_ids"]] == [list(p) for p in one["prompt_ids"]]
    # batch_id is numbered per group of the run's requests: compare which requests share a batch.
    batches = [run.groupby("batch_id")["request_id"].apply(tuple).tolist() for run in (tp, one)]
    assert batches[0] == batches[1]
    tp_steps, one_steps = pd.read_parquet(out / "steps.parquet"), pd.read_parquet(reference / "steps.parquet")
    keys = ["model", "dataset", "request_id", "row", "batch_size", "pad_len", "method", "step"]
    for tp_row, one_row in zip(tp.itertuples(), one.itertuples()):
        solo_tp, solo_one = list(tp_row.solo_ids), list(one_row.solo_ids)
        split = first_difference(solo_tp, solo_one)
        last = min(len(solo_tp), len(solo_one)) - 1 if split is None else split
        assert split is None or solo_tp[split] == solo_one[split] ^ 1, (tp_row.request_id, split)
        # The teacher-forced steps of the shared solo history: the same keys, the same solo tokens.
        rows = [
            steps[(steps["request_id"] == tp_row.request_id) & (steps["step"] <= last)].reset_index(drop=True)
            for steps in (tp_steps, one_steps)
        ]
        pd.testing.assert_frame_equal(rows[0][keys], rows[1][keys])
        assert rows[0]["solo_token"].tolist() == solo_tp[: last + 1]
        assert rows[1]["solo_token"].tolist() == solo_one[: last + 1]


def test_needle_mode_places_each_request_among_fillers(planted_model_dir, tmp_path):
    out = tmp_path / "needle"
    invoke(
        [
            "verify",
            "--model",
            str(planted_model_dir),
            "--dataset",
            "gsm8k",
            "--limit",
            "3",
            "--batch-sizes",
            "4",
            "--max-new-tokens",
            "6",
            "--policy",
            "always",
            "--needle",
            "--out",
            str(out),
        ]
    )
    sequences = pd.read_parquet(out / "sequences.parquet")
    # One verified row per batch of 4 (the rest are fillers), at a seeded row; exact repair holds.
    assert len(sequences) == 3 and set(sequences["batch_size"]) == {4} and sequences["batch_id"].is_unique
    assert sequences["row"].between(0, 3).all() and sequences["identical"].all()
    # The planted head flips every multi-row step: determinism holds because repairs happened.
    assert pd.read_parquet(out / "steps.parquet")["repaired"].sum() > 0


def test_a_crash_before_the_sharded_summary_is_finished_by_resume(tiny_model_dir, tmp_path, monkeypatch):
    from mgbench.engines.inprocess import audit
    from mgbench.runs import parts

    out = tmp_path / "run"
    invoke(flips_args(tiny_model_dir, out, "--limit", "4", "--shard", "0/2"))
    write_json = parts._write_json

    def interrupted_at_the_manifest(document, path):
        if path.name == "manifest.json":
            raise KeyboardInterrupt
        write_json(document, path)

    monkeypatch.setattr(parts, "_write_json", interrupted_at_the_manifest)
    assert runner.invoke(app, flips_args(tiny_model_dir, out, "--limit", "4", "--shard", "1/2")).exit_code == 130
    monkeypatch.setattr(parts, "_write_json", write_json)
    assert not (out / "manifest.json").exists() and not missing_shards(out)
    refused = runner.invoke(app, flips_args(tiny_model_dir, out, "--limit", "4", "--shard", "1/2"))
    assert refused.exit_code == 2 and "already complete" in refused.stderr
    monkeypatch.setattr(audit, "run_solo", lambda *a, **k: pytest.fail("finishing decodes nothing"))
    invoke(flips_args(tiny_model_dir, out, "--limit", "4", "--shard", "1/2", "--resume"))
    assert json.loads((out / "manifest.json").read_text())["shard"] is None
    assert json.loads((out / "summary.json").read_text())["sequences"] == 4

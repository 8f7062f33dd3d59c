"""The example scripts examples/gpu_check.py and examples/bench_memory.py, run as a user runs them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_CHECK = ROOT / "examples" / "gpu_check.py"
BENCH_MEMORY = ROOT / "examples" / "bench_memory.py"
COMMANDS = (
    "flips",
    "calibrate",
    "verify",
    "compare",
    "probe",
    "flips --kernels fixed-order",
    "flips --batch-invariant",
    "flips --kernels fixed-order, large batch",
)


def run_script(script: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},
    )


def test_gpu_check_without_cuda_says_so_in_one_line_and_exits_2(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: the script would run the check")
    done = run_script(GPU_CHECK, "--out", str(tmp_path / "out"), timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "CUDA is not available" in lines[0], done.stderr
    assert not (tmp_path / "out").exists()  # nothing was started


@pytest.mark.slow
@pytest.mark.full  # every command it runs has tests of its own; 5 minutes of the suite's 10
def test_gpu_check_quick_on_cpu_runs_every_command(tmp_path):
    out = tmp_path / "check"
    done = run_script(GPU_CHECK, "--device", "cpu", "--quick", "--out", str(out), timeout=3000)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    document = (out / "gpu_check.md").read_text()
    rows = [line for line in document.splitlines() if line.startswith("| ") and not line.startswith("| command")]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == list(COMMANDS)
    assert all(" | ok | " in row for row in rows), document
    for command in COMMANDS:
        assert command in done.stdout
    assert "flip rate" in document and "TAU" in document and "determinism" in document
    for run in ("flips", "calibrate", "verify", "compare", "probe"):
        assert (out / run / "manifest.json").is_file()


@pytest.mark.slow  # fresh Python processes that import torch
def test_bench_memory_tiny_sweep_prints_its_table(tmp_path):
    done = run_script(
        BENCH_MEMORY,
        *("--vocab", "4096", "--max-new-tokens", "8,16", "--limit", "2", "--batch-size", "2"),
        *("--keep", str(tmp_path / "kept")),
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "peak memory of mgbench flips" in out and "peak RSS MB" in out and "torch" in out.splitlines()[0]
    rows = [line for line in out.splitlines() if "4,096" in line and "│" in line]
    assert len(rows) == 2, out
    # every request generated max_new_tokens (the EOS rows of the random head are zero)
    assert "32 (2 x >= 16)" in out and "16 (2 x >= 8)" in out, out
    runs = sorted(p.name for p in (tmp_path / "kept").glob("*/run-*"))
    assert runs == ["run-v4096-n16", "run-v4096-n8"]


@pytest.mark.slow  # fresh Python processes that import torch
@pytest.mark.full  # the script's error path (about 15 s); the sweep above runs it every time
def test_bench_memory_reports_a_failing_run_and_exits_nonzero(tmp_path):
    done = run_script(
        BENCH_MEMORY,
        *("--vocab", "4096", "--max-new-tokens", "8", "--limit", "2", "--batch-size", "2"),
        *("--dataset", "no-such-dataset"),
        timeout=300,
    )
    assert done.returncode == 1
    assert "mgbench flips failed (exit 2)" in done.stderr and "no-such-dataset" in done.stderr


def test_gpu_check_refuses_an_unknown_also_alias_before_running_anything(tmp_path):
    done = run_script(
        GPU_CHECK, "--device", "cpu", "--also", "no-such-model", "--out", str(tmp_path / "o"), timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no-such-model" in lines[0], done.stderr
    assert not (tmp_path / "o").exists()

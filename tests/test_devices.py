"""The run's device, wherever the CUDA path names one: synchronizes, the current device, the cache
clear, the probe's timing and status line, peak memory in the manifest. Checked on CPU with the
CUDA calls recorded (a fake "cuda:1"), and with tiny random-init models."""

import json
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import random_prompts, tiny_llama
from typer.testing import CliRunner

from mgbench.assets import models
from mgbench.cli import app
from mgbench.engines.inprocess.kernels import invariance_probe
from mgbench.engines.inprocess.kernels.attention_forms import PER_ROW, AttentionForm
from mgbench.engines.inprocess.kernels.batch_invariant import InvariancePlan
from mgbench.engines.inprocess.stopwatch import Stopwatch
from mgbench.pipelines import probe
from mgbench.render.console import err_console
from mgbench.runs import oom, rundir

runner = CliRunner()


@pytest.fixture
def cuda_calls(monkeypatch):
    """torch.cuda's device calls recorded instead of run: [(call, device)]."""
    calls = []
    for name in ("synchronize", "set_device"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None, name=name: calls.append((name, str(device))))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(("empty_cache", None)))
    return calls


def test_stopwatch_and_probe_timing_synchronize_the_runs_device(cuda_calls):
    watch = Stopwatch("cuda:1")
    with watch.section("verify"):
        pass
    assert cuda_calls == [("synchronize", "cuda:1")] * 2 and "verify" in watch.seconds
    cuda_calls.clear()
    invariance_probe._time_ms(lambda: None, "cuda:1", repeats=1)
    assert cuda_calls and set(cuda_calls) == {("synchronize", "cuda:1")}
    cuda_calls.clear()
    Stopwatch("cpu")
    invariance_probe._time_ms(lambda: None, "cpu", repeats=1)
    assert cuda_calls == []


def test_the_model_is_loaded_with_its_gpu_made_current(cuda_calls, monkeypatch, tmp_path):
    import transformers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: object())
    tiny = tiny_llama(hidden=32, vocab=64, layers=1)

    def from_pretrained(*args, **kwargs):
        cuda_calls.append(("from_pretrained", kwargs["device_map"]))
        return tiny

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    lm = models.load_model(str(tmp_path), "bf16", "cuda:1", "sdpa")
    assert lm.device == "cuda:1"
    assert cuda_calls == [("set_device", "cuda:1"), ("from_pretrained", "cuda:1")]
    cuda_calls.clear()
    models.load_model(str(tmp_path), "bf16", "cpu", "sdpa")
    assert cuda_calls == [("from_pretrained", "cpu")]


def test_memory_is_released_only_where_cuda_was_used(cuda_calls, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    oom.release_memory()
    assert cuda_calls == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    oom.release_memory()
    assert cuda_calls == [("empty_cache", None)]


def test_peak_memory_names_the_runs_device(monkeypatch):
    cpu = rundir.peak_memory("cpu")
    assert cpu["kind"] == "process peak RSS" and cpu["device"] == "cpu" and cpu["bytes"] > 10 * 2**20
    asked = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: asked.append(str(device)) or 123)
    assert rundir.peak_memory("cuda:1") == {"bytes": 123, "kind": "cuda allocated", "device": "cuda:1"}
    assert asked == ["cuda:1"]


def test_a_flips_manifest_records_peak_memory(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = ["flips", "--model", str(tiny_model_dir), "--dataset", "gsm8k", "--limit", "2", "--batch-size", "2"]
    result = runner.invoke(app, [*args, "--max-new-tokens", "4", "--out", str(out)])
    assert result.exit_code == 0, result.output
    peak = json.loads((out / "manifest.json").read_text())["peak_memory"]
    assert peak["kind"] == "process peak RSS" and peak["device"] == "cpu" and peak["bytes"] > 10 * 2**20


def test_the_probe_times_the_step_not_the_cache_assembly(monkeypatch):
    """A padded cache that takes 100 ms to assemble (the probe assembles one per timed form and row
    count): the probe's step times, a few ms for this model, stay below it."""
    model = tiny_llama(hidden=64, vocab=512, layers=2)
    [prompt] = random_prompts([12], 512)
    assemble = invariance_probe._assembled

    def slow_assembly(*args):
        time.sleep(0.1)
        return assemble(*args)

    monkeypatch.setattr(invariance_probe, "_assembled", slow_assembly)
    report = invariance_probe.probe_model(model, prompt, rows=3)
    assert 0 < report.plain_step_ms < 100 and 0 < report.invariant_step_ms < 100


def invariant_run_line(monkeypatch, machine: dict, attention: AttentionForm) -> str:
    """The status line a --batch-invariant run prints after its probe (the probe faked)."""
    report = SimpleNamespace(
        plan=InvariancePlan({"model.layers.0.mlp.down_proj": None}, attention),
        machine=machine,
        exact=True,
        invariant_rows_differing=[],
    )
    monkeypatch.setattr(probe, "probe_for_run", lambda lm, run: report)
    run = SimpleNamespace(options=SimpleNamespace(batch_invariant=True, batch_sizes=(8,)))
    with err_console.capture() as captured:
        assert probe.probe_if_invariant(object(), run) is report
    return captured.get()


def test_the_batch_invariant_line_names_the_device_and_attention_form_that_ran(monkeypatch):
    gpu = {"cpu": "Intel Xeon", "cpu_capability": "AVX512", "device": "cuda:1", "gpu": "NVIDIA H200"}
    line = invariant_run_line(monkeypatch, gpu, AttentionForm("aligned", 8))
    assert "NVIDIA H200 (cuda:1)" in line and "Xeon" not in line
    assert "attention aligned groups (pads mod 8" in line and "per row" not in line
    assert "1 varying modules" in line
    cpu = {"cpu": "Intel Xeon", "cpu_capability": "AVX512", "device": "cpu"}
    line = invariant_run_line(monkeypatch, cpu, PER_ROW)
    assert "Intel Xeon, AVX512" in line and "attention per row (unpadded keys, as alone)" in line


def test_decode_timers_record_on_the_runs_device_stream(monkeypatch):
    """DecodeTimer and the lockstep's SectionTimer record their CUDA events on the stream of the
    run's device (a fake "cuda:1"), not on whatever GPU is current."""
    from mgbench.engines.inprocess.stopwatch import DecodeTimer, SectionTimer

    streams, recorded = [], []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self, stream=None):
            recorded.append(stream)

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 5.0

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams.append(str(device)) or f"s:{device}")
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    assert DecodeTimer("cuda:1").seconds() == 0.005
    timer = SectionTimer("cuda:1")
    for _ in range(3):
        with timer:
            pass
    assert timer.seconds() == 0.015
    assert set(streams) == {"cuda:1"} and recorded == ["s:cuda:1"] * 8

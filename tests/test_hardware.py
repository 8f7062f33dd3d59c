"""The kernel family a run executes under: which pairs of kernel variables run, refused in one line."""

from typer.testing import CliRunner

from mgbench.cli import app
from mgbench.runs.machine import kernel_environment_problem, supported_capabilities

AVX2_CPU = {"sse4_2", "avx", "avx2", "fma"}
AVX512_CPU = AVX2_CPU | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "amx_bf16"}


def pair(capability=None, isa=None):
    return {"ATEN_CPU_CAPABILITY": capability, "ONEDNN_MAX_CPU_ISA": isa}


def test_supported_capabilities_follow_the_cpu_flags():
    assert supported_capabilities({"sse4_2"}) == ["default"]
    assert supported_capabilities(AVX2_CPU) == ["default", "avx2"]
    assert supported_capabilities(AVX512_CPU) == ["default", "avx2", "avx512"]


def test_pairs_that_run_are_accepted():
    for cpu in (AVX2_CPU, AVX512_CPU):
        assert kernel_environment_problem(pair(), cpu) is None
        assert kernel_environment_problem(pair("default", "AVX2"), cpu) is None
        assert kernel_environment_problem(pair("avx2", "AVX2"), cpu) is None
    assert kernel_environment_problem(pair("avx2"), AVX2_CPU) is None  # the CPU's own family
    assert kernel_environment_problem(pair("avx512"), AVX512_CPU) is None
    assert kernel_environment_problem(pair("avx2"), set()) is None  # not an x86 cpuinfo: not checked


def test_pairs_that_cannot_run_are_refused_in_one_line():
    refused = {
        "ATEN_CPU_CAPABILITY=avx512: this CPU has no AVX512": (pair("avx512"), AVX2_CPU),
        "not a torch kernel family": (pair("avx9000"), AVX2_CPU),
        "needs ONEDNN_MAX_CPU_ISA=AVX2 as well (got unset)": (pair("avx2"), AVX512_CPU),
        "needs ONEDNN_MAX_CPU_ISA=AVX2 as well (got AVX512_CORE_AMX)": (pair("default", "AVX512_CORE_AMX"), AVX512_CPU),
        "ONEDNN_MAX_CPU_ISA=AVX3 is not a oneDNN ISA": (pair(None, "AVX3"), AVX2_CPU),
    }
    for message, (environment, cpu) in refused.items():
        problem = kernel_environment_problem(environment, cpu)
        assert problem and message in problem and "\n" not in problem


def test_cli_refuses_an_unknown_family_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx9000")
    monkeypatch.setattr("mgbench.runs.machine.cpu_flags", lambda: AVX2_CPU)
    result = CliRunner().invoke(app, ["flips", "--limit", "1", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "ATEN_CPU_CAPABILITY=avx9000" in result.stderr
    assert not (tmp_path / "run").exists()

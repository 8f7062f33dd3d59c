"""Names of the machine a figure was measured on (the processor model, not just its architecture)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The processor's model name ("AMD EPYC", "Intel(R) Xeon(R) ..."), from /proc/cpuinfo on Linux."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --- the kernel family torch and oneDNN run ---------------------------------------------------
# `ATEN_CPU_CAPABILITY` picks torch's vector kernels, `ONEDNN_MAX_CPU_ISA` caps oneDNN's; a run's
# figures hold for the family it ran under (`make test-matrix` runs the suite under each).
KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
TORCH_CAPABILITIES = ("default", "avx2", "avx512")  # the x86 families torch's CPU build carries
ONEDNN_BELOW_AVX512 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2")
ONEDNN_ISAS = ONEDNN_BELOW_AVX512 + (
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
    "DEFAULT",
)
_AVX512_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


def kernel_environment(environ=None) -> dict:
    environ = os.environ if environ is None else environ
    return {name: environ.get(name) for name in KERNEL_VARIABLES}


def cpu_flags() -> set[str]:
    """The x86 feature flags of /proc/cpuinfo (empty elsewhere: other CPUs are not checked)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def supported_capabilities(flags: set[str]) -> list[str]:
    """The torch kernel families this CPU can run, lowest first."""
    families = ["default"]
    if {"avx2", "fma"} <= flags:
        families.append("avx2")
        if _AVX512_FLAGS <= flags:
            families.append("avx512")
    return families


def kernel_environment_problem(environment: dict, flags: set[str]) -> str | None:
    """Why this pair of kernel variables cannot run here, in one line; None when it can."""
    if not flags:
        return None
    capability, isa = environment.get("ATEN_CPU_CAPABILITY"), environment.get("ONEDNN_MAX_CPU_ISA")
    supported = supported_capabilities(flags)
    if isa is not None and isa.upper() not in ONEDNN_ISAS:
        return f"ONEDNN_MAX_CPU_ISA={isa} is not a oneDNN ISA (for example AVX2 or AVX512_CORE_AMX)"
    if capability is None:
        return None
    if capability.lower() not in TORCH_CAPABILITIES:
        return f"ATEN_CPU_CAPABILITY={capability} is not a torch kernel family (one of {', '.join(TORCH_CAPABILITIES)})"
    if capability.lower() not in supported:
        return (
            f"ATEN_CPU_CAPABILITY={capability}: this CPU has no {capability.upper()} (it runs {', '.join(supported)})"
        )
    below_native = supported.index(capability.lower()) < len(supported) - 1
    if "avx512" in supported and below_native and (isa is None or isa.upper() not in ONEDNN_BELOW_AVX512):
        # oneDNN would pack bf16 for AVX-512 kernels that torch's narrower SDPA build cannot feed.
        return (
            f"ATEN_CPU_CAPABILITY={capability} on this AVX-512 CPU needs ONEDNN_MAX_CPU_ISA=AVX2 as well "
            f"(got {isa or 'unset'}): set both"
        )
    return None


def check_kernel_environment() -> None:
    """Refuse, in one line, a kernel pair torch would crash on or silently not run."""
    from mgbench.errors import UserError

    problem = kernel_environment_problem(kernel_environment(), cpu_flags())
    if problem:
        raise UserError(problem)


def matrix_environments(flags: set[str]) -> list[str]:
    """The kernel pairs `make test-matrix` reruns the suite under: every family below AVX-512 this
    CPU runs, each with oneDNN capped to match (the suite's own run covers the CPU's native pair)."""
    return [
        f"ATEN_CPU_CAPABILITY={family} ONEDNN_MAX_CPU_ISA=AVX2"
        for family in supported_capabilities(flags)
        if family != "avx512"
    ]


def machine_facts(device: str) -> dict:
    """What the figures depend on: the processor, the ISA torch dispatches to, the accelerator."""
    import torch

    facts = {
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "kernel_environment": kernel_environment(),
    }
    if torch.device(device).type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return facts


if __name__ == "__main__":  # `python -m mgbench.runs.machine`: one kernel pair per line, for the Makefile
    print("\n".join(matrix_environments(cpu_flags())))

"""Names of the machine a figure was measured on (the processor model, not just its architecture)."""

from __future__ import annotations

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

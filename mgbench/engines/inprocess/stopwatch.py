"""Named time sections inside the decode loop (where verification time goes).

Device-aware: on CUDA each section synchronizes first and last, so a section holds the kernels
it launched; that costs throughput, so a Stopwatch is only attached when a breakdown is asked for.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class Stopwatch:
    def __init__(self, device: str = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def section(self, name: str):
        if self.cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.seconds[name] += time.perf_counter() - start


class NoStopwatch:
    """The default: sections cost nothing."""

    seconds: dict[str, float] = {}

    @contextmanager
    def section(self, name: str):
        yield

"""Timing: decode loops' elapsed time (CUDA events on a GPU) and named sections inside them
(where verification time goes).

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


def synchronize(device) -> None:
    """Wait for queued kernels so wall-clock readings cover the work they claim to."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class DecodeTimer:
    """Elapsed seconds of a decode loop: CUDA events on a GPU (queued with the kernels they
    bracket), perf_counter after a synchronize elsewhere."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            # Recorded on the run's device's stream, whichever GPU is current.
            self.stream = torch.cuda.current_stream(torch.device(device))
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.begin.record(self.stream)
        else:
            self.started = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            self.end.record(self.stream)
            self.end.synchronize()
            return self.begin.elapsed_time(self.end) / 1000.0
        return time.perf_counter() - self.started


class SectionTimer:
    """Seconds spent inside `with timer:` blocks, summed: CUDA events on the run's GPU (read once,
    at the end), perf_counter elsewhere. Times the solo lanes of a lockstep loop apart from the batch."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.stream = torch.cuda.current_stream(torch.device(device)) if self.cuda else None
        self.spans: list = []
        self.total = 0.0

    def __enter__(self):
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.begin.record(self.stream)
        else:
            self.started = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.stream)
            self.spans.append((self.begin, end))
        else:
            self.total += time.perf_counter() - self.started

    def seconds(self) -> float:
        if self.spans:
            self.spans[-1][1].synchronize()
            self.total += sum(begin.elapsed_time(end) for begin, end in self.spans) / 1000.0
            self.spans = []
        return self.total

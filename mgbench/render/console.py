"""The terminal: stdout and stderr consoles and the progress bars of long passes (rich).

Results go to stdout (or JSON there with --json); progress, status lines and errors to stderr.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def log_width(stream) -> int | None:
    """Full width where output goes to a file or a CI log (no cut columns, no ellipses): rich's
    80-column default applies only when the stream is not a terminal and COLUMNS is unset."""
    if "COLUMNS" in os.environ or stream.isatty():
        return None
    return 10_000


console = Console(width=log_width(sys.stdout))


err_console = Console(stderr=True, width=log_width(sys.stderr))


def progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=False,
    )


@contextmanager
def pass_progress(
    solo_label: str, batched_label: str, requests: int, batches_per_request: int, repeat_label: str | None = None
):
    """Bars for the solo, the batched and (an endpoint's) solo-repeat passes; yields the
    ProgressFn that drives them."""
    with progress_bar() as progress:
        per_request = {"solo": 1, "batched": batches_per_request, **({"solo-repeat": 1} if repeat_label else {})}
        labels = {"solo": solo_label, "batched": batched_label, "solo-repeat": repeat_label}
        tasks = {phase: progress.add_task(labels[phase], total=requests * k) for phase, k in per_request.items()}

        def advance(phase: str, n: int) -> None:
            if phase == "total":  # what is left to decode (this shard, groups not yet committed)
                for name, k in per_request.items():
                    progress.update(tasks[name], total=n * k)
            else:
                progress.advance(tasks[phase], n)

        yield advance

"""The one interface the flips audit decodes through, whichever engine answers.

- `InProcessEngine` (engines/inprocess/): the shared decode engine on a loaded model;
  teacher-forced steps, so every step is comparable and logits, ulps and K/V are measured.
- `EndpointEngine` (engines/endpoint/): an OpenAI-compatible server seen as a black box;
  first-divergence steps from tokens and top-k logprobs.

Both yield the same per-group records (`AuditRecords`); the pipeline that commits, resumes,
summarises and reports them (pipelines/flips.py, analysis/) does not know which engine ran.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterator, Protocol

from mgbench.runs.groups import ProgressFn
from mgbench.runs.oom import SplitFn


@dataclass
class AuditRecords:
    steps: list[dict] = field(default_factory=list)  # one dict of equal-length columns per batch row
    sequences: list[dict] = field(default_factory=list)  # one dict per (request, batch size)
    solo_tokens: int = 0
    solo_seconds: float = 0.0
    batched_tokens: dict[int, int] = field(default_factory=dict)
    batched_seconds: dict[int, float] = field(default_factory=dict)
    oom_splits: list[dict] = field(default_factory=list)  # batches retried smaller after out-of-memory
    extra: dict = field(default_factory=dict)  # engine-specific figures of the group (endpoint: solo repeat)


class AuditEngine(Protocol):
    method: str  # "teacher-forced" or "first-divergence" (the steps table's method column)
    label: str  # the engine's name in summaries and side-by-side reports
    tokenizer: object  # applies the chat template: both engines audit identical token-id prompts

    def audit(
        self, run, prompts: list[list[int]], wanted, on_progress: ProgressFn, on_split: SplitFn
    ) -> Iterator[tuple[int, AuditRecords]]:
        """(group index, records) for every wanted group, in group order."""

    def manifest(self, run) -> dict:
        """The run's manifest.json."""

    def close(self) -> None:
        """Release what the engine holds (a connection pool, an event loop)."""


def engine_kind(run) -> str:
    return "endpoint" if run.endpoint is not None else "in-process"


def run_options(run) -> dict:
    """The options a flips manifest records (a --baseline compares the engine kind too)."""
    return {
        **asdict(run.options),
        "max_new_tokens": run.max_new_tokens,
        "shard": str(run.shard),
        "engine": engine_kind(run),
    }

"""The one interface the flips audit decodes through, whichever engine answers.

- `InProcessEngine` (mgbench/engine/): the shared decode engine on a loaded model; teacher-forced
  steps, so every step is comparable and logits, ulps and K/V are measured.
- `EndpointEngine` (mgbench/endpoint/): an OpenAI-compatible server seen as a black box;
  first-divergence steps from tokens and top-k logprobs.

Both yield the same per-group records (grouping.AuditRecords); the pipeline that commits,
resumes, summarises and reports them (flips.py, analysis.py) does not know which engine ran.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Iterator, Protocol

from .grouping import AuditRecords, ProgressFn
from .oom import SplitFn


class AuditEngine(Protocol):
    method: str  # "teacher-forced" or "first-divergence" (the steps table's method column)
    label: str  # the engine's name in summaries and side-by-side reports
    tokenizer: object  # applies the chat template: both engines audit identical token-id prompts

    def audit(self, run, prompts: list[list[int]], wanted, on_progress: ProgressFn,
              on_split: SplitFn) -> Iterator[tuple[int, AuditRecords]]:
        """(group index, records) for every wanted group, in group order."""

    def manifest(self, run) -> dict:
        """The run's manifest.json."""

    def close(self) -> None:
        """Release what the engine holds (a connection pool, an event loop)."""


def engine_kind(run) -> str:
    return "endpoint" if run.endpoint is not None else "in-process"


def run_options(run) -> dict:
    """The options a flips manifest records (a --baseline compares the engine kind too)."""
    return {**asdict(run.options), "max_new_tokens": run.max_new_tokens, "shard": str(run.shard),
            "engine": engine_kind(run)}


class InProcessEngine:
    method = "teacher-forced"

    def __init__(self, lm, probe=None):
        self.lm, self.probe = lm, probe  # probe: the ProbeReport a --batch-invariant run plans with
        self.tokenizer = lm.tokenizer
        self.label = f"in-process ({lm.attn}{', batch-invariant' if probe is not None else ''})"

    def audit(self, run, prompts, wanted, on_progress, on_split):
        from .audit import audit_groups

        return audit_groups(self.lm.model, self.tokenizer, run.requests, prompts, run.options, run.max_new_tokens,
                            run.config.name, self.lm.device, wanted=wanted, on_progress=on_progress,
                            on_split=on_split, plan=self.probe.plan if self.probe is not None else None)

    def manifest(self, run) -> dict:
        from . import results

        lm = self.lm
        return results.manifest("flips", run_options(run), lm.device, {
            "engine": {"kind": "in-process", "label": self.label, "method": self.method},
            "dtype": lm.dtype, "attn": lm.attn, "model_source": lm.source, "dataset_config": asdict(run.config),
            **({"probe": self.probe.to_dict()} if self.probe is not None else {})}, inputs=run.inputs)

    def close(self) -> None:
        pass

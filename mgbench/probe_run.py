"""`mgbench probe`, and the probe every batch-invariant run starts with.

The probe prompt is the longest of the run's prompts (cut to PROBE_MAX_TOKENS: the prefill is
paid once at batch size 1), so the probe sees the model, dtype, kernels and context lengths of the
run it plans for.
"""

from __future__ import annotations

import torch

from . import data
from .engine.probe import ProbeReport, probe_model

PROBE_MAX_TOKENS = 384


def probe_prompt(lm, config: data.DatasetConfig, requests: list[data.Request]) -> torch.Tensor:
    prompts = [data.encode(lm.tokenizer, config, request.text) for request in requests]
    longest = max(prompts, key=len)[:PROBE_MAX_TOKENS]
    return torch.tensor(longest, dtype=torch.long, device=lm.device)


def probe_rows(batch_size: int) -> int:
    """Rows of the probe that plans batches up to `batch_size` (a probe needs at least 2)."""
    return max(2, batch_size)


def probe_for_run(lm, run, batch_size: int | None = None) -> ProbeReport:
    """Probe this run's model on its longest prompt, with as many rows as its largest batch (or
    `batch_size`, for a run whose batches shrank)."""
    rows = probe_rows(batch_size if batch_size is not None else max(run.options.batch_sizes))
    return probe_model(lm.model, probe_prompt(lm, run.config, run.requests), rows)


def run_summary(report: ProbeReport) -> dict:
    """What a run's summary says of its batch-invariant mode."""
    return {"exact_on_probe": report.exact, "plan": report.plan.describe(),
            "probe_step_increment": report.step_increment, "machine": report.machine}

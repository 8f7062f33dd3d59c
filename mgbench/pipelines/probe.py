"""`mgbench probe`, and the probe every batch-invariant run starts with.

The probe prompt is the longest of the run's prompts (cut to PROBE_MAX_TOKENS: the prefill is
paid once at batch size 1), so the probe sees the model, dtype, kernels and context lengths of the
run it plans for.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from mgbench.assets import datasets
from mgbench.engines.inprocess.invariance_probe import ProbeReport, probe_model
from mgbench.pipelines.prepared import prepare
from mgbench.pipelines.session import finish_output, load_with_status
from mgbench.render import terminal
from mgbench.render.console import console, err_console
from mgbench.runs import rundir
from mgbench.runs.options import RunOptions

PROBE_MAX_TOKENS = 384


def probe_prompt(lm, config: datasets.DatasetConfig, requests: list[datasets.Request]) -> torch.Tensor:
    prompts = [datasets.encode(lm.tokenizer, config, request.text) for request in requests]
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
    return {
        "exact_on_probe": report.exact,
        "plan": report.plan.describe(),
        "probe_step_increment": report.step_increment,
        "machine": report.machine,
    }


def run_probe(options: RunOptions, rows: int, json_out: bool, out: Path) -> None:
    """`mgbench probe` from validated options to probe.json and its table."""
    run = prepare(options)  # its one batch size is --rows
    rundir.prepare_out_dir(out)
    lm = load_with_status(options)
    with err_console.status(f"probing one decode step over {rows} rows"):
        found = probe_for_run(lm, run).to_dict()
    manifest = rundir.manifest(
        "probe",
        {**asdict(options), "rows": rows},
        lm.device,
        {"dtype": lm.dtype, "attn": lm.attn, "model_source": lm.source},
    )
    rundir.publish_run(out, {}, {"probe": found, "manifest": manifest})
    finish_output(out, found, json_out, lambda: terminal.render_probe(console, found, options.model, lm.dtype))


def probe_if_invariant(lm, run):
    """The probe a --batch-invariant run plans with (None otherwise), said in one line."""
    if lm is None or not run.options.batch_invariant:
        return None
    with err_console.status(
        f"probing which ops vary on this machine ({probe_rows(max(run.options.batch_sizes))} rows)"
    ):
        report = probe_for_run(lm, run)
    changed = len(report.plan.forms)
    line = (
        f"batch-invariant mode: per-row attention, {changed} varying modules in exact forms "
        f"(probe: {report.machine['cpu']}, {report.machine['cpu_capability']})"
    )
    if report.exact:
        err_console.print(f"[green]{line}; exact on the probe batch[/]", highlight=False)
    else:
        err_console.print(
            f"[bold yellow]{line}; NOT exact on the probe batch (rows "
            f"{report.invariant_rows_differing} differ from solo): the run measures how far off[/]",
            highlight=False,
        )
    return report

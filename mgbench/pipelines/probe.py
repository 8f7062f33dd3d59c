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
from mgbench.engines.inprocess.kernels.fixed_order_probe import FixedOrderProbe, probe_fixed_order
from mgbench.engines.inprocess.kernels.invariance_probe import ProbeReport, machine_facts, probe_model
from mgbench.engines.inprocess.kernels.sets import STOCK, Kernels
from mgbench.engines.inprocess.verification.spec import verify_shape
from mgbench.pipelines.prepared import prepare
from mgbench.pipelines.session import finish_output, load_with_status
from mgbench.render import probe_terminal
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


def fixed_order_probe_for_run(
    lm,
    run,
    batch_size: int | None = None,
    chunk_tokens: int = 8,
    tile: int | None = None,
    calls: list[int] = (),
    verify_rows: int = 0,
) -> FixedOrderProbe:
    """The fixed-order forms probed on this run's own prompts (cut to PROBE_MAX_TOKENS), as many
    rows as its largest batch; a chunk of `chunk_tokens` checked against its steps (as a verify
    batch of `verify_rows` rows where replays pack them); `calls`, the row counts of the replays'
    forwards, checked too; chunks and tiles of `tile` rows (default: the run's --tile-rows, else
    each size the probe tries)."""
    rows = probe_rows(batch_size if batch_size is not None else max(run.options.batch_sizes))
    prompts = [
        torch.tensor(datasets.encode(lm.tokenizer, run.config, r.text)[:PROBE_MAX_TOKENS], device=lm.device)
        for r in run.requests
    ]
    tile = tile if tile is not None else run.options.tile_rows
    return probe_fixed_order(
        lm.model, prompts, rows, chunk_tokens=chunk_tokens, tile=tile, calls=calls, verify_rows=verify_rows
    )


def fixed_order_summary(probe: FixedOrderProbe) -> dict:
    """What a run's summary says of its fixed-order kernels."""
    return {
        "reference": "fixed-order solo",
        "plan": probe.plan.describe(),
        "probe_rows": probe.rows,
        "probe_batch_sizes": probe.batch_sizes,
        "chunk_vs_steps": probe.chunk_vs_steps,
    }


def plan_line(plan) -> str:
    """A fixed-order plan in one clause: attention form, modules per form, the tile size T."""
    described = plan.describe()
    modules = ", ".join(f"{n} modules {form}" for form, n in described["modules"].items()) or "every module as is"
    tile = f"T = {plan.tile} rows" if plan.tile else "no tile needed"
    return f"attention {plan.attention}, {modules}; {tile}"


def kernels_for_run(
    lm, run, batch_size: int | None = None, replays: list = ()
) -> tuple[Kernels, FixedOrderProbe | None]:
    """The kernel set a run decodes with; a fixed-order run is probed first (with every forward its
    replay policies `replays` make, and their verify batch), said in one line (and one more per
    part that fell back to per row, with its cost)."""
    if lm is None or run.options.kernels != "fixed-order":
        return STOCK, None
    rows = probe_rows(batch_size if batch_size is not None else max(run.options.batch_sizes))
    calls, verify_rows, verify_tokens = verify_shape(replays)
    chunk = max(8, verify_tokens)
    with err_console.status(f"probing the fixed-order forms on {rows} real prompts, batch sizes 1..{rows}"):
        probe = fixed_order_probe_for_run(lm, run, batch_size, chunk, None, calls, verify_rows)
    err_console.print(
        f"[green]fixed-order kernels: {plan_line(probe.plan)}; reference: solo through the same kernels[/] "
        f"(probe: {probe.rows} rows, {probe.seconds:.0f} s)",
        highlight=False,
    )
    for line in probe.fallbacks:
        err_console.print(f"[bold yellow]fixed-order fallback: {line}[/]", highlight=False)
    if not probe.chunk_vs_steps["exact"]:
        check = probe.chunk_vs_steps
        err_console.print(
            f"[bold yellow]fixed-order: {check['tokens']} tokens in one forward ({check.get('verify_rows') or 'a few'} "
            f"rows) differ from the same tokens step by step ({check['rows_differing']}/{check['rows']} rows): "
            "replays are not exact against their reference here[/]",
            highlight=False,
        )
    return Kernels("fixed-order", probe.plan), probe


def run_probe(options: RunOptions, rows: int, json_out: bool, out: Path) -> None:
    """`mgbench probe` from validated options to probe.json and its table."""
    run = prepare(options)  # its one batch size is --rows
    rundir.prepare_out_dir(out)
    lm = load_with_status(options)
    if options.kernels == "fixed-order":
        with err_console.status(f"probing the fixed-order forms on {rows} real prompts, batch sizes 1..{rows}"):
            found = fixed_order_probe_for_run(lm, run).to_dict()
        found["machine"] = machine_facts(lm.device)
    else:
        with err_console.status(f"probing one decode step over {rows} rows"):
            found = probe_for_run(lm, run).to_dict()
    manifest = rundir.manifest(
        "probe",
        {**asdict(options), "rows": rows},
        lm.device,
        {"dtype": lm.dtype, "attn": lm.attn, "model_source": lm.source},
    )
    rundir.publish_run(out, {}, {"probe": found, "manifest": manifest})
    render = (
        probe_terminal.render_fixed_order_probe if options.kernels == "fixed-order" else probe_terminal.render_probe
    )
    finish_output(out, found, json_out, lambda: render(console, found, options.model, lm.dtype))


def probed_on(machine: dict) -> str:
    """The device a probe ran on, as its status line names it: the GPU, or the CPU and its ISA."""
    if "gpu" in machine:
        return f"{machine['gpu']} ({machine['device']})"
    return f"{machine['cpu']}, {machine['cpu_capability']}"


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
        f"batch-invariant mode: attention {report.plan.attention.label}, {changed} varying modules in exact "
        f"forms (probe: {probed_on(report.machine)})"
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

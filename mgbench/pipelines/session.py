"""What every pipeline's run shares with the terminal: the model loaded under a status line, an
out-of-memory split said, the CI gate attached, the output finished (terminal, JSON, CI summary)."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from mgbench.analysis import gate
from mgbench.analysis.gate import describe_failure
from mgbench.assets import models
from mgbench.render.console import console, err_console
from mgbench.render.markdown import section_markdown
from mgbench.runs.options import RunOptions
from mgbench.runs.placement import Placement, rank_device
from mgbench.runs.rundir import json_text, missing_shards


def load_with_status(options: RunOptions):
    """The run's model, on this rank's device (`--device cuda` under torchrun: cuda:LOCAL_RANK)."""
    with err_console.status(f"loading {options.model}"):
        device = rank_device(options.device)
        return models.load_model(options.model, options.dtype, device, options.attn, options.tp_plan)


def warn_split(batch_size: int, half: int) -> None:
    err_console.print(
        f"[bold yellow]out of memory[/] at batch size {batch_size}: retrying it as batches of "
        f"{half} (their rows record batch_size {half}; summary.json lists the split)",
        highlight=False,
    )


def shard_status(placement: Placement, out: Path, complete: bool) -> None:
    if not placement.shard.sharded:
        return
    if complete:
        console.print(f"shard {placement.shard}: done; all shards are in: {out} is complete")
    else:
        console.print(f"shard {placement.shard}: done; waiting for shard {', '.join(missing_shards(out))}")


def attach_gate(run, spec, command: str, extra_identity: dict | None = None):
    """Load and check the baseline (before any model is loaded) and let the run's summary carry the
    gate's verdict. Returns the baseline (or None)."""
    baseline = gate.load_baseline(spec.baseline, command) if spec.baseline is not None else None
    if baseline is not None:
        run.inputs.append(
            {"role": "baseline", "path": str(baseline.path), "schema_version_read": baseline.schema_version}
        )
        gate.check_baseline(
            baseline,
            gate.run_identity(
                {**asdict(run.options), "max_new_tokens": run.max_new_tokens},
                [r.request_id for r in run.requests],
                extra_identity,
            ),
        )
    if spec.active:
        # verify's steps are free-running: its test is on sequences. flips hands over its steps
        # table's aggregates (streamed once for the summary and the gate).
        teacher_forced = command == "flips"
        run.gate = lambda summary, tables: gate.evaluate(
            spec,
            summary,
            tables["steps"] if teacher_forced else None,
            tables["sequences"].to_pandas(),
            baseline,
            None if teacher_forced else ["policy"],
        )
    return baseline


def finish_output(out: Path, summary: dict, json_out: bool, render) -> None:
    """The run's report on the terminal, or its summary as JSON on stdout (then nothing else
    goes there); and its report.md section in the GitHub step summary when CI asks for one."""
    if json_out:
        print(json_text(summary), end="")
        err_console.print(f"results: {out}", highlight=False)
    else:
        render()
        console.print(f"results: [bold]{out}[/]")
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        with open(step_summary, "a", encoding="utf-8") as handle:
            handle.write(section_markdown(out) + "\n")


def gate_lines(summary: dict) -> None:
    """What the gate decided, on stderr (stdout may be JSON)."""
    verdict = summary.get("gate")
    if not verdict:
        return
    for failure in verdict["failures"]:
        err_console.print(f"[bold red]FAIL[/] {describe_failure(failure)}", highlight=False, soft_wrap=True)
    if verdict["passed"]:
        tested = verdict.get("baseline", {}).get("tests", {})
        against = "; ".join(f"{name} p = {t['p_value']:.3g}" for name, t in tested.items())
        err_console.print(
            "[green]PASS[/] determinism gate" + (f" (baseline: {against})" if against else ""), highlight=False
        )

"""The diff pipeline: recorded run directories -> paired outputs -> report, gate, optional run directory.

Reads only the runs' JSON and Parquet files: no model is loaded and torch is never imported, so a
baseline recorded on one node is compared with a run of another anywhere (a CI job included).
"""

from __future__ import annotations

import os
from pathlib import Path

from mgbench.analysis import runs_diff
from mgbench.render.console import console, err_console
from mgbench.runs import rundir, schema


def write_run(out: Path, rows: list[dict], summary: dict, runs: list[runs_diff.RecordedRun], options: dict) -> Path:
    """diff.parquet, summary.json, manifest.json and the margins histogram, published atomically."""
    from mgbench.render import plots
    from mgbench.render.diff_markdown import PLOT

    inputs = [{"role": "run", "path": str(run.path), "schema_version_read": run.schema_version_read} for run in runs]
    manifest = rundir.manifest("diff", options, "cpu", inputs=inputs)
    return rundir.publish_run(
        out,
        {"diff": schema.diff_table(rows)},
        {"summary": summary, "manifest": manifest},
        lambda staging: plots.divergence_margins(summary["pairs"], staging / PLOT),
    )


def run_diff(
    paths: list[Path],
    mode: str,
    out: Path | None,
    required: float | None,
    junit: Path | None,
    json_out: bool,
    shown: int,
) -> bool:
    """`mgbench diff`; False when a pair of runs fell below --require-identical."""
    same = sorted({str(p) for p in paths if sum(q.resolve() == p.resolve() for q in paths) > 1})
    if same:  # identical by construction (a control): said, so a 100% is not read as a finding
        err_console.print(
            f"note: {', '.join(same)} given more than once: that pair is the same run, identical by construction",
            highlight=False,
            soft_wrap=True,
        )
    if out is not None:
        rundir.prepare_out_dir(out)
    names = runs_diff.run_names(paths)
    runs = [runs_diff.load_run(path, name, mode) for path, name in zip(paths, names)]
    rows, summary = runs_diff.diff_runs(runs, mode, required)
    if out is not None:
        datasets = sorted({d for run in summary["runs"] for d in run["datasets"]})
        options = {
            "model": summary["model"],
            "dataset": ", ".join(datasets),
            "runs": [str(path) for path in paths],
            "batched": mode == runs_diff.BATCHED,
            "require_identical": required,
        }
        write_run(out, rows, summary, runs, options)
    if junit is not None:
        from mgbench.render.junit import diff_junit, write_junit

        write_junit(junit, diff_junit(summary))
    if json_out:
        print(rundir.json_text(summary), end="")
    else:
        from mgbench.render.diff_terminal import render_diff

        render_diff(console, summary, shown)
    if out is not None:
        (err_console if json_out else console).print(f"results: {out}", highlight=False)
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary and out is not None:  # a CI job's summary page shows the report.md section
        from mgbench.render.markdown import section_markdown

        with open(step_summary, "a", encoding="utf-8") as handle:
            handle.write(section_markdown(out) + "\n")
    passed = summary["passed"]
    if passed is not None:
        lowest = f"{100 * summary['min_identical_share']:.2f}%"
        if passed:
            err_console.print(f"[green]PASS[/] identical share {lowest} >= {required}", highlight=False)
        for pair in summary["pairs"]:
            if pair["identical_share"] < required:
                err_console.print(
                    f"[bold red]FAIL[/] {pair['run_a']} vs {pair['run_b']}: {pair['identical']}/{pair['paired']} "
                    f"identical ({100 * pair['identical_share']:.2f}%) < required {required}",
                    highlight=False,
                    soft_wrap=True,
                )
    return passed is not False

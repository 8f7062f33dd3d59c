"""`mgbench report`: report.md from run directories of any command, from any machine."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer

from mgbench.cli.exits import user_errors
from mgbench.cli.options import DebugOpt
from mgbench.render.console import console
from mgbench.render.markdown import render


def report_command(
    runs: list[Path] = typer.Argument(..., help="Run directories of flips, calibrate, verify or compare."),
    out: Optional[Path] = typer.Option(
        None, "--out", "-o", help="Folder for report.md and its plots (default: reports/report-TIME/)."
    ),
    json_out: bool = typer.Option(False, "--json", help='Print {"report": PATH, "runs": [...]} on stdout.'),
    debug: bool = DebugOpt,
) -> None:
    """Render report.md with tables and plots from run directories, also ones recorded on another machine.

    Examples:

        mgbench report reports/flips-smollm2-135m-math500-20261202-120000

        mgbench report runs/calibrate runs/verify runs/compare --out docs/results
    """
    with user_errors(debug):
        target = out or Path("reports") / f"report-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
        path = render(list(runs), target)
    if json_out:
        print(json.dumps({"report": str(path), "runs": [str(r) for r in runs]}, indent=2))
    else:
        console.print(f"report: [bold]{path}[/]")

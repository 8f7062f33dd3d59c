"""`mgbench report`: report.md from run directories of any command, from any machine."""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer

from mgbench.cli.exits import user_errors
from mgbench.cli.options import DebugOpt
from mgbench.errors import UserError
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
        if target.exists() and (not target.is_dir() or any(target.iterdir())):  # as flips and diff refuse it
            raise UserError(f"--out {target} already exists and is not empty; choose another directory or remove it")
        first_made = target  # the outermost folder this report creates: removed again if it fails
        while not first_made.parent.exists() and first_made.parent != first_made:
            first_made = first_made.parent
        made = not first_made.exists()
        try:
            path = render(list(runs), target)
        except BaseException as exc:
            if made:
                shutil.rmtree(first_made, ignore_errors=True)
            if isinstance(exc, (KeyError, TypeError)):  # a run document without what its section reads
                raise UserError(
                    f"cannot report on {', '.join(map(str, runs))}: a run document lacks {exc} (an unfinished "
                    "run, or one written by another mgbench version)"
                ) from exc
            raise
    if json_out:
        print(json.dumps({"report": str(path), "runs": [str(r) for r in runs]}, indent=2))
    else:
        console.print(f"report: [bold]{path}[/]")

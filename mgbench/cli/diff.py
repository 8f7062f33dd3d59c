"""`mgbench diff`: the same requests in recorded runs (other nodes, kernel families, engines, versions,
replicas) compared output by output; no model loaded, torch never imported."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mgbench.cli.exits import user_errors
from mgbench.cli.options import DebugOpt, JsonOpt, check_output_file
from mgbench.errors import UserError


def diff(
    runs: list[Path] = typer.Argument(..., help="Two or more run directories of flips (any engine) or verify."),
    batched: bool = typer.Option(
        False, "--batched", help="Compare batched outputs (per request and batch size) instead of solo outputs."
    ),
    require_identical: Optional[float] = typer.Option(
        None,
        "--require-identical",
        help="Exit 1 when any pair of runs has a smaller share of identical outputs than this (e.g. 1.0).",
    ),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Write JUnit XML: one case per pair of runs."),
    out: Optional[Path] = typer.Option(
        None,
        "--out",
        "-o",
        help="Write a run directory (diff.parquet, summary.json, manifest.json, a histogram) for `mgbench report`.",
    ),
    show: int = typer.Option(20, "--show", help="Divergences listed per pair in the terminal."),
    json_out: bool = JsonOpt,
    debug: bool = DebugOpt,
) -> None:
    """Compare recorded runs of one model: do the same requests give the same tokens elsewhere?

    Requests pair by their prompt token ids (whatever the runs' order, limits or shards). For
    each pair of runs: the share of identical solo outputs; for each other one the first
    divergence, the token on each side and the solo top-1/top-2 margin on each side there (a
    tie there is numeric noise; a wide margin is a real change; "-": not recorded); and what
    differs between the manifests (machine, kernel family, engine, versions, ...). Exit codes:
    0 ok, 1 a --require-identical check failed, 2 bad input (different models, no shared request).

    Examples:

        mgbench diff runs/native runs/avx2

        mgbench diff runs/base runs/new --require-identical 1.0 --junit diff.xml

        mgbench diff runs/fleet/replica-0 runs/fleet/replica-1 --out runs/d

        mgbench report runs/d
    """
    with user_errors(debug):
        if len(runs) < 2:
            raise UserError("give two run directories or more to compare")
        if require_identical is not None and not 0.0 <= require_identical <= 1.0:
            raise UserError(f"--require-identical {require_identical}: a share between 0 and 1 (e.g. 1.0)")
        if show < 0:
            raise UserError(f"--show {show}: a count of divergences, 0 or more")
        check_output_file(junit, "--junit")
        from mgbench.analysis.runs_diff import BATCHED, SOLO
        from mgbench.pipelines.diff import run_diff  # pandas and pyarrow: after the input checks

        passed = run_diff(list(runs), BATCHED if batched else SOLO, out, require_identical, junit, json_out, show)
    raise typer.Exit(0 if passed else 1)

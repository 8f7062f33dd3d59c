"""`mgbench probe`: declare the options, build the validated run options, call the pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mgbench.cli.exits import user_errors
from mgbench.cli.options import (
    AttnOpt,
    DebugOpt,
    DeviceOpt,
    DtypeOpt,
    KernelsOpt,
    ModelOpt,
    OutOpt,
    SeedOpt,
    TileRowsOpt,
    default_out,
)
from mgbench.errors import UserError
from mgbench.runs.options import RunOptions


def probe(
    model: str = ModelOpt,
    dataset: str = typer.Option(
        "math500", "--dataset", "-d", help="Where the probe prompt comes from (the longest of a seeded sample)."
    ),
    limit: int = typer.Option(8, "--limit", "-n", help="Sample size the probe prompt is chosen from."),
    seed: int = SeedOpt,
    rows: int = typer.Option(
        16, "--rows", help="Rows of the probe batch: row counts 1..ROWS and pad lengths 0..ROWS-1 are measured."
    ),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    attn: str = AttnOpt,
    kernels: str = KernelsOpt,
    tile_rows: Optional[int] = TileRowsOpt,
    json_out: bool = typer.Option(False, "--json", help="Print probe.json on stdout instead of the table."),
    out: Optional[Path] = OutOpt,
    debug: bool = DebugOpt,
) -> None:
    """Probe which parts of one decode step are batch-invariant on this machine, op by op.

    Runs one real decode step over ROWS left-padded rows and replays every linear layer, norm,
    activation, the lm_head and attention on each row alone and on every row count, bitwise.
    Reports, per op: invariant or not, max |diff|, the row counts or pad lengths that differ, and
    the exact form `--batch-invariant` runs it in (the fastest measured); then the whole step,
    plain and in batch-invariant mode, against solo. Writes probe.json and manifest.json.

    With `--kernels fixed-order`: decodes a few steps of ROWS real prompts of unequal lengths through
    the fixed-order kernels, recomputes every part of the first, middle and last layer at batch sizes
    up to ROWS (and around each tile size T) against each row alone, bitwise, per form (as is, never
    one row, chunks of at most T rows, tiles of exactly T rows, per row), picks T (or takes
    --tile-rows), and checks a chunk of tokens in one forward against the same tokens step by step.

    Examples:

        mgbench probe

        mgbench probe --rows 8 --json > probe.json

        mgbench probe --model llama-3.1-8b --device cuda --rows 64

        mgbench probe --kernels fixed-order --rows 64 --dataset gsm8k --limit 64

        mgbench probe --kernels fixed-order --rows 64 --tile-rows 32
    """
    with user_errors(debug):
        if rows < 2:
            raise UserError(f"--rows must be at least 2 (got {rows}): the probe compares a batch with its rows alone")
        options = RunOptions(
            model=model,
            dataset=dataset,
            limit=limit,
            seed=seed,
            batch_sizes=(rows,),
            dtype=dtype,
            device=device,
            attn=attn,
            kernels=kernels,
            tile_rows=tile_rows,
        )
        from mgbench.pipelines.probe import run_probe  # loads torch

        run_probe(options, rows, json_out, out or default_out("probe", model, dataset))

"""`mgbench compare`: declare the options, build the validated run options, call the pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mgbench.analysis.calibration import read_calibration_threshold
from mgbench.cli.exits import user_errors
from mgbench.cli.options import (
    AttnOpt,
    BatchSizeOpt,
    DatasetOpt,
    DebugOpt,
    DeviceOpt,
    DtypeOpt,
    JsonOpt,
    ModelOpt,
    OutOpt,
    SeedOpt,
    SortOpt,
    TileRowsOpt,
    TpPlanOpt,
    default_out,
)
from mgbench.errors import UserError
from mgbench.runs.options import RunOptions, check_tile_rows
from mgbench.runs.placement import Placement


def compare(
    model: str = ModelOpt,
    dataset: str = DatasetOpt,
    limit: int = typer.Option(32, "--limit", "-n", help="Requests (a seeded sample)."),
    seed: int = SeedOpt,
    batch_size: int = BatchSizeOpt,
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens to generate per request."),
    threshold: Optional[float] = typer.Option(None, "--threshold", help="TAU of MarginGate."),
    threshold_from: Optional[Path] = typer.Option(
        None, "--threshold-from", help="calibration.json from `mgbench calibrate`."
    ),
    threshold_unit: str = typer.Option("logit", "--threshold-unit", help="Unit of --threshold: logit or ulp."),
    repeats: int = typer.Option(
        3, "--repeats", help="Timed repeats after one warm-up pass (median and spread reported)."
    ),
    json_out: bool = JsonOpt,
    sort_by_length: bool = SortOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    attn: str = AttnOpt,
    out: Optional[Path] = OutOpt,
    tp_plan: Optional[str] = TpPlanOpt,
    only: Optional[str] = typer.Option(
        None,
        "--only",
        help=(
            "Run only the configurations whose names start with these comma-separated prefixes (`none`, the "
            "increments' base, always runs), e.g. `fixed-order,window,margin` ; `*` stands for any characters: "
            "`margin*/exact` is MarginGate's exact repair at any TAU, without its replays."
        ),
    ),
    tile_rows: Optional[int] = TileRowsOpt,
    debug: bool = DebugOpt,
) -> None:
    """Compare MarginGate with always-on verification, the oracle floor, batch-invariant attention and solo decoding.

    Same prompts, same batches, one process, after a warm-up pass: wall time of the decode
    steps, tokens/s, latency increment over plain batched decoding, trigger rate, repairs and
    sequence-level determinism for each configuration; the increment reduction always/MarginGate
    per repair mode; the gate's own cost; where verification time goes. Writes compare.parquet,
    summary.json, latency_increment.png and determinism_vs_triggers.png.

    Examples:

        mgbench compare --limit 32 --batch-size 8 \\
            --threshold-from calibration.json

        mgbench compare --model llama-3.1-8b --device cuda --batch-size 64 \\
            --limit 256 --threshold 0.5

        # LLM-42's window against MarginGate, both on the fixed-order reference

        mgbench compare --threshold 0.47 --only fixed-order,window,margin
    """
    with user_errors(debug):
        options = RunOptions(
            model=model,
            dataset=dataset,
            limit=limit,
            seed=seed,
            batch_sizes=(batch_size,),
            max_new_tokens=max_new_tokens,
            prefill="alone",
            sort_by_length=sort_by_length,
            dtype=dtype,
            device=device,
            attn=attn,
            tp_plan=tp_plan,
        )
        if threshold is not None and threshold_from is not None:
            raise UserError("give --threshold or --threshold-from, not both")
        tau, unit = read_calibration_threshold(threshold_from, model) if threshold_from else (threshold, threshold_unit)
        from mgbench.engines.inprocess.verification.spec import policy_specs
        from mgbench.pipelines.compare import run_compare  # loads torch

        policy_specs("margin", "exact", tau, unit)  # validates the threshold
        check_tile_rows(tile_rows)
        if repeats < 1:
            raise UserError(f"--repeats must be at least 1 (got {repeats})")
        placement = Placement.resolve(None, False, tp_plan, out)
        if placement.shard.sharded:
            raise UserError("compare times one process: run it without torchrun, or under torchrun with --tp-plan auto")
        prefixes = tuple(p.strip() for p in only.split(",") if p.strip()) if only else None
        if only is not None and not prefixes:
            raise UserError("--only is empty: give configuration name prefixes such as window,margin")
        run_compare(
            options,
            placement,
            tau,
            unit,
            repeats,
            out or default_out("compare", model, dataset),
            json_out,
            prefixes,
            tile_rows,
        )

"""`mgbench calibrate`: declare the options, build the validated options, call the pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from mgbench.analysis.calibration import CalibrateOptions, SafetyRule
from mgbench.cli.exits import user_errors
from mgbench.cli.options import (
    AttnOpt,
    BatchSizeOpt,
    BatchSizesOpt,
    DatasetOpt,
    DebugOpt,
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    OutOpt,
    PrefillOpt,
    SeedOpt,
    SortOpt,
    default_out,
)
from mgbench.errors import UserError
from mgbench.runs.options import RunOptions, parse_batch_sizes


def check_transfer(items: list[str]) -> None:
    """Each --transfer item readable before any trace is recorded: a run directory (or
    steps.parquet) by its Parquet footers, a dataset by its config and data file."""
    from mgbench.assets import datasets
    from mgbench.runs import scan

    for item in items:
        path = Path(item)
        if path.is_dir() or path.suffix == ".parquet":
            scan.file_schemas(scan.steps_files(path))
        else:
            config = datasets.load_config(item)
            if config.kind != "hub":
                datasets.data_file(config)


def calibrate(
    runs: Optional[list[Path]] = typer.Argument(
        None, help="flips run directories to calibrate on (no model is loaded)."
    ),
    model: str = ModelOpt,
    dataset: str = DatasetOpt,
    limit: int = typer.Option(32, "--limit", "-n", help="Requests per recorded dataset."),
    seed: int = SeedOpt,
    batch_size: int = BatchSizeOpt,
    batch_sizes: Optional[str] = BatchSizesOpt,
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens per request when recording traces."),
    prefill: str = PrefillOpt,
    sort_by_length: bool = SortOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    attn: str = AttnOpt,
    safety: str = typer.Option(
        "x1.5", "--safety", help="Widening of the minimal TAU: xF multiplies, +D adds (in the unit)."
    ),
    unit: str = typer.Option(
        "logit", "--unit", help="Margin unit written to calibration.json: logit (raw, as the paper) or ulp."
    ),
    confidence: float = typer.Option(
        0.95, "--confidence", help="Level of the one-sided Clopper-Pearson bound on misses."
    ),
    transfer: Optional[str] = typer.Option(
        None, "--transfer", help="Comma-separated datasets or run dirs to test the TAU on."
    ),
    require_flips: bool = typer.Option(False, "--require-flips", help="Exit 1 when the traces hold no flip."),
    out: Optional[Path] = OutOpt,
    json_out: bool = typer.Option(
        False, "--json", help="Print calibration.json on stdout (nothing else goes to stdout)."
    ),
    debug: bool = DebugOpt,
) -> None:
    """Calibrate the MarginGate threshold: the smallest TAU whose gate (margin < TAU) catches every flip.

    Traces come from flips run directories, or are recorded first with the same engine as
    `mgbench flips` (cached under $MGBENCH_CACHE/traces; an identical request reuses them).
    Reports TAU in raw logits and in BF16 ulps, the trigger rate each needs, recall and trigger
    rate on --transfer datasets, and a bound on the probability of a missed flip. Writes
    calibration.json (read by `verify --threshold-from`), curve.parquet, curve.png, margins.png.

    Examples:

        mgbench calibrate --dataset math500

        mgbench calibrate --dataset math500 --transfer gsm8k,humaneval,sharegpt

        mgbench calibrate runs/math500-b8 runs/math500-b16 --unit ulp --safety +1
    """
    with user_errors(debug):
        sizes = parse_batch_sizes(batch_sizes) if batch_sizes else (batch_size,)
        record_options = RunOptions(
            model=model,
            dataset=dataset,
            limit=limit,
            seed=seed,
            batch_sizes=sizes,
            max_new_tokens=max_new_tokens,
            prefill=prefill,
            sort_by_length=sort_by_length,
            dtype=dtype,
            device=device,
            attn=attn,
        )
        options = CalibrateOptions(SafetyRule.parse(safety), unit, confidence)
        transfer_items = [item.strip() for item in (transfer or "").split(",") if item.strip()]
        check_transfer(transfer_items)
        for run in runs or []:  # else the pipeline would take a missing folder's name for a dataset's
            if not run.exists():
                raise UserError(f"{run} does not exist: give the flips run directories to calibrate on")
        target = out or default_out("calibrate", model, "+".join(str(r) for r in runs) if runs else dataset)
        from mgbench.pipelines.calibrate import run_calibrate  # loads torch: after every input check

        document = run_calibrate(list(runs or []), record_options, options, transfer_items, target, json_out)
    raise typer.Exit(1 if require_flips and document["flips"] == 0 else 0)

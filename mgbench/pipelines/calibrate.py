"""`mgbench calibrate` as a pipeline: step tables in, calibration.json, curves and plots out."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import pandas as pd
import pyarrow as pa

from mgbench import SCHEMA_VERSION, __version__
from mgbench.analysis import calibration
from mgbench.analysis.calibration import CalibrateOptions
from mgbench.assets.models import cache_root
from mgbench.errors import UserError
from mgbench.pipelines.session import finish_output, load_with_status
from mgbench.render import terminal
from mgbench.render.console import console, err_console
from mgbench.runs import rundir, scan, schema
from mgbench.runs.options import RunOptions


def trace_dir(options: RunOptions) -> Path:
    """Cache folder of a flips recording with exactly these settings ($MGBENCH_TRACES overrides the root)."""
    key = json.dumps({"options": asdict(options), "schema": SCHEMA_VERSION, "mgbench": __version__}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(os.environ.get("MGBENCH_TRACES", cache_root() / "traces"))
    return root / f"{Path(options.dataset).stem}-{digest}"


def traces_for(options: RunOptions, record: Callable[[RunOptions, Path], None]) -> tuple[pd.DataFrame, str, bool]:
    """(steps, folder, reused) of a flips recording; an identical earlier recording is reused."""
    folder = trace_dir(options)
    reused = rundir.is_complete_run(folder)
    if not reused:
        record(options, folder)
    return scan.margin_counts(folder), str(folder), reused


def single_model(tables: list[pd.DataFrame]) -> str:
    models = sorted(set().union(*(set(t["model"].unique()) for t in tables)))
    if len(models) != 1:
        raise UserError(f"calibration traces mix models ({', '.join(models)}): calibrate one model at a time")
    return models[0]


def calibrate(
    calibration_steps: pd.DataFrame, transfer: dict[str, pd.DataFrame], options: CalibrateOptions, sources: list[str]
) -> tuple[dict, pd.DataFrame]:
    """(calibration document, curve table) for the given steps."""
    # Counts per distinct margin from here on: a streamed run arrives as counts already.
    steps = calibration.validate_steps(calibration_steps, "calibration traces")
    transfer = {name: calibration.validate_steps(table, f"transfer {name}") for name, table in transfer.items()}
    model = single_model([steps, *transfer.values()])
    units = [
        u
        for u in calibration.measured_units(steps)
        if all(u in calibration.measured_units(t) for t in transfer.values())
    ]
    if options.unit not in units:
        raise UserError(
            f"--unit {options.unit}: the traces have no {calibration.UNITS[options.unit]} column values "
            "(endpoint runs: an API gives logprobs, not the raw top-1 logit an ulp needs); use --unit logit"
        )
    per_unit = {unit: calibration.calibrate_unit(steps, unit, options.safety, options.confidence) for unit in units}
    chosen = per_unit[options.unit]
    curves = pd.concat([calibration.curve(steps, unit) for unit in units], ignore_index=True)
    transfer_rows = []
    for unit, figures in per_unit.items():
        if figures["tau"] is None or not transfer:
            continue
        table = calibration.transfer_table(transfer, unit, figures["tau"], options.confidence)
        transfer_rows += [{"unit": unit, "tau": figures["tau"], **row} for row in table.to_dict("records")]
    document = {
        "schema_version": SCHEMA_VERSION,
        "kind": "mgbench.calibration",
        "model": model,
        "datasets": sorted(steps["dataset"].unique().tolist()),
        "batch_sizes": sorted(int(b) for b in steps["batch_size"].unique()),
        "unit": options.unit,
        "tau": chosen["tau"],
        "tau_min": chosen["tau_min"],
        "safety": str(options.safety),
        "trigger_rate": chosen["trigger_rate"],
        "oracle_trigger_rate": chosen["oracle_trigger_rate"],
        "flips": chosen["flips"],
        "steps": chosen["steps"],
        "bound": calibration.bound_figures(chosen["flips"], chosen["steps"], options.confidence),
        "per_unit": per_unit,
        "transfer": transfer_rows,
        "sources": sources,
    }
    return document, curves


def publish(out: Path, document: dict, curves: pd.DataFrame, steps: pd.DataFrame, manifest: dict) -> None:
    from mgbench.render import plots

    taus = {unit: figures["tau"] for unit, figures in document["per_unit"].items()}

    def draw(staging: Path) -> None:
        plots.calibration_curves(curves, taus, staging / "curve.png")
        plots.margin_histograms(steps, staging / "margins.png")

    curve_table = pa.Table.from_pandas(curves, preserve_index=False)
    curve_table = curve_table.replace_schema_metadata({schema.SCHEMA_KEY: SCHEMA_VERSION.encode()})
    rundir.publish_run(out, {"curve": curve_table}, {"calibration": document, "manifest": manifest}, draw)


def run_calibrate(
    runs: list[Path],
    record_options: RunOptions,
    options: CalibrateOptions,
    transfer_items: list[str],
    out: Path,
    json_out: bool = False,
) -> dict:
    """`mgbench calibrate` from validated options to calibration.json, its curves and its report;
    returns the calibration document."""
    rundir.prepare_out_dir(out)
    loaded = {}

    def record(opts: RunOptions, folder: Path) -> None:
        # Recording a trace always resumes: an interrupted calibrate continues where it stopped.
        # Imported here: calibrating recorded runs needs no torch, model or engine (it starts fast).
        from mgbench.pipelines.flips import in_process_engine, open_writer, record_with_progress
        from mgbench.pipelines.prepared import prepare

        run = prepare(opts, resume=True)
        with open_writer(run, folder) as writer:
            if "lm" not in loaded:
                loaded["lm"] = load_with_status(opts)
            record_with_progress(in_process_engine(loaded["lm"], run), run, folder, writer)

    def is_run(item: str) -> bool:  # a run directory or steps.parquet; anything else names a dataset
        return Path(item).is_dir() or Path(item).suffix == ".parquet"

    inputs = []  # every table read, with the schema version it was written with (older ones are upgraded)

    def traces(item: str):
        path = Path(item)
        if is_run(item):
            steps, source = scan.margin_counts(path), str(path)
        else:
            steps, source, reused = traces_for(replace(record_options, dataset=item), record)
            err_console.print(
                f"{item}: {'reused cached' if reused else 'recorded'} traces in {source}", highlight=False
            )
        inputs.append({"path": source, "schema_version_read": schema.schema_read_from(steps)})
        return steps, source

    if runs:
        tables = [traces(str(run)) for run in runs]
        steps = pd.concat([t for t, _ in tables], ignore_index=True)
        sources = [s for _, s in tables]
    else:
        steps, source = traces(record_options.dataset)
        sources = [source]
    transfer = {}
    for item in transfer_items:
        table, source = traces(item)
        transfer[Path(item).name if is_run(item) else item] = table
        sources.append(source)

    document, curves = calibrate(steps, transfer, options, sources)
    device = loaded["lm"].device if "lm" in loaded else "cpu"
    manifest = rundir.manifest(
        "calibrate",
        {
            "runs": [str(r) for r in runs],
            "record": asdict(record_options),
            "safety": str(options.safety),
            "unit": options.unit,
            "confidence": options.confidence,
            "transfer": transfer_items,
        },
        device,
        inputs=inputs,
    )
    publish(out, document, curves, steps, manifest)
    finish_output(out, document, json_out, lambda: terminal.render_calibration(console, document))
    return document

"""`mgbench calibrate` as a pipeline: step tables in, calibration.json, curves and plots out."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
import pyarrow as pa

from . import SCHEMA_VERSION, __version__, calibration, results
from .config import RunOptions
from .errors import UserError
from .models import cache_root


@dataclass(frozen=True)
class CalibrateOptions:
    safety: calibration.SafetyRule
    unit: str = "logit"
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if self.unit not in calibration.UNITS:
            raise UserError(f"--unit {self.unit!r}: choose one of {', '.join(calibration.UNITS)}")
        if not 0.5 <= self.confidence < 1:
            raise UserError(f"--confidence {self.confidence}: use a level in [0.5, 1), e.g. 0.95")


def trace_dir(options: RunOptions) -> Path:
    """Cache folder of a flips recording with exactly these settings ($MGBENCH_TRACES overrides the root)."""
    key = json.dumps({"options": asdict(options), "schema": SCHEMA_VERSION, "mgbench": __version__}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(os.environ.get("MGBENCH_TRACES", cache_root() / "traces"))
    return root / f"{Path(options.dataset).stem}-{digest}"


def traces_for(options: RunOptions, record: Callable[[RunOptions, Path], None]) -> tuple[pd.DataFrame, str, bool]:
    """(steps, folder, reused) of a flips recording; an identical earlier recording is reused."""
    folder = trace_dir(options)
    reused = results.is_complete_run(folder)
    if not reused:
        record(options, folder)
    return results.read_steps(folder), str(folder), reused


def single_model(tables: list[pd.DataFrame]) -> str:
    models = sorted(set().union(*(set(t["model"].unique()) for t in tables)))
    if len(models) != 1:
        raise UserError(f"calibration traces mix models ({', '.join(models)}): calibrate one model at a time")
    return models[0]


def calibrate(calibration_steps: pd.DataFrame, transfer: dict[str, pd.DataFrame], options: CalibrateOptions,
              sources: list[str]) -> tuple[dict, pd.DataFrame]:
    """(calibration document, curve table) for the given steps."""
    steps = calibration.validate_steps(calibration_steps, "calibration traces")
    for name, table in transfer.items():
        calibration.validate_steps(table, f"transfer {name}")
    model = single_model([steps, *transfer.values()])
    units = [u for u in calibration.measured_units(steps)
             if all(u in calibration.measured_units(t) for t in transfer.values())]
    if options.unit not in units:
        raise UserError(f"--unit {options.unit}: the traces have no {calibration.UNITS[options.unit]} column values "
                        "(endpoint runs: an API gives logprobs, not the raw top-1 logit an ulp needs); use --unit logit")
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
    from . import plots

    taus = {unit: figures["tau"] for unit, figures in document["per_unit"].items()}

    def draw(staging: Path) -> None:
        plots.calibration_curves(curves, taus, staging / "curve.png")
        plots.margin_histograms(steps, staging / "margins.png")

    curve_table = pa.Table.from_pandas(curves, preserve_index=False)
    curve_table = curve_table.replace_schema_metadata({results.SCHEMA_KEY: SCHEMA_VERSION.encode()})
    results.publish_run(out, {"curve": curve_table}, {"calibration": document, "manifest": manifest}, draw)

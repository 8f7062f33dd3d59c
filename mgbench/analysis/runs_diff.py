"""The same request in recorded runs: outputs paired by prompt ids and compared (`mgbench diff`, no torch).

Every flips run's sequences table holds each request's prompt ids and solo output ids (schema 3
adds the solo margin of every step); a verify run's holds solo and batched ids. Runs of one model
recorded anywhere (another node, kernel family, engine, version, replica) pair their requests by
prompt ids, whatever their order, limits or shards; a verify run keeps no prompt ids, so a pair
with one pairs by dataset and request id (the index in the dataset file, stable under sampling).
For each pair of runs: how many paired outputs are identical and, for each other one, the first
divergence, the token on each side there and the solo margin on each side there (top-1 minus
top-2 of the step that chose that token; None where the run did not record it: never guessed).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path

import numpy as np
import pandas as pd

from mgbench.analysis.divergence import first_divergence
from mgbench.analysis.figures import with_axis
from mgbench.analysis.manifests import manifest_differences, model_identity
from mgbench.errors import UserError

SOLO, BATCHED = "solo", "batched"
PROMPT_IDS, REQUEST_IDS = "prompt ids", "dataset and request id"


@dataclass
class RecordedRun:
    """One run directory as diff reads it: its manifest and one row per compared output."""

    path: Path
    name: str
    manifest: dict
    command: str
    outputs: pd.DataFrame  # dataset, request_id, prompt, prompt_len, batch_size, variant, ids, margins
    has_prompt_ids: bool
    schema_version_read: str
    max_new_tokens: int | None
    summary: dict = field(default_factory=dict)
    _steps_margins: dict | None = None

    def steps_margins(self) -> dict[int, np.ndarray]:
        """request id -> solo margin per step, from the steps table of a flips run recorded before
        sequences held solo_margins (the same solo pass measured them); {} when it has none."""
        if self._steps_margins is None:
            self._steps_margins = read_steps_margins(self.path) if self.command == "flips" else {}
        return self._steps_margins


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot read ({exc})") from exc


def prompt_key(ids) -> str:
    """A short, stable name of a prompt: the first 16 hex digits of SHA-256 over its int32 ids."""
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()[:16]


def run_names(paths: list[Path]) -> list[str]:
    """Short unique labels: the folder name, with its parent where two folders share a name; a run
    given twice is told apart by its position (#2, #3, ...)."""
    names = [p.name or str(p) for p in paths]
    folders = {}
    for name, path in zip(names, paths):
        folders.setdefault(name, set()).add(path.resolve())
    if any(len(found) > 1 for found in folders.values()):  # two folders of one name: say whose
        names = [f"{p.parent.name}/{p.name}" if p.parent.name else p.name for p in paths]
    return [name if name not in names[:index] else f"{name}#{index + 1}" for index, name in enumerate(names)]


def _variant(frame: pd.DataFrame) -> pd.Series:
    """What decoded the batched rows: flips runs "none", verify runs their policy (and repair)."""
    policy = frame["policy"].fillna("none") if "policy" in frame else pd.Series("none", index=frame.index)
    if "repair" not in frame:
        return policy
    repair = frame["repair"].fillna("none")
    return policy.where(repair == "none", policy + "/" + repair)


def load_run(path: Path, name: str, mode: str) -> RecordedRun:
    """A flips or verify run directory (whole or sharded, any readable schema version)."""
    from mgbench.runs import rundir, schema

    if not path.exists():
        raise UserError(f"{path} does not exist; give run directories of mgbench flips or verify")
    if not path.is_dir():
        raise UserError(f"{path} is not a directory; give run directories of mgbench flips or verify")
    if rundir.looks_sharded(path):
        rundir.check_shards_complete(path)
    if not (path / "manifest.json").is_file():
        raise UserError(f"{path} is not an mgbench run directory (no manifest.json)")
    manifest = read_json(path / "manifest.json")
    command = manifest.get("command", "unknown")
    expected = {"flips": schema.SEQUENCES_SCHEMA, "verify": schema.VERIFY_SEQUENCES_SCHEMA}.get(command)
    if expected is None:
        raise UserError(f"{path} is a {command} run: diff reads the outputs of flips or verify runs")
    table = rundir.read_run_table(path, "sequences", expected)
    frame = table.to_pandas()
    frame = with_axis(frame)
    if mode == SOLO:  # a repeat row's reference is its load's first run, not the request alone
        frame = frame[frame["axis"] != "repeat"]
    has_prompt_ids = "prompt_ids" in frame
    ids = frame["solo_ids"] if mode == SOLO else frame["batched_ids"]
    margins = frame["solo_margins"] if mode == SOLO and "solo_margins" in frame else pd.Series(None, index=frame.index)
    outputs = pd.DataFrame(
        {
            "dataset": frame["dataset"].astype(object),
            "request_id": frame["request_id"].astype("int64"),
            "prompt": frame["prompt_ids"].map(prompt_key) if has_prompt_ids else None,
            "prompt_len": frame["prompt_len"].astype("Int64"),
            "batch_size": frame["batch_size"].astype("Int64") if mode == BATCHED else pd.NA,
            "axis": frame["axis"].astype(object) if mode == BATCHED else None,
            "variant": _variant(frame) if mode == BATCHED else None,
            "ids": ids.map(lambda v: [] if v is None else [int(t) for t in v]),
            "margins": margins,
        }
    )
    if mode == SOLO:  # a flips run has one row per (request, batch size): the solo output is the same in each
        outputs = outputs.drop_duplicates("request_id", keep="first")
    summary_path = path / "summary.json"
    summary = read_json(summary_path) if summary_path.is_file() else {}
    limit = (manifest.get("options") or {}).get("max_new_tokens") or summary.get("max_new_tokens")
    return RecordedRun(
        path,
        name,
        manifest,
        command,
        outputs.reset_index(drop=True),
        has_prompt_ids,
        schema.schema_read_from(table),
        int(limit) if limit else None,
        summary,
    )


def read_steps_margins(run: Path) -> dict[int, np.ndarray]:
    """request id -> the solo margin of each step, from a flips run's steps table (every step of a
    teacher-forced run; steps up to the first divergence of an endpoint run, NaN after)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mgbench.runs import rundir

    try:
        files = rundir.table_files(run, "steps")
    except UserError:
        return {}
    columns = ["request_id", "step", "solo_margin"]
    parts = [pq.read_table(path, columns=columns) for path in files]
    if not parts:
        return {}
    frame = pa.concat_tables(parts).to_pandas().dropna(subset=["solo_margin"])
    frame = frame.drop_duplicates(["request_id", "step"])
    margins = {}
    for request_id, group in frame.groupby("request_id"):
        values = np.full(int(group["step"].max()) + 1, np.nan, dtype=np.float64)
        values[group["step"].to_numpy()] = group["solo_margin"].to_numpy(dtype=np.float64)
        margins[int(request_id)] = values
    return margins


def _known(value) -> float | None:
    if value is None or value is pd.NA:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def margin_at(run: RecordedRun, margins, request_id: int, step: int) -> float | None:
    """The solo margin of `step` on one side: recorded in the sequences table, else (a flips run
    recorded before schema 3) in its steps table; None when neither holds it."""
    if margins is not None and not (np.isscalar(margins) and pd.isna(margins)) and step < len(margins):
        known = _known(margins[step])
        if known is not None:
            return known
    from_steps = run.steps_margins().get(request_id)
    if from_steps is not None and step < len(from_steps):
        return _known(from_steps[step])
    return None


def check_same_model(runs: list[RecordedRun]) -> str:
    identities = [model_identity(run.manifest) for run in runs]
    if len(set(identities)) > 1:
        named = ", ".join(f"{run.name}: {identity}" for run, identity in zip(runs, identities))
        raise UserError(
            f"the runs decoded different models or tokenizers ({named}); their token ids cannot be compared"
        )
    return identities[0]


def pair_key(a: RecordedRun, b: RecordedRun, mode: str) -> tuple[str, list[str]]:
    paired_by = PROMPT_IDS if a.has_prompt_ids and b.has_prompt_ids else REQUEST_IDS
    columns = ["prompt"] if paired_by == PROMPT_IDS else ["dataset", "request_id"]
    return paired_by, columns + (["axis", "batch_size", "variant"] if mode == BATCHED else [])


def diff_pair(a: RecordedRun, b: RecordedRun, mode: str) -> tuple[list[dict], dict]:
    """Rows (one per paired output) and the figures of one pair of runs."""
    paired_by, key = pair_key(a, b, mode)
    left, right = a.outputs.drop_duplicates(key), b.outputs.drop_duplicates(key)
    merged = left.merge(right, on=key, how="inner", suffixes=("_a", "_b"), sort=False)
    merged = merged.sort_values("request_id_a" if "request_id_a" in merged else "request_id", kind="stable")
    limits = [limit for limit in (a.max_new_tokens, b.max_new_tokens) if limit]
    compared = min(limits) if len(limits) == 2 and limits[0] != limits[1] else None
    rows = []
    for row in merged.itertuples(index=False):
        item = row._asdict()
        ids_a, ids_b = item["ids_a"], item["ids_b"]
        if compared is not None:
            ids_a, ids_b = ids_a[:compared], ids_b[:compared]
        step = first_divergence(ids_a, ids_b)
        request_a = int(item["request_id_a" if "request_id_a" in item else "request_id"])
        request_b = int(item["request_id_b"]) if "request_id_b" in item else request_a
        diverged = step is not None
        rows.append(
            {
                "run_a": a.name,
                "run_b": b.name,
                "request": item["prompt"] if paired_by == PROMPT_IDS else f"{item['dataset']}#{request_a}",
                "paired_by": paired_by,
                "dataset": item["dataset_a"] if "dataset_a" in item else item["dataset"],
                "request_id_a": request_a,
                "request_id_b": request_b,
                "batch_size": None if mode == SOLO else int(item["batch_size"]),
                "variant": None if mode == SOLO else item["variant"],
                "prompt_len": _int_or_none(item.get("prompt_len_a")),
                "tokens_a": len(ids_a),
                "tokens_b": len(ids_b),
                "identical": not diverged,
                "first_divergence": step,
                "token_a": ids_a[step] if diverged and step < len(ids_a) else None,
                "token_b": ids_b[step] if diverged and step < len(ids_b) else None,
                "margin_a": margin_at(a, item["margins_a"], request_a, step) if diverged and mode == SOLO else None,
                "margin_b": margin_at(b, item["margins_b"], request_b, step) if diverged and mode == SOLO else None,
            }
        )
    paired = len(rows)
    identical = sum(r["identical"] for r in rows)
    figures = {
        "run_a": a.name,
        "run_b": b.name,
        "paired_by": paired_by,
        "paired": paired,
        "identical": identical,
        "identical_share": identical / paired if paired else None,
        "only_in_a": len(left) - paired,
        "only_in_b": len(right) - paired,
        "compared_tokens": compared,
        "margins_at_divergence": margin_figures(rows),
        "divergences": [divergence_record(r) for r in rows if not r["identical"]],
    }
    return rows, figures


def _int_or_none(value) -> int | None:
    return None if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)) else int(value)


def divergence_record(row: dict) -> dict:
    """A divergence in the summary: which request, at which step (the first divergence), what each side had there."""
    keys = ("request", "dataset", "request_id_a", "request_id_b", "batch_size", "variant")
    return {
        **{key: row[key] for key in keys},
        "step": row["first_divergence"],
        **{key: row[key] for key in ("token_a", "token_b", "margin_a", "margin_b")},
    }


def margin_figures(rows: list[dict]) -> dict:
    """At the divergences whose margins both sides recorded: how many, how many were exact ties on
    a side (numeric noise can flip those), and the wider of the two margins (a wide one is a real
    change of the logits, not a tie broken the other way)."""
    diverged = [r for r in rows if not r["identical"]]
    both = [(r["margin_a"], r["margin_b"]) for r in diverged if r["margin_a"] is not None and r["margin_b"] is not None]
    wider = np.array([max(pair) for pair in both], dtype=np.float64)
    return {
        "divergences": len(diverged),
        "known": len(both),
        "ties": sum(min(pair) == 0.0 for pair in both),
        "wider_margin_median": float(np.median(wider)) if len(wider) else None,
        "wider_margin_max": float(wider.max()) if len(wider) else None,
    }


def describe_run(run: RecordedRun) -> dict:
    manifest = run.manifest
    engine = manifest.get("engine") or {}
    return {
        "name": run.name,
        "path": str(run.path),
        "command": run.command,
        "engine": engine.get("label") or run.summary.get("engine") or "in-process",  # runs before engines: in process
        "device_name": manifest.get("device_name"),
        # an endpoint's kernels are the server's: the client's variables say nothing about them
        "kernel_environment": None if engine.get("kind") == "endpoint" else manifest.get("kernel_environment"),
        "datasets": sorted(run.outputs["dataset"].dropna().unique().tolist()),
        "outputs": len(run.outputs),
        "max_new_tokens": run.max_new_tokens,
        "schema_version_read": run.schema_version_read,
    }


def diff_runs(runs: list[RecordedRun], mode: str, required: float | None = None) -> tuple[list[dict], dict]:
    """Every pair of runs compared: (rows of all pairs, the summary). Refuses runs of different
    models, and pairs of runs that share no request."""
    model = check_same_model(runs)
    rows, pairs = [], []
    for a, b in combinations(runs, 2):
        pair_rows, figures = diff_pair(a, b, mode)
        if not figures["paired"]:
            raise UserError(
                f"{a.name} and {b.name} share no request (paired by {figures['paired_by']}"
                + (", batch size and policy" if mode == BATCHED else "")
                + "): nothing to compare"
            )
        rows += pair_rows
        pairs.append(figures)
    names = [run.name for run in runs]
    matrix = [[None] * len(runs) for _ in runs]
    for pair in pairs:
        i, j = names.index(pair["run_a"]), names.index(pair["run_b"])
        matrix[i][j] = matrix[j][i] = pair["identical_share"]
    lowest = min(pair["identical_share"] for pair in pairs)
    summary = {
        "command": "diff",
        "mode": mode,
        "model": model,
        "runs": [describe_run(run) for run in runs],
        "pairs": pairs,
        "matrix": {"names": names, "identical_share": matrix},
        "min_identical_share": lowest,
        "required_identical": required,
        "passed": None if required is None else all(pair["identical_share"] >= required for pair in pairs),
        "manifest_differences": manifest_differences([run.manifest for run in runs]),
    }
    return rows, summary

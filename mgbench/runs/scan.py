"""Steps tables read by streaming: the counts calibration needs, in memory bounded by distinct values.

Margins live on a bf16 grid, so a table of counts per (model, dataset, batch size, flipped,
margin, margin_ulp) carries everything a threshold calibration computes, exactly. It is built by
reading the run's Parquet files (one file, or a sharded run's parts) a record batch at a time,
projecting the six columns and aggregating each batch with Arrow's hash grouping; the partial
counts are merged as they come, so memory follows the number of distinct keys, not of rows.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from mgbench.errors import UserError
from mgbench.runs import rundir
from mgbench.runs.schema import readable_version

COUNT_KEYS = ["model", "dataset", "batch_size", "flipped", "margin", "margin_ulp"]
BATCH_ROWS = 1 << 21  # rows per scanned record batch
MERGE_EVERY = 16  # partial count tables kept before they are merged


def steps_files(run: Path) -> list[Path]:
    """The Parquet files holding a run's steps: steps.parquet, a sharded run's parts, or a path."""
    if not run.exists():
        raise UserError(f"{run} does not exist")
    return rundir.table_files(run, "steps") if run.is_dir() else [run]


def _batches(files: list[Path]):
    """Record batches of the six columns, one file after another. A file is read sequentially
    (a dataset scanner's read-ahead buffered most of a large file), and the string keys are read
    dictionary-encoded (grouping on them is then a grouping on small integers)."""
    for path in files:
        reader = pq.ParquetFile(path, read_dictionary=["model", "dataset"])
        yield from reader.iter_batches(batch_size=BATCH_ROWS, columns=COUNT_KEYS, use_threads=True)


def _decoded(table: pa.Table) -> pa.Table:
    """Dictionary-encoded keys as plain strings: batches carry different dictionaries."""
    for name in ("model", "dataset"):
        column = table[name]
        if pa.types.is_dictionary(column.type):
            table = table.set_column(table.schema.get_field_index(name), name, column.cast(pa.string()))
    return table


def _grouped(table: pa.Table, aggregation: tuple) -> pa.Table:
    """`table` grouped by COUNT_KEYS, its one aggregate named "count" and placed last."""
    counted = table.group_by(COUNT_KEYS).aggregate([aggregation])
    return counted.rename_columns([*COUNT_KEYS, "count"]).select(COUNT_KEYS + ["count"])


def _merge(parts: list[pa.Table]) -> pa.Table:
    return _grouped(pa.concat_tables(parts), ("count", "sum"))


def margin_counts(run: Path) -> pd.DataFrame:
    """Counts of steps per COUNT_KEYS over a run directory (or steps.parquet), streamed; its
    `attrs["schema_version_read"]` is the version the files were written with."""
    files = steps_files(run)
    versions = set()
    for path in files:
        try:
            schema = pq.read_schema(path)
        except (OSError, pa.ArrowInvalid) as exc:
            raise UserError(f"{path} is not a readable Parquet file ({exc})") from exc
        versions.add(readable_version(path, schema))
        missing = [name for name in COUNT_KEYS if name not in schema.names]
        if missing:
            raise UserError(f"{path}: steps table lacks columns {', '.join(missing)}")
    parts: list[pa.Table] = []
    for batch in _batches(files):
        if batch.num_rows:
            parts.append(_decoded(_grouped(pa.Table.from_batches([batch]), ([], "count_all"))))
        if len(parts) >= MERGE_EVERY:
            parts = [_merge(parts)]
    counts = _merge(parts).to_pandas() if parts else pd.DataFrame(columns=COUNT_KEYS + ["count"])
    counts.attrs["schema_version_read"] = min(versions)
    return counts

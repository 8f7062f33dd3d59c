"""Steps tables read by streaming: the counts calibration needs, in memory bounded by distinct values;
and record batches of any steps table (files, an Arrow table, a DataFrame) for the streamed
aggregates of a flips summary and the baseline gate (analysis/step_aggregates.py).

Margins live on a bf16 grid, so a table of counts per (model, dataset, batch size, flipped,
margin, margin_ulp) carries everything a threshold calibration computes, exactly. It is built by
reading the run's Parquet files (one file, or a sharded run's parts) a record batch at a time,
projecting the six columns and aggregating each batch with Arrow's hash grouping; the partial
counts are merged as they come, so memory follows the number of distinct keys, not of rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mgbench.errors import UserError
from mgbench.runs import rundir
from mgbench.runs.schema import SCHEMA_VERSION, STEPS_SCHEMA, readable_version, upgrade

COUNT_KEYS = ["model", "dataset", "batch_size", "flipped", "margin", "margin_ulp"]
BATCH_ROWS = 1 << 21  # rows per scanned record batch
MERGE_EVERY = 16  # partial count tables kept before they are merged


def steps_files(run: Path) -> list[Path]:
    """The Parquet files holding a run's steps: steps.parquet, a sharded run's parts, or a path."""
    if not run.exists():
        raise UserError(f"{run} does not exist")
    return rundir.table_files(run, "steps") if run.is_dir() else [run]


def row_groups(path: Path, columns: list[str], read_dictionary: tuple[str, ...] = ()) -> Iterator[pa.Table]:
    """A Parquet file's `columns`, one row group at a time, sliced into tables of at most
    BATCH_ROWS rows: memory is bounded by the largest row group (pyarrow writes at most 1 Mi rows
    per group by default). iter_batches buffered more as a file grew (measured over a 50 M-row
    steps file, 11 columns: 955 MB peak against 361 MB row group by row group, and slower)."""
    reader = pq.ParquetFile(path, read_dictionary=list(read_dictionary) or None)
    for index in range(reader.metadata.num_row_groups):
        yield from _slices(reader.read_row_group(index, columns=columns, use_threads=True))


def _slices(table: pa.Table) -> Iterator[pa.Table]:
    """`table` as zero-copy slices of at most BATCH_ROWS rows."""
    for start in range(0, table.num_rows, BATCH_ROWS):
        yield table.slice(start, BATCH_ROWS)


def file_schemas(files: list[Path]) -> dict[Path, tuple[str, list[str]]]:
    """Per Parquet file: the schema version it was written with and its column names, read from
    its footer; one clear line for a file that is not readable, foreign or newer."""
    schemas = {}
    for path in files:
        try:
            schema = pq.read_schema(path)
        except (OSError, pa.ArrowInvalid) as exc:
            raise UserError(f"{path} is not a readable Parquet file ({exc})") from exc
        schemas[path] = (readable_version(path, schema), schema.names)
    return schemas


def _batches(files: list[Path], schemas: dict) -> Iterator[pa.Table]:
    """The six columns (and `axis`, where the file has it), one file after another; the string
    keys read dictionary-encoded (grouping on them is then a grouping on small integers)."""
    for path in files:
        axis = ["axis"] if "axis" in schemas[path][1] else []
        yield from row_groups(path, COUNT_KEYS + axis, ("model", "dataset"))


def _decoded(table: pa.Table) -> pa.Table:
    """Dictionary-encoded keys as plain strings: batches carry different dictionaries."""
    for name in ("model", "dataset"):
        column = table[name]
        if pa.types.is_dictionary(column.type):
            table = table.set_column(table.schema.get_field_index(name), name, column.cast(pa.string()))
    return table


def grouped_count(table: pa.Table, keys: list[str], aggregation: tuple = ([], "count_all")) -> pa.Table:
    """`table` grouped by `keys`, its one aggregate named "count" and placed last (the default
    counts rows; ("count", "sum") merges partial counts)."""
    counted = table.group_by(keys).aggregate([aggregation])
    return counted.rename_columns([*keys, "count"]).select(keys + ["count"])


def merged_counts(parts: list[pa.Table], keys: list[str]) -> pa.Table:
    return grouped_count(pa.concat_tables(parts), keys, ("count", "sum"))


def margin_counts(run: Path) -> pd.DataFrame:
    """Counts of steps per COUNT_KEYS over a run directory (or steps.parquet), streamed; its
    `attrs["schema_version_read"]` is the version the files were written with."""
    files = steps_files(run)
    schemas = file_schemas(files)
    for path, (_, names) in schemas.items():
        missing = [name for name in COUNT_KEYS if name not in names]
        if missing:
            raise UserError(f"{path}: steps table lacks columns {', '.join(missing)}")
    parts: list[pa.Table] = []
    for batch in _batches(files, schemas):
        if "axis" in batch.schema.names:  # a threshold gates batched steps: the batch axis's rows alone
            batch = batch.filter(pc.equal(batch["axis"], "batch"))
        if batch.num_rows:
            parts.append(_decoded(grouped_count(batch, COUNT_KEYS)))
        if len(parts) >= MERGE_EVERY:
            parts = [merged_counts(parts, COUNT_KEYS)]
    counts = merged_counts(parts, COUNT_KEYS).to_pandas() if parts else pd.DataFrame(columns=COUNT_KEYS + ["count"])
    counts.attrs["schema_version_read"] = min(version for version, _ in schemas.values())
    return counts


BatchReader = Callable[[list[str]], Iterator[pa.Table]]


def step_reader(source: pa.Table | pd.DataFrame | list[Path]) -> BatchReader:
    """A re-readable stream over a steps table: `read(columns)` yields record batches (as
    tables) of those of `columns` the table has. Files are read a batch at a time, older schema
    versions upgraded batch by batch; a table in memory is sliced, not copied."""
    if isinstance(source, pd.DataFrame):
        source = pa.Table.from_pandas(source, preserve_index=False)
    if isinstance(source, pa.Table):
        table = source

        def read_table(columns: list[str]) -> Iterator[pa.Table]:
            yield from _slices(table.select([c for c in columns if c in table.schema.names]))

        return read_table
    schemas = file_schemas(list(source))

    def read_files(columns: list[str]) -> Iterator[pa.Table]:
        for path, (version, names) in schemas.items():
            present = [c for c in columns if c in names]
            for table in row_groups(path, present):
                if version != SCHEMA_VERSION:  # an older run: the columns it lacked, as the upgrade fills them
                    table = upgrade(table, version, STEPS_SCHEMA)
                    table = table.select([c for c in columns if c in table.schema.names])
                yield table

    return read_files

"""What a flips summary and the baseline gate need from a steps table, aggregated batch by batch.

A steps table has one row per (sequence, step): at fleet scale hundreds of millions. The figures
read from it are small: counts per margin value (bf16 grid), the drift's count and max, the
median K/V perturbation overall and at each offset before a flip, and per sequence its step range
and flipped steps. They are computed here from a stream of record batches (`runs/scan.py`) in two
passes, in memory bounded by distinct margins, sequences and flips, not by rows; and bitwise as
pandas computes them on the whole table (the quantiles and medians below are pandas' own, applied
to the values that decide them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from mgbench.errors import UserError
from mgbench.runs.scan import BatchReader, grouped_count, merged_counts
from mgbench.runs.schema import DEFAULT_AXIS, STEPS_SCHEMA

MARGIN_KEYS = ["axis", "batch_size", "flipped", "margin", "margin_ulp"]
SEQUENCE_KEYS = ["request_id", "axis", "batch_size"]
KV_WINDOW = 8
MERGE_EVERY = 16
_HALF_BITS = 16  # the exact median: a histogram of a float32's top 16 order bits, then of its low 16


@dataclass
class StepAggregates:
    rows: int
    margin_counts: pd.DataFrame  # steps per MARGIN_KEYS (nulls and NaN margins kept as NaN)
    methods: list[str]  # distinct values of `method`, sorted
    drift_steps: int  # non-flipped steps with a measured logprob drift
    drift_steps_differing: int  # ... of which the drift is above zero
    max_logprob_drift: float | None
    kv_overall_median: float  # NaN without measured K/V
    kv_before_flips: pd.DataFrame | None  # offset, flips, kv_delta_median (None: figures not asked for)
    sequences: pd.DataFrame | None  # per SEQUENCE_KEYS: steps, first_step, last_step (None: no request_id)
    flip_steps: pd.DataFrame | None  # SEQUENCE_KEYS + step of every flipped step


def _numpy(table: pa.Table, name: str) -> np.ndarray:
    return table[name].to_numpy()


def order_keys(values: np.ndarray) -> np.ndarray:
    """float32 values as uint32 keys that sort as the values do (negative ones bit-inverted)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000))


def key_values(keys: np.ndarray) -> np.ndarray:
    """The inverse of order_keys."""
    keys = keys.astype(np.uint32)
    return np.where(keys & np.uint32(0x80000000), keys ^ np.uint32(0x80000000), ~keys).view(np.float32)


class ExactMedian:
    """The median of a float32 column over two passes, as pandas computes it (NaN skipped), from
    2 x 65536 counts: pass one counts values by their top order bits, pass two counts the low bits
    of the values in the one or two bins that hold the middle ranks."""

    def __init__(self) -> None:
        self.coarse = np.zeros(1 << _HALF_BITS, np.int64)
        self.fine: dict[int, np.ndarray] = {}

    def first_pass(self, values: np.ndarray) -> None:
        keys = order_keys(values[~np.isnan(values)])
        self.coarse += np.bincount(keys >> _HALF_BITS, minlength=1 << _HALF_BITS)

    def _ranks(self) -> list[int]:
        n = int(self.coarse.sum())
        return sorted({(n - 1) // 2, n // 2}) if n else []

    def _bin_of(self, rank: int) -> int:
        return int(np.searchsorted(np.cumsum(self.coarse), rank, side="right"))

    def needed_bins(self) -> set[int]:
        return {self._bin_of(rank) for rank in self._ranks()}

    def second_pass(self, values: np.ndarray) -> None:
        keys = order_keys(values[~np.isnan(values)])
        for coarse_bin in self.needed_bins():
            inside = keys[(keys >> _HALF_BITS) == coarse_bin] & np.uint32((1 << _HALF_BITS) - 1)
            counts = np.bincount(inside, minlength=1 << _HALF_BITS)
            self.fine[coarse_bin] = self.fine.get(coarse_bin, 0) + counts

    def value(self) -> float:
        ranks = self._ranks()
        if not ranks:
            return float("nan")
        before = np.concatenate([[0], np.cumsum(self.coarse)])
        middle = []
        for rank in ranks:
            coarse_bin = self._bin_of(rank)
            low = int(np.searchsorted(np.cumsum(self.fine[coarse_bin]), rank - before[coarse_bin], side="right"))
            middle.append(key_values(np.array([(coarse_bin << _HALF_BITS) | low]))[0])
        # pandas' median of the middle value(s) is its median of the whole column
        return float(pd.Series(np.array(middle, np.float32)).median())


def _step_codes(batch_id: np.ndarray, row: np.ndarray, step: np.ndarray, bits: tuple[int, int]) -> np.ndarray:
    """(batch_id, row, step) packed in one int64, `bits` = (row bits, step bits)."""
    row_bits, step_bits = bits
    return (batch_id.astype(np.int64) << (row_bits + step_bits)) | (row.astype(np.int64) << step_bits) | step


def _code_bits(max_batch_id: int, max_row: int, max_step: int) -> tuple[int, int]:
    bits = (max(int(max_row), 1).bit_length(), max(int(max_step), 1).bit_length())
    if max(int(max_batch_id), 1).bit_length() + sum(bits) > 62:
        raise UserError(
            f"steps table too wide to index its flips (batch_id {max_batch_id}, row {max_row}, step {max_step})"
        )
    return bits


FIRST_PASS = [
    "batch_id",
    "row",
    "step",
    "axis",
    "batch_size",
    "flipped",
    "margin",
    "margin_ulp",
    "logprob_drift",
    "kv_delta_mean",
    "method",
    "request_id",
]


def with_axis(table: pa.Table) -> pa.Table:
    """A steps table (or a batch of one) with its `axis` column: a table made without one (an
    analysis of columns picked by hand) varied the batch."""
    if "axis" in table.schema.names:
        return table
    return table.append_column("axis", pa.array([DEFAULT_AXIS] * table.num_rows, pa.string()))


def aggregate_steps(read: BatchReader, figures: bool = True, pairs: bool = True) -> StepAggregates:
    """The aggregates of the steps table `read` streams (see runs.scan.step_reader): those of a
    flips summary (`figures`: margin counts, drift, K/V, which take a second pass) and those the
    baseline test pairs (`pairs`: per-sequence step ranges and flipped steps). What is not asked
    for is left empty."""
    rows, drift_steps, drift_differing, drift_max = 0, 0, 0, None
    margin_parts, sequence_parts, flip_parts, flip_sequence_parts = [], [], [], []
    methods: set[str] = set()
    median = ExactMedian()
    extent = [0, 0, 0]  # largest batch_id, row, step
    columns = FIRST_PASS if figures else ["flipped", *SEQUENCE_KEYS, "step"]
    for batch in read(columns):
        if not batch.num_rows:
            continue
        batch = with_axis(batch)
        rows += batch.num_rows
        flipped = _numpy(batch, "flipped").astype(bool)
        flipped_rows = batch.filter(pa.array(flipped))
        if pairs and "request_id" in batch.schema.names:
            sequence_parts.append(_sequence_ranges(batch))
            flip_sequence_parts.append(flipped_rows.select(SEQUENCE_KEYS + ["step"]))
            if len(sequence_parts) >= MERGE_EVERY:
                sequence_parts = [_merged_sequences(sequence_parts)]
        if not figures:
            continue
        margin_parts.append(grouped_count(batch.select(MARGIN_KEYS), MARGIN_KEYS))
        if len(margin_parts) >= MERGE_EVERY:
            margin_parts = [merged_counts(margin_parts, MARGIN_KEYS)]
        if "method" in batch.schema.names:
            methods.update(m for m in pc.unique(batch["method"]).to_pylist() if m is not None)
        if "logprob_drift" in batch.schema.names:
            drift = _numpy(batch, "logprob_drift")[~flipped]
            drift = drift[~np.isnan(drift)]
            drift_steps += len(drift)
            drift_differing += int((drift > 0).sum())
            if len(drift):
                drift_max = float(drift.max()) if drift_max is None else max(drift_max, float(drift.max()))
        median.first_pass(_numpy(batch, "kv_delta_mean"))
        for index, name in enumerate(("batch_id", "row", "step")):
            extent[index] = max(extent[index], int(pc.max(batch[name]).as_py()))
        flip_parts.append(flipped_rows.select(["batch_id", "row", "step"]))
    if not margin_parts:  # no steps: the empty counts, typed as the table's columns
        margin_parts = [grouped_count(STEPS_SCHEMA.empty_table().select(MARGIN_KEYS), MARGIN_KEYS)]
    counts = merged_counts(margin_parts, MARGIN_KEYS).to_pandas()
    kv_profile = _kv_before_flips(read, flip_parts, median, extent, KV_WINDOW) if figures else None
    sequences = flip_steps = None
    if sequence_parts:
        sequences = _merged_sequences(sequence_parts).to_pandas()
        flip_steps = pa.concat_tables(flip_sequence_parts).to_pandas()
    return StepAggregates(
        rows=rows,
        margin_counts=counts,
        methods=sorted(methods),
        drift_steps=drift_steps,
        drift_steps_differing=drift_differing,
        max_logprob_drift=drift_max,
        kv_overall_median=median.value(),
        kv_before_flips=kv_profile,
        sequences=sequences,
        flip_steps=flip_steps,
    )


def _sequence_ranges(table: pa.Table, merging: bool = False) -> pa.Table:
    """Per sequence (SEQUENCE_KEYS): steps, first_step, last_step; of steps rows, or of such partials."""
    if merging:
        aggregations = [("steps", "sum"), ("first_step", "min"), ("last_step", "max")]
    else:
        aggregations = [("step", "count"), ("step", "min"), ("step", "max")]
    grouped = table.group_by(SEQUENCE_KEYS).aggregate(aggregations)
    produced = [f"{column}_{function}" for column, function in aggregations]
    return pa.table(
        {
            **{k: grouped[k] for k in SEQUENCE_KEYS},
            **dict(zip(("steps", "first_step", "last_step"), map(grouped.column, produced))),
        }
    )


def _merged_sequences(parts: list[pa.Table]) -> pa.Table:
    return _sequence_ranges(pa.concat_tables(parts), merging=True)


def _kv_before_flips(read: BatchReader, flip_parts, median: ExactMedian, extent, window: int) -> pd.DataFrame:
    """Second pass: the K/V perturbation at each offset -window..0 from every flip (the same
    (batch, row), `offset` steps earlier), and the counts the exact overall median needs."""
    flips = pa.concat_tables(flip_parts) if flip_parts else None
    bits = _code_bits(*extent)
    targets, offsets = np.zeros(0, np.int64), np.zeros(0, np.int64)
    if flips is not None and flips.num_rows:
        batch_id, row, step = (_numpy(flips, n) for n in ("batch_id", "row", "step"))
        per_offset = []
        for offset in range(-window, 1):
            keep = step + offset >= 0  # before step 0 nothing was decoded
            per_offset.append((_step_codes(batch_id[keep], row[keep], step[keep] + offset, bits), offset))
        targets = np.concatenate([codes for codes, _ in per_offset])
        offsets = np.concatenate([np.full(len(codes), offset) for codes, offset in per_offset])
        order = np.argsort(targets, kind="stable")
        targets, offsets = targets[order], offsets[order]
    found_offsets, found_values = [], []
    for batch in read(["batch_id", "row", "step", "kv_delta_mean"]):
        values = _numpy(batch, "kv_delta_mean")
        median.second_pass(values)
        if not len(targets):
            continue
        codes = _step_codes(*(_numpy(batch, n) for n in ("batch_id", "row", "step")), bits)
        at = np.searchsorted(targets, codes, side="left")
        # a step is the target of one flip per offset at most; walk the run of equal targets
        while True:
            inside = at < len(targets)
            hit = np.zeros(len(codes), bool)
            hit[inside] = targets[at[inside]] == codes[inside]
            if not hit.any():
                break
            found_offsets.append(offsets[at[hit]])
            found_values.append(values[hit])
            codes, values, at = codes[hit], values[hit], at[hit] + 1
    all_offsets = np.concatenate(found_offsets) if found_offsets else np.zeros(0, np.int64)
    all_values = np.concatenate(found_values) if found_values else np.zeros(0, np.float32)
    rows = []
    for offset in range(-window, 1):
        values = pd.Series(all_values[all_offsets == offset]).dropna()
        rows.append(
            {
                "offset": offset,
                "flips": len(values),
                "kv_delta_median": values.median() if len(values) else float("nan"),
            }
        )
    return pd.DataFrame(rows)


def quantile_from_counts(values: np.ndarray, counts: np.ndarray, q: float, missing: bool = False) -> float:
    """pandas' Series.quantile(q) (linear) of the column whose distinct values are `values`
    (sorted, no NaN) with `counts`: numpy's interpolation between the two ranks it reads. With
    `missing` values in the column pandas returns the result in the column's dtype (float32)."""
    n = int(counts.sum())
    if n == 0:
        return float("nan")
    virtual = (n - 1) * q
    lo = int(np.floor(virtual))
    hi = min(lo + 1, n - 1)
    cumulative = np.cumsum(counts)
    pair = values[np.searchsorted(cumulative, [lo, hi], side="right")].astype(np.float32)
    result = np.quantile(pair, [virtual - lo])[0]
    return float(np.float32(result) if missing else result)


def margin_quantiles(counts: pd.DataFrame, quantiles: tuple, column: str) -> dict[str, list[float]]:
    """Quantiles of a margin column at flip and at non-flip steps, from margin counts."""
    out = {}
    for name, flipped in (("flip", True), ("non-flip", False)):
        part = counts[counts["flipped"] == flipped]
        missing = bool(part[column].isna().any())
        marginal = part[part[column].notna()].groupby(column, sort=True)["count"].sum()
        values, weights = marginal.index.to_numpy(np.float32), marginal.to_numpy(np.int64)
        out[name] = [quantile_from_counts(values, weights, q, missing) for q in quantiles]
    return out


def steps_by_batch_size(counts: pd.DataFrame) -> pd.DataFrame:
    """Per axis and batch size: steps and flips (index axis, batch_size)."""
    counts = counts.assign(flips=counts["count"] * counts["flipped"].astype(np.int64))
    return counts.groupby(["axis", "batch_size"]).agg(steps=("count", "sum"), flips=("flips", "sum"))


def flips_count(aggregates: StepAggregates) -> int:
    counts = aggregates.margin_counts
    return int(counts.loc[counts["flipped"].astype(bool), "count"].sum())


def aggregate(source, figures: bool = True, pairs: bool = True) -> StepAggregates:
    """The aggregates of a steps table: its Parquet files (list of paths), an Arrow table or a
    DataFrame (see aggregate_steps for `figures` and `pairs`)."""
    from mgbench.runs.scan import step_reader

    return aggregate_steps(step_reader(source), figures, pairs)

"""Arrow tables with a versioned schema: the step and sequence tables, and reading any version.

Every Parquet file mgbench writes carries its schema version in the schema metadata; reading
upgrades older versions in memory and refuses foreign or newer files in one line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mgbench import SCHEMA_VERSION
from mgbench.errors import UserError

SCHEMA_KEY = b"mgbench.schema_version"
# Parquet names list items "element": declaring it so keeps the schema equal after a round trip.
TOKEN_IDS = pa.list_(pa.field("element", pa.int32()))
MARGINS = pa.list_(pa.field("element", pa.float32()))  # one float per generated token; null items unknown

# Where a row sat: shared by the step and sequence tables.
PLACEMENT_FIELDS = [
    ("model", pa.string()),
    ("dataset", pa.string()),
    ("request_id", pa.int64()),
    ("batch_id", pa.int32()),
    ("row", pa.int32()),
    ("batch_size", pa.int32()),
    ("pad_len", pa.int32()),
]

# How a step was compared with solo: "teacher-forced" (the in-process engine feeds the solo token,
# so every step is comparable) or "first-divergence" (a black-box endpoint: steps up to and
# including the first differing token). Columns an endpoint cannot measure are null there.
METHODS = ("teacher-forced", "first-divergence")
# What a flips audit varies, request by request, one thing at a time, against the same request
# decoded alone with its prompt prefilled in one forward (an endpoint: sent alone, cold): the batch
# it shares (`batch`); a prefix of its prompt computed earlier and reused, as a prefix cache does
# (`prefix-cache`); its prompt prefilled in chunks, as a chunked-prefill scheduler does
# (`chunked-prefill`); or, against the first run of the same concurrent load, that load run again
# (`repeat`, an endpoint's: there the reference is the first run's output).
AXES = ("batch", "prefix-cache", "chunked-prefill", "repeat")
PREFILL_AXES = ("prefix-cache", "chunked-prefill")  # in process: decoded alone, from a prefill cut into pieces
IN_PROCESS_AXES = ("batch", "prefix-cache", "chunked-prefill")
ENDPOINT_AXES = ("batch", "prefix-cache", "repeat")
# What the fixed-order kernels promise: every decode step's forward has a fixed per-row reduction
# order, so the batch axis is invariant by construction. Prompts are still prefilled through the
# stock attention (alone, as the solo reference prefills them), so a prompt prefilled in pieces
# (the prefix-cache and chunked-prefill axes) is measured, not promised.
FIXED_ORDER_INVARIANT = (
    "the batch axis (decode steps); prefix-cache and chunked-prefill are measured (prefill attention is stock)"
)
# The axis of each row of the flips tables: rows that do not say were decoded on the batch axis
# (the only one before schema 5, and an endpoint's).
AXIS_FIELD = ("axis", pa.string())
DEFAULT_AXIS = "batch"

STEP_FIELDS = [
    *PLACEMENT_FIELDS,
    AXIS_FIELD,
    ("method", pa.string()),
    ("step", pa.int32()),
    ("solo_token", pa.int64()),
    ("batched_token", pa.int64()),
    ("flipped", pa.bool_()),
    ("margin", pa.float32()),
    ("margin_ulp", pa.float32()),
    ("solo_margin", pa.float32()),
    ("max_abs_logit_diff", pa.float32()),
    ("logprob_drift", pa.float32()),  # max |solo - batched| top-k logprob, over ids in both top-k
    ("kv_delta_mean", pa.float32()),
    ("kv_delta_max", pa.float32()),
]

SEQUENCE_FIELDS = [
    *PLACEMENT_FIELDS,
    AXIS_FIELD,
    ("prompt_len", pa.int32()),
    ("prompt_ids", TOKEN_IDS),
    ("solo_ids", TOKEN_IDS),
    ("solo_margins", MARGINS),  # top-1 minus top-2 logit of every solo step (the step that chose solo_ids[i])
    ("batched_ids", TOKEN_IDS),
    ("first_divergence", pa.int32()),
    ("identical", pa.bool_()),
    ("policy", pa.string()),
    ("triggers", pa.int32()),
    ("repairs", pa.int32()),
]


def _schema(fields) -> pa.Schema:
    return pa.schema(fields, metadata={SCHEMA_KEY: SCHEMA_VERSION.encode()})


STEPS_SCHEMA = _schema(STEP_FIELDS)
SEQUENCES_SCHEMA = _schema(SEQUENCE_FIELDS)

# `mgbench verify`'s tables: free-running steps under a policy, and its sequences.
VERIFY_STEP_FIELDS = [
    *PLACEMENT_FIELDS,
    ("policy", pa.string()),
    ("repair", pa.string()),
    ("step", pa.int32()),
    ("solo_token", pa.int64()),
    ("batched_token", pa.int64()),
    ("matches_solo", pa.bool_()),
    ("margin", pa.float32()),
    ("margin_ulp", pa.float32()),
    ("triggered", pa.bool_()),
    ("repaired", pa.bool_()),
]
# What verification did to a sequence, as the one free-running loop counts it for every policy:
# verifications it took part in, reference tokens computed for it, repairs (rollbacks), and the
# emitted tokens those threw away.
REPLAY_RECORD_FIELDS = [
    ("replays", pa.int32()),
    ("replayed", pa.int32()),
    ("rollbacks", pa.int32()),
    ("discarded", pa.int32()),
]
VERIFY_SEQUENCE_FIELDS = [
    *PLACEMENT_FIELDS,
    ("policy", pa.string()),
    ("repair", pa.string()),
    ("prompt_len", pa.int32()),
    ("solo_ids", TOKEN_IDS),
    ("batched_ids", TOKEN_IDS),
    ("first_divergence", pa.int32()),
    ("identical", pa.bool_()),
    ("steps", pa.int32()),
    ("triggers", pa.int32()),
    ("repairs", pa.int32()),
    *REPLAY_RECORD_FIELDS,
]
VERIFY_STEPS_SCHEMA = pa.schema(
    VERIFY_STEP_FIELDS, metadata={SCHEMA_KEY: SCHEMA_VERSION.encode(), b"mgbench.table": b"verify_steps"}
)
VERIFY_SEQUENCES_SCHEMA = pa.schema(
    VERIFY_SEQUENCE_FIELDS, metadata={SCHEMA_KEY: SCHEMA_VERSION.encode(), b"mgbench.table": b"verify_sequences"}
)

# `mgbench diff`'s table: one row per (pair of runs, paired request), plain columns for pandas and DuckDB.
DIFF_FIELDS = [
    ("run_a", pa.string()),
    ("run_b", pa.string()),
    ("request", pa.string()),  # the prompt's SHA-256 (16 hex digits) or, paired by request id, DATASET#ID
    ("paired_by", pa.string()),
    ("dataset", pa.string()),
    ("request_id_a", pa.int64()),
    ("request_id_b", pa.int64()),
    ("batch_size", pa.int32()),  # --batched: the batch size both outputs were decoded at; null for solo outputs
    ("variant", pa.string()),  # --batched: the policy that decoded them (flips runs: none)
    ("prompt_len", pa.int32()),
    ("tokens_a", pa.int32()),  # tokens compared on each side
    ("tokens_b", pa.int32()),
    ("identical", pa.bool_()),
    ("first_divergence", pa.int32()),
    ("token_a", pa.int64()),  # each side's token at the first divergence (null: that side had ended)
    ("token_b", pa.int64()),
    ("margin_a", pa.float32()),  # each side's solo top-1 minus top-2 there (null: not recorded)
    ("margin_b", pa.float32()),
]
DIFF_SCHEMA = pa.schema(DIFF_FIELDS, metadata={SCHEMA_KEY: SCHEMA_VERSION.encode(), b"mgbench.table": b"diff"})


def diff_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=DIFF_SCHEMA)


def _column(rows: list[dict], name: str, kind: pa.DataType) -> pa.Array:
    """One column over per-row dicts; a row whose value is None did not measure it: nulls there."""
    parts = [pa.nulls(len(r["step"]), kind) if r[name] is None else pa.array(np.asarray(r[name]), kind) for r in rows]
    return pa.concat_arrays(parts) if parts else pa.array([], kind)


def steps_table(row_columns: list[dict], model: str, dataset: str) -> pa.Table:
    """Concatenate per-row column dicts (arrays, or None where unmeasured) into the steps table."""
    n = sum(len(r["step"]) for r in row_columns)
    columns = {"model": pa.array([model] * n, pa.string()), "dataset": pa.array([dataset] * n, pa.string())}
    for name, kind in STEP_FIELDS[2:]:
        if name == "axis":
            columns[name] = pa.array([r.get("axis", DEFAULT_AXIS) for r in row_columns for _ in r["step"]], kind)
        else:
            columns[name] = _column(row_columns, name, kind)
    return pa.Table.from_pydict(columns, schema=STEPS_SCHEMA)


def sequences_table(rows: list[dict], model: str, policy: str = "none") -> pa.Table:
    full = [{"model": model, "policy": policy, "axis": DEFAULT_AXIS, **row} for row in rows]
    return pa.Table.from_pylist(full, schema=SEQUENCES_SCHEMA)


# Every schema version this project has written, oldest first. A table of an older version is
# upgraded on read, so runs recorded by an earlier release (CI baselines among them) stay usable.
READABLE_VERSIONS = ("1", "2", "3", "4", SCHEMA_VERSION)
# The key under which an upgraded table remembers the version it was read from.
READ_FROM_KEY = b"mgbench.schema_version_read"


def _with_column(table: pa.Table, name: str, array: pa.Array, expected: pa.Schema) -> pa.Table:
    """`table` plus column `name`, placed where `expected` has it."""
    index = expected.names.index(name)
    before = [n for n in expected.names[:index] if n in table.schema.names]
    position = table.schema.get_field_index(before[-1]) + 1 if before else 0
    return table.add_column(position, pa.field(name, array.type), array)


def upgrade_v1(table: pa.Table, expected: pa.Schema) -> pa.Table:
    """Schema 1 -> 2. Only the steps table changed: it gained `method` (every v1 run was the
    in-process engine's, so teacher-forced) and `logprob_drift` (not measured then: null)."""
    rows = table.num_rows
    if "method" in expected.names and "method" not in table.schema.names:
        table = _with_column(table, "method", pa.array(["teacher-forced"] * rows, pa.string()), expected)
    if "logprob_drift" in expected.names and "logprob_drift" not in table.schema.names:
        table = _with_column(table, "logprob_drift", pa.nulls(rows, pa.float32()), expected)
    return table


def upgrade_v2(table: pa.Table, expected: pa.Schema) -> pa.Table:
    """Schema 2 -> 3. Only the flips sequences table changed: it gained `solo_margins` (not
    recorded then: null, so a diff shows those margins as unknown)."""
    if "solo_margins" in expected.names and "solo_margins" not in table.schema.names:
        table = _with_column(table, "solo_margins", pa.nulls(table.num_rows, MARGINS), expected)
    return table


def upgrade_v3(table: pa.Table, expected: pa.Schema) -> pa.Table:
    """Schema 3 -> 4. Only verify's sequences table changed: it gained the replay records
    (`replays, replayed, rollbacks, discarded`; not recorded then: null)."""
    for name, kind in REPLAY_RECORD_FIELDS:
        if name in expected.names and name not in table.schema.names:
            table = _with_column(table, name, pa.nulls(table.num_rows, kind), expected)
    return table


def upgrade_v4(table: pa.Table, expected: pa.Schema) -> pa.Table:
    """Schema 4 -> 5. The flips tables gained `axis`: every earlier run varied the batch alone."""
    if "axis" in expected.names and "axis" not in table.schema.names:
        table = _with_column(table, "axis", pa.array([DEFAULT_AXIS] * table.num_rows, pa.string()), expected)
    return table


# version -> the function that lifts it to the next version
UPGRADES = {"1": upgrade_v1, "2": upgrade_v2, "3": upgrade_v3, "4": upgrade_v4}


def upgrade(table: pa.Table, version: str, expected: pa.Schema) -> pa.Table:
    """A table of an older readable version, brought to this version; it remembers the version it
    was read from under READ_FROM_KEY."""
    read_from = version
    while version != SCHEMA_VERSION:
        table = UPGRADES[version](table, expected)
        version = READABLE_VERSIONS[READABLE_VERSIONS.index(version) + 1]
    metadata = {**(table.schema.metadata or {}), SCHEMA_KEY: SCHEMA_VERSION.encode(), READ_FROM_KEY: read_from.encode()}
    return table.replace_schema_metadata(metadata)


def schema_read_from(table) -> str:
    """The schema version a table (Arrow, or pandas carrying attrs["schema_version_read"]) was written with."""
    if hasattr(table, "attrs"):
        return table.attrs.get("schema_version_read", SCHEMA_VERSION)
    metadata = table.schema.metadata or {}
    return metadata.get(READ_FROM_KEY, metadata.get(SCHEMA_KEY, SCHEMA_VERSION.encode())).decode()


def readable_version(path: Path, schema: pa.Schema) -> str:
    """The schema version a file's schema carries, refused in one line when it is foreign or newer."""
    version = (schema.metadata or {}).get(SCHEMA_KEY)
    if version is None:
        raise UserError(f"{path} was not written by mgbench (no {SCHEMA_KEY.decode()} metadata)")
    version = version.decode()
    if version not in READABLE_VERSIONS:
        newer = version.isdigit() and int(version) > int(SCHEMA_VERSION)
        raise UserError(
            f"{path} has schema version {version}"
            + (", newer than" if newer else "; unknown to")
            + f" this mgbench (it reads versions {', '.join(READABLE_VERSIONS)})"
            + ("; upgrade mgbench to read it" if newer else "")
        )
    return version


def read_table(path: Path, expected: pa.Schema) -> pa.Table:
    """Read a table written by mgbench, upgrading older schema versions and refusing foreign or
    newer-schema files with a clear error."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise UserError(f"{path} is not a readable Parquet file ({exc})") from exc
    version = readable_version(path, table.schema)
    if version != SCHEMA_VERSION:
        table = upgrade(table, version, expected)
    missing = [name for name in expected.names if name not in table.schema.names]
    if missing:
        raise UserError(f"{path} lacks columns {', '.join(missing)}")
    return table

"""Parquet tables: schema round trip, foreign files refused, atomic publication."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mgbench.errors import UserError
from mgbench.runs import rundir, schema


def row_columns(n=3):
    return [
        {
            "request_id": np.full(n, 7),
            "batch_id": np.zeros(n, np.int32),
            "row": np.zeros(n, np.int32),
            "batch_size": np.full(n, 2, np.int32),
            "pad_len": np.full(n, 5, np.int32),
            "method": np.full(n, "teacher-forced"),
            "step": np.arange(n, dtype=np.int32),
            "solo_token": np.arange(n),
            "batched_token": np.arange(n),
            "flipped": np.zeros(n, bool),
            "margin": np.ones(n, np.float32),
            "margin_ulp": np.ones(n, np.float32),
            "solo_margin": np.ones(n, np.float32),
            "max_abs_logit_diff": np.zeros(n, np.float32),
            "logprob_drift": np.zeros(n, np.float32),
            "kv_delta_mean": np.zeros(n, np.float32),
            "kv_delta_max": np.zeros(n, np.float32),
        }
    ]


def test_parquet_round_trip_keeps_schema(tmp_path):
    steps = schema.steps_table(row_columns(), "m", "d")
    sequences = schema.sequences_table(
        [
            {
                "request_id": 7,
                "dataset": "d",
                "batch_id": 0,
                "row": 0,
                "batch_size": 2,
                "pad_len": 5,
                "prompt_len": 4,
                "prompt_ids": [1, 2, 3, 4],
                "solo_ids": [5, 6],
                "batched_ids": [5, 7],
                "first_divergence": 1,
                "identical": False,
                "triggers": 0,
                "repairs": 0,
            }
        ],
        "m",
    )
    out = rundir.publish_run(
        tmp_path / "run", {"steps": steps, "sequences": sequences}, {"summary": {"x": np.int64(1)}}
    )
    for name, table, expected in (
        ("steps", steps, schema.STEPS_SCHEMA),
        ("sequences", sequences, schema.SEQUENCES_SCHEMA),
    ):
        back = schema.read_table(out / f"{name}.parquet", expected)
        assert back.schema.equals(expected, check_metadata=True)
        assert back.equals(table)
    frame = pd.read_parquet(out / "sequences.parquet")
    assert frame.loc[0, "batched_ids"].tolist() == [5, 7]


def test_foreign_parquet_is_refused(tmp_path):
    path = tmp_path / "foreign.parquet"
    pq.write_table(pa.table({"a": [1]}), path)
    with pytest.raises(UserError, match="not written by mgbench"):
        schema.read_table(path, schema.STEPS_SCHEMA)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not parquet")
    with pytest.raises(UserError, match="not a readable Parquet"):
        schema.read_table(garbage, schema.STEPS_SCHEMA)


def test_failed_publication_leaves_nothing(tmp_path):
    def crash(staging):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        rundir.publish_run(tmp_path / "run", {"steps": schema.steps_table(row_columns(), "m", "d")}, {}, crash)
    assert list(tmp_path.iterdir()) == []


def test_existing_out_dir_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "x").write_text("keep me")
    with pytest.raises(UserError, match="not empty"):
        rundir.prepare_out_dir(tmp_path / "run")

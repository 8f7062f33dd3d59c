"""Analysis functions on synthetic tables with known answers."""

import pandas as pd
import pytest

from mgbench.analysis import figures
from mgbench.analysis.divergence import first_divergence
from mgbench.analysis.step_aggregates import aggregate


def synthetic_steps():
    # Two rows of 10 steps; row 1 flips at step 9 with a rising K/V delta before it.
    frames = []
    for row in (0, 1):
        frames.append(
            pd.DataFrame(
                {
                    "batch_id": 0,
                    "row": row,
                    "batch_size": 2,
                    "step": range(10),
                    "flipped": [False] * 9 + [row == 1],
                    "margin": [1.0] * 9 + [0.125 if row == 1 else 2.0],
                    "margin_ulp": [8.0] * 9 + [1.0 if row == 1 else 16.0],
                    "kv_delta_mean": [0.01 * (s + 1) if row == 1 else 0.0 for s in range(10)],
                    "logprob_drift": [0.0] * 8 + [0.25, 0.5]
                    if row == 1
                    else 0.0,  # the flip's own drift is not counted
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


def synthetic_sequences():
    return pd.DataFrame(
        {
            "batch_id": [0, 0],
            "row": [0, 1],
            "batch_size": [2, 2],
            "pad_len": [3, 0],
            "identical": [True, False],
            "solo_ids": [[1, 2, 3], [4, 5, 6, 7]],
            "batched_ids": [[1, 2, 3], [4, 5, 9, 9]],
        }
    )


def test_summary_counts_and_rates():
    summary = figures.summarize_flips(aggregate(synthetic_steps()), synthetic_sequences())
    assert summary["steps"] == 20 and summary["flips"] == 1
    assert summary["flip_rate"] == pytest.approx(0.05)
    assert summary["sequences_diverged"] == 1 and summary["determinism"] == pytest.approx(0.5)
    assert summary["margin_logit_quantiles_flip"]["q50"] == pytest.approx(0.125)
    assert summary["margin_ulp_quantiles_non_flip"]["q100"] == pytest.approx(16.0)
    assert summary["by_batch_size"][0]["flip_rate"] == pytest.approx(0.05)
    # drift counts steps with the same token only: 19 of them, one drifted (0.25); the flip's 0.5 is not drift
    assert (summary["drift_steps"], summary["drift_steps_differing"], summary["max_logprob_drift"]) == (19, 1, 0.25)
    # without teacher forcing: 3 steps of the identical row + steps 0..2 of the diverging one, 1 flip
    assert (summary["synchronous_steps"], summary["first_divergence_flips"]) == (6, 1)


def test_kv_before_flips_window():
    steps = aggregate(synthetic_steps())
    table = steps.kv_before_flips
    assert list(table["offset"]) == list(range(-8, 1)) and (table["flips"] == 1).all()
    assert table.set_index("offset").loc[-8, "kv_delta_median"] == pytest.approx(0.02)  # step 1 of row 1
    assert table.set_index("offset").loc[0, "kv_delta_median"] == pytest.approx(0.10)
    assert steps.kv_overall_median == pytest.approx(0.005)  # ten zeros and 0.01..0.10


def test_no_flips_gives_empty_flip_quantiles():
    steps = synthetic_steps()
    steps["flipped"] = False
    summary = figures.summarize_flips(aggregate(steps), synthetic_sequences())
    assert summary["flips"] == 0 and summary["margin_logit_quantiles_flip"]["q50"] is None


def test_batch_pad_lengths_in_row_order():
    pads = figures.batch_pad_lengths(synthetic_sequences().iloc[::-1])
    assert pads.loc[0, "pad_lens"] == [3, 0]


@pytest.mark.parametrize(
    "reference,candidate,expected",
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 3], [1, 5, 3], 1),
        ([1, 2, 3], [1, 2], 2),
        ([1, 2], [1, 2, 3], 2),
    ],
)
def test_first_divergence(reference, candidate, expected):
    assert first_divergence(reference, candidate) == expected

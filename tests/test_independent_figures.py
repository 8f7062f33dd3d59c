"""The figures MarginGate gates on, checked against a separate computation.

A real `mgbench flips` run of the default model (both prefill modes) is recomputed here from
plain HF calls and none of mgbench's engine: solo by `generate` (its logits and its cache),
the batch by plain left-padded forwards fed the solo tokens (tests/helpers.py). Every step's
margin, margin in ulps, solo margin, logit difference, logprob drift and K/V deltas of the run's
steps table must equal what this file computes with its own top-2, its own bf16 ulp (read from
the float's exponent bits) and its own norms. `bf16_ulp` is unit-tested on its own.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import default_model_flips_args, plain_solo, plain_teacher_forced
from typer.testing import CliRunner

from mgbench.cli import app
from mgbench.engines.inprocess.metrics import bf16_ulp

STEPS = 12  # the run's (helpers.default_model_flips_args)
REQUESTS = 4
TOP_K = 5  # the run's drift compares the top-5 logprobs (metrics.TOP_LOGPROBS), as an endpoint would


# --- bf16_ulp ------------------------------------------------------------------------------------


def ulp_from_bits(value: float) -> float:
    """BF16 spacing above |value| from its bit pattern: the exponent field e (8 bits after the
    sign) gives 2**(e - 127 - 7) for normal numbers; subnormals and zero share e = 1's spacing."""
    bits = torch.tensor([value], dtype=torch.bfloat16).view(torch.int16).item() & 0x7FFF
    field = bits >> 7
    return math.ldexp(1.0, max(field, 1) - 127 - 7)


@pytest.mark.parametrize("exponent", [-126, -20, -1, 0, 1, 7, 8, 20, 127])
def test_bf16_ulp_at_powers_of_two_is_the_gap_to_the_next_bf16(exponent):
    x = torch.tensor([math.ldexp(1.0, exponent), -math.ldexp(1.0, exponent)], dtype=torch.bfloat16)
    above = torch.nextafter(x[0], torch.tensor(float("inf"), dtype=torch.bfloat16))  # the next bf16 up
    assert bf16_ulp(x).tolist() == [float(above - x[0])] * 2 == [math.ldexp(1.0, exponent - 7)] * 2
    # just below the power of two: the binade below, half the spacing (the subnormals' below 2**-126)
    below = torch.nextafter(x[0], torch.tensor(0.0, dtype=torch.bfloat16))
    assert float(bf16_ulp(below.view(1))) == float(x[0] - below) == math.ldexp(1.0, max(exponent, -125) - 8)


@pytest.mark.parametrize("value", [0.0, -0.0, 2.0**-133, 2.0**-130, 3 * 2.0**-133, 2.0**-127])
def test_bf16_ulp_at_zero_and_subnormals_is_the_smallest_spacing(value):
    x = torch.tensor([value], dtype=torch.bfloat16)
    assert float(x) == value  # representable: these are bf16 subnormals (or zero)
    assert float(bf16_ulp(x)) == 2.0**-133 == ulp_from_bits(value)


def test_bf16_ulp_agrees_with_the_exponent_bits_over_every_finite_bf16():
    every = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # +0 .. max finite
    ulps = bf16_ulp(every)
    fields = (every.view(torch.int16).to(torch.int32) >> 7).clamp(min=1)
    assert torch.equal(ulps, torch.ldexp(torch.ones_like(ulps), fields - 134))
    assert bf16_ulp(torch.tensor([float("inf"), float("nan")])).isnan().all()


# --- a real run against plain HF calls ------------------------------------------------------------


def own_top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-1 minus top-2, top-1) of each row, by a full sort in float64."""
    ranked = logits.double().sort(dim=-1, descending=True).values
    return ranked[..., 0] - ranked[..., 1], ranked[..., 0]


def own_drift(batched: torch.Tensor, solo: torch.Tensor) -> torch.Tensor:
    """Max |solo - batched| log-softmax (float64) over solo's top-k ids that batched's top-k holds too."""
    b, s = batched.double().log_softmax(-1), solo.double().log_softmax(-1)
    out = torch.zeros(batched.shape[:-1], dtype=torch.float64)
    for index in np.ndindex(*batched.shape[:-1]):
        shared = set(s[index].topk(TOP_K).indices.tolist()) & set(b[index].topk(TOP_K).indices.tolist())
        out[index] = max((abs(float(s[index][i] - b[index][i])) for i in shared), default=0.0)
    return out


def own_kv_deltas(batched_cache, solo_cache, row: int, pad: int, start: int, count: int):
    """Per step (the K/V column of the token fed at that step), the relative L2 distance over
    heads and dims of keys and values together, per layer; (mean, max) over layers, float64."""
    per_layer = []
    for b_layer, s_layer in zip(batched_cache.layers, solo_cache.layers):
        b = torch.stack([b_layer.keys[row], b_layer.values[row]])[:, :, pad + start : pad + start + count]
        s = torch.stack([s_layer.keys[0], s_layer.values[0]])[:, :, start : start + count]
        b, s = b.double(), s.double()
        per_layer.append((b - s).pow(2).sum(dim=(0, 1, 3)).sqrt() / s.pow(2).sum(dim=(0, 1, 3)).sqrt())
    stacked = torch.stack(per_layer)
    return stacked.mean(0), stacked.amax(0)


# `make test` recomputes the default prefill (alone); the batched prefill's run (a left-padded
# prefill of 4 math500 prompts, about 60 s on an AVX2 EPYC's 2 cores) is in `make test-full`. Every
# run, test_engine.py (batched-padded) recomputes a padded batched prefill's logit differences and
# flips on a tiny model; its margins in ulps, drift and K/V deltas only here.
# The alone run is conftest's default_model_run (test_cli runs it again in a fresh process).
@pytest.fixture(scope="module", params=["alone", pytest.param("batched", marks=pytest.mark.full)])
def recorded(request, tmp_path_factory):
    if request.param == "alone":
        out = request.getfixturevalue("default_model_run")
    else:
        out = tmp_path_factory.mktemp(f"independent-{request.param}") / "run"
        result = CliRunner().invoke(app, default_model_flips_args(request.param, out))
        assert result.exit_code == 0, result.output
    return request.param, pd.read_parquet(out / "steps.parquet"), pd.read_parquet(out / "sequences.parquet")


@pytest.mark.slow
def test_run_figures_equal_plain_hf_recomputation(recorded, default_lm, capsys):
    prefill, steps, sequences = recorded
    model, pad_id = default_lm.model, int(default_lm.tokenizer.pad_token_id)
    assert sequences["batch_id"].nunique() == 1 and len(sequences) == REQUESTS
    sequences = sequences.sort_values("row")
    prompts = [torch.tensor(ids, dtype=torch.long) for ids in sequences["prompt_ids"]]
    n = int(sequences["solo_ids"].map(len).min())  # no request ends before STEPS here: checked below
    assert n == STEPS, "a request ended early; the recomputation compares full-length outputs"
    solos = [plain_solo(model, p, STEPS, pad_id, with_cache=True) for p in prompts]
    solo_tokens = torch.stack([tokens for tokens, _, _ in solos])
    solo_logits = torch.stack([logits for _, logits, _ in solos])
    batched, batch_cache = plain_teacher_forced(model, prompts, solo_tokens, prefill, pad_id, with_cache=True)
    total = max(len(p) for p in prompts)

    own_margin, own_top1 = own_top2(batched)
    own_ulp = torch.tensor([[ulp_from_bits(float(v)) for v in row] for row in own_top1.float()], dtype=torch.float64)
    own_solo_margin, _ = own_top2(solo_logits)
    drift = own_drift(batched, solo_logits)
    for row, (prompt, sequence) in enumerate(zip(prompts, sequences.itertuples())):
        table = steps[steps["request_id"] == sequence.request_id].sort_values("step")
        assert table["step"].tolist() == list(range(STEPS)) and int(table["pad_len"].iloc[0]) == total - len(prompt)
        assert table["solo_token"].tolist() == solo_tokens[row].tolist() == list(sequence.solo_ids)
        assert table["batched_token"].tolist() == batched[row].argmax(-1).tolist()
        # margins: the float32 difference of two bf16 logits is exact, and an ulp is a power of two
        assert table["margin"].tolist() == own_margin[row].tolist()
        assert table["margin_ulp"].tolist() == (own_margin[row] / own_ulp[row]).tolist()
        assert table["solo_margin"].tolist() == own_solo_margin[row].tolist()
        assert list(sequence.solo_margins) == own_solo_margin[row].tolist()
        assert (
            table["max_abs_logit_diff"].tolist()
            == (batched[row].double() - solo_logits[row].double()).abs().amax(-1).tolist()
        )
        # computed in float32 by the run, float64 here: equal to float32 rounding
        np.testing.assert_allclose(table["logprob_drift"], drift[row].numpy(), rtol=1e-5, atol=2e-6)
        kv_mean, kv_max = own_kv_deltas(batch_cache, solos[row][2], row, total - len(prompt), len(prompt) - 1, STEPS)
        np.testing.assert_allclose(table["kv_delta_mean"], kv_mean.numpy(), rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(table["kv_delta_max"], kv_max.numpy(), rtol=1e-4, atol=1e-7)
    if prefill == "alone":  # the prompt's K/V is each row's own prefill: no delta at step 0 by construction
        assert (steps.loc[steps["step"] == 0, ["kv_delta_mean", "kv_delta_max"]] == 0).all().all()
    with capsys.disabled():
        print(
            f"\n[this machine] {prefill} prefill, batch {REQUESTS}: {int(steps['flipped'].sum())} flips, "
            f"{int((steps['max_abs_logit_diff'] > 0).sum())}/{len(steps)} steps whose logits differ from solo, "
            f"max drift {steps['logprob_drift'].max():.3g}, max K/V delta {steps['kv_delta_max'].max():.3g}"
        )

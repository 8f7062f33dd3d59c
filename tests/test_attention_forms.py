"""Exact attention forms of the batch-invariant mode: grouping, the probe's verdicts, the fallback.

The per-row form is exact by construction (it is the row's solo call). A grouped form is used
only where the probe found it bitwise equal to per row on this machine; a planted perturbation
of the grouped call must make the probe refuse it (the case the check must catch)."""

import pytest
import torch
from helpers import VOCAB, random_prompts, tiny_llama

import mgbench.engines.inprocess.kernels.attention_forms as forms
from mgbench.engines.inprocess.kernels.attention_forms import PER_ROW, AttentionForm, aligned_groups, attend, per_row
from mgbench.engines.inprocess.kernels.batch_invariant import base_attention
from mgbench.engines.inprocess.kernels.invariance_probe import probe_model

PROMPT = random_prompts([40], vocab=VOCAB, seed=7)[0]


def test_aligned_groups_share_a_pad_residue_and_leave_pads_multiple_of_the_width():
    pads = [0, 1, 8, 9, 17, 3]
    groups = aligned_groups(pads, 8)
    assert groups == [([0, 2], 0), ([1, 3, 4], 1), ([5], 3)]
    for rows, shift in groups:
        assert all((pads[r] - shift) % 8 == 0 and pads[r] >= shift for r in rows)
    assert sorted(r for rows, _ in groups for r in rows) == list(range(len(pads)))
    # The shift is the group's smallest pad: a group of long-padded rows drops all its padding lanes.
    assert aligned_groups([16, 24, 9, 40], 8) == [([0, 1, 3], 16), ([2], 9)]


def random_call(model, rows: int, keys: int, seed: int = 0):
    """A decode-step attention call of the model's first layer on random q/k/v (bf16)."""
    g = torch.Generator().manual_seed(seed)
    attn = model.model.layers[0].self_attn
    heads, kv, dim = model.config.num_attention_heads, model.config.num_key_value_heads, attn.head_dim
    query = torch.randn(rows, heads, 1, dim, generator=g).bfloat16()
    key, value = (torch.randn(rows, kv, keys, dim, generator=g).bfloat16() for _ in range(2))
    return base_attention("sdpa", attn), attn, query, key, value, {"scaling": attn.scaling}


@pytest.mark.parametrize("kv_heads", [4, 2])  # without and with grouped-query heads
def test_grouped_form_with_a_tiny_block_falls_back_to_per_row_exactly(kv_heads):
    # Every group longer than max_keys runs per row: the result is the per-row one by construction.
    model = tiny_llama(kv_heads=kv_heads)
    base, module, q, k, v, kwargs = random_call(model, rows=6, keys=30)
    pads = [0, 5, 9, 2, 13, 7]
    form = AttentionForm("aligned", 8, max_keys=4)
    assert torch.equal(
        attend(base, module, q, k, v, pads, form, **kwargs), per_row(base, module, q, k, v, pads, **kwargs)
    )


def test_probe_refuses_a_grouped_form_that_is_planted_inexact(monkeypatch):
    """PLANTED: the grouped SDPA call's first element is moved by 0.125, so no aligned form can be
    exact on any machine: the probe must say so and plan per-row attention."""
    real = forms.sdpa_call

    def nudged(*args, **kwargs):
        out = real(*args, **kwargs)
        out.view(-1)[0] += 0.125
        return out

    monkeypatch.setattr(forms, "sdpa_call", nudged)
    with torch.inference_mode():
        report = probe_model(tiny_llama(), PROMPT, rows=8)
    verdicts = {f.name: f.invariant for f in report.findings if f.op == "attention form"}
    assert verdicts[PER_ROW.label] is True
    assert len(verdicts) == 1 + len(forms.ALIGNMENTS) and not any(v for k, v in verdicts.items() if k != PER_ROW.label)
    assert report.plan.attention == PER_ROW and report.exact


def test_probe_checks_groups_of_several_rows_even_where_its_own_pads_leave_every_group_single(monkeypatch):
    """PLANTED: a grouped call that masks any key (a row padded inside its group) moves its first
    element, standing in for a kernel whose lanes shift with the padding (8-aligned groups on a
    16-lane CPU). The probe's own pads 0-5 put every row of 6 in a group of its own for every width,
    so its calls alone pass any aligned form; it must also check real calls re-padded into groups
    of several rows, and refuse them all. Without the plant, the re-padded check itself must agree
    with per row wherever it passes an aligned form (the clean side)."""
    real = forms.sdpa_call

    def lane_shifted(module, query, key, value, mask, scaling):
        out = real(module, query, key, value, mask, scaling)
        if bool(torch.isinf(mask).any()):
            out.view(-1)[0] += 0.125
        return out

    with torch.inference_mode():
        clean = probe_model(tiny_llama(), PROMPT, rows=6)
    monkeypatch.setattr(forms, "sdpa_call", lane_shifted)
    with torch.inference_mode():
        report = probe_model(tiny_llama(), PROMPT, rows=6)
    verdicts = {f.name: f for f in report.findings if f.op == "attention form"}
    for align in forms.ALIGNMENTS:
        finding = verdicts[AttentionForm("aligned", align).label]
        assert not finding.invariant and finding.varies_at, align
        assert set(finding.varies_at) <= set(forms.grouping_pads(6, align))
    assert report.plan.attention == PER_ROW and report.exact
    assert clean.exact  # whatever form it chose without the plant, the mode's step equals solo
    for align in (2, 8, 64):  # two rows already share a group
        pads = forms.grouping_pads(2, align)
        assert pads[0] % align == pads[1] % align and pads[0] != pads[1]
    print(
        "\n[this machine] aligned forms exact without the plant:",
        [f.name.split(",")[0] for f in clean.findings if f.op == "attention form" and f.invariant],
    )


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_probe_chooses_an_exact_form_and_the_mode_is_solo_bitwise(kv_heads):
    """Whatever form the probe picks here, it equals per-row attention on the probe's calls and on
    random keys up to and past a kernel block (agreement with the exact-by-construction form); the
    decode step in the mode equals solo."""
    model = tiny_llama(kv_heads=kv_heads)
    with torch.inference_mode():
        report = probe_model(model, PROMPT, rows=8)
        chosen = report.plan.attention
        lines = [f for f in report.findings if f.op == "attention form"]
        print(
            f"\n[this machine] attention forms (kv_heads {kv_heads}): "
            + "; ".join(f"{f.name}: {'exact' if f.invariant else 'not exact'} {f.form_ms:.2f} ms" for f in lines)
            + f" -> {chosen.label}"
        )
        assert [f.form for f in lines].count("chosen") == 1 and report.exact
        for keys in (45, 300, forms.KV_BLOCK + 8):
            base, module, q, k, v, kwargs = random_call(model, rows=8, keys=keys, seed=keys)
            pads = [0, 1, 2, 3, 4, 5, 6, 7]
            assert torch.equal(
                attend(base, module, q, k, v, pads, chosen, **kwargs), per_row(base, module, q, k, v, pads, **kwargs)
            )

"""The shared decode engine: solo vs HF generate, teacher-forced flips vs an independent loop,
negative and positive controls, exact cache operations."""

import pytest
import torch
from helpers import (
    VOCAB,
    plain_flip_audit,
    plain_teacher_forced,
    plant_near_ties,
    plant_nudged_head,
    random_prompts,
    tiny_llama,
)

from mgbench.engines.inprocess import cache as cache_ops
from mgbench.engines.inprocess.decode import prefill_alone
from mgbench.engines.inprocess.runners import run_solo, run_teacher_forced
from mgbench.engines.inprocess.verification.loop import run_free

PAD_ID = 0


def solos_of(model, prompts, steps):
    with torch.inference_mode():
        return [run_solo(model, p, steps, set()) for p in prompts]


# `full`: make test checks the default model's solo tokens against `generate` in
# tests/test_independent_figures.py (4 math500 prompts, 12 steps), and the solo runner's against
# `generate` on tiny models here (test_natural_batch_agrees_with_independent_loop).
@pytest.mark.full
@pytest.mark.slow
def test_solo_runner_reproduces_hf_generate_on_default_model(default_lm, math500_prompts):
    model, tokenizer = default_lm.model, default_lm.tokenizer
    from mgbench.engines.inprocess.audit import eos_token_ids

    eos = eos_token_ids(model, tokenizer)
    for ids in math500_prompts[:3]:
        prompt = torch.tensor(ids)
        with torch.inference_mode():
            ours = run_solo(model, prompt, 24, eos).tokens.tolist()
            theirs = model.generate(
                prompt.view(1, -1), max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        assert ours == theirs[0, len(ids) :].tolist()


def engine_columns(result, name):
    return torch.stack([torch.from_numpy(row[name]) for row in result.rows])


def near_tie_model():
    model = tiny_llama()
    plant_near_ties(model)
    return model


def test_teacher_forced_flips_agree_with_independent_loop():
    """Positive control by construction: near-ties planted, and a head that moves the argmax to the
    runner-up wherever the margin is below 0.05 when called with more than one row. Every batched
    step flips on any machine; the engine's figures equal plain HF calls on the same batch."""
    model = near_tie_model()
    plant_nudged_head(model, delta=0.05)
    prompts = random_prompts([12, 17, 9, 21], vocab=VOCAB)
    steps = 16
    independent = plain_flip_audit(model, prompts, steps)
    solos = solos_of(model, prompts, steps)
    assert torch.equal(torch.stack([s.tokens for s in solos]), independent["solo_tokens"])
    with torch.inference_mode():
        result = run_teacher_forced(model, prompts, solos, "batched", PAD_ID)
    assert torch.equal(engine_columns(result, "batched_token"), independent["batched_token"])
    assert torch.equal(engine_columns(result, "flipped"), independent["flipped"])
    # Certain flips: steps where the unplanted batch keeps solo's argmax at a margin the head nudges.
    natural = plain_teacher_forced(near_tie_model(), prompts, independent["solo_tokens"]).float()
    top2 = natural.topk(2, dim=-1).values
    certain = (natural.argmax(-1) == independent["solo_tokens"]) & (top2[..., 0] - top2[..., 1] < 0.05)
    assert certain.sum() > len(prompts) and engine_columns(result, "flipped")[certain].all()


@pytest.mark.parametrize("prefill", ["alone", "batched"])
def test_batch_of_one_equals_solo_by_construction(prefill):
    """Negative control: the batched path with one unpadded row runs solo's own computation."""
    model = near_tie_model()
    prompts = random_prompts([16], vocab=VOCAB, seed=3)
    solos = solos_of(model, prompts, 24)
    with torch.inference_mode():
        result = run_teacher_forced(model, prompts, solos, prefill, PAD_ID)
        free = run_free(model, prompts, [s.row_prefill for s in solos], prefill, PAD_ID, 24, set())
    assert result.rows[0]["max_abs_logit_diff"].max() == 0.0 and result.rows[0]["kv_delta_max"].max() == 0.0
    assert not result.rows[0]["flipped"].any()
    assert free.tokens[0] == solos[0].tokens.tolist()


@pytest.mark.parametrize("lengths", [[16, 16, 16, 16], [12, 17, 20, 25, 9, 28, 4, 21]], ids=["unpadded", "padded"])
@pytest.mark.parametrize("prefill", ["alone", "batched"])
def test_natural_batch_agrees_with_independent_loop(lengths, prefill, capsys):
    """What this machine's kernels do to a real batch (near-ties planted, nothing else) is printed and
    asserted only as agreement: the engine's logit differences and flips equal plain HF calls on
    exactly these batches, and every row's free-running decoding follows solo up to its first flip."""
    model = near_tie_model()
    prompts = random_prompts(lengths, vocab=VOCAB, seed=3)
    independent = plain_flip_audit(model, prompts, 24, prefill)
    solos = solos_of(model, prompts, 24)
    assert [s.tokens.tolist() for s in solos] == independent["solo_tokens"].tolist()  # the solo runner is generate
    with torch.inference_mode():
        result = run_teacher_forced(model, prompts, solos, prefill, PAD_ID)
        free = run_free(model, prompts, [s.row_prefill for s in solos], prefill, PAD_ID, 24, set())
    diff = engine_columns(result, "max_abs_logit_diff")
    assert torch.equal(diff, independent["max_abs_logit_diff"])
    flipped = engine_columns(result, "flipped")
    assert torch.equal(flipped, independent["flipped"])
    # Every row, free-running: until its first teacher-forced flip the batch is fed what solo
    # emitted, so it emits solo's tokens; at that step, the batched argmax the audit recorded
    # (each row's logits depend on the batch's shape, never on the other rows' tokens). A row
    # that never flips (every row whose logits equal solo's among them) is solo's throughout.
    batched_token = engine_columns(result, "batched_token")
    for row, solo in enumerate(solos):
        if flipped[row].any():
            first = int(flipped[row].int().argmax())
            expected = [*solo.tokens[:first].tolist(), int(batched_token[row, first])]
            compared = free.tokens[row][: first + 1]
        else:
            expected, compared = solo.tokens.tolist(), free.tokens[row]
        assert compared == expected, f"row {row}: free-running decoding against solo and the audit's flips"
    with capsys.disabled():
        print(
            f"\n[this machine] {prefill} prefill, pads {result.pad_lens}: rows differing from solo "
            f"{[r for r in range(len(prompts)) if diff[r].max() > 0]}, flips {int(independent['flipped'].sum())}"
        )


def test_planted_padded_batch_flips_and_diverges():
    """Positive control by construction for free-running decoding: the planted head flips every
    multi-row step of the near-tie model, so a padded batch diverges from solo on any machine."""
    model = near_tie_model()
    plant_nudged_head(model, delta=1.0)
    prompts = random_prompts([12, 17, 20, 25, 9, 28, 4, 21], vocab=VOCAB)
    solos = solos_of(model, prompts, 32)
    with torch.inference_mode():
        result = run_teacher_forced(model, prompts, solos, "alone", PAD_ID)
        free = run_free(model, prompts, [s.row_prefill for s in solos], "alone", PAD_ID, 32, set())
    # Step 0 is each row's prefill alone (one row): the plant starts at step 1 and nudges every
    # step there (all margins are near-ties), so flips are certain wherever the unplanted batch
    # would keep solo's argmax (most steps; exactly which depends on the machine).
    assert not any(row["flipped"][0] for row in result.rows)
    assert sum(int(row["flipped"].sum()) for row in result.rows) > len(prompts)
    assert sum(tokens != solo.tokens.tolist() for tokens, solo in zip(free.tokens, solos)) > len(prompts) // 2


def test_probe_accounts_for_every_row_that_differs():
    """Negative control inside the probe: a row where every op equals the op on the row alone
    must give the solo logits; the rows that differ are a subset of the rows with a varying op."""
    from mgbench.engines.inprocess.kernels.invariance_probe import probe_model

    model = tiny_llama()
    with torch.inference_mode():
        probe = probe_model(model, random_prompts([40], vocab=VOCAB, seed=7)[0], rows=32)
    assert set(probe.plain_rows_differing) <= set(probe.varying_op_rows)
    assert probe.exact and probe.invariant_rows_differing == []
    ops = {f.op for f in probe.findings}
    assert {"linear", "lm_head", "norm", "activation", "embedding", "attention", "argmax", "decode step"} <= ops


def test_cache_row_slice_and_column_overwrite_are_exact():
    model = tiny_llama(hidden=64, vocab=256)
    prompts = random_prompts([5, 9, 7], vocab=256)
    with torch.inference_mode():
        rows = [cache_ops.clone_layers(cache_ops.cache_layers(prefill_alone(model, p)[1])) for p in prompts]
        batched, pads = cache_ops.left_pad_stack(rows, model.config)
        assert pads == [4, 0, 2]
        for row, original in enumerate(rows):
            sliced = cache_ops.row_slice(batched, row, pads[row])
            for (k, v), (k0, v0) in zip(sliced, original):
                assert torch.equal(k, k0) and torch.equal(v, v0)
        column = [(torch.randn_like(k[0, :, 0]), torch.randn_like(v[0, :, 0])) for k, v in rows[0]]
        before = [(k.clone(), v.clone()) for k, v in cache_ops.cache_layers(batched)]
        cache_ops.write_column(batched, row=2, position=6, column=column)
        for (k_new, v_new), (k_ref, v_ref) in zip(cache_ops.read_column(batched, 2, 6), column):
            assert torch.equal(k_new, k_ref) and torch.equal(v_new, v_ref)
        for (k, v), (k_old, v_old) in zip(cache_ops.cache_layers(batched), before):
            changed = (k != k_old).any(dim=(1, 3)) | (v != v_old).any(dim=(1, 3))  # [batch, seq]
            assert changed.nonzero().tolist() == [[2, 6]]  # that row and column, nothing else


def test_lockstep_solo_equals_the_solo_runner_and_its_rerun():
    """The teacher-forced pass decodes each request alone in lockstep with the batch (nothing of
    a step's logits is kept past it). By construction that is run_solo's computation: its
    tokens, margins and top logits equal run_solo's bitwise, and a second pass fed those
    results (the re-decode of later batch sizes) gives every column bitwise again."""
    model = near_tie_model()
    plant_nudged_head(model, delta=0.05)  # flips, so the rows compared are not all trivial
    prompts = random_prompts([12, 17, 9, 21], vocab=VOCAB)
    eos = {7, 11}  # some rows may stop early: lengths differ
    with torch.inference_mode():
        solos = [run_solo(model, p, 20, eos) for p in prompts]
        fresh = run_teacher_forced(model, prompts, [None] * 4, "alone", PAD_ID, 20, eos)
        again = run_teacher_forced(model, prompts, fresh.solos, "alone", PAD_ID, 20, eos)
    for ours, theirs in zip(fresh.solos, solos):
        assert torch.equal(ours.tokens, theirs.tokens) and torch.equal(ours.margins, theirs.margins)
        assert torch.equal(ours.top_ids, theirs.top_ids) and torch.equal(ours.top_logits, theirs.top_logits)
        assert torch.equal(ours.row_prefill.logits, theirs.row_prefill.logits)
    assert sum(int(row["flipped"].sum()) for row in fresh.rows) > 0
    for a, b, solo in zip(fresh.rows, again.rows, solos):
        assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
        assert a["solo_token"].tolist() == solo.tokens.tolist()


def test_a_solo_reference_that_does_not_repeat_stops_the_run():
    """Planted: the head moves the argmax after its first calls, so the request decoded alone a
    second time gives other tokens; the lockstep pass refuses to compare against two references."""
    from mgbench.errors import UserError

    model = near_tie_model()
    prompts = random_prompts([12], vocab=VOCAB)
    with torch.inference_mode():
        first = run_teacher_forced(model, prompts, [None], "alone", PAD_ID, 12, set())
        plant_nudged_head(model, delta=1.0, invariant_up_to=0)  # now every call, alone too, is nudged
        with pytest.raises(UserError, match="solo decoding does not repeat"):
            run_teacher_forced(model, prompts, first.solos, "alone", PAD_ID, 12, set())

"""The shared decode engine: solo vs HF generate, teacher-forced flips vs an independent loop,
negative and positive controls, exact cache operations."""

import pytest
import torch

from helpers import BatchedRunnerUpNudge, measured_plain_varies, plant_near_ties, random_prompts, tiny_llama
from mgbench.engine import cache as cache_ops
from mgbench.engine.decode import prefill_alone
from mgbench.engine.runners import run_free, run_solo, run_teacher_forced

PAD_ID = 0


def solos_of(model, prompts, steps):
    with torch.inference_mode():
        return [run_solo(model, p, steps, set()) for p in prompts]


@pytest.mark.slow
def test_solo_runner_reproduces_hf_generate_on_default_model(default_lm, math500_prompts):
    model, tokenizer = default_lm.model, default_lm.tokenizer
    from mgbench.audit import eos_token_ids

    eos = eos_token_ids(model, tokenizer)
    for ids in math500_prompts[:3]:
        prompt = torch.tensor(ids)
        with torch.inference_mode():
            ours = run_solo(model, prompt, 24, eos).tokens.tolist()
            theirs = model.generate(prompt.view(1, -1), max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        assert ours == theirs[0, len(ids):].tolist()


def independent_teacher_forced_argmax(model, prompts, solo_tokens):
    """A plain loop over HF forward calls: one left-padded prefill, then the solo tokens fed one by one."""
    total = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), total), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, total - len(p):] = p
        mask[row, total - len(p):] = 1
    lengths = torch.tensor([len(p) for p in prompts])
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True)
        argmax, cache = [out.logits[:, -1].argmax(-1)], out.cache
        for step in range(1, solo_tokens.shape[1]):
            mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=torch.long)], dim=1)
            out = model(input_ids=solo_tokens[:, step - 1 : step], attention_mask=mask,
                        position_ids=(lengths + step - 1).view(-1, 1), cache=cache, use_cache=True)
            argmax.append(out.logits[:, -1].argmax(-1))
    return torch.stack(argmax, dim=1)


def test_teacher_forced_flips_agree_with_independent_loop():
    model = tiny_llama()
    model.lm_head = BatchedRunnerUpNudge(model.lm_head, delta=0.05)
    prompts = random_prompts([12, 17, 9, 21], vocab=8192)
    steps = 16
    # Solo tokens from HF generate, independently of the engine.
    with torch.inference_mode():
        solo_tokens = torch.stack([
            model.generate(p.view(1, -1), max_new_tokens=steps, do_sample=False, pad_token_id=PAD_ID)[0, len(p):]
            for p in prompts
        ])
    solos = solos_of(model, prompts, steps)
    assert torch.equal(torch.stack([s.tokens for s in solos]), solo_tokens)

    expected = independent_teacher_forced_argmax(model, prompts, solo_tokens)
    with torch.inference_mode():
        result = run_teacher_forced(model, prompts, solos, "batched", PAD_ID)
    engine_batched = torch.stack([torch.from_numpy(r["batched_token"]) for r in result.rows])
    engine_flips = torch.stack([torch.from_numpy(r["flipped"]) for r in result.rows])
    assert torch.equal(engine_batched, expected)
    assert torch.equal(engine_flips, expected != solo_tokens)
    assert engine_flips.sum() > 0, "the nudge must produce flips, otherwise this test proves nothing"
    margins = torch.cat([torch.from_numpy(r["solo_margin"]) for r in result.rows])
    assert (margins[engine_flips.flatten()] < 0.05 + 0.01).all()  # flips only where the nudge can reach


@pytest.fixture(scope="module")
def planted():
    """The tiny planted model and its probe on this machine (32 rows: pads 0-31)."""
    from mgbench.engine.probe import probe_model

    model = tiny_llama()
    plant_near_ties(model)
    with torch.inference_mode():
        probe = probe_model(model, random_prompts([40], vocab=8192, seed=7)[0], rows=32)
    return model, probe


def row_count_varying(probe) -> list[str]:
    return [f.name for f in probe.findings if f.axis == "rows" and not f.invariant]


@pytest.mark.parametrize("prefill", ["alone", "batched"])
def test_negative_control_equal_lengths(planted, prefill):
    """No padding: the batch equals solo bitwise where the probe finds no op varying with the row
    count on this machine; where one does, the batch differs (asserted as measured)."""
    model, probe = planted
    prompts = random_prompts([16, 16, 16, 16], vocab=8192, seed=3)
    solos = solos_of(model, prompts, 24)
    with torch.inference_mode():
        result = run_teacher_forced(model, prompts, solos, prefill, PAD_ID)
        free = run_free(model, prompts, [s.row_prefill for s in solos], prefill, PAD_ID, 24, set())
    assert result.pad_lens == [0, 0, 0, 0]
    bitwise = all(row["max_abs_logit_diff"].max() == 0.0 and row["kv_delta_max"].max() == 0.0 for row in result.rows)
    varying = row_count_varying(probe)
    assert bitwise == (not varying), (f"ops varying with the row count here: {varying or 'none'}; the unpadded "
                                      f"batch {'equals' if bitwise else 'differs from'} solo")
    if bitwise:
        assert not any(row["flipped"].any() for row in result.rows)
        assert all(f == s.tokens.tolist() for f, s in zip(free.tokens, solos))


def test_probe_accounts_for_every_row_that_differs():
    """Negative control inside the probe: a row where every op equals the op on the row alone
    must give the solo logits; the rows that differ are a subset of the rows with a varying op."""
    from mgbench.engine.probe import probe_model

    model = tiny_llama()
    with torch.inference_mode():
        probe = probe_model(model, random_prompts([40], vocab=8192, seed=7)[0], rows=32)
    assert set(probe.plain_rows_differing) <= set(probe.varying_op_rows)
    assert probe.exact and probe.invariant_rows_differing == []
    ops = {f.op for f in probe.findings}
    assert {"linear", "lm_head", "norm", "activation", "embedding", "attention", "argmax", "decode step"} <= ops


def test_positive_control_chosen_by_the_probe_of_this_machine(planted):
    """Where the probe measures plain batched decoding differing from solo, a padded batch of the
    planted model differs, flips and diverges; where it measures nothing, the batch equals solo."""
    model, probe = planted
    prompts = random_prompts([12, 17, 20, 25, 9, 28, 4, 21], vocab=8192)
    solos = solos_of(model, prompts, 32)
    with torch.inference_mode():
        result = run_teacher_forced(model, prompts, solos, "alone", PAD_ID)
        free = run_free(model, prompts, [s.row_prefill for s in solos], "alone", PAD_ID, 32, set())
    differs = [r for r, row in enumerate(result.rows) if row["max_abs_logit_diff"].max() > 0]
    if not probe.varies:
        assert not differs, "the probe found nothing varying on this machine, so the batch must equal solo"
        return
    assert differs, measured_plain_varies(probe)
    assert sum(int(result.rows[r]["flipped"].sum()) for r in differs) > 0, \
        f"{measured_plain_varies(probe)}, and the planted near-ties turn that into flips"
    assert any(free.tokens[r] != solos[r].tokens.tolist() for r in differs), \
        "plain batched free-running decoding must diverge somewhere (negative control for verify)"


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

"""The batch-invariant mode and the probe that plans it: exact forms chosen by measurement,
bitwise solo decoding on this machine, a planted row-count-varying layer, the CLI."""

import json

import pandas as pd
import pytest
import torch
from helpers import VOCAB, RowCountPerturbedLinear, plain_flip_audit, plant_near_ties, random_prompts, tiny_llama
from typer.testing import CliRunner

from mgbench.cli import app
from mgbench.engines.inprocess.kernels.batch_invariant import batch_invariant, chunk_sizes, decoding_mode, run_in_chunks
from mgbench.engines.inprocess.kernels.invariance_probe import probe_model
from mgbench.engines.inprocess.runners import run_solo, run_teacher_forced
from mgbench.engines.inprocess.verification.loop import run_free

PAD_ID = 0
runner = CliRunner()


def test_chunk_sizes_take_the_largest_allowed_first():
    assert chunk_sizes(8, (1, 2, 3, 4)) == [4, 4]
    assert chunk_sizes(7, (4,)) == [4, 1, 1, 1]
    assert chunk_sizes(5, (1,)) == [1] * 5
    x = torch.arange(14.0).view(7, 2)
    calls = []
    out = run_in_chunks(lambda part: calls.append(part.shape[0]) or part * 2, x, (1, 3))
    assert calls == [3, 3, 1] and torch.equal(out, x * 2)


PROBE_PROMPT = random_prompts([40], vocab=VOCAB, seed=7)[0]


def probe_of(model):
    with torch.inference_mode():
        return probe_model(model, PROBE_PROMPT, rows=8)


@pytest.fixture(scope="module")
def perturbed():
    """PLANTED: layer 0's down projection offsets its output when called with more than 4 rows.
    Returned with the probe of the same model unplanted: what this machine's kernels do by themselves."""
    model = tiny_llama()
    plant_near_ties(model)
    unplanted = probe_of(model)
    mlp = model.model.layers[0].mlp
    mlp.down_proj = RowCountPerturbedLinear(mlp.down_proj, invariant_up_to=4)
    return model, probe_of(model), unplanted


def test_probe_finds_the_planted_row_count_dependence(perturbed):
    """The planted row counts (5-8) are found on any machine; anything else found is exactly what the
    unplanted model's probe finds here (agreement, not a prediction that nothing else varies)."""
    model, probe, unplanted = perturbed
    finding = next(f for f in probe.findings if f.name.startswith("mlp.down_proj"))
    natural = next(f for f in unplanted.findings if f.name.startswith("mlp.down_proj"))
    assert not finding.invariant and finding.varies_at == sorted(set(natural.varies_at) | {5, 6, 7, 8})
    assert finding.form == "bmm (one GEMV per row)" or finding.form.startswith("chunks of") or finding.form == "per row"
    # A finding covers every module of its shape and class, so both layers' down projections are planned.
    planted = {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}
    assert set(probe.plan.forms) == set(unplanted.plan.forms) | planted
    assert probe.plain_rows_differing == list(range(8)), "the planted offset reaches every row's logits"
    assert probe.exact, "the planned forms make the probe step equal solo"


def test_batch_invariant_decoding_reproduces_solo_bitwise(perturbed):
    model, probe, _ = perturbed
    prompts = random_prompts([12, 17, 20, 25, 9, 28, 4, 21], vocab=VOCAB)
    with torch.inference_mode():
        solos = [run_solo(model, p, 24, set()) for p in prompts]
        plain = run_teacher_forced(model, prompts, solos, "alone", PAD_ID)
        forced = run_teacher_forced(
            model, prompts, solos, "alone", PAD_ID, batch_mode=lambda: decoding_mode(model, prompts, probe.plan)
        )
        with decoding_mode(model, prompts, probe.plan):
            free = run_free(model, prompts, [s.row_prefill for s in solos], "alone", PAD_ID, 24, set())
    # Negative control: without the mode the planted layer (and whatever varies here) differs.
    assert all(row["max_abs_logit_diff"].max() > 0 for row in plain.rows)
    assert sum(int(row["flipped"].sum()) for row in plain.rows) > 0
    for row, solo in zip(forced.rows, solos):
        assert row["max_abs_logit_diff"].max() == 0.0 and row["kv_delta_max"].max() == 0.0
    assert free.tokens == [s.tokens.tolist() for s in solos]


def test_the_mode_leaves_nothing_behind(perturbed):
    model, probe, _ = perturbed
    before = model.config._attn_implementation
    with batch_invariant(model, [0, 3], probe.plan):
        assert model.config._attn_implementation != before
        assert "forward" in vars(model.model.layers[0].mlp.down_proj)
    assert model.config._attn_implementation == before
    assert all("forward" not in vars(m) for m in model.modules())


def test_every_planned_form_equals_the_module_row_by_row(perturbed):
    """Whatever form the probe picked (chunks or one GEMV per row), it equals the module on each
    row alone on fresh inputs too."""
    from mgbench.engines.inprocess.kernels.batch_invariant import apply_form

    model, probe, _ = perturbed
    named = dict(model.named_modules())
    for name, form in probe.plan.forms.items():
        module = named[name]
        x = torch.randn(8, 1, module.in_features, dtype=torch.bfloat16)
        alone = torch.cat([module(x[r : r + 1]) for r in range(8)])
        assert torch.equal(apply_form(module, form, x), alone), (name, form.label)
        if isinstance(module, RowCountPerturbedLinear):
            assert not torch.equal(module(x), alone), "the planted layer varies with 8 rows"


# --- the CLI on the tiny local model folder ---


def flips_cli(folder, out, *args):
    return runner.invoke(
        app,
        [
            "flips",
            "--model",
            str(folder),
            "--dataset",
            "gsm8k",
            "--limit",
            "6",
            "--batch-size",
            "6",
            "--max-new-tokens",
            "16",
            "--out",
            str(out),
            *args,
        ],
    )


def test_flips_batch_invariant_has_no_flips_where_plain_flips(planted_model_dir, tmp_path):
    """Positive control by construction: the planted head flips plain batched decoding on any
    machine; the batch-invariant mode, planned by the probe, runs it per row and flips nothing."""
    plain = flips_cli(planted_model_dir, tmp_path / "plain")
    invariant = flips_cli(planted_model_dir, tmp_path / "invariant", "--batch-invariant")
    assert plain.exit_code == 0 and invariant.exit_code == 0, plain.output + invariant.output
    assert json.loads((tmp_path / "plain" / "summary.json").read_text())["flips"] > 0
    inv = json.loads((tmp_path / "invariant" / "summary.json").read_text())
    assert inv["batch_invariant"] is True and inv["flips"] == 0 and inv["determinism"] == 1.0
    steps = pd.read_parquet(tmp_path / "invariant" / "steps.parquet")
    assert (steps["max_abs_logit_diff"] == 0).all()
    manifest = json.loads((tmp_path / "invariant" / "manifest.json").read_text())
    assert manifest["probe"]["batch_invariant_exact"] is True and manifest["probe"]["machine"]["cpu_capability"]
    assert "lm_head" in json.dumps(manifest["probe"]["plan"]["modules"]), "the planted head is planned per row"
    refused = flips_cli(planted_model_dir, tmp_path / "refused", "--batch-invariant", "--prefill", "batched")
    assert refused.exit_code == 2 and "--batch-invariant prefills each request alone" in refused.stderr
    assert not (tmp_path / "refused").exists()


def test_probe_command_writes_probe_json(tiny_model_dir, tmp_path):
    result = runner.invoke(
        app,
        ["probe", "--model", str(tiny_model_dir), "--dataset", "gsm8k", "--rows", "4", "--out", str(tmp_path / "p")],
    )
    assert result.exit_code == 0, result.output
    probe = json.loads((tmp_path / "p" / "probe.json").read_text())
    assert probe["kind"] == "mgbench.probe" and probe["rows"] == 4 and probe["pad_lens"] == [0, 1, 2, 3]
    assert probe["batch_invariant_exact"] is True
    assert any(f["op"] == "attention" for f in probe["findings"])
    # Each finding's row in the table carries its verdict, and the probe machine records the kernels.
    lines = result.stdout.splitlines()
    for finding in probe["findings"]:
        # The name up to its first comma tells the aligned forms apart ("aligned groups (pads mod 8").
        row = next(line for line in lines if finding["name"].split(",")[0] in line and finding["op"] in line)
        assert (" yes " in row) == finding["invariant"], row
    assert set(probe["machine"]["kernel_environment"]) == {"ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"}
    as_json = runner.invoke(
        app, ["probe", "--model", str(tiny_model_dir), "--rows", "2", "--json", "--out", str(tmp_path / "q")]
    )
    assert json.loads(as_json.stdout)["rows"] == 2
    bad = runner.invoke(app, ["probe", "--model", str(tiny_model_dir), "--rows", "1", "--out", str(tmp_path / "r")])
    assert bad.exit_code == 2 and "--rows must be at least 2" in bad.stderr and not (tmp_path / "r").exists()


# 8 steps of 4 prompts: a step costs the test's passes together (solo, plain, batch-invariant,
# free-running, the independent recomputation) about 1.6 s on 2 AVX2 cores, bf16 without bf16
# instructions (16 steps: 35 s, 8 steps: 22 s).
STEPS = 8


@pytest.mark.slow
def test_default_model_batch_invariant_mode_is_solo_bitwise(default_lm, math500_prompts, math500_prefills):
    """The real default model, real MATH500 prompts: under the plan probed on this machine every
    teacher-forced logit row and every free-running token equals solo. What plain batched decoding
    of the same batch does here is printed and asserted as agreement with plain HF calls."""
    model = default_lm.model
    prompts = [torch.tensor(p) for p in math500_prompts]
    with torch.inference_mode():
        probe = probe_model(model, max(prompts, key=len), rows=len(prompts))
        solos = [run_solo(model, p, STEPS, set(), prefill=q) for p, q in zip(prompts, math500_prefills)]
        plain = run_teacher_forced(model, prompts, solos, "alone", 2)
        forced = run_teacher_forced(
            model, prompts, solos, "alone", 2, batch_mode=lambda: decoding_mode(model, prompts, probe.plan)
        )
        with decoding_mode(model, prompts, probe.plan):
            free = run_free(model, prompts, [s.row_prefill for s in solos], "alone", 2, STEPS, set())
    assert probe.exact
    assert all(row["max_abs_logit_diff"].max() == 0.0 for row in forced.rows)
    assert free.tokens == [s.tokens.tolist() for s in solos]
    independent = plain_flip_audit(model, prompts, STEPS, "alone")
    diff = torch.stack([torch.from_numpy(row["max_abs_logit_diff"]) for row in plain.rows])
    assert torch.equal(diff, independent["max_abs_logit_diff"])
    print(
        f"\n[this machine] default model, 4 math500 prompts x {STEPS} steps, plain batched: max |logit diff| "
        f"{float(diff.max()):.4g}, flips {int(independent['flipped'].sum())}"
    )

"""The batch-invariant mode and the probe that plans it: exact forms chosen by measurement,
bitwise solo decoding on this machine, a planted row-count-varying layer, the CLI."""

import json

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from helpers import RowCountPerturbedLinear, measured_plain_varies, plant_near_ties, random_prompts, tiny_llama
from mgbench.cli import app
from mgbench.engine.batch_invariant import batch_invariant, chunk_sizes, decoding_mode, run_in_chunks
from mgbench.engine.probe import probe_model
from mgbench.engine.runners import run_free, run_solo, run_teacher_forced

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


@pytest.fixture(scope="module")
def perturbed():
    """PLANTED: layer 0's down projection offsets its output when called with more than 4 rows."""
    model = tiny_llama()
    plant_near_ties(model)
    mlp = model.model.layers[0].mlp
    mlp.down_proj = RowCountPerturbedLinear(mlp.down_proj, invariant_up_to=4)
    with torch.inference_mode():
        probe = probe_model(model, random_prompts([40], vocab=8192, seed=7)[0], rows=8)
    return model, probe


def test_probe_finds_the_planted_row_count_dependence(perturbed):
    model, probe = perturbed
    finding = next(f for f in probe.findings if f.name.startswith("mlp.down_proj"))
    assert not finding.invariant and finding.varies_at == [5, 6, 7, 8]
    assert finding.form in ("chunks of 4/3/2/1 rows", "bmm (one GEMV per row)")
    assert set(probe.plan.forms) == {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}
    assert probe.plain_rows_differing == list(range(8)), "the planted offset reaches every row's logits"
    assert probe.exact, "the planned forms make the probe step equal solo"


def test_batch_invariant_decoding_reproduces_solo_bitwise(perturbed):
    model, probe = perturbed
    prompts = random_prompts([12, 17, 20, 25, 9, 28, 4, 21], vocab=8192)
    with torch.inference_mode():
        solos = [run_solo(model, p, 24, set()) for p in prompts]
        plain = run_teacher_forced(model, prompts, solos, "alone", PAD_ID)
        with decoding_mode(model, prompts, probe.plan):
            forced = run_teacher_forced(model, prompts, solos, "alone", PAD_ID)
            free = run_free(model, prompts, [s.row_prefill for s in solos], "alone", PAD_ID, 24, set())
    # Negative control: without the mode the planted layer (and whatever varies here) differs.
    assert all(row["max_abs_logit_diff"].max() > 0 for row in plain.rows)
    assert sum(int(row["flipped"].sum()) for row in plain.rows) > 0
    for row, solo in zip(forced.rows, solos):
        assert row["max_abs_logit_diff"].max() == 0.0 and row["kv_delta_max"].max() == 0.0
    assert free.tokens == [s.tokens.tolist() for s in solos]


def test_the_mode_leaves_nothing_behind(perturbed):
    model, probe = perturbed
    before = model.config._attn_implementation
    with batch_invariant(model, [0, 3], probe.plan):
        assert model.config._attn_implementation != before
        assert "forward" in vars(model.model.layers[0].mlp.down_proj)
    assert model.config._attn_implementation == before
    assert all("forward" not in vars(m) for m in model.modules())


def test_every_planned_form_equals_the_module_row_by_row(perturbed):
    """Whatever form the probe picked (chunks or one GEMV per row), it equals the module on each
    row alone on fresh inputs too."""
    from mgbench.engine.batch_invariant import apply_form

    model, probe = perturbed
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
    return runner.invoke(app, ["flips", "--model", str(folder), "--dataset", "gsm8k", "--limit", "6", "--batch-size",
                               "6", "--max-new-tokens", "16", "--out", str(out), *args])


def test_flips_batch_invariant_has_no_flips_where_plain_flips(tiny_model_dir, tiny_probe, tmp_path):
    plain = flips_cli(tiny_model_dir, tmp_path / "plain")
    invariant = flips_cli(tiny_model_dir, tmp_path / "invariant", "--batch-invariant")
    assert plain.exit_code == 0 and invariant.exit_code == 0, plain.output + invariant.output
    inv = json.loads((tmp_path / "invariant" / "summary.json").read_text())
    assert inv["batch_invariant"] is True and inv["flips"] == 0 and inv["determinism"] == 1.0
    steps = pd.read_parquet(tmp_path / "invariant" / "steps.parquet")
    assert (steps["max_abs_logit_diff"] == 0).all()
    manifest = json.loads((tmp_path / "invariant" / "manifest.json").read_text())
    assert manifest["probe"]["batch_invariant_exact"] is True and manifest["probe"]["machine"]["cpu_capability"]
    if tiny_probe.varies:  # the positive control, as measured here
        plain_summary = json.loads((tmp_path / "plain" / "summary.json").read_text())
        assert plain_summary["flips"] > 0, measured_plain_varies(tiny_probe)
    refused = flips_cli(tiny_model_dir, tmp_path / "refused", "--batch-invariant", "--prefill", "batched")
    assert refused.exit_code == 2 and "--batch-invariant prefills each request alone" in refused.stderr
    assert not (tmp_path / "refused").exists()


def test_probe_command_writes_probe_json(tiny_model_dir, tmp_path):
    result = runner.invoke(app, ["probe", "--model", str(tiny_model_dir), "--dataset", "gsm8k", "--rows", "4",
                                 "--out", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    probe = json.loads((tmp_path / "p" / "probe.json").read_text())
    assert probe["kind"] == "mgbench.probe" and probe["rows"] == 4 and probe["pad_lens"] == [0, 1, 2, 3]
    assert probe["batch_invariant_exact"] is True
    assert any(f["op"] == "attention" for f in probe["findings"])
    assert "invariant" in result.stdout and "attention" in result.stdout
    as_json = runner.invoke(app, ["probe", "--model", str(tiny_model_dir), "--rows", "2", "--json",
                                  "--out", str(tmp_path / "q")])
    assert json.loads(as_json.stdout)["rows"] == 2
    bad = runner.invoke(app, ["probe", "--model", str(tiny_model_dir), "--rows", "1", "--out", str(tmp_path / "r")])
    assert bad.exit_code == 2 and "--rows must be at least 2" in bad.stderr and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_default_model_batch_invariant_mode_is_solo_bitwise(default_lm, math500_prompts):
    """The real default model, real MATH500 prompts: under the plan probed on this machine every
    teacher-forced logit row and every free-running token equals solo; plain batched decoding of
    the same batch differs where the probe measures variance (the negative control)."""
    from mgbench.audit import eos_token_ids

    model = default_lm.model
    eos = eos_token_ids(model, default_lm.tokenizer)
    prompts = [torch.tensor(p) for p in math500_prompts]
    with torch.inference_mode():
        probe = probe_model(model, max(prompts, key=len), rows=len(prompts))
        solos = [run_solo(model, p, 16, eos) for p in prompts]
        plain = run_teacher_forced(model, prompts, solos, "alone", 2)
        with decoding_mode(model, prompts, probe.plan):
            forced = run_teacher_forced(model, prompts, solos, "alone", 2)
            free = run_free(model, prompts, [s.row_prefill for s in solos], "alone", 2, 16, eos)
    assert probe.exact
    assert all(row["max_abs_logit_diff"].max() == 0.0 for row in forced.rows)
    assert free.tokens == [s.tokens.tolist() for s in solos]
    if probe.varies:
        assert any(row["max_abs_logit_diff"].max() > 0 for row in plain.rows), measured_plain_varies(probe)

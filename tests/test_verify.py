"""Verification policies and repairs: exact reaches 100%, plain batched decoding does not (the
negative control), the oracle triggers exactly on flips, repairs write the reference K/V bitwise."""

import json
import xml.etree.ElementTree as ET

import pandas as pd
import pytest
import torch
from helpers import VOCAB, plant_near_ties, plant_nudged_head, random_prompts, tiny_llama
from typer.testing import CliRunner

from mgbench.engines.inprocess import cache as cache_ops
from mgbench.engines.inprocess.decode import decode_step
from mgbench.engines.inprocess.runners import STOCK, prefill_for_batch, run_solo, run_teacher_forced
from mgbench.engines.inprocess.verification.loop import run_free
from mgbench.engines.inprocess.verification.spec import PolicySpec
from mgbench.engines.inprocess.verification.step import StepContext
from mgbench.engines.inprocess.verification.stock_verifiers import ColumnVerifier, ExactVerifier

PAD_ID = 0
STEPS = 32
LENGTHS = [12, 17, 20, 25, 9, 28, 4, 21]


@pytest.fixture(scope="module")
def flipping_batch():
    """A random-init Llama whose batched decoding flips: planted near-tie lm_head rows, and a
    labelled deterministic nudge of the runner-up logit in batched calls, so flips happen on any CPU."""
    model = tiny_llama()
    plant_near_ties(model)
    plant_nudged_head(model, delta=0.02)
    prompts = random_prompts(LENGTHS, vocab=VOCAB)
    with torch.inference_mode():
        solos = [run_solo(model, p, STEPS, set()) for p in prompts]
    return model, prompts, solos


def decode(batch, spec: PolicySpec, prefill="alone"):
    model, prompts, solos = batch
    prefills = [s.row_prefill for s in solos]
    with torch.inference_mode():
        policy = spec.build(model, prompts, prefills, solos, STEPS)
        free = run_free(model, prompts, prefills, prefill, PAD_ID, STEPS, set(), policy)
    identical = sum(free.tokens[i] == s.tokens.tolist() for i, s in enumerate(solos))
    return free, identical


@pytest.mark.parametrize("prefill", ["alone", "batched"])
def test_negative_control_plain_batched_decoding_diverges(flipping_batch, prefill):
    _, identical = decode(flipping_batch, PolicySpec("none"), prefill)
    assert identical < len(LENGTHS)


@pytest.mark.parametrize("prefill", ["alone", "batched"])
@pytest.mark.parametrize(
    "spec",
    [PolicySpec("always", "exact"), PolicySpec("oracle", "exact"), PolicySpec("margin", "exact", tau=0.05)],
    ids=lambda s: s.label,
)
def test_exact_repair_reaches_full_determinism(flipping_batch, spec, prefill):
    free, identical = decode(flipping_batch, spec, prefill)
    assert identical == len(LENGTHS)
    assert sum(map(sum, free.repaired)) > 0, "repairs must happen, otherwise the batch never flipped"


def test_margin_gate_with_too_small_threshold_misses_flips(flipping_batch):
    # A threshold below every flip's margin verifies nothing useful: the check must then fail.
    _, identical = decode(flipping_batch, PolicySpec("margin", "exact", tau=1e-6))
    assert identical < len(LENGTHS)


def test_oracle_triggers_exactly_on_flips(flipping_batch):
    model, prompts, solos = flipping_batch
    free, identical = decode(flipping_batch, PolicySpec("oracle", "exact"))
    assert identical == len(LENGTHS)
    assert free.triggered == free.repaired  # every trigger was a real flip, every flip was repaired
    with torch.inference_mode():
        forced = run_teacher_forced(model, prompts, solos, "alone", PAD_ID)
    for row, record in enumerate(forced.rows):
        first_flip = next((s for s, f in enumerate(record["flipped"]) if f), None)
        first_trigger = next((s for s, t in enumerate(free.triggered[row]) if t), None)
        assert first_flip == first_trigger  # same history up to the first flip


def test_column_repair_writes_the_reference_column_bitwise(flipping_batch):
    model, prompts, solos = flipping_batch
    prefills = [s.row_prefill for s in solos]
    with torch.inference_mode():
        logits, cache, mask, pads = prefill_for_batch(model, prompts, prefills, "alone", PAD_ID)
        fed = logits.argmax(-1)
        positions = torch.tensor([len(p) for p in prompts])
        logits, mask = decode_step(model, cache, fed, positions, mask)
        emitted = [[int(t)] for t in fed]  # each row's step-0 token; step 1's is read from the logits
        ctx = StepContext(1, logits, cache, pads, fed, positions, list(range(len(prompts))), emitted)
        verifier = ColumnVerifier(model, prompts, prefills)
        # The batch-1 reference, computed independently over the row's unpadded history.
        repaired_rows = 0
        for row in range(len(prompts)):
            history = cache_ops.row_slice(cache, row, pads[row])
            reference = cache_ops.cache_from_layers([(k[:, :, :-1], v[:, :, :-1]) for k, v in history], model.config)
            ref_logits, _ = decode_step(
                model,
                reference,
                fed[row : row + 1],
                positions[row : row + 1],
                torch.ones((1, history[0][0].shape[-2] - 1), dtype=torch.long),
            )
            before = cache_ops.read_column(cache, row, cache_ops.cache_layers(cache)[0][0].shape[-2] - 1)
            token, fixed, _ = verifier.verify(ctx, row)
            assert token == int(ref_logits[0].argmax())
            after = cache_ops.read_column(cache, row, cache_ops.cache_layers(cache)[0][0].shape[-2] - 1)
            expected = cache_ops.read_column(reference, 0, history[0][0].shape[-2] - 1) if fixed else before
            for (k, v), (k_ref, v_ref) in zip(after, expected):
                assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
            repaired_rows += fixed
    assert repaired_rows > 0, "the nudge makes batched and batch-1 argmax differ on some row"


def solo_columns(model, prompt, solo, n: int) -> torch.Tensor:
    """K/V of the solo run's first n steps' input tokens: the request decoded alone again, fed its tokens."""
    decoder = STOCK.solo(model, prompt, n, solo.row_prefill)
    for step in range(1, n):
        decoder.step(solo.tokens[step - 1 : step], torch.tensor([len(prompt) + step - 1]))
    return decoder.columns(0, len(prompt) - 1, n)


def test_exact_repair_makes_the_row_history_solo_bitwise(flipping_batch):
    model, prompts, solos = flipping_batch
    prefills = [s.row_prefill for s in solos]
    with torch.inference_mode():
        policy = PolicySpec("oracle", "exact").build(model, prompts, prefills, solos, STEPS)
        free = run_free(model, prompts, prefills, "alone", PAD_ID, STEPS, set(), policy)
        verifier: ExactVerifier = policy.verifier.reference
        # A row's shadow starts at its first trigger after the prefill (step 0 checks the prefill's
        # own logits) and is advanced to each later trigger: it exists exactly for the rows the
        # run records a trigger at step >= 1 for, and has fed the emitted tokens up to the last one.
        last_trigger = [max((s for s, t in enumerate(row) if t and s > 0), default=None) for row in free.triggered]
        assert [None if shadow is None else shadow.fed for shadow in verifier.shadows] == last_trigger
        shadowed = [row for row, shadow in enumerate(verifier.shadows) if shadow is not None]
        assert shadowed, "the oracle triggers on the planted flips"
        for row in shadowed:
            # The shadow replayed the emitted prefix with solo steps: its K/V equal the solo run's.
            shadow = verifier.shadows[row]
            solo_kv = solo_columns(model, prompts[row], solos[row], shadow.fed)
            shadow_kv = cache_ops.columns_of_row(shadow.cache, 0, len(prompts[row]) - 1, shadow.fed)
            assert torch.equal(shadow_kv, solo_kv)
    assert sum(map(sum, free.repaired)) > 0


# --- the CLI on a tiny local model folder (fast), for exit codes, JUnit and JSON ---


def verify_cli(folder, out, *args):
    from mgbench.cli import app

    return CliRunner().invoke(
        app,
        [
            "verify",
            "--model",
            str(folder),
            "--dataset",
            "gsm8k",
            "--limit",
            "6",
            "--batch-sizes",
            "3,6",
            "--max-new-tokens",
            "24",
            "--out",
            str(out),
            *args,
        ],
    )


def junit_cases(path) -> tuple[ET.Element, dict[str, ET.Element]]:
    """A JUnit file read by an XML parser: the testsuite and its cases by name, the suite's counts
    checked against the cases it holds."""
    suite = ET.parse(path).getroot()
    assert suite.tag == "testsuite" and suite.get("name") == "mgbench.verify"
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    assert int(suite.get("tests")) == len(cases) == len(suite.findall("testcase"))
    assert int(suite.get("failures")) == sum(case.find("failure") is not None for case in cases.values())
    return suite, cases


def test_cli_exit_codes_and_junit(planted_model_dir, tmp_path):
    tiny_model_dir = planted_model_dir  # every multi-row step flips: the gate must catch it anywhere
    failing = verify_cli(
        tiny_model_dir,
        tmp_path / "none",
        "--policy",
        "none",
        "--require-determinism",
        "1.0",
        "--junit",
        str(tmp_path / "none.xml"),
    )
    assert failing.exit_code == 1, failing.output
    # JUnit, read by an XML parser: one case per (policy, dataset, batch size); each case whose
    # outputs diverged fails with its determinism and lists the diverged requests of the run's table.
    sequences = pd.read_parquet(tmp_path / "none" / "sequences.parquet")
    suite, cases = junit_cases(tmp_path / "none.xml")
    groups = list(sequences.groupby(["batch_size"]))
    assert (
        list(cases)
        == [f"none batch_size={size}" for (size,), _ in groups]
        == ["none batch_size=3", "none batch_size=6"]
    )
    summary = json.loads((tmp_path / "none" / "summary.json").read_text())
    failing_sizes = [r["batch_size"] for r in summary["by_batch_size"] if r["determinism"] < 1.0]
    assert int(suite.get("failures")) == len(failing_sizes) > 0
    for (size,), group in groups:
        failure = cases[f"none batch_size={size}"].find("failure")
        assert (failure is not None) == (size in failing_sizes) == (not group["identical"].all())
        diverged = group[~group["identical"]]
        listed = ", ".join(f"request {r.request_id} at token {int(r.first_divergence)}" for r in diverged.itertuples())
        assert failure is None or (
            failure.get("message") == f"determinism {group['identical'].mean():.2%} < required 100.00%"
            and failure.text == f"diverged from the solo reference: {listed}"
        )
    invariant = verify_cli(
        tiny_model_dir,
        tmp_path / "inv",
        "--policy",
        "none",
        "--batch-invariant",
        "--require-determinism",
        "1.0",
        "--json",
    )
    assert invariant.exit_code == 0, invariant.output
    assert json.loads(invariant.stdout)["policies"][0]["determinism"] == 1.0
    passing = verify_cli(
        tiny_model_dir,
        tmp_path / "exact",
        "--policy",
        "always",
        "--repair",
        "exact",
        "--require-determinism",
        "1.0",
        "--junit",
        str(tmp_path / "exact.xml"),
        "--json",
    )
    assert passing.exit_code == 0, passing.output
    summary = json.loads(passing.stdout)
    assert summary["passed"] is True and summary["policies"][0]["determinism"] == 1.0
    suite, cases = junit_cases(tmp_path / "exact.xml")
    expected = [f"{r['policy']} batch_size={r['batch_size']}" for r in summary["by_batch_size"]]
    assert list(cases) == expected == ["always/exact batch_size=3", "always/exact batch_size=6"]
    assert suite.get("failures") == "0" and all(r["determinism"] == 1.0 for r in summary["by_batch_size"])
    steps = pd.read_parquet(tmp_path / "exact" / "steps.parquet")
    assert {"triggered", "repaired", "matches_solo", "margin"} <= set(steps.columns)
    assert steps["repaired"].sum() > 0, "determinism restored by repairs, not 0 flips == 0 flips"


def test_cli_refuses_calibration_of_another_model(tiny_model_dir, tmp_path):
    calibration = tmp_path / "calibration.json"
    calibration.write_text(
        json.dumps({"kind": "mgbench.calibration", "model": "llama-3.1-8b", "tau": 0.5, "unit": "logit"})
    )
    result = verify_cli(tiny_model_dir, tmp_path / "o", "--threshold-from", str(calibration))
    assert result.exit_code == 2 and "calibrated for model 'llama-3.1-8b'" in result.stderr
    result = verify_cli(tiny_model_dir, tmp_path / "o", "--policy", "margin")
    assert result.exit_code == 2 and "needs --threshold" in result.stderr
    result = verify_cli(tiny_model_dir, tmp_path / "o", "--threshold", "nan")
    assert result.exit_code == 2

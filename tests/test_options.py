"""Options checked by their effect: a threshold taken from a calibration, the ulp unit, calibrate's
confidence, longest-first batching, the dtype and attention the model runs in, what an endpoint
audit asks the server, and a verify run killed with -9 then resumed. Tiny models, a stub server."""

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch
from helpers import cli_args
from stub_openai import StubServer, StubState
from typer.testing import CliRunner

from mgbench.cli import app

runner = CliRunner()


def invoke(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result


def flips_args(model, out, *extra):
    return cli_args("flips", model, out, *extra, limit=4, batch=2, tokens=8)


def verify_args(model, out, *extra, limit="2", tokens="8"):
    return cli_args("verify", model, out, *extra, limit=limit, batch=2, tokens=tokens)


@pytest.fixture(scope="module")
def planted_flips(planted_model_dir, tmp_path_factory):
    """A flips run of the planted model (flips at every batched decode step), in arrival order."""
    out = tmp_path_factory.mktemp("flips") / "run"
    invoke(flips_args(planted_model_dir, out))
    return out


@pytest.fixture(scope="module")
def calibration(planted_flips, tmp_path_factory):
    """calibrate on that run with the defaults (logit unit, 95% confidence): no model loaded."""
    out = tmp_path_factory.mktemp("calibration") / "cal"
    invoke(["calibrate", str(planted_flips), "--out", str(out)])
    document = json.loads((out / "calibration.json").read_text())
    assert document["tau"] is not None and document["unit"] == "logit"
    return out / "calibration.json", document


def gated_steps(out):
    """verify's steps after the prefill: step 0 is each request's prefill alone, never gated."""
    steps = pd.read_parquet(out / "steps.parquet")
    assert len(steps) and not steps.loc[steps["step"] == 0, "triggered"].any()
    return steps[steps["step"] > 0]


def test_verify_takes_tau_and_unit_from_a_calibration(planted_model_dir, calibration, tmp_path):
    path, document = calibration
    args = verify_args(planted_model_dir, tmp_path / "v", "--threshold-from", str(path))
    result = invoke([*args, "--json"])
    summary = json.loads(result.stdout)
    tau = document["tau"]
    assert summary["threshold"] == tau and summary["threshold_unit"] == "logit"
    assert [p["policy"] for p in summary["policies"]] == [f"margin<{tau:.4g}/exact"]
    steps = gated_steps(tmp_path / "v")
    # The gate is margin < TAU in logits, at every step: the calibrated TAU, in the calibrated unit.
    assert steps["triggered"].tolist() == (steps["margin"] < tau).tolist()
    assert steps["triggered"].any()
    assert ((steps["margin_ulp"] < tau) != steps["triggered"]).any(), "the ulp reading would gate otherwise"


def test_compare_takes_tau_and_unit_from_a_calibration(planted_model_dir, calibration, tmp_path):
    path, document = calibration
    tau = document["tau"]
    # --only names the calibrated TAU's configurations: refused unless compare runs them with it.
    only = f"margin<{tau:.4g}/exact,margin<{tau:.4g}/column"
    args = ["compare", "--model", str(planted_model_dir), "--dataset", "gsm8k", "--limit", "2", "--batch-size", "2"]
    args += ["--max-new-tokens", "4", "--repeats", "1", "--only", only, "--out", str(tmp_path / "c")]
    summary = json.loads(invoke([*args, "--threshold-from", str(path), "--json"]).stdout)
    assert summary["threshold"] == tau and summary["threshold_unit"] == document["unit"]
    configs = {c["config"]: c for c in summary["configs"]}
    assert set(configs) == {"none", *only.split(",")}
    assert all(configs[name]["triggers"] > 0 for name in only.split(","))  # the planted near-ties sit below TAU


def test_threshold_unit_ulp_gates_on_ulp_margins(tiny_model_dir, tmp_path):
    out = tmp_path / "v"
    args = verify_args(tiny_model_dir, out, "--threshold", "2", "--threshold-unit", "ulp")
    result = invoke([*args, "--json"])
    assert [p["policy"] for p in json.loads(result.stdout)["policies"]] == ["margin<2ulp/exact"]
    steps = gated_steps(out)
    assert steps["triggered"].tolist() == (steps["margin_ulp"] < 2).tolist()
    assert steps["triggered"].any() and not steps["triggered"].all()
    assert ((steps["margin"] < 2) != steps["triggered"]).any(), "a logit reading of 2 would gate otherwise"


def test_calibrate_confidence_sets_the_miss_bound(planted_flips, calibration, tmp_path):
    from scipy.stats import beta

    _, default = calibration
    invoke(["calibrate", str(planted_flips), "--confidence", "0.99", "--out", str(tmp_path / "c")])
    document = json.loads((tmp_path / "c" / "calibration.json").read_text())
    flips = int(pd.read_parquet(planted_flips / "steps.parquet")["flipped"].sum())
    assert document["flips"] == flips > 0 and document["bound"]["confidence"] == 0.99
    # One-sided Clopper-Pearson with no miss among n flips: the 0.99 quantile of Beta(1, n).
    assert document["bound"]["miss_probability_bound"] == pytest.approx(beta.ppf(0.99, 1, flips), rel=1e-9)
    assert default["bound"]["miss_probability_bound"] == pytest.approx(beta.ppf(0.95, 1, flips), rel=1e-9)
    assert document["tau"] == default["tau"]  # the threshold does not depend on the confidence


def batches(run):
    """Request ids per batch, in batch order and row order."""
    sequences = pd.read_parquet(run / "sequences.parquet").sort_values(["batch_id", "row"])
    return [group["request_id"].tolist() for _, group in sequences.groupby("batch_id", sort=True)]


def test_sort_by_length_batches_longest_first(planted_model_dir, planted_flips, tmp_path):
    invoke(flips_args(planted_model_dir, tmp_path / "sorted", "--sort-by-length"))
    sequences = pd.read_parquet(planted_flips / "sequences.parquet").drop_duplicates("request_id")
    arrival = sorted(sequences["request_id"])
    length = dict(zip(sequences["request_id"], sequences["prompt_ids"].map(len)))
    longest_first = sorted(arrival, key=lambda r: (-length[r], arrival.index(r)))
    assert longest_first != arrival, "these prompts would batch alike either way"
    assert batches(planted_flips) == [arrival[i : i + 2] for i in range(0, 4, 2)]
    assert batches(tmp_path / "sorted") == [longest_first[i : i + 2] for i in range(0, 4, 2)]


@pytest.mark.parametrize("dtype,attn,torch_dtype", [("fp16", "eager", torch.float16), ("fp32", "sdpa", torch.float32)])
def test_dtype_and_attn_reach_the_model(tiny_model_dir, tmp_path, monkeypatch, dtype, attn, torch_dtype):
    from transformers import AutoModelForCausalLM

    from mgbench.assets import models

    loaded = []
    load = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    out = tmp_path / "run"
    invoke([*flips_args(tiny_model_dir, out, "--dtype", dtype, "--attn", attn), "--limit", "2"])
    [lm] = loaded
    assert lm.model.dtype == torch_dtype and lm.model.config._attn_implementation == attn
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dtype"] == dtype and manifest["attn"] == attn
    # The solo outputs are greedy decoding of that model: HF generate on the folder loaded apart.
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch_dtype, attn_implementation=attn)
    sequences = pd.read_parquet(out / "sequences.parquet").drop_duplicates("request_id")
    assert len(sequences) == 2
    for prompt, solo in zip(sequences["prompt_ids"], sequences["solo_ids"]):
        with torch.inference_mode():
            generated = reference.eval().generate(
                torch.tensor([prompt.tolist()]), max_new_tokens=8, do_sample=False, pad_token_id=0
            )
        assert solo.tolist() == generated[0, len(prompt) :].tolist()


ENDPOINT_AUDIT = ["flips", "--dataset", "gsm8k", "--limit", "2", "--batch-size", "3", "--max-new-tokens", "4"]


def audited_prompts(out):
    return {tuple(p) for p in pd.read_parquet(out / "sequences.parquet")["prompt_ids"]}


def test_endpoint_top_logprobs_is_asked_in_every_request(tmp_path):
    state = StubState()
    with StubServer(state) as server:
        invoke([*ENDPOINT_AUDIT, "--endpoint", server.url, "--top-logprobs", "3", "--out", str(tmp_path / "e")])
    assert len(state.bodies) > 1 and {body["logprobs"] for body in state.bodies} == {3}
    # Without --needle, every request sent is an audited one, batched with the others (2 of them).
    assert {tuple(body["prompt"]) for body in state.bodies} == audited_prompts(tmp_path / "e")
    assert set(pd.read_parquet(tmp_path / "e" / "sequences.parquet")["batch_size"]) == {2}


def test_endpoint_needle_sends_each_request_among_fillers(tmp_path):
    state = StubState()
    with StubServer(state) as server:
        invoke([*ENDPOINT_AUDIT, "--endpoint", server.url, "--needle", "--out", str(tmp_path / "e")])
    audited = audited_prompts(tmp_path / "e")
    fillers = [body for body in state.bodies if tuple(body["prompt"]) not in audited]
    assert len(audited) == 2 and len(fillers) == 2 * (3 - 1)  # each request among B - 1 fillers
    assert {body["logprobs"] for body in state.bodies} == {5}  # the default top-k
    sequences = pd.read_parquet(tmp_path / "e" / "sequences.parquet")
    assert set(sequences["batch_size"]) == {3} and len(sequences) == 2


@pytest.mark.slow  # fresh Python processes that import torch
def test_verify_killed_then_resumed_equals_an_uninterrupted_run(tiny_model_dir, tmp_path):
    # 6 requests at batch size 2: three groups, committed one by one.
    args = verify_args(tiny_model_dir, tmp_path / "run", "--policy", "none,oracle", limit="6", tokens="4")
    parts = tmp_path / ".run.partial" / "parts"
    log = tmp_path / "killed.log"  # a file, not a pipe: a full pipe would stall the run
    with open(log, "w") as output:
        running = subprocess.Popen([sys.executable, "-m", "mgbench", *args], stdout=output, stderr=output)
    try:
        deadline = time.monotonic() + 300
        while not (parts / "group-00000.json").exists() and running.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (parts / "group-00000.json").exists(), f"exit {running.poll()}: {log.read_text()[-2000:]}"
        os.kill(running.pid, signal.SIGKILL)
        running.wait(timeout=60)
    finally:
        if running.poll() is None:
            running.kill()
            running.wait(timeout=60)
    assert running.returncode == -signal.SIGKILL
    assert not (tmp_path / "run").exists()  # nothing published
    done = sorted(p.name for p in parts.glob("group-*.json"))
    assert "group-00000.json" in done and len(done) < 3

    invoke([*args, "--resume"])
    assert not parts.parent.exists()
    invoke(verify_args(tiny_model_dir, tmp_path / "whole", "--policy", "none,oracle", limit="6", tokens="4"))
    for table in ("steps", "sequences"):
        resumed, whole = (pd.read_parquet(tmp_path / run / f"{table}.parquet") for run in ("run", "whole"))
        assert len(whole) and set(whole["policy"]) == {"none", "oracle/exact"}
        pd.testing.assert_frame_equal(resumed, whole)

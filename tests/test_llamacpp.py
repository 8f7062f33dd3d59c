"""The endpoint audit against real llama.cpp servers (`make llamacpp`) on this machine.

Two servers (conftest's `llamacpp_servers`, shared with test_diff: started when the first test
needs them, each on a free loopback port, stopped by its PID): `-np 1` (one slot: requests queue
and each is decoded alone, so the audit is clean by construction) and `-np 8` (eight slots
decoded together: whatever this CPU's kernels do). A missing build is a failure, not a skip:
`make test` and `.ci/run` build it. The `-np 8` figures are checked against a bare client that
shares no code with mgbench, on the same prompts.
"""

import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pandas as pd
import pytest
import reference
from helpers import kill_server_after_first_commit, raw_margins
from typer.testing import CliRunner

from mgbench.assets import datasets
from mgbench.cli import app
from mgbench.engines.endpoint.local_server import free_port

pytestmark = pytest.mark.server  # every test here talks to a real server (conftest starts it on first use)

runner = CliRunner()
AUDIT = ["flips", "--dataset", "gsm8k", "--limit", "4", "--batch-size", "4", "--max-new-tokens", "16"]
TOP = 5


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def bare_completion(
    url: str, model: str, prompt: list[int], max_tokens: int, cache: bool = False
) -> tuple[list[int], list[dict]]:
    """One greedy completion with plain urllib, prompt cache off unless `cache`: (token ids, top
    logprobs by id)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": TOP}
    request = urllib.request.Request(
        url + "/completions", json.dumps({**body, "cache_prompt": cache}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        content = json.load(response)["choices"][0]["logprobs"]["content"]
    return [e["id"] for e in content], [{t["id"]: t["logprob"] for t in e["top_logprobs"]} for e in content]


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    config = datasets.load_config("gsm8k")
    selected = datasets.select_requests(config, datasets.read_records(config), 4, 0)
    return [datasets.encode(default_tokenizer, config, r.text) for r in selected]


def audit(url: str, out, *extra) -> dict:
    result = runner.invoke(app, [*AUDIT, "--endpoint", url, "--out", str(out), "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def audited(llamacpp_servers, tmp_path_factory):
    """One mgbench audit of each server: {name: (run directory, summary)}."""
    root = tmp_path_factory.mktemp("audits")
    return {name: (root / name, audit(server.url, root / name)) for name, server in llamacpp_servers.items()}


def test_negative_control_one_slot_decodes_each_request_alone(llamacpp_servers, prompts, audited):
    """One slot: a batch's requests are decoded one after another, each the computation it is
    alone, so the audit must find no flip and no drift. Its margins must be the ones a bare
    client's raw responses give (the server's batch-of-one repeat is measured first)."""
    url = llamacpp_servers["np1"].url
    model = served_model(url)
    solos = [bare_completion(url, model, p, 16) for p in prompts]
    assert solos == [bare_completion(url, model, p, 16) for p in prompts], "llama.cpp -np 1 alone twice differs"
    out, summary = audited["np1"]
    print(f"\n[this machine] llama.cpp -np 1: flips {summary['flips']}, max drift {summary['max_logprob_drift']}")
    assert summary["flips"] == 0 and summary["sequences_diverged"] == 0 and summary["max_logprob_drift"] == 0.0
    assert summary["solo_repeat"]["deterministic"] and summary["solo_repeat"]["requests"] == 4
    sequences = pd.read_parquet(out / "sequences.parquet").sort_values("request_id")
    steps = pd.read_parquet(out / "steps.parquet")
    by_prompt = {tuple(p): solo for p, solo in zip(prompts, solos)}
    for row in sequences.itertuples():
        ids, tops = by_prompt[tuple(row.prompt_ids)]
        assert list(row.solo_ids) == ids and list(row.batched_ids) == ids
        assert list(row.solo_margins) == raw_margins(tops)
        mine = steps[steps["request_id"] == row.request_id].sort_values("step")
        assert mine["margin"].tolist() == mine["solo_margin"].tolist() == raw_margins(tops)[: len(mine)]
        assert (mine["logprob_drift"] == 0).all() and len(mine) == len(ids)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["endpoint"]["props"]["total_slots"] == 1
    assert manifest["endpoint"]["prompt_format"] == "token-ids"


def test_eight_slots_reported_as_a_bare_client_measures(llamacpp_servers, prompts, audited):
    """mgbench's verdict on solo repeats agrees with a bare client's; its drift equals its own
    recorded steps; the bare client's concurrent drift is printed beside it (two runs batch by
    arrival, so their figures are not predicted to agree)."""
    url = llamacpp_servers["np8"].url
    model = served_model(url)
    solos = [bare_completion(url, model, p, 16) for p in prompts]
    repeats = solos == [bare_completion(url, model, p, 16) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: bare_completion(url, model, p, 16), prompts))
    measured_drift, diverged = 0.0, 0
    for (solo_ids, solo_top), (ids, top) in zip(solos, together):
        agree = next((i for i, (a, b) in enumerate(zip(solo_ids, ids)) if a != b), min(len(solo_ids), len(ids)))
        diverged += agree < min(len(solo_ids), len(ids))
        for a, b in zip(solo_top[:agree], top[:agree]):
            measured_drift = max([measured_drift] + [abs(a[t] - b[t]) for t in a.keys() & b.keys()])
    out, summary = audited["np8"]
    print(
        f"\n[this machine] llama.cpp -np 8: mgbench flips {summary['flips']}, diverged "
        f"{summary['sequences_diverged']}/4, max drift {summary['max_logprob_drift']}; bare client: "
        f"diverged {diverged}/4, max drift {measured_drift}"
    )
    sequences = pd.read_parquet(out / "sequences.parquet")
    assert summary["solo_repeat"]["deterministic"] == repeats  # a server that repeats alone, both say so
    if repeats:  # deterministic alone: mgbench's solo answers are the bare client's
        assert sequences["solo_ids"].map(list).tolist() == [ids for ids, _ in solos]
    assert sequences["prompt_ids"].map(list).tolist() == prompts
    steps = pd.read_parquet(out / "steps.parquet")
    recorded = reference.drift_figures(steps)["max_logprob_drift"] or 0.0  # over steps emitting one token
    assert (summary["max_logprob_drift"] or 0.0) == pytest.approx(recorded)
    assert summary["flips"] == int(steps["flipped"].sum())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["endpoint"]["props"]["total_slots"] == 8
    assert manifest["endpoint"]["server_version"] == manifest["endpoint"]["props"]["build_info"]
    assert summary["engine"].startswith("llama.cpp ") and summary["engine"].endswith(", 8 slots")


def test_one_slot_on_the_prefix_cache_and_repeat_axes(llamacpp_servers, prompts, tmp_path):
    """One slot, cache_prompt on for the warm requests. Must pass, by construction: the same load
    twice is each request decoded alone twice (the repeat axis, 100% where solo repeats). What a
    warm prompt cache does is printed and asserted only as agreement: each request's warm answer
    equals a bare client's cache_prompt sending of it right after the prompt was computed afresh,
    token for token. (A pair of two cache_prompt sendings would reuse whatever prefix the slot held
    before, so its warm answer depended on the requests sent earlier: that failed one of three full-suite
    runs on an AVX2 EPYC.)"""
    url = llamacpp_servers["np1"].url
    summary = audit(url, tmp_path / "axes", "--axes", "batch,prefix-cache,repeat")
    rows = {row["axis"]: row for row in summary["by_batch_size"]}
    print(
        "\n[this machine] llama.cpp -np 1 by axis: "
        + ", ".join(
            f"{a} {r['sequences_diverged']}/{r['sequences']} diverged, {r['flips']} flips" for a, r in rows.items()
        )
    )
    assert summary["solo_repeat"]["deterministic"]
    assert rows["repeat"]["determinism"] == 1.0 and rows["batch"]["determinism"] == 1.0
    model = served_model(url)
    sequences = pd.read_parquet(tmp_path / "axes" / "sequences.parquet")
    warm = sequences[sequences["axis"] == "prefix-cache"]
    assert len(warm) == 4
    for row in warm.itertuples():
        prompt = [int(t) for t in row.prompt_ids]
        bare_completion(url, model, prompt, 16, cache=False)  # the prompt computed afresh, kept in the slot
        ids, tops = bare_completion(url, model, prompt, 16, cache=True)
        assert list(row.batched_ids) == ids
    steps = pd.read_parquet(tmp_path / "axes" / "steps.parquet")
    warm_steps = steps[steps["axis"] == "prefix-cache"]
    assert summary["flips"] == int(steps["flipped"].sum()) and len(warm_steps) > 0


def test_report_puts_llamacpp_beside_other_engines(audited, tmp_path):
    runs = [str(audited[name][0]) for name in ("np8", "np1")]
    done = runner.invoke(app, ["report", *runs, "--out", str(tmp_path / "r")])
    assert done.exit_code == 0, done.output
    side = (tmp_path / "r" / "report.md").read_text().split("## Engines side by side")[1].split("\n## ")[0]
    rows = [line for line in side.splitlines() if line.startswith("| llama.cpp")]
    assert len(rows) == 2 and "| 8 |" in rows[0] and "| 1 |" in rows[1]  # the slots column
    assert all("| identical |" in row for row in rows)  # solo twice


def exit_2(result, message, out):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.output, result.stderr
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.partial*"))


def test_dead_server_exits_2_in_one_line(tmp_path):
    out = tmp_path / "run"
    dead = f"http://127.0.0.1:{free_port()}/v1"  # a free port: nothing listens there
    exit_2(runner.invoke(app, [*AUDIT, "--endpoint", dead, "--out", str(out)]), "nothing is listening", out)


def test_server_killed_mid_run_then_resume_keeps_committed_groups(llamacpp_servers, audited, tmp_path):
    """Kills the -np 8 server mid-run, restarts it on the same port (whatever happens, so the
    tests after this one find it up), resumes."""
    server = llamacpp_servers["np8"]
    out = tmp_path / "run"
    limit = ["--limit", "8"]  # two groups of 4: the kill lands after the first commit, the second is redone
    command = [sys.executable, "-m", "mgbench", *AUDIT, *limit, "--endpoint", server.url, "--out", str(out)]
    try:
        code, stderr, before = kill_server_after_first_commit(command, out, server)
    finally:
        if not server.alive():
            server.start().wait_ready(timeout=300)  # same command, same port
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "--resume" in errors[0], stderr[-2000:]
    assert "Traceback" not in stderr
    resumed = runner.invoke(app, [*AUDIT, *limit, "--endpoint", server.url, "--out", str(out), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    final = {table: pd.read_parquet(out / f"{table}.parquet") for table in ("steps", "sequences")}
    for table, rows in before.items():  # committed before the kill: published as it was
        kept = final[table][final[table]["batch_id"].isin(rows["batch_id"])]
        pd.testing.assert_frame_equal(kept.reset_index(drop=True), rows.reset_index(drop=True))
    sequences = final["sequences"]
    assert sorted(sequences["request_id"]) == sorted(set(sequences["request_id"])) and len(sequences) == 8

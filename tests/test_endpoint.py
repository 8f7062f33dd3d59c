"""The endpoint audit without vLLM: first-divergence semantics, faults and resume against a stub
OpenAI server in a thread (tests/stub_openai.py). The real vLLM server is tests/test_vllm.py."""

import json
from collections import Counter

import pandas as pd
import pytest
from stub_openai import StubServer, StubState
from typer.testing import CliRunner

from mgbench.analysis.divergence import Decoded, first_divergence_columns, logprob_drift, repeat_agreement, top2_margin
from mgbench.cli import app

runner = CliRunner()
AUDIT = ["flips", "--dataset", "gsm8k", "--limit", "4", "--batch-size", "2", "--max-new-tokens", "6"]


def decoded(ids, second=-1.0):
    return Decoded(ids, [{t: -0.5, t + 1: second} for t in ids])


def test_first_divergence_rows_stop_at_the_flip_and_leave_unmeasurable_columns_null():
    solo = decoded([5, 6, 7, 8])
    batched = Decoded([5, 6, 9, 10], [{5: -0.5, 6: -1.0}, {6: -0.5, 7: -0.75}, {9: -0.5, 10: -0.5}, {10: -0.1, 11: -1}])
    columns = first_divergence_columns(solo, batched)
    assert columns["step"].tolist() == [0, 1, 2]  # steps 0..first divergence, later ones not comparable
    assert columns["flipped"].tolist() == [False, False, True]
    assert columns["margin"].tolist() == [0.5, 0.25, 0.0]  # batched top-1 minus top-2; a tie is 0
    assert columns["logprob_drift"].tolist() == [0.0, 0.25, 0.0]  # step 2 shares no id: 0 by definition
    assert all(columns[name] is None for name in ("margin_ulp", "max_abs_logit_diff", "kv_delta_mean", "kv_delta_max"))
    same = first_divergence_columns(solo, decoded([5, 6, 7, 8]))
    assert len(same["step"]) == 4 and not same["flipped"].any()


def test_margin_is_by_value_not_rank_and_drift_over_shared_ids():
    assert top2_margin({7: -2.0, 3: -0.5, 9: -0.5}) == 0.0  # emitted token listed second on a tie
    assert logprob_drift({1: -0.5, 2: -1.0}, {1: -0.25, 3: -9.0}) == 0.25
    agreement = repeat_agreement(decoded([1, 2, 3]), decoded([1, 2, 4], second=-1.5))
    assert agreement == {"first_divergence": 2, "steps": 2, "logprob_steps_differing": 2, "max_logprob_drift": 0.5}


def flips(url, out, *extra):
    return runner.invoke(app, [*AUDIT, "--endpoint", url, "--out", str(out), "--json", *extra])


def test_positive_control_concurrent_variance_is_caught_and_negative_control_is_clean(tmp_path):
    with StubServer(StubState(flip_when_concurrent=True)) as server:
        result = flips(server.url, tmp_path / "varies")
    assert result.exit_code == 0, result.output
    varies = json.loads(result.stdout)
    assert varies["method"] == "first-divergence" and varies["flips"] == 4 and varies["sequences_diverged"] == 4
    assert varies["steps"] == 4 * 3  # each pair: steps 0, 1 and the flip at 2
    assert varies["max_logprob_drift"] == 0.125 and varies["drift_share"] == 1.0
    assert varies["solo_repeat"]["deterministic"] is True
    steps = pd.read_parquet(tmp_path / "varies" / "steps.parquet")
    assert steps["margin_ulp"].isna().all() and steps["kv_delta_mean"].isna().all()
    assert (steps["method"] == "first-divergence").all() and steps["margin"].notna().all()

    with StubServer() as server:  # no concurrency effect: the audit must say so
        result = flips(server.url, tmp_path / "clean")
    clean = json.loads(result.stdout)
    assert clean["flips"] == 0 and clean["sequences_diverged"] == 0 and clean["max_logprob_drift"] == 0.0
    assert clean["steps"] == 4 * 6


def test_llamacpp_response_shape_is_read_by_the_response_and_audited_alike(tmp_path):
    # The same planted variance as above, answered in llama.cpp's shape: the audit must be the same.
    state = StubState(flip_when_concurrent=True, llamacpp=True)
    with StubServer(state) as server:
        result = flips(server.url, tmp_path / "llama")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["flips"] == 4 and summary["sequences_diverged"] == 4 and summary["max_logprob_drift"] == 0.125
    assert summary["engine"] == "llama.cpp b1-stub, 8 slots"
    assert all(body["cache_prompt"] is False for body in state.bodies)  # a server with /props takes it
    manifest = json.loads((tmp_path / "llama" / "manifest.json").read_text())
    assert manifest["endpoint"]["props"]["total_slots"] == 8 and manifest["endpoint"]["server_version"] == "b1-stub"
    steps = pd.read_parquet(tmp_path / "llama" / "steps.parquet")
    with StubServer(StubState(flip_when_concurrent=True)) as server:  # vLLM's shape, same answers
        assert flips(server.url, tmp_path / "vllm").exit_code == 0
    vllm_steps = pd.read_parquet(tmp_path / "vllm" / "steps.parquet")
    pd.testing.assert_frame_equal(steps, vllm_steps)
    with StubServer(state := StubState()) as server:  # vLLM's shape: no cache_prompt sent
        assert flips(server.url, tmp_path / "plain").exit_code == 0
    assert all("cache_prompt" not in body for body in state.bodies)


def test_calibrate_reads_an_endpoint_run_and_refuses_its_null_ulps(tmp_path):
    with StubServer(StubState(flip_when_concurrent=True)) as server:
        assert flips(server.url, tmp_path / "run").exit_code == 0
    done = runner.invoke(app, ["calibrate", str(tmp_path / "run"), "--out", str(tmp_path / "cal"), "--json"])
    assert done.exit_code == 0, done.output
    document = json.loads(done.stdout)
    assert document["unit"] == "logit" and document["flips"] == 4 and document["tau"] is not None
    refused = runner.invoke(app, ["calibrate", str(tmp_path / "run"), "--unit", "ulp", "--out", str(tmp_path / "u")])
    assert refused.exit_code == 2 and "ulp" in refused.stderr and "endpoint" in refused.stderr
    assert not (tmp_path / "u").exists()


def one_line_exit_2(result, message, out):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert message in lines[-1] and "Traceback" not in result.output, result.stderr
    assert len([line for line in lines if line.startswith("error:")]) == 1
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.partial*")), "half-written run"


@pytest.mark.parametrize(
    "state,message",
    [
        (StubState(mode="not-openai"), "not an OpenAI model list"),
        (StubState(mode="no-logprobs"), "no top logprobs"),
        (StubState(mode="text-keys"), "by token text"),
        (StubState(models=("a", "b")), "choose one with --served-model"),
        (StubState(mode="http-500"), "HTTP 500: TypeError: 'function' object is not subscriptable"),
    ],
)
def test_server_faults_exit_2_in_one_line(tmp_path, state, message):
    with StubServer(state) as server:
        one_line_exit_2(flips(server.url, tmp_path / "run"), message, tmp_path / "run")


def test_unknown_served_model_and_nothing_listening(tmp_path):
    from mgbench.engines.endpoint.local_server import free_port

    with StubServer() as server:
        one_line_exit_2(
            flips(server.url, tmp_path / "run", "--served-model", "nope"), "does not serve 'nope'", tmp_path / "run"
        )
    one_line_exit_2(
        flips(f"http://127.0.0.1:{free_port()}/v1", tmp_path / "run"), "nothing is listening", tmp_path / "run"
    )


def test_timeout_exits_2(tmp_path):
    with StubServer(StubState(mode="slow", fail_after=1)) as server:
        one_line_exit_2(
            flips(server.url, tmp_path / "run", "--request-timeout", "0.5"),
            "within --request-timeout 0.5 s",
            tmp_path / "run",
        )


@pytest.mark.parametrize(
    "option",
    [
        ["--dtype", "fp32"],
        ["--prefill", "batched"],
        ["--batch-invariant"],
        ["--attn", "eager"],
        ["--device", "cpu"],
        ["--shard", "0/2"],
    ],
)
def test_in_process_options_are_refused_with_the_reason(tmp_path, option):
    result = runner.invoke(app, [*AUDIT, "--endpoint", "http://127.0.0.1:9/v1", *option, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "cannot apply to --endpoint" in result.stderr, result.output


def test_endpoint_only_options_need_an_endpoint(tmp_path):
    result = runner.invoke(app, [*AUDIT, "--served-model", "x", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "only apply with --endpoint" in result.stderr
    result = runner.invoke(app, [*AUDIT, "--endpoint", "localhost:8000", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "base URL" in result.stderr


def test_dropped_connection_then_resume_equals_an_uninterrupted_run(tmp_path):
    with StubServer(StubState(flip_when_concurrent=True)) as server:
        assert flips(server.url, tmp_path / "whole").exit_code == 0
    # Group 0 takes 1 (the start check) + 2 solo + 2 batched + 2 solo again completions.
    with StubServer(StubState(mode="drop", fail_after=8, flip_when_concurrent=True)) as server:
        first = flips(server.url, tmp_path / "run")
        url = server.url
    assert first.exit_code == 2 and "dropped the connection" in first.stderr and "--resume" in first.stderr
    assert not (tmp_path / "run").exists() and (tmp_path / ".run.partial").is_dir()  # group 0 kept
    with StubServer(StubState(flip_when_concurrent=True)) as server:  # a new port is another server
        moved = flips(server.url, tmp_path / "run", "--resume")
    assert moved.exit_code == 2 and "other options" in moved.stderr
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with StubServer(StubState(flip_when_concurrent=True), port=port):  # the same server, restarted
        resumed = flips(url, tmp_path / "run", "--resume")
    assert resumed.exit_code == 0, resumed.output
    for table in ("steps", "sequences"):
        pd.testing.assert_frame_equal(
            pd.read_parquet(tmp_path / "run" / f"{table}.parquet"),
            pd.read_parquet(tmp_path / "whole" / f"{table}.parquet"),
        )


def test_baseline_gate_on_an_endpoint_run(tmp_path):
    with StubServer(StubState(flip_when_concurrent=True)) as server:
        assert flips(server.url, tmp_path / "base").exit_code == 0
        same = flips(server.url, tmp_path / "again", "--baseline", str(tmp_path / "base"))
        assert same.exit_code == 0, same.output
        assert json.loads(same.stdout)["gate"]["baseline"]["tests"]["flip_rate"]["p_value"] == 1.0
        strict = flips(server.url, tmp_path / "strict", "--require-determinism", "1.0")
        assert strict.exit_code == 1 and "determinism" in strict.stderr


def test_report_puts_engines_side_by_side(tmp_path):
    with StubServer(StubState(flip_when_concurrent=True)) as server:
        assert flips(server.url, tmp_path / "a", "--label", "stub varying").exit_code == 0
    with StubServer() as server:
        assert flips(server.url, tmp_path / "b", "--label", "stub steady").exit_code == 0
    done = runner.invoke(app, ["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "r")])
    assert done.exit_code == 0, done.output
    text = (tmp_path / "r" / "report.md").read_text()
    side = text.split("## Engines side by side")[1].split("## ")[0]
    rows = [line for line in side.splitlines() if line.startswith("| stub")]
    assert [row.split(" | ")[0] for row in rows] == ["| stub varying", "| stub steady"]
    assert "| 4 | 33.33% |" in rows[0] and "| 0 | 0.00% |" in rows[1]  # flips, flip rate of each engine
    assert all("first-divergence" in row for row in rows)


def test_a_200_that_is_not_json_exits_2_in_one_line(tmp_path):
    with StubServer(StubState(mode="not-json")) as server:
        one_line_exit_2(flips(server.url, tmp_path / "run"), "without an OpenAI completion", tmp_path / "run")


def test_http_500_after_a_committed_group_keeps_it_for_resume(tmp_path):
    # Group 0 takes 1 (the start check) + 2 solo + 2 batched + 2 solo again completions.
    with StubServer(StubState(mode="http-500", fail_after=8)) as server:
        result = flips(server.url, tmp_path / "run")
    assert result.exit_code == 2 and "HTTP 500" in result.stderr and "--resume" in result.stderr, result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()
    parts = tmp_path / ".run.partial" / "parts"
    assert sorted(p.name for p in parts.glob("group-*.json")) == ["group-00000.json"]  # group 0, nothing after


def test_short_completions_are_audited_as_long_as_they_are(tmp_path):
    with StubServer(StubState(short_at=3, flip_when_concurrent=True)) as server:
        result = flips(server.url, tmp_path / "run")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    sequences = pd.read_parquet(tmp_path / "run" / "sequences.parquet")
    steps = pd.read_parquet(tmp_path / "run" / "steps.parquet")
    assert sequences["solo_ids"].map(len).tolist() == [3] * 4 and sequences["batched_ids"].map(len).tolist() == [3] * 4
    assert steps.groupby("request_id")["step"].max().tolist() == [2] * 4  # the planted flip at step 2, the last
    assert summary["flips"] == 4 and summary["steps"] == 12 == len(steps)


def test_a_server_not_deterministic_alone_is_reported_and_its_requests_not_counted(tmp_path):
    """Negative control beside it: the same requests from a server that repeats alone are counted."""
    with StubServer(StubState(mode="unstable")) as server:
        result = flips(server.url, tmp_path / "unstable")
    assert result.exit_code == 0, result.output
    repeat = json.loads(result.stdout)["solo_repeat"]
    assert repeat["deterministic"] is False and repeat["requests_differing"] == 4
    assert [d["first_divergence"] for d in repeat["differing"]] == [1] * 4  # where the stub changes its answers
    assert len(pd.read_parquet(tmp_path / "unstable" / "steps.parquet")) == 0  # no unstable reference counted
    with StubServer() as server:
        steady = json.loads(flips(server.url, tmp_path / "steady").stdout)
    assert steady["solo_repeat"]["deterministic"] is True and steady["steps"] == 4 * 6


def test_a_server_that_loses_its_picked_port_moves_to_another(tmp_path):
    """A port taken between the pick and the server's bind: the server is started again on a new
    port, and the one answering is the one started (the squatter never answers HTTP)."""
    import socket
    import sys

    from mgbench.engines.endpoint.local_server import LocalServer, free_port

    script = tmp_path / "serve.py"
    script.write_text(
        f"#!{sys.executable}\n"
        "import http.server, json, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        body = json.dumps({'data': [{'id': 'moved'}]}).encode()\n"
        "        self.send_response(200); self.send_header('Content-Length', str(len(body))); self.end_headers()\n"
        "        self.wfile.write(body)\n"
        "try:\n"
        "    server = http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H)\n"
        "except OSError as exc:\n"
        "    sys.exit(f'error: {exc}')\n"
        "server.serve_forever()\n"
    )
    script.chmod(0o755)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", free_port()))
        squatter.listen()
        taken = squatter.getsockname()[1]
        server = LocalServer([str(script), str(taken)], taken, tmp_path / "log.txt", picked=True).start()
        try:
            server.wait_ready(timeout=60)
            assert server.port != taken and server.alive()
            assert served_id(server.url) == "moved"
        finally:
            server.stop()


def served_id(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/models", timeout=10) as response:
        return json.load(response)["data"][0]["id"]


def rows_by_axis(summary) -> dict:
    return {row["axis"]: row for row in summary["by_batch_size"]}


@pytest.mark.parametrize("llamacpp", [True, False], ids=["llama.cpp", "vLLM"])
def test_prefix_cache_axis_catches_a_planted_warm_near_tie_at_its_margin_and_passes_without_it(llamacpp, tmp_path):
    """Must fail: a stub whose cached prompt moves the token at step 3 at a planted margin of
    0.0625 (llama.cpp-shaped: a cache_prompt request after the pair's first sending computed it
    afresh; vLLM-shaped: a request after one with its cache_salt): every request diverges there on
    the prefix-cache axis, the flip's margin is the planted one, and the batch axis stays clean.
    Must pass: the same stub without the plant."""
    with StubServer(StubState(llamacpp=llamacpp, warm_flip=(3, 0.0625))) as server:
        result = flips(server.url, tmp_path / "warm", "--axes", "batch,prefix-cache")
        bodies = [b for b in server.state.bodies if int(b["max_tokens"]) > 2]
    assert result.exit_code == 0, result.output
    rows = rows_by_axis(json.loads(result.stdout))
    assert rows["prefix-cache"]["sequences_diverged"] == 4 and rows["prefix-cache"]["flips"] == 4
    assert rows["prefix-cache"]["flip_margin_logit_median"] == rows["prefix-cache"]["flip_margin_logit_max"] == 0.0625
    assert rows["batch"]["sequences_diverged"] == 0
    sequences = pd.read_parquet(tmp_path / "warm" / "sequences.parquet")
    warm = sequences[sequences["axis"] == "prefix-cache"]
    assert (warm["first_divergence"] == 3).all() and (warm["batch_size"] == 1).all()
    if llamacpp:  # one cache_prompt request per request (the warm one); every other, the pair's first included, false
        assert sum(bool(b.get("cache_prompt")) for b in bodies) == 4
        assert sum(b.get("cache_prompt") is False for b in bodies) == len(bodies) - 4
        assert all("cache_salt" not in b for b in bodies)
    else:  # every request a salt of its own, but each warm pair one it shares
        salts = Counter(b["cache_salt"] for b in bodies)
        assert sorted(Counter(salts.values()).items()) == [(1, len(bodies) - 8), (2, 4)]
        assert all("cache_prompt" not in b for b in bodies)

    with StubServer(StubState(llamacpp=llamacpp)) as server:
        clean = flips(server.url, tmp_path / "cold", "--axes", "batch,prefix-cache", "--require-determinism", "1")
    assert clean.exit_code == 0, clean.output
    assert all(r["determinism"] == 1.0 for r in rows_by_axis(json.loads(clean.stdout)).values())


def test_the_batch_axis_stays_cold_on_a_server_whose_prefix_cache_is_on(tmp_path):
    """Must pass: a vLLM-shaped stub with its prefix cache on and a planted warm flip, audited on
    the batch axis alone: every request carries a cache_salt of its own, so none is answered warm.
    Must fail: the same stub refusing cache_salt (HTTP 400 naming it): mgbench goes on unsalted
    and says so, and the repeated sendings come back warm: solo twice differs for every request."""
    with StubServer(StubState(warm_flip=(3, 0.0625))) as server:
        cold = flips(server.url, tmp_path / "cold", "--require-determinism", "1")
        salts = [b.get("cache_salt") for b in server.state.bodies]
    assert cold.exit_code == 0, cold.output
    summary = json.loads(cold.stdout)
    assert summary["solo_repeat"] == {**summary["solo_repeat"], "deterministic": True}
    assert rows_by_axis(summary)["batch"]["determinism"] == 1.0
    assert None not in salts and len(set(salts)) == len(salts)
    manifest = json.loads((tmp_path / "cold" / "manifest.json").read_text())
    assert manifest["endpoint"]["cold_requests"] == "cache_salt of its own"

    with StubServer(StubState(mode="strict", warm_flip=(3, 0.0625))) as server:
        warm = flips(server.url, tmp_path / "warm")
    assert warm.exit_code == 0, warm.output
    summary = json.loads(warm.stdout)
    assert summary["solo_repeat"]["deterministic"] is False
    manifest = json.loads((tmp_path / "warm" / "manifest.json").read_text())
    assert manifest["endpoint"]["cold_requests"] == "as the server caches (cache_salt refused)"
    assert any(note.startswith("cache_salt refused") for note in manifest["endpoint"]["notes"])


def test_a_server_refusing_token_ids_and_cache_salt_is_audited_with_text_unsalted(tmp_path):
    """The two refusals of the first completion, token ids first (a 400 naming the prompt), then
    cache_salt (a 422 whose detail names it): both are met, each said in the manifest."""
    with StubServer(StubState(mode="strict-text")) as server:
        result = flips(server.url, tmp_path / "run")
        bodies = list(server.state.bodies)
    assert result.exit_code == 0, result.output
    endpoint = json.loads((tmp_path / "run" / "manifest.json").read_text())["endpoint"]
    assert endpoint["prompt_format"] == "text" and endpoint["cold_requests"].endswith("(cache_salt refused)")
    assert [note.split(" (")[0] for note in endpoint["notes"]] == ["token-id prompts refused", "cache_salt refused"]
    assert bodies and all(isinstance(b["prompt"], str) and "cache_salt" not in b for b in bodies)


def test_repeat_axis_catches_a_load_answered_otherwise_the_second_time_and_passes_without_it(tmp_path):
    """Must fail: a stub whose answer to a prompt's third full-length sending (the load's second
    run, after solo and the first run) flips at step 2: every request differs run to run, and the
    solo reference stays stable. Must pass: the same stub without the plant."""
    with StubServer(StubState(flip_on_sending=3)) as server:
        result = flips(server.url, tmp_path / "twice", "--axes", "repeat", "--require-determinism", "1")
    assert result.exit_code == 1, result.output
    summary = json.loads(result.stdout)
    rows = rows_by_axis(summary)
    assert set(rows) == {"repeat"} and rows["repeat"]["sequences_diverged"] == 4 and rows["repeat"]["flips"] == 4
    assert summary["solo_repeat"]["deterministic"] is True and "repeat" in result.stderr
    with StubServer() as server:
        clean = flips(server.url, tmp_path / "same", "--axes", "repeat", "--require-determinism", "1")
    assert clean.exit_code == 0 and rows_by_axis(json.loads(clean.stdout))["repeat"]["determinism"] == 1.0


def test_axes_an_engine_cannot_vary_are_refused_in_one_line(tmp_path):
    chunked = flips("http://127.0.0.1:9/v1", tmp_path / "c", "--axes", "chunked-prefill")
    assert chunked.exit_code == 2 and "--axes chunked-prefill runs in process" in chunked.stderr
    repeat = runner.invoke(app, ["flips", "--axes", "repeat", "--out", str(tmp_path / "r")])
    assert repeat.exit_code == 2 and "--axes repeat runs over --endpoint" in repeat.stderr

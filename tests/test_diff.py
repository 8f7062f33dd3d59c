"""`mgbench diff`: recorded runs compared output by output (no model, no torch).

Stub runs are written with mgbench's own table functions, with differences PLANTED at known steps
and margins; diff must find exactly those. Controls by construction: a run against itself, and
against a copy in another request order, is 100% identical. Real runs (slow): two in-process runs of
a tiny random-init model under two kernel families, and two llama.cpp servers with different slot
counts, diffed and checked against a direct pandas comparison of their sequences tables (whether
they differ is measured, never predicted).
"""

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from stub_openai import StubServer, StubState
from typer.testing import CliRunner

from mgbench import SCHEMA_VERSION
from mgbench.analysis.divergence import Decoded, step_margins
from mgbench.analysis.runs_diff import prompt_key
from mgbench.cli import app
from mgbench.runs import rundir, schema

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
V1_RUN = Path(__file__).parent / "fixtures" / "v1-flips-run"
TOKENS = 8


def prompt(i: int) -> list[int]:
    return [100 + i, 7, 8, 9][: 2 + i % 3] + [i]


def solo(i: int) -> list[int]:
    return [1000 + 10 * i + t for t in range(TOKENS)]


def margins(i: int) -> list[float]:
    return [0.5 + i + 0.125 * t for t in range(TOKENS)]


def request(i, solo_ids=None, solo_margins="default", request_id=None):
    """(request id, prompt ids, solo ids, solo margins) of request i of the stub dataset."""
    return (
        i if request_id is None else request_id,
        prompt(i),
        solo(i) if solo_ids is None else solo_ids,
        margins(i) if solo_margins == "default" else solo_margins,
    )


def write_run(
    path: Path,
    requests: list[tuple],
    model: str = "smollm2-135m",
    batch_sizes=(2, 4),
    manifest: dict | None = None,
    batched=None,
    steps: list[dict] | None = None,
) -> Path:
    """A flips run directory as the pipeline writes one: one sequences row per (request, batch
    size); `batched`: {(request id, batch size): batched ids} where they differ from solo."""
    rows = []
    for batch_index, size in enumerate(batch_sizes):
        for row, (request_id, prompt_ids, solo_ids, solo_margins) in enumerate(requests):
            batched_ids = (batched or {}).get((request_id, size), solo_ids)
            rows.append(
                {
                    "request_id": request_id,
                    "dataset": "math500",
                    "batch_id": batch_index,
                    "row": row,
                    "batch_size": size,
                    "pad_len": 0,
                    "prompt_len": len(prompt_ids),
                    "prompt_ids": prompt_ids,
                    "solo_ids": solo_ids,
                    "solo_margins": solo_margins,
                    "batched_ids": batched_ids,
                    "first_divergence": None,
                    "identical": True,
                    "triggers": 0,
                    "repairs": 0,
                }
            )
    document = {
        "schema_version": SCHEMA_VERSION,
        "command": "flips",
        "options": {"model": model, "dataset": "math500", "max_new_tokens": TOKENS, "batch_sizes": list(batch_sizes)},
        "torch": "2.13.0+cpu",
        "device_name": "AMD EPYC (AVX512)",
        "kernel_environment": {"ATEN_CPU_CAPABILITY": None, "ONEDNN_MAX_CPU_ISA": None},
        "engine": {"kind": "in-process", "label": "in-process (sdpa)", "method": "teacher-forced"},
        "git_revision": "abc",
        **(manifest or {}),
    }
    return rundir.publish_run(
        path,
        {
            "steps": schema.steps_table(steps or [], model, "math500"),
            "sequences": schema.sequences_table(rows, model),
        },
        {"summary": {"max_new_tokens": TOKENS}, "manifest": document},
    )


# Run B: request 1 diverges at step 3 (an exact tie on B's side), request 4 at step 0 (a wide
# margin on both sides); request 5 is not in B, request 6 only in B; B's requests come in another
# order, under other request ids (another sample of the dataset), on another kernel family.
PLANTED = {1: (3, 0.0), 4: (0, 2.5)}  # request -> (step, B's margin there)


def planted_b() -> list[tuple]:
    requests = []
    for i in (6, 4, 3, 2, 1, 0):
        ids, m = solo(i), margins(i)
        if i in PLANTED:
            step, margin = PLANTED[i]
            ids = ids[:step] + [ids[step] + 1] + [5, 5, 5, 5, 5, 5, 5, 5][: TOKENS - step - 1]
            m = m[:step] + [margin] + m[step + 1 :]
        requests.append(request(i, ids, m, request_id=50 + i))
    return requests


@pytest.fixture
def runs(tmp_path):
    a = write_run(tmp_path / "a", [request(i) for i in range(6)])
    b = write_run(
        tmp_path / "b",
        planted_b(),
        batch_sizes=(4,),
        manifest={"kernel_environment": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}},
    )
    c = write_run(tmp_path / "c", [request(i) for i in (5, 3, 1, 0, 2, 4)], batch_sizes=(8,))  # a's outputs
    return a, b, c


def diff_json(*args) -> tuple[int, dict]:
    result = runner.invoke(app, ["diff", *map(str, args), "--json"])
    return result.exit_code, json.loads(result.stdout) if result.stdout.strip() else result.output


def test_planted_differences_are_found_exactly(runs):
    a, b, _ = runs
    code, summary = diff_json(a, b)
    assert code == 0, summary
    [pair] = summary["pairs"]
    assert pair["paired_by"] == "prompt ids" and pair["paired"] == 5 and pair["identical"] == 3
    assert pair["only_in_a"] == 1 and pair["only_in_b"] == 1 and pair["identical_share"] == 0.6
    found = {d["request_id_a"]: d for d in pair["divergences"]}
    assert sorted(found) == sorted(PLANTED)
    for i, (step, margin_b) in PLANTED.items():
        d = found[i]
        assert d["request"] == prompt_key(prompt(i)) and d["request_id_b"] == 50 + i
        assert d["step"] == step and d["token_a"] == solo(i)[step] and d["token_b"] == solo(i)[step] + 1
        assert d["margin_a"] == pytest.approx(margins(i)[step]) and d["margin_b"] == margin_b
    assert pair["margins_at_divergence"] == {
        "divergences": 2,
        "known": 2,
        "ties": 1,
        "wider_margin_median": pytest.approx((margins(1)[3] + 4.5) / 2),
        "wider_margin_max": 4.5,
    }
    keys = {d["key"]: d["values"] for d in summary["manifest_differences"]}
    assert keys["kernel_environment.ATEN_CPU_CAPABILITY"] == [None, "avx2"]
    assert keys["options.batch_sizes"] == [[2, 4], [4]]
    assert "git_revision" not in keys and "device_name" not in keys  # equal: not shown
    assert summary["matrix"]["identical_share"] == [[None, 0.6], [0.6, None]]


def test_controls_a_run_against_itself_and_a_reordered_copy_are_identical(runs):
    a, _, c = runs
    for other in (a, c):
        code, summary = diff_json(a, other)
        assert code == 0
        [pair] = summary["pairs"]
        assert pair["identical_share"] == 1.0 and pair["divergences"] == [] and pair["paired"] == 6
    assert [r["name"] for r in summary["runs"]] == ["a", "c"]
    code, itself = diff_json(a, a)
    assert [r["name"] for r in itself["runs"]] == ["a", "a#2"]
    assert diff_json(V1_RUN, V1_RUN)[1]["pairs"][0]["identical_share"] == 1.0  # a schema-1 run too


def test_unknown_margins_are_shown_as_unknown_never_guessed(tmp_path):
    a = write_run(tmp_path / "a", [request(0, solo_margins=None), request(1, solo_margins=None)])
    moved = solo(1)[:2] + [7, 7, 7, 7, 7, 7]
    b = write_run(tmp_path / "b", [request(0, solo_margins=None), request(1, moved, solo_margins=None)])
    code, summary = diff_json(a, b)
    [d] = summary["pairs"][0]["divergences"]
    assert (d["step"], d["margin_a"], d["margin_b"]) == (2, None, None)
    assert summary["pairs"][0]["margins_at_divergence"]["known"] == 0
    table = runner.invoke(app, ["diff", str(a), str(b)])
    row = next(line for line in table.stdout.splitlines() if prompt_key(prompt(1)) in line)
    assert [cell.strip() for cell in row.split("│")][-2:] == ["-", "-"], row


def test_older_runs_margins_come_from_their_steps_table(tmp_path):
    """A flips run recorded before solo_margins: the solo margin its steps table measured is used."""

    def steps_of(i):
        n = TOKENS
        return {
            "request_id": np.full(n, i),
            "batch_id": np.zeros(n, np.int32),
            "row": np.zeros(n, np.int32),
            "batch_size": np.full(n, 2, np.int32),
            "pad_len": np.zeros(n, np.int32),
            "method": np.full(n, "teacher-forced"),
            "step": np.arange(n, dtype=np.int32),
            "solo_token": np.array(solo(i)),
            "batched_token": np.array(solo(i)),
            "flipped": np.zeros(n, bool),
            "margin": np.ones(n, np.float32),
            "margin_ulp": None,
            "solo_margin": np.array(margins(i), np.float32),
            "max_abs_logit_diff": None,
            "logprob_drift": None,
            "kv_delta_mean": None,
            "kv_delta_max": None,
        }

    a = write_run(tmp_path / "a", [request(1, solo_margins=None)], batch_sizes=(2,), steps=[steps_of(1)])
    b = write_run(tmp_path / "b", [request(1, solo(1)[:5] + [9, 9, 9])], batch_sizes=(2,))
    [d] = diff_json(a, b)[1]["pairs"][0]["divergences"]
    assert d["step"] == 5 and d["margin_a"] == pytest.approx(margins(1)[5]) and d["margin_b"] == margins(1)[5]


def test_batched_outputs_pair_per_request_and_batch_size(tmp_path):
    a = write_run(tmp_path / "a", [request(i) for i in range(3)], batched={(2, 4): solo(2)[:6] + [0, 0]})
    b = write_run(tmp_path / "b", [request(i) for i in range(3)])
    code, solo_summary = diff_json(a, b)
    assert solo_summary["pairs"][0]["identical_share"] == 1.0  # solo outputs agree
    code, summary = diff_json(a, b, "--batched")
    [pair] = summary["pairs"]
    assert summary["mode"] == "batched" and pair["paired"] == 6 and pair["identical"] == 5
    [d] = pair["divergences"]
    assert (d["request_id_a"], d["batch_size"], d["variant"], d["step"]) == (2, 4, "none", 6)
    assert d["margin_a"] is None and d["margin_b"] is None  # batched margins are not in the sequences table


def test_a_sharded_run_and_a_verify_run_pair_with_a_whole_flips_run(runs, tmp_path):
    """A run recorded in two shards reads as one; a verify run (no prompt ids kept) pairs by
    dataset and request id, its solo outputs as any flips run's."""
    a = runs[0]
    whole = pd.read_parquet(a / "sequences.parquet")
    sharded = tmp_path / "sharded"
    for index, part in enumerate((whole.iloc[::2], whole.iloc[1::2])):
        (sharded / "sequences").mkdir(parents=True, exist_ok=True)
        (sharded / "shards").mkdir(exist_ok=True)
        table = pa.Table.from_pandas(part, schema=schema.SEQUENCES_SCHEMA, preserve_index=False)
        pq.write_table(table, sharded / "sequences" / f"part-{index}-of-2.parquet")
        (sharded / "shards" / f"{index}-of-2.json").write_text(json.dumps({"fingerprint": {"shards": 2}}))
    shutil.copy(a / "manifest.json", sharded / "manifest.json")
    [pair] = diff_json(a, sharded)[1]["pairs"]
    assert pair["paired"] == 6 and pair["identical"] == 6

    rows = [
        {
            "model": "smollm2-135m",
            "dataset": "math500",
            "request_id": i,
            "batch_id": 0,
            "row": i,
            "batch_size": 4,
            "pad_len": 0,
            "policy": policy,
            "repair": "none" if policy == "none" else "column",
            "prompt_len": len(prompt(i)),
            "solo_ids": solo(i) if i != 2 else solo(2)[:5] + [3, 3, 3],
            "batched_ids": solo(i),
            "first_divergence": None,
            "identical": True,
            "steps": TOKENS,
            "triggers": 0,
            "repairs": 0,
        }
        for policy in ("none", "margin:0.5")
        for i in range(4)
    ]
    verify = rundir.publish_run(
        tmp_path / "verify",
        {"sequences": pa.Table.from_pylist(rows, schema=schema.VERIFY_SEQUENCES_SCHEMA)},
        {"manifest": {"command": "verify", "options": {"model": "smollm2-135m", "max_new_tokens": TOKENS}}},
    )
    [pair] = diff_json(a, verify)[1]["pairs"]
    assert pair["paired_by"] == "dataset and request id" and pair["paired"] == 4 and pair["identical"] == 3
    [d] = pair["divergences"]
    assert (d["request"], d["step"], d["margin_a"], d["margin_b"]) == ("math500#2", 5, margins(2)[5], None)


def test_runs_of_other_lengths_are_compared_on_their_common_tokens(tmp_path):
    a = write_run(tmp_path / "a", [request(0), request(1)])
    short = write_run(
        tmp_path / "short",
        [request(0, solo(0)[:6]), request(1, solo(1)[:4] + [0, 0])],
        manifest={"options": {"model": "smollm2-135m", "max_new_tokens": 6}},
    )
    [pair] = diff_json(a, short)[1]["pairs"]
    assert pair["compared_tokens"] == 6 and pair["identical"] == 1
    assert [d["step"] for d in pair["divergences"]] == [4]


def test_different_models_and_disjoint_requests_are_refused_in_one_line(tmp_path, runs):
    a = runs[0]
    other = write_run(tmp_path / "gemma", [request(0)], model="gemma3-270m")
    disjoint = write_run(tmp_path / "disjoint", [request(i) for i in range(10, 12)])
    for args, message in (
        ([a, other], "different models or tokenizers"),
        ([a, disjoint], "share no request"),
        ([a], "two run directories or more"),
        ([a, tmp_path / "missing"], "does not exist"),
        ([a, a, "--require-identical", "2"], "between 0 and 1"),
    ):
        result = runner.invoke(app, ["diff", *map(str, args)])
        assert result.exit_code == 2, result.output
        assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr


def test_require_identical_exit_codes_and_junit(runs, tmp_path):
    a, b, c = runs
    xml = tmp_path / "diff.xml"
    failed = runner.invoke(app, ["diff", str(a), str(b), str(c), "--require-identical", "0.9", "--junit", str(xml)])
    assert failed.exit_code == 1, failed.output
    suite = ET.parse(xml).getroot()
    cases = suite.findall("testcase")
    assert len(cases) == 3 and suite.get("tests") == "3" and suite.get("failures") == "2"
    failing = {case.get("name"): case.find("failure") for case in cases}
    assert failing["a vs c"] is None
    assert failing["a vs b"].get("message") == "identical 60.00% < required 90.00%"
    assert f"request {prompt_key(prompt(1))} (id 1) at token 3" in failing["a vs b"].text
    assert "FAIL" in failed.stderr and "a vs b" in failed.stderr
    passed = runner.invoke(app, ["diff", str(a), str(b), "--require-identical", "0.6", "--junit", str(xml)])
    assert passed.exit_code == 0 and ET.parse(xml).getroot().find("testcase/failure") is None
    assert runner.invoke(app, ["diff", str(a), str(c), "--require-identical", "1.0"]).exit_code == 0


def test_out_writes_a_run_that_json_pandas_and_report_read(runs, tmp_path, monkeypatch):
    a, b, c = runs
    out = tmp_path / "d"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(tmp_path / "step-summary.md"))
    result = runner.invoke(app, ["diff", str(a), str(b), str(c), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert "| a |  | 3/5 (60.00%) | 6/6 (100.00%) |" in (tmp_path / "step-summary.md").read_text()
    assert json.loads(result.stdout) == json.loads((out / "summary.json").read_text())  # stdout: the summary only
    assert sorted(p.name for p in out.iterdir()) == [
        "diff.parquet",
        "divergence_margins.png",
        "manifest.json",
        "summary.json",
    ]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["command"] == "diff" and [Path(i["path"]).name for i in manifest["inputs"]] == ["a", "b", "c"]
    table = pd.read_parquet(out / "diff.parquet")  # no glue: plain columns
    assert len(table) == 5 + 6 + 5 and table.groupby(["run_a", "run_b"])["identical"].sum().to_dict() == {
        ("a", "b"): 3,
        ("a", "c"): 6,
        ("b", "c"): 3,
    }
    planted = table[(table["run_b"] == "b") & ~table["identical"]].set_index("request_id_a")
    assert planted.loc[1, "first_divergence"] == 3 and planted.loc[1, "margin_b"] == 0.0
    assert planted.loc[4, "token_b"] == solo(4)[0] + 1
    assert table["batch_size"].isna().all()  # solo outputs
    assert runner.invoke(app, ["diff", str(a), str(b), "--out", str(out)]).exit_code == 2  # not empty: refused

    report = runner.invoke(app, ["report", str(out), "--out", str(tmp_path / "r")])
    assert report.exit_code == 0, report.output
    text = (tmp_path / "r" / "report.md").read_text()
    assert "## diff: d" in text and "| a |  | 3/5 (60.00%) | 6/6 (100.00%) |" in text
    assert "| c | 6/6 (100.00%) | 3/5 (60.00%) |  |" in text
    assert "![divergence_margins.png](0-divergence_margins.png)" in text
    assert (tmp_path / "r" / "0-divergence_margins.png").stat().st_size > 0
    assert "`kernel_environment.ATEN_CPU_CAPABILITY`" in text


def test_manifest_differences_keep_what_names_the_build_and_skip_run_noise():
    from mgbench.analysis.manifests import manifest_differences

    props = {"total_slots": 8, "build_info": "b1", "chat_template": "{% x %}", "default_generation_settings": {}}
    base = {"created_utc": "t0", "argv": ["a"], "endpoint": {"url": "u0", "props": props}, "torch": "2.13"}
    other = {
        "created_utc": "t1",
        "argv": ["b"],
        "endpoint": {"url": "u1", "props": {**props, "total_slots": 1, "chat_template": "{% y %}"}},
        "torch": "2.13",
        "kernel_environment": {"ATEN_CPU_CAPABILITY": "avx2"},
    }
    keys = [d["key"] for d in manifest_differences([base, other])]
    assert keys == ["kernel_environment.ATEN_CPU_CAPABILITY", "endpoint.props.total_slots", "endpoint.url"]


def test_diff_never_imports_torch(runs):
    a, b, _ = runs
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mgbench", "diff", str(a), str(b), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")]
    assert "mgbench.analysis.runs_diff" in imported and "pandas" in imported
    heavy = [m for m in imported if m.split(".")[0] in ("torch", "transformers")]
    assert heavy == [], heavy[:5]
    assert json.loads(done.stdout)["pairs"][0]["identical"] == 3


def test_step_margins_leave_short_top_k_unknown():
    decoded = Decoded([5, 6, 7], [{5: -0.1, 4: -0.6}, {6: -0.2}, {}])
    assert step_margins(decoded) == [0.5, None, None]
    assert step_margins(Decoded([1, 2], [{1: -1.0, 2: -1.0}])) == [0.0, None]


def endpoint_flips(url: str, out: Path, *extra) -> dict:
    audit = ["flips", "--dataset", "gsm8k", "--limit", "3", "--batch-size", "3", "--max-new-tokens", "6"]
    result = runner.invoke(app, [*audit, "--endpoint", url, "--out", str(out), "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_endpoint_fleet_records_one_run_per_replica_and_diff_finds_the_planted_one(tmp_path):
    """Two stub replicas, the second with a PLANTED change at step 4 of every answer: the fleet
    audit writes OUT/replica-0 and OUT/replica-1 (complete runs, solo margins recorded), and diff
    finds every request diverging at step 4 with the stub's margin (0.25) on both sides."""
    with StubServer() as same, StubServer(StubState(shift_at=4)) as moved:
        urls = f"{same.url},{moved.url}"
        fleet = endpoint_flips(urls, tmp_path / "fleet", "--junit", str(tmp_path / "flips.xml"))
    assert [r["replica"] for r in fleet["replicas"]] == [0, 1]
    assert sorted(p.name for p in tmp_path.glob("flips*.xml")) == ["flips-replica-0.xml", "flips-replica-1.xml"]
    again = endpoint_flips(urls, tmp_path / "fleet", "--resume")  # servers gone: complete replicas are skipped
    assert [r["summary"] for r in again["replicas"]] == [r["summary"] for r in fleet["replicas"]]
    zero, one = (Path(r["run"]) for r in fleet["replicas"])
    assert (zero, one) == (tmp_path / "fleet" / "replica-0", tmp_path / "fleet" / "replica-1")
    sequences = pd.read_parquet(zero / "sequences.parquet")
    assert sequences["solo_margins"].map(list).tolist() == [[0.25] * 6] * 3
    manifests = [json.loads((run / "manifest.json").read_text()) for run in (zero, one)]
    assert [m["endpoint"]["replica"] for m in manifests] == [0, 1]
    assert fleet["replicas"][1]["summary"]["engine"].endswith(", replica 1")

    code, summary = diff_json(zero, one)
    [pair] = summary["pairs"]
    assert pair["paired"] == 3 and pair["identical"] == 0
    assert {(d["step"], d["margin_a"], d["margin_b"]) for d in pair["divergences"]} == {(4, 0.25, 0.25)}
    assert all(d["token_b"] == d["token_a"] + 1 for d in pair["divergences"])
    keys = {d["key"] for d in summary["manifest_differences"]}
    assert {"endpoint.url", "endpoint.replica", "engine.label"} <= keys

    with StubServer() as server:  # negative control: a single URL, the same server, twice
        first = endpoint_flips(server.url, tmp_path / "one")
        endpoint_flips(server.url, tmp_path / "two")
    assert (
        "replicas" not in first
        and "replica" not in json.loads((tmp_path / "one" / "manifest.json").read_text())["endpoint"]
    )
    assert diff_json(tmp_path / "one", tmp_path / "two")[1]["pairs"][0]["identical_share"] == 1.0


def test_a_fleet_url_list_with_a_gap_or_a_repeat_is_refused_in_one_line(tmp_path):
    url = "http://127.0.0.1:9/v1"
    for endpoint, message in ((f"{url},", "an empty URL"), (f"{url},{url}", "listed twice")):
        result = runner.invoke(app, ["flips", "--endpoint", endpoint, "--out", str(tmp_path / "f")])
        assert result.exit_code == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "f").exists()


def direct_comparison(run_a: Path, run_b: Path, batched: bool = False) -> tuple[int, int, dict]:
    """(paired, identical, {key: first differing index}) straight from the two sequences tables;
    key: the prompt ids (and, batched, the batch size)."""
    column = "batched_ids" if batched else "solo_ids"
    tables = []
    for run in (run_a, run_b):
        frame = pd.read_parquet(run / "sequences.parquet")
        frame["key"] = [
            (tuple(int(t) for t in ids), int(size) if batched else None)
            for ids, size in zip(frame["prompt_ids"], frame["batch_size"])
        ]
        tables.append(frame.drop_duplicates("key").set_index("key")[column].map(list))
    a, b = tables
    shared = a.index.intersection(b.index)
    divergences = {}
    for key in shared:
        x, y = a[key], b[key]
        if x != y:
            divergences[key] = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
    return len(shared), len(shared) - len(divergences), divergences


def assert_diff_agrees_with_pandas(run_a: Path, run_b: Path, label: str, batched: bool = False) -> dict:
    code, summary = diff_json(run_a, run_b, *(["--batched"] if batched else []))
    assert code == 0, summary
    [pair] = summary["pairs"]
    paired, identical, divergences = direct_comparison(run_a, run_b, batched)
    outputs = "batched" if batched else "solo"
    print(f"\n[this machine] {label}: {pair['identical']}/{pair['paired']} {outputs} outputs identical")
    assert (pair["paired"], pair["identical"]) == (paired, identical)
    found = {(d["request"], d["batch_size"]): d["step"] for d in pair["divergences"]}
    assert found == {(prompt_key(list(ids)), size): step for (ids, size), step in divergences.items()}
    return summary


@pytest.mark.slow
def test_two_kernel_families_in_process_diffed_as_pandas_compares(tiny_model_dir, tmp_path):
    """The tiny random-init model run natively and under ATEN_CPU_CAPABILITY=default with oneDNN
    capped at AVX2, each in its own process: diff's counts equal a direct comparison of the tables."""
    audit = [sys.executable, "-m", "mgbench", "flips", "--model", str(tiny_model_dir), "--dataset", "math500"]
    audit += ["--limit", "4", "--batch-size", "2", "--max-new-tokens", "12"]
    families = {"native": {}, "default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
    runs = {}
    for name, variables in families.items():
        env = {k: v for k, v in os.environ.items() if k not in variables} | variables
        runs[name] = tmp_path / name
        done = subprocess.run(
            [*audit, "--out", str(runs[name])], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT
        )
        assert done.returncode == 0, done.stderr[-3000:]
    summary = assert_diff_agrees_with_pandas(runs["native"], runs["default"], "tiny model, native vs default kernels")
    keys = {d["key"]: d["values"] for d in summary["manifest_differences"]}
    assert keys["kernel_environment.ATEN_CPU_CAPABILITY"] == [None, "default"]
    again = tmp_path / "native-copy"
    shutil.copytree(runs["native"], again)
    assert diff_json(runs["native"], again)[1]["pairs"][0]["identical_share"] == 1.0


@pytest.mark.server
def test_two_llamacpp_servers_diffed_as_pandas_compares(llamacpp_servers, tmp_path):
    """llama.cpp with one slot and with eight (the session's servers, conftest)."""
    servers = [llamacpp_servers["np1"], llamacpp_servers["np8"]]
    fleet = endpoint_flips(",".join(s.url for s in servers), tmp_path / "fleet")
    zero, one = (Path(r["run"]) for r in fleet["replicas"])
    summary = assert_diff_agrees_with_pandas(zero, one, "llama.cpp -np 1 vs -np 8")
    assert_diff_agrees_with_pandas(zero, one, "llama.cpp -np 1 vs -np 8", batched=True)
    for run in (zero, one):  # a server's solo margins, every step, from its top logprobs
        sequences = pd.read_parquet(run / "sequences.parquet")
        assert all(len(m) == len(ids) for m, ids in zip(sequences["solo_margins"], sequences["solo_ids"]))
        assert not any(np.isnan(m).any() for m in sequences["solo_margins"])
    assert all(d["margin_a"] is not None for d in summary["pairs"][0]["divergences"])
    slots = {d["key"]: d["values"] for d in summary["manifest_differences"]}["endpoint.props.total_slots"]
    assert slots == [1, 8]

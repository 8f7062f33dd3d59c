"""Every output format parsed and checked against the run it describes: each command's --json
equal to the file it summarises (or the catalogue it lists), report.md's section of every
command with its figures recomputed from the run's own tables, JUnit XML read by an XML parser,
and every PNG opened. One run of each command on the planted tiny model, shared by the tests."""

import json
import shlex
import shutil
import struct
import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
import tomllib
from typer.testing import CliRunner

from mgbench.cli import app

runner = CliRunner()
TAU = 0.05
REPORTED = ("flips", "calibrate", "verify", "probe", "compare", "diff")  # report.md's order


def commands(model: Path, root: Path) -> dict[str, tuple[list[str], int]]:
    """Each command once, with --json (and --junit where it has one): (arguments, exit code).
    compare's run is the session's shared one (conftest `planted_compare_run`)."""
    decode = ["--model", str(model), "--dataset", "gsm8k"]
    flips = [*decode, "--limit", "4", "--batch-size", "4", "--max-new-tokens", "8"]
    return {
        "flips": (["flips", *flips, "--out", str(root / "flips"), "--junit", str(root / "flips.xml"), "--json"], 0),
        # The batch-invariant mode runs the planted head per row: the other side of the diff.
        "flips-invariant": (["flips", *flips, "--batch-invariant", "--out", str(root / "flips-invariant")], 0),
        "calibrate": (["calibrate", str(root / "flips"), "--out", str(root / "calibrate"), "--json"], 0),
        "verify": (
            [
                "verify",
                *decode,
                "--limit",
                "4",
                "--batch-sizes",
                "2,4",
                "--max-new-tokens",
                "6",
                "--policy",
                "none,margin",
                "--threshold",
                str(TAU),
                "--out",
                str(root / "verify"),
                "--junit",
                str(root / "verify.xml"),
                "--json",
            ],
            0,
        ),
        "probe": (["probe", "--model", str(model), "--rows", "2", "--out", str(root / "probe"), "--json"], 0),
        # Plain batched vs batch-invariant outputs of the planted head: they differ, so this fails.
        "diff": (
            [
                "diff",
                str(root / "flips"),
                str(root / "flips-invariant"),
                "--batched",
                "--require-identical",
                "1.0",
                "--out",
                str(root / "diff"),
                "--junit",
                str(root / "diff.xml"),
                "--json",
            ],
            1,
        ),
        "report": (["report", *(str(root / k) for k in REPORTED), "--out", str(root / "report"), "--json"], 0),
        "models": (["models", "--json"], 0),
        "datasets": (["datasets", "--json"], 0),
    }


@pytest.fixture(scope="module")
def runs(planted_model_dir, planted_compare_run, tmp_path_factory):
    """{command: (its --json output parsed, or None)}; the run directories lie under runs['root']."""
    root = tmp_path_factory.mktemp("outputs")
    compared, printed_compare = planted_compare_run
    shutil.copytree(compared, root / "compare")
    printed = {"root": root, "compare": printed_compare}
    for name, (args, code) in commands(planted_model_dir, root).items():
        result = runner.invoke(app, args)
        assert result.exit_code == code, f"{name}: {result.output}"
        printed[name] = json.loads(result.stdout) if "--json" in args else None
    return printed


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


# --- --json -----------------------------------------------------------------------------------


def test_every_json_output_equals_what_it_describes(runs):
    root = runs["root"]
    written = {
        "flips": root / "flips" / "summary.json",
        "verify": root / "verify" / "summary.json",
        "compare": root / "compare" / "summary.json",
        "diff": root / "diff" / "summary.json",
        "calibrate": root / "calibrate" / "calibration.json",
        "probe": root / "probe" / "probe.json",
    }
    for name, path in written.items():
        assert runs[name] == read_json(path), name
    assert runs["report"] == {"report": str(root / "report" / "report.md"), "runs": [str(root / k) for k in REPORTED]}
    assert (root / "report" / "report.md").is_file()
    # The summaries hold the figures of their own tables.
    steps = pd.read_parquet(root / "flips" / "steps.parquet")
    assert runs["flips"]["steps"] == len(steps) and runs["flips"]["flips"] == int(steps["flipped"].sum())
    assert runs["calibrate"]["flips"] == int(steps["flipped"].sum())
    sequences = pd.read_parquet(root / "verify" / "sequences.parquet")
    for policy in runs["verify"]["policies"]:
        rows = sequences[sequences["policy"] == policy["policy"]]
        assert (policy["sequences"], policy["identical"]) == (len(rows), int(rows["identical"].sum()))
    assert runs["diff"]["pairs"][0]["paired"] == len(pd.read_parquet(root / "diff" / "diff.parquet"))


def test_models_and_datasets_json_list_the_catalogue(runs):
    from mgbench.assets.models import DEFAULT_MODEL, REGISTRY

    assert [m["alias"] for m in runs["models"]] == list(REGISTRY)
    for entry in runs["models"]:
        spec = REGISTRY[entry["alias"]]
        assert (entry["hub_id"], entry["notes"]) == (spec.hub_id, spec.description)
        assert entry["default"] == (entry["alias"] == DEFAULT_MODEL)
    assert [m["hub_id"] for m in runs["models"] if m["default"]] == ["HuggingFaceTB/SmolLM2-135M-Instruct"]  # README
    # Datasets: every config file under datasets_cfg/, read here with tomllib.
    configs = sorted((Path(__file__).parents[1] / "datasets_cfg").glob("*.toml"))
    assert [d["name"] for d in runs["datasets"]] == [p.stem for p in configs]
    for entry, path in zip(runs["datasets"], configs):
        raw = tomllib.loads(path.read_text())
        source, prompt = raw["source"], raw["prompt"]
        assert (entry["name"], entry["description"]) == (raw["name"], raw["description"])
        assert (entry["kind"], entry["format"]) == (source["kind"], source["format"])
        assert entry["location"] == f"{source['package']}/{source['path']}"  # every packaged config
        assert (entry["prompt_field"], entry["template"]) == (prompt["field"], prompt.get("template"))
        assert (entry["chat_template"], entry["max_new_tokens"]) == (prompt["chat_template"], raw["max_new_tokens"])


# --- JUnit ------------------------------------------------------------------------------------


def junit_cases(path: Path) -> tuple[ET.Element, dict[str, ET.Element]]:
    suite = ET.parse(path).getroot()
    assert suite.tag == "testsuite"
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    assert int(suite.get("tests")) == len(cases) == len(list(suite.iter("testcase")))
    assert int(suite.get("failures")) == sum(case.find("failure") is not None for case in cases.values())
    return suite, cases


def test_junit_of_flips_verify_and_diff_hold_the_runs_figures(runs):
    root = runs["root"]
    suite, cases = junit_cases(root / "flips.xml")  # no threshold: every case passes, with its figures
    assert list(cases) == [f"batch_size={r['batch_size']}" for r in runs["flips"]["by_batch_size"]]
    assert suite.get("failures") == "0"
    for row in runs["flips"]["by_batch_size"]:
        text = cases[f"batch_size={row['batch_size']}"].find("system-out").text
        assert text.startswith(f"{row['flips']} flips / {row['steps']} steps")
        assert f"{row['sequences_diverged']}/{row['sequences']} sequences diverged" in text

    # verify without --require-determinism: its JUnit still requires every output equal to solo
    # (100%), so each (policy, batch size) case whose outputs diverged fails and lists them.
    suite, cases = junit_cases(root / "verify.xml")
    expected = [f"{r['policy']} batch_size={r['batch_size']}" for r in runs["verify"]["by_batch_size"]]
    assert list(cases) == expected
    sequences = pd.read_parquet(root / "verify" / "sequences.parquet")
    failing = 0
    for (policy, batch_size), group in sequences.groupby(["policy", "batch_size"], sort=False):
        failure = cases[f"{policy} batch_size={batch_size}"].find("failure")
        diverged = group[~group["identical"]]
        assert (failure is None) == diverged.empty, (policy, batch_size)
        if failure is not None:
            failing += 1
            assert failure.get("message") == f"determinism {group['identical'].mean():.2%} < required 100.00%"
            listed = ", ".join(
                f"request {r.request_id} at token {int(r.first_divergence)}" for r in diverged.itertuples()
            )
            assert failure.text == f"diverged from the solo reference: {listed}"
    assert int(suite.get("failures")) == failing > 0, "positive control: plain batched decoding of the planted head"

    # diff --require-identical 1.0 over outputs that differ: one failing case, its divergences listed.
    suite, cases = junit_cases(root / "diff.xml")
    (pair,) = runs["diff"]["pairs"]
    case = cases[f"{pair['run_a']} vs {pair['run_b']}"]
    assert suite.get("failures") == "1" and pair["identical"] < pair["paired"]
    failure = case.find("failure")
    assert failure.get("message") == f"identical {pair['identical_share']:.2%} < required 100.00%"
    divergences = pd.read_parquet(root / "diff" / "diff.parquet").query("not identical")
    for d in divergences.itertuples():
        assert f"(id {d.request_id_a}) at token {d.first_divergence}: {d.token_a} vs {d.token_b}" in failure.text


# --- report.md --------------------------------------------------------------------------------


def sections(text: str) -> dict[str, list[str]]:
    """report.md's '## kind: name' sections, by kind."""
    found, current = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            current = line[3:].split(":")[0]
            found[current] = []
        elif current is not None:
            found[current].append(line)
    return found


def tables(lines: list[str]) -> list[list[dict[str, str]]]:
    """The markdown tables of some lines: rows as {header: cell} (a repeated header gets ' 2')."""
    found, block = [], []
    for line in [*lines, ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif block:
            assert all(len(row) == len(block[0]) for row in block[1:]), f"a row's cells do not match {block[0]}"
            headers = []
            for h in block[0]:
                headers.append(h if h not in headers else f"{h} 2")
            found.append([dict(zip(headers, row)) for row in block[2:]])
            block = []
    return found


def value(cell: str):
    """A report cell back as a number: '87.50%' -> 0.875, '**no**' -> 'no', '-' -> None."""
    cell = cell.strip("*")
    if cell == "-":
        return None
    try:
        return float(cell[:-1]) / 100 if cell.endswith("%") else float(cell)
    except ValueError:
        return cell


def shown(cell: str, expected) -> bool:
    """The cell shows `expected` to its printed precision (percentages with 2 decimals, 4 digits)."""
    got = value(cell)
    if expected is None or got is None:
        return got is expected
    return got == pytest.approx(expected, rel=6e-4, abs=5.1e-5 if cell.endswith("%") else 1e-12)


def line_with(lines: list[str], start: str) -> str:
    (line,) = [line for line in lines if line.startswith(start)]
    return line


def numbers_in(line: str) -> list[float]:
    import re

    return [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", line)]


@pytest.fixture(scope="module")
def report(runs):
    return sections((runs["root"] / "report" / "report.md").read_text())


def test_report_has_one_section_per_command_that_names_its_run(runs, report):
    assert list(report) == list(REPORTED)
    for kind, lines in report.items():
        manifest = read_json(runs["root"] / kind / "manifest.json")
        assert manifest["command"] == kind
        variables = [f"{k}={v}" for k, v in manifest["kernel_environment"].items() if v is not None]
        typed = " ".join(variables + [shlex.quote(a) for a in manifest["argv"]])
        assert line_with(lines, "Command: ") == f"Command: `{typed}`"
        assert f"device {manifest['device_name']}, torch {manifest['torch']}," in line_with(lines, "model `")


def test_report_flips_section_recomputed_from_the_steps_table(runs, report):
    run = runs["root"] / "flips"
    steps, sequences = pd.read_parquet(run / "steps.parquet"), pd.read_parquet(run / "sequences.parquet")
    (row,) = tables(report["flips"])[0]
    flips = int(steps["flipped"].sum())
    assert flips > 0, "positive control: the planted head flips batched steps"
    assert (value(row["steps"]), value(row["flips"])) == (len(steps), flips)
    assert shown(row["flip rate"], flips / len(steps))
    assert value(row["sequences"]) == len(sequences) and value(row["diverged"]) == int((~sequences["identical"]).sum())
    assert shown(row["determinism"], sequences["identical"].mean())
    summary = runs["flips"]  # timings: as the summary holds them; in process, solo is decoded once
    assert "solo_repeat" not in summary and row["solo twice"] == "-"
    assert shown(row["solo tok/s"], summary["solo_tokens_per_s"])
    assert shown(row["batched tok/s"], summary["batched_tokens_per_s"])
    margins = line_with(report["flips"], "Batched margin at flips (logit)")
    at_flips, elsewhere = steps.loc[steps["flipped"], "margin"], steps.loc[~steps["flipped"], "margin"]
    median, top, other = numbers_in(margins)
    assert median == pytest.approx(np.median(at_flips), rel=6e-4) and top == pytest.approx(at_flips.max(), rel=6e-4)
    assert other == pytest.approx(np.median(elsewhere), rel=6e-4, abs=1e-12)


def test_report_calibrate_section_recomputed_from_the_audits_steps(runs, report):
    steps = pd.read_parquet(runs["root"] / "flips" / "steps.parquet")
    calibration = runs["calibrate"]
    rows = {r["unit"]: r for r in tables(report["calibrate"])[0]}
    assert set(rows) == {"logit", "ulp"}
    flipped = steps["flipped"].to_numpy()
    for unit, column in (("logit", "margin"), ("ulp", "margin_ulp")):
        margins = steps[column].to_numpy(dtype=float)
        worst = margins[flipped].max()
        above = margins[margins > worst]
        # the next observed margin above every flip; where every step flipped, one float32 step above
        tau_min = above.min() if len(above) else float(np.nextafter(np.float32(worst), np.float32(np.inf)))
        tau = 1.5 * tau_min  # the default safety rule, x1.5
        assert calibration["safety"] == "x1.5" and calibration["per_unit"][unit]["tau"] == pytest.approx(tau)
        row = rows[unit]
        assert value(row["flips"]) == flipped.sum() and shown(row["max flip margin"], worst)
        assert shown(row["minimal TAU"], tau_min) and shown(row["triggers"], (margins < tau_min).mean())
        assert shown(row["TAU (x1.5)"], tau) and shown(row["triggers 2"], (margins < tau).mean())
        assert shown(row["oracle"], flipped.mean())
    assert line_with(report["calibrate"], "Bound: ") == f"Bound: {calibration['bound']['verdict']}."
    assert f"with {flipped.sum()} flips and none missed" in calibration["bound"]["verdict"]


def test_report_verify_section_recomputed_from_the_verify_tables(runs, report):
    run = runs["root"] / "verify"
    steps, sequences = pd.read_parquet(run / "steps.parquet"), pd.read_parquet(run / "sequences.parquet")
    rows = tables(report["verify"])[0]
    groups = list(sequences.groupby(["policy", "batch_size"], sort=False))
    assert [(r["policy"], value(r["batch size"])) for r in rows] == [key for key, _ in groups]
    for row, ((policy, batch_size), group) in zip(rows, groups):
        emitted = steps[(steps["policy"] == policy) & (steps["batch_size"] == batch_size)]
        assert value(row["sequences"]) == len(group) and value(row["identical"]) == group["identical"].sum()
        assert shown(row["determinism"], group["identical"].mean())
        assert (
            shown(row["trigger rate"], emitted["triggered"].mean())
            and value(row["repairs"]) == emitted["repaired"].sum()
        )
    by_policy = {r["policy"]: value(r["determinism"]) for r in rows}
    assert by_policy["none"] < 1.0 and by_policy[f"margin<{TAU}/exact"] == 1.0, "planted flips, then repaired"
    assert not any(line.startswith("Required determinism") for line in report["verify"])  # none was required


def test_report_compare_section_recomputed_from_compare_parquet(runs, report):
    run = runs["root"] / "compare"
    timed = pd.read_parquet(run / "compare.parquet")
    rows = tables(report["compare"])[0]
    assert [r["config"] for r in rows] == list(timed["config"].unique())
    per_config = timed.groupby("config", sort=False)
    none_seconds = per_config.get_group("none")["seconds"].median()
    none_by_repeat = per_config.get_group("none").set_index("repeat")["seconds"]
    assert len(none_by_repeat) == 2, "two timed repeats: the increment is a median over them"
    for row in rows:
        group = per_config.get_group(row["config"])
        seconds = group["seconds"].median()
        assert shown(row["decode s (median)"], seconds)
        low, high = row["spread"].split("-")
        assert shown(low, group["seconds"].min()) and shown(high, group["seconds"].max())
        assert shown(row["tok/s"], group["tokens"].median() / seconds)
        # each repeat's increment over that repeat's plain pass, then their median
        increments = group.set_index("repeat")["seconds"] / none_by_repeat - 1
        assert shown(row["increment"], increments.median())
        assert shown(row["determinism"], group["identical"].min() / group["sequences"].iloc[0])
        assert shown(row["trigger rate"], (group["triggers"] / group["steps"]).median())
        assert value(row["repairs"]) == group["repairs"].median()
    # The gate's share of a plain batched step: one batch of full-length outputs, so the plain
    # configuration ran max_new_tokens - 1 decode iterations.
    summary, none = runs["compare"], per_config.get_group("none")
    assert (none["steps"] == none["sequences"] * summary["max_new_tokens"]).all() and summary["batch_size"] == 2
    plain_step = none_seconds / (summary["max_new_tokens"] - 1)
    assert summary["plain_batched_step_seconds"] == pytest.approx(plain_step)
    assert summary["gate_seconds_per_step"] > 0
    gate_line = line_with(report["compare"], "- gate alone: ")
    assert shown(gate_line.split()[3], summary["gate_seconds_per_step"] / plain_step)


def test_report_probe_section_shows_probe_json(runs, report):
    probe = runs["probe"]
    rows = tables(report["probe"])[0]
    assert [(r["op"], r["module / shape"]) for r in rows] == [(f["op"], f["name"]) for f in probe["findings"]]
    for row, finding in zip(rows, probe["findings"]):
        assert value(row["invariant"]) == ("yes" if finding["invariant"] else "no")
        assert shown(row["max abs diff"], finding["max_abs_diff"])
    by_op = {(r["op"], r["module / shape"]): r for r in rows}
    # The planted head varies with the row count by construction; the batch-invariant mode does not.
    (head,) = [r for key, r in by_op.items() if key[0] == "lm_head"]
    assert value(head["invariant"]) == "no"
    assert value(by_op["decode step", "batch-invariant mode vs solo logits"]["invariant"]) == "yes"
    step = line_with(report["probe"], "Decode step: ")
    plain, invariant = numbers_in(step)[:2]
    assert plain == pytest.approx(probe["plain_step_ms"], abs=0.051)
    assert invariant == pytest.approx(probe["invariant_step_ms"], abs=0.051)
    assert step.endswith(f"exact on the probe batch: {'yes' if probe['batch_invariant_exact'] else 'NO'}.")


def first_divergence(a, b):
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if n == len(a) == len(b) else n


def test_report_diff_section_recomputed_from_both_runs(runs, report):
    root = runs["root"]
    a, b = (pd.read_parquet(root / name / "sequences.parquet") for name in ("flips", "flips-invariant"))
    for side in (a, b):
        side["key"] = [(tuple(p), s) for p, s in zip(side["prompt_ids"], side["batch_size"])]
    paired = a.merge(b, on="key", suffixes=("_a", "_b"))
    assert len(paired) == len(a) == len(b)
    divergences = {
        r.request_id_a: first_divergence(list(r.batched_ids_a), list(r.batched_ids_b)) for r in paired.itertuples()
    }
    identical = sum(d is None for d in divergences.values())
    assert identical < len(paired), "positive control: the planted head changes batched outputs"
    pair_line = line_with(report["diff"], "**flips vs flips-invariant**: ")
    assert pair_line.startswith(
        f"**flips vs flips-invariant**: {identical}/{len(paired)} ({identical / len(paired):.2%}) identical"
    )
    rows = tables(report["diff"])[2]  # runs, the identical-share matrix, then the divergences
    assert {int(value(r["id"])): int(value(r["step"])) for r in rows} == {
        k: v for k, v in divergences.items() if v is not None
    }
    tokens = {r.request_id_a: (r.batched_ids_a, r.batched_ids_b) for r in paired.itertuples()}
    for row in rows:
        token_a, token_b = tokens[int(value(row["id"]))]
        step = int(value(row["step"]))
        assert (value(row["token flips"]), value(row["token flips-invariant"])) == (token_a[step], token_b[step])
    matrix = tables(report["diff"])[1]
    assert value(matrix[0]["flips-invariant"].split()[1].strip("()")) == pytest.approx(identical / len(paired))


# --- PNG --------------------------------------------------------------------------------------


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG signature and its IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", path
    return struct.unpack(">II", head[16:24])


def test_every_plot_is_a_png_of_plausible_size_with_content(runs):
    root = runs["root"]
    expected = {
        "calibrate": {"curve.png", "margins.png"},
        "compare": {"latency_increment.png", "determinism_vs_triggers.png"},
        "diff": {"divergence_margins.png"},
        "report": {
            "0-margins.png",
            "1-curve.png",
            "1-margins.png",
            "4-latency_increment.png",
            "4-determinism_vs_triggers.png",
            "5-divergence_margins.png",
        },
    }
    two_panels = {"curve.png", "margins.png"}  # one panel per margin unit: logit and ulp here
    for folder, names in expected.items():
        assert {p.name for p in (root / folder).glob("*.png")} == names, folder
        for name in names:
            path = root / folder / name
            width, height = png_size(path)
            assert 300 <= height <= width <= 4000, (path, width, height)
            if name.split("-")[-1] in two_panels:
                assert width >= 2 * height, (path, width, height)
            pixels = matplotlib.image.imread(path)
            assert pixels.shape[:2] == (height, width) and pixels.std() > 0, path  # drawn, not blank
    # The report links each plot it copied, and the copies are the run's own files.
    text = (root / "report" / "report.md").read_text()
    for name in expected["report"]:
        assert f"]({name})" in text
    for copy, source in (
        ("1-curve.png", "calibrate/curve.png"),
        ("4-latency_increment.png", "compare/latency_increment.png"),
    ):
        assert (root / "report" / copy).read_bytes() == (root / source).read_bytes()

"""JUnit XML for CI: verify (one case per policy, dataset, batch size) and flips (one case per
dataset and batch size, plus the baseline regression test when there is one)."""

from __future__ import annotations

import os
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pandas as pd


@dataclass
class Case:
    classname: str
    name: str
    failure: str | None = None  # the failure message; None passes
    text: str = ""  # figures (system-out of a passing case, body of a failing one)


def cases_xml(suite_name: str, cases: list[Case]) -> ET.ElementTree:
    suite = ET.Element(
        "testsuite", name=suite_name, tests=str(len(cases)), failures=str(sum(c.failure is not None for c in cases))
    )
    for c in cases:
        case = ET.SubElement(suite, "testcase", classname=c.classname, name=c.name)
        if c.failure is not None:
            ET.SubElement(case, "failure", message=c.failure).text = c.text
        elif c.text:
            ET.SubElement(case, "system-out").text = c.text
    return ET.ElementTree(suite)


def junit_xml(sequences: pd.DataFrame, required: float) -> ET.ElementTree:
    cases = []
    for (policy, dataset, batch_size), group in sequences.groupby(["policy", "dataset", "batch_size"], sort=False):
        determinism = float(group["identical"].mean())
        case = Case(f"mgbench.verify.{dataset}", f"{policy} batch_size={batch_size}")
        if determinism < required:
            diverged = group.loc[~group["identical"], ["request_id", "first_divergence"]]
            detail = ", ".join(
                f"request {r.request_id} at token {int(r.first_divergence)}" for r in diverged.itertuples()
            )
            case.failure = f"determinism {determinism:.2%} < required {required:.2%}"
            case.text = f"diverged from the solo reference: {detail}"
        cases.append(case)
    return cases_xml("mgbench.verify", cases)


def flips_junit(summary: dict) -> ET.ElementTree:
    """One case per batch size with its figures; failing where the gate's thresholds broke there."""
    from mgbench.analysis.gate import condition_label, describe_failure, overall_label

    gate = summary.get("gate") or {"failures": []}
    cases = []
    for row in summary["by_batch_size"]:
        label = condition_label(row)
        broken = [describe_failure(f) for f in gate["failures"] if f["where"] in (label, overall_label(summary))]
        figures = (
            f"{row['flips']} flips / {row['steps']} steps ({row['flip_rate']:.2%}); "
            f"{row['sequences_diverged']}/{row['sequences']} sequences diverged "
            f"(determinism {row['determinism']:.2%})"
        )
        cases.append(
            Case(
                f"mgbench.flips.{summary['dataset']}",
                f"batch_size={row['batch_size']}" if label.startswith("batch size") else f"axis={label}",
                "; ".join(broken) or None,
                figures,
            )
        )
    if "baseline" in gate:
        regressed = [describe_failure(f) for f in gate["failures"] if f["check"] == "baseline"]
        tests = gate["baseline"]["tests"]
        figures = "; ".join(
            f"{name}: {t['rate']:.2%} vs baseline {t['baseline_rate']:.2%}, p = {t['p_value']:.3g}"
            for name, t in tests.items()
            if t["pairs"]
        )
        cases.append(
            Case(f"mgbench.flips.{summary['dataset']}", "baseline regression", "; ".join(regressed) or None, figures)
        )
    return cases_xml("mgbench.flips", cases)


def write_junit(path: Path, tree: ET.ElementTree) -> None:
    """Written next to its target and renamed, so CI never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "wb") as handle:
        tree.write(handle, encoding="utf-8", xml_declaration=True)
    os.replace(staging, path)


def diff_junit(summary: dict) -> ET.ElementTree:
    """`mgbench diff`: one case per pair of runs, failing where its identical share is below
    --require-identical; the divergences (request, step, tokens) in the case's text."""
    required = summary.get("required_identical")
    cases = []
    for pair in summary["pairs"]:
        share = pair["identical_share"]
        figures = f"{pair['identical']}/{pair['paired']} outputs identical ({share:.2%}), paired by {pair['paired_by']}"
        diverged = "; ".join(
            f"request {d['request']} (id {d['request_id_a']}) at token {d['step']}: {d['token_a']} vs {d['token_b']}"
            for d in pair["divergences"]
        )
        failure = None
        if required is not None and share < required:
            failure = f"identical {share:.2%} < required {required:.2%}"
        text = figures + (f"\n{diverged}" if diverged else "")
        cases.append(Case(f"mgbench.diff.{summary['mode']}", f"{pair['run_a']} vs {pair['run_b']}", failure, text))
    return cases_xml("mgbench.diff", cases)

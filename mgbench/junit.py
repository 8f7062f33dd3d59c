"""JUnit XML for CI: one test case per (policy, dataset, batch size) of a verify run."""

from __future__ import annotations

import os
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd


def junit_xml(sequences: pd.DataFrame, required: float) -> ET.ElementTree:
    suite = ET.Element("testsuite", name="mgbench.verify")
    failures = 0
    for (policy, dataset, batch_size), group in sequences.groupby(["policy", "dataset", "batch_size"], sort=False):
        case = ET.SubElement(suite, "testcase", classname=f"mgbench.verify.{dataset}",
                             name=f"{policy} batch_size={batch_size}")
        determinism = float(group["identical"].mean())
        if determinism < required:
            failures += 1
            diverged = group.loc[~group["identical"], ["request_id", "first_divergence"]]
            detail = ", ".join(f"request {r.request_id} at token {int(r.first_divergence)}" for r in diverged.itertuples())
            failure = ET.SubElement(case, "failure", message=f"determinism {determinism:.2%} < required {required:.2%}")
            failure.text = f"diverged from the solo reference: {detail}"
    suite.set("tests", str(len(suite)))
    suite.set("failures", str(failures))
    return ET.ElementTree(suite)


def write_junit(path: Path, tree: ET.ElementTree) -> None:
    """Written next to its target and renamed, so CI never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "wb") as handle:
        tree.write(handle, encoding="utf-8", xml_declaration=True)
    os.replace(staging, path)

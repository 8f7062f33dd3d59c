"""`mgbench flips --endpoint URL1,URL2,...`: replicas of one served model, one flips run each.

A fleet is N single-endpoint audits, one after another (a replica is never audited while another
is loaded by this client): OUT/replica-I is a complete run directory of replica I, whatever the
others did, and `mgbench diff OUT/replica-*` compares the replicas' outputs for the same requests.
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext, redirect_stdout
from dataclasses import replace
from pathlib import Path

from mgbench.analysis.gate import GateSpec
from mgbench.engines.endpoint.client import EndpointOptions
from mgbench.errors import UserError
from mgbench.render.console import console, err_console
from mgbench.runs import rundir
from mgbench.runs.options import RunOptions
from mgbench.runs.placement import Placement


def endpoint_urls(endpoint: str | None) -> list[str]:
    """The URLs of --endpoint: one server, or a comma-separated fleet of replicas."""
    if endpoint is None:
        return []
    urls = [url.strip() for url in endpoint.split(",")]
    if any(not url for url in urls):
        raise UserError(f"--endpoint {endpoint!r}: an empty URL in the list; give URL1,URL2,... without gaps")
    if len(set(urls)) < len(urls):
        raise UserError(f"--endpoint {endpoint!r}: a URL is listed twice; each replica once")
    return urls


def replicas(first: EndpointOptions, urls: list[str]) -> list[EndpointOptions]:
    """The endpoint options of every replica: the same audit, each its own URL and index."""
    return [replace(first, url=url, replica=index) for index, url in enumerate(urls)]


def replica_dir(out: Path, index: int) -> Path:
    return out / f"replica-{index}"


def replica_junit(junit: Path | None, index: int) -> Path | None:
    """flips.xml -> flips-replica-0.xml: one JUnit file per replica's run."""
    return None if junit is None else junit.with_name(f"{junit.stem}-replica-{index}{junit.suffix}")


def run_fleet(
    options: RunOptions,
    resume: bool,
    out: Path,
    spec: GateSpec,
    junit: Path | None,
    json_out: bool,
    fleet: list[EndpointOptions],
) -> bool:
    """One flips run per replica under OUT/replica-I; False when any replica's gate failed."""
    from mgbench.pipelines.flips import run_flips

    if not resume:
        rundir.prepare_out_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    passed, runs = True, []
    for endpoint_options in fleet:
        index = endpoint_options.replica
        target = replica_dir(out, index)
        runs.append(target)
        err_console.print(f"replica {index}: {endpoint_options.base} -> {target}", highlight=False)
        if resume and rundir.is_complete_run(target):
            err_console.print(f"replica {index}: already complete", highlight=False)
            continue
        placement = Placement.resolve(None, resume, None, target)
        # --json: one document for the fleet at the end; each replica's report goes to stderr.
        with redirect_stdout(sys.stderr) if json_out else nullcontext():
            passed &= run_flips(options, placement, target, spec, replica_junit(junit, index), False, endpoint_options)
    if json_out:
        documents = [
            {
                "replica": e.replica,
                "url": e.base,
                "run": str(run),
                "summary": json.loads((run / "summary.json").read_text()),
            }
            for e, run in zip(fleet, runs)
        ]
        print(rundir.json_text({"replicas": documents}), end="")
    else:
        console.print("replica runs: " + " ".join(str(run) for run in runs), highlight=False)
        console.print("compare them: mgbench diff " + " ".join(str(run) for run in runs), highlight=False)
    return passed

"""README's tour, regenerated from the run directories that ship with the project.

The runs under reports/example/runs/ were recorded by `record` on one machine (their manifests
name it). `render` writes reports/example/report.md (and its plots) from them and rewrites README's
tour blocks (between `<!-- tour NAME -->` and `<!-- /tour -->`) from the same sections, so the
front door shows what the code prints today. `check` renders again into a scratch folder and
exits 1 when report.md or a README block differs (tests/test_tour.py runs it).

    .venv/bin/python examples/tour.py record   # re-record every run here (about 15 minutes on 2 cores)
    .venv/bin/python examples/tour.py render
    .venv/bin/python examples/tour.py check
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "reports" / "example"
SHIPPED = EXAMPLE / "runs"
README = ROOT / "README.md"
RECORDED_IN = Path("/tmp/runs")  # where README's commands write (the user's copy of the tour)
MGBENCH = ".venv/bin/mgbench"  # as typed from the checkout, and as the manifests record it

AUDIT = ["--dataset", "math500", "--limit", "16", "--batch-size", "8", "--max-new-tokens", "32"]
COMPARED = "always,margin*/column,margin*/exact,oracle,fixed-order,batch-invariant,solo"


def other_family() -> dict[str, str]:
    """The first other kernel family this CPU runs (`python -m mgbench.runs.machine`)."""
    listed = subprocess.run([sys.executable, "-m", "mgbench.runs.machine"], capture_output=True, text=True, check=True)
    return dict(pair.split("=", 1) for pair in listed.stdout.splitlines()[0].split())


def tour(family: dict[str, str]) -> list[tuple[str, dict[str, str], list[str]]]:
    """(run name, kernel variables, mgbench arguments) in the tour's order; later runs read earlier ones."""
    runs = str(RECORDED_IN)
    cal = f"{runs}/cal/calibration.json"
    return [
        ("probe", {}, ["probe", "--out", f"{runs}/probe"]),
        ("flips-plain", {}, ["flips", *AUDIT, "--out", f"{runs}/flips-plain"]),
        ("flips-inv", {}, ["flips", "--batch-invariant", *AUDIT, "--out", f"{runs}/flips-inv"]),
        ("cal", {}, ["calibrate", f"{runs}/flips-plain", "--out", f"{runs}/cal"]),
        (
            "verify",
            {},
            ["verify", "--policy", "none,margin", "--repair", "exact", "--threshold-from", cal]
            + ["--dataset", "math500", "--limit", "16", "--batch-sizes", "4,8", "--max-new-tokens", "32"]
            + ["--require-determinism", "1.0", "--out", f"{runs}/verify"],
        ),
        (
            "compare",
            {},
            ["compare", *AUDIT, "--threshold-from", cal, "--repeats", "3", "--only", COMPARED]
            + ["--out", f"{runs}/compare"],
        ),
        ("flips-other-family", family, ["flips", *AUDIT, "--out", f"{runs}/flips-other-family"]),
        ("diff", {}, ["diff", f"{runs}/flips-plain", f"{runs}/flips-other-family", "--out", f"{runs}/diff"]),
    ]


def record() -> None:
    """Run the tour here into /tmp/runs, then ship the runs (each a few hundred KB at most)."""
    steps = tour(other_family())
    for name, _, _ in steps:
        if (RECORDED_IN / name).exists():
            sys.exit(f"{RECORDED_IN / name} exists: remove {RECORDED_IN} first")
    for name, family, args in steps:
        print(f"== {name}: {' '.join(f'{k}={v}' for k, v in family.items())} {MGBENCH} {' '.join(args)}", flush=True)
        done = subprocess.run([MGBENCH, *args], cwd=ROOT, env={**os.environ, **family})
        if done.returncode not in (0, 1):  # 1: a gate that failed, which the tour shows as it is
            sys.exit(f"{name} exited {done.returncode}")
    shutil.rmtree(SHIPPED, ignore_errors=True)
    for name, _, _ in steps:
        shutil.copytree(RECORDED_IN / name, SHIPPED / name)


def shipped_runs() -> list[Path]:
    return [SHIPPED / name for name, _, _ in tour({})]


def sections(report: str) -> dict[str, list[str]]:
    """report.md's sections by run name (`## flips: flips-plain` -> `flips-plain`)."""
    found, name = {}, None
    for line in report.splitlines():
        heading = re.match(r"## \w+: (\S+)$", line)
        if heading:
            name = heading.group(1)
            found[name] = []
        elif name is not None:
            found[name].append(line)
    return found


def tour_block(lines: list[str]) -> str:
    """A README block: the command in a shell block, then the section's figures without its
    provenance line (the tour names the machine once) and plots; a probe keeps only the rows that
    vary and the decode-step rows."""
    command = next(line for line in lines if line.startswith("Command: "))[len("Command: ") :].strip("`")
    body = []
    for line in lines:
        if line.startswith(("model `", "Command: ", "![")):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")] if line.startswith("| ") else []
        if len(cells) > 3 and cells[3] == "yes" and cells[0] not in ("decode step", "op"):
            continue  # an invariant probe row (op, module, n, invariant, ...)
        body.append(line)
    text = "\n".join(body).strip("\n")
    text = re.sub(r"\n{3,}", "\n\n", text)
    return f"```bash\n{command}\n```\n\n{text}\n"


def readme_with(readme: str, blocks: dict[str, str]) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in blocks:
            raise SystemExit(f"README names tour block {name!r}, which no shipped run renders")
        return f"<!-- tour {name} -->\n{blocks[name]}<!-- /tour -->"

    return re.sub(r"<!-- tour (\S+) -->\n.*?<!-- /tour -->", replace, readme, flags=re.S)


def machine_block() -> str:
    """The machine the tour was recorded on, from its plain flips run's manifest."""
    manifest = json.loads((SHIPPED / "flips-plain" / "manifest.json").read_text())
    return (
        f"{manifest['device_name']}, {manifest['torch_threads']} torch threads, torch {manifest['torch']}, "
        f"transformers {manifest['transformers']}, recorded {manifest['created_utc'][:10]}.\n"
    )


def rendered(scratch: Path) -> tuple[str, str]:
    """(report.md, README) as the code renders them from the shipped runs."""
    from mgbench.render.markdown import render

    report = render(shipped_runs(), scratch).read_text()
    blocks = {name: tour_block(lines) for name, lines in sections(report).items()}
    blocks["machine"] = machine_block()
    return report, readme_with(README.read_text(), blocks)


def write() -> None:
    with tempfile.TemporaryDirectory(prefix="mgbench-tour-") as scratch:
        report, readme = rendered(Path(scratch))
        for old in EXAMPLE.glob("*.png"):
            old.unlink()
        for made in Path(scratch).iterdir():
            shutil.copy2(made, EXAMPLE / made.name)
    README.write_text(readme)
    print(f"wrote {EXAMPLE / 'report.md'} and README's tour blocks")


def stale() -> list[str]:
    """Unified diffs of report.md and README against what the code renders now (empty: current)."""
    with tempfile.TemporaryDirectory(prefix="mgbench-tour-") as scratch:
        report, readme = rendered(Path(scratch))
    found = []
    for path, fresh in ((EXAMPLE / "report.md", report), (README, readme)):
        old = path.read_text() if path.exists() else ""
        if old != fresh:
            lines = old.splitlines(True), fresh.splitlines(True)
            found.append("".join(difflib.unified_diff(*lines, str(path), "rendered from the shipped runs")))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("record", "render", "check"))
    action = parser.parse_args().action
    if action == "record":
        record()
        write()
    elif action == "render":
        write()
    else:
        diffs = stale()
        print("".join(diffs) or "report.md and README's tour blocks match the shipped runs")
        sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()

"""`mgbench report`: report.md with plots from run directories of any command, from any machine.

Reads only the run directories' JSON and Parquet files (no model, no torch), so runs recorded
on a GPU box render anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

from mgbench.errors import UserError
from mgbench.render.diff_markdown import diff_section
from mgbench.render.md_cells import _copy_plots, _num, _pct, _table
from mgbench.render.probe_markdown import fixed_order_lines, probe_section, reference_text


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot read ({exc})") from exc


def run_kind(run: Path) -> str:
    from mgbench.runs.rundir import check_shards_complete, looks_sharded

    if run.is_dir() and looks_sharded(run):
        check_shards_complete(run)
    if not run.exists():
        raise UserError(f"{run} does not exist; give run directories of mgbench commands")
    if not run.is_dir() or not (run / "manifest.json").is_file():
        raise UserError(f"{run} is not an mgbench run directory (no manifest.json)")
    return _read_json(run / "manifest.json").get("command", "unknown")


def _audit_cells(figures: dict) -> list:
    """steps, flips, flip rate, sequences, diverged, determinism: of a whole flips run or of one axis."""
    keys = ("steps", "flips", "flip_rate", "sequences", "sequences_diverged", "determinism")
    return [_pct(figures[k]) if k in ("flip_rate", "determinism") else figures[k] for k in keys]


def axes_lines(s: dict) -> list[str]:
    """A run that varied more than the batch: one row per axis (and batch size), side by side."""
    from mgbench.analysis.gate import condition_label, varies_more_than_the_batch

    rows = s.get("by_batch_size", [])
    if not varies_more_than_the_batch(rows):
        return []
    head = "By axis (each against the request alone and cold; repeat against its load's first run):"
    return [head, ""] + _table(
        ["axis", "steps", "flips", "flip rate", "sequences", "diverged", "determinism", "flip margin median / max"],
        [
            [
                condition_label(r),
                *_audit_cells(r),
                f"{_num(r.get('flip_margin_logit_median'))} / {_num(r.get('flip_margin_logit_max'))}",
            ]
            for r in rows
        ],
    )


def flips_section(run: Path, out: Path, prefix: str) -> list[str]:
    from mgbench.render import plots
    from mgbench.runs import scan

    s = _read_json(run / "summary.json")
    lines = _table(
        [
            "engine",
            "method",
            "determinism against",
            "steps",
            "flips",
            "flip rate",
            "sequences",
            "diverged",
            "determinism",
            "drift (same-token steps)",
            "max drift",
            "solo twice",
            "solo tok/s",
            "batched tok/s",
        ],
        [
            [
                s.get("engine") or "-",
                s.get("method") or "-",
                reference_text(s),
                *_audit_cells(s),
                _pct(s.get("drift_share")),
                _num(s.get("max_logprob_drift")),
                solo_repeat_text(s),
                _num(s["solo_tokens_per_s"]),
                _num(s["batched_tokens_per_s"]),
            ]
        ],
    )
    lines += fixed_order_lines(s)
    lines += axes_lines(s)
    repeat = s.get("solo_repeat")
    if repeat:
        lines += [
            f"Solo vs solo again (batch size 1): {repeat['requests_differing']} of {repeat['requests']} requests "
            f"differ, {repeat['logprob_steps_differing']} of {repeat['steps']} steps' logprobs differ "
            f"(max {_num(repeat['max_logprob_drift'])})"
            + (
                ": not deterministic at batch size 1, those requests are left out of the comparisons with solo."
                if repeat["requests_differing"]
                else "."
            ),
            "",
        ]
    q = s["margin_logit_quantiles_flip"]
    lines += [
        f"Batched margin at flips (logit): median {_num(q.get('q50'))}, max {_num(q.get('q100'))}; "
        f"at non-flip steps: median {_num(s['margin_logit_quantiles_non_flip'].get('q50'))}.",
        "",
    ]
    gate = s.get("gate")
    if gate:
        from mgbench.analysis.gate import describe_failure

        verdict = "PASS" if gate["passed"] else "FAIL: " + "; ".join(describe_failure(f) for f in gate["failures"])
        lines += [f"Determinism gate: {verdict}.", ""]
    plots.margin_histograms(scan.margin_counts(run), out / f"{prefix}margins.png")  # streamed: counts, not rows
    return lines + [f"![margins]({prefix}margins.png)", ""]


def calibrate_section(run: Path, out: Path, prefix: str) -> list[str]:
    c = _read_json(run / "calibration.json")
    rows = [
        [
            unit,
            f["flips"],
            _num(f.get("max_flip_margin")),
            _num(f["tau_min"]),
            _pct(f["trigger_rate_min"]),
            _num(f["tau"]),
            _pct(f["trigger_rate"]),
            _pct(f["oracle_trigger_rate"]),
        ]
        for unit, f in c["per_unit"].items()
    ]
    lines = _table(
        ["unit", "flips", "max flip margin", "minimal TAU", "triggers", f"TAU ({c['safety']})", "triggers", "oracle"],
        rows,
    )
    lines += [f"Bound: {c['bound']['verdict']}.", ""]
    if c["transfer"]:
        lines += _table(
            ["dataset", "unit", "TAU", "flips", "missed", "recall", "trigger rate"],
            [
                [
                    t["dataset"],
                    t["unit"],
                    _num(t["tau"]),
                    t["flips"],
                    t["missed"],
                    _pct(t["recall"]),
                    _pct(t["trigger_rate"]),
                ]
                for t in c["transfer"]
            ],
        )
    return lines + _copy_plots(run, out, prefix, ("curve.png", "margins.png"))


def verify_section(run: Path, out: Path, prefix: str) -> list[str]:
    s = _read_json(run / "summary.json")
    lines = _table(
        ["policy", "batch size", "sequences", "identical", "determinism", "trigger rate", "repairs"],
        [
            [
                r["policy"],
                r["batch_size"],
                r["sequences"],
                r["identical"],
                _pct(r["determinism"]),
                _pct(r["trigger_rate"]),
                r["repairs"],
            ]
            for r in s["by_batch_size"]
        ],
    )
    if s.get("passed") is not None:
        lines += [f"Required determinism {s['required_determinism']}: {'PASS' if s['passed'] else 'FAIL'}.", ""]
    return lines


def spread(row: dict, key: str, fmt) -> str:
    """min-max over the repeats (`key_min`, `key_max`; `min`, `max` for an empty key)."""
    low, high = row.get(f"{key}_min" if key else "min"), row.get(f"{key}_max" if key else "max")
    return "-" if low is None or high is None else f"{fmt(low)}-{fmt(high)}"


def compare_section(run: Path, out: Path, prefix: str) -> list[str]:
    s = _read_json(run / "summary.json")
    lines = _table(
        ["config", "decode s (median)", "spread", "tok/s", "increment", "determinism", "against"]
        + ["trigger rate", "repairs"],
        [
            [
                r["config"],
                _num(r["seconds"]),
                spread(r, "seconds", _num),
                _num(r["tokens_per_s"]),
                _pct(r["increment"]),
                _pct(r["determinism"]),
                r.get("reference", "stock solo"),
                _pct(r["trigger_rate"]),
                _num(r["repairs"]),
            ]
            for r in s["configs"]
        ],
    )
    repeats = f"median of {s['repeats']} repeats, spread: min-max"
    for r in s["reductions"]:
        lines.append(
            f"- increment reduction always/{r['repair']} over margin/{r['repair']}: {_num(r['median'])}x "
            f"({spread(r, '', _num)})"
        )
    for r in s.get("replay_reductions", []):
        lines.append(
            f"- increment reduction {r['window']} over {r['gate']} (fixed-order solo): {_num(r['median'])}x "
            f"({spread(r, '', _num)})"
        )
    lines.append(f"- timings: {repeats}")
    lines += [f"- gate alone: {_pct(s['gate_share_of_step'])} of a plain batched step", ""] + fixed_order_lines(s)
    return lines + _copy_plots(run, out, prefix, ("latency_increment.png", "determinism_vs_triggers.png"))


SECTIONS = {
    "flips": flips_section,
    "calibrate": calibrate_section,
    "verify": verify_section,
    "compare": compare_section,
    "probe": probe_section,
    "diff": diff_section,
}


def engine_build(manifest: dict) -> tuple[str, str]:
    """(version or build, slots) of the engine a flips run audited: a server's own version (vLLM's
    /version, llama.cpp's build from /props) and slots; in process, torch and its kernel family."""
    endpoint = manifest.get("endpoint")
    if endpoint is not None:
        slots = (endpoint.get("props") or {}).get("total_slots")
        return endpoint.get("server_version") or "-", str(slots) if slots else "-"
    capability = (manifest.get("kernel_environment") or {}).get("cpu_capability")
    return f"torch {manifest.get('torch', '?')}" + (f" ({capability})" if capability else ""), "-"


def solo_repeat_text(summary: dict) -> str:
    """An endpoint's solo-twice check; the in-process engine decodes solo once (exact by construction)."""
    repeat = summary.get("solo_repeat")
    if not repeat:
        return "-"
    return "identical" if repeat["deterministic"] else f"{repeat['requests_differing']}/{repeat['requests']} differ"


def engines_side_by_side(runs: list[Path]) -> list[str]:
    """One row per flips run: the engines (in-process, vLLM eager, llama.cpp -np 8...) compared."""
    rows = []
    for run in runs:
        s = _read_json(run / "summary.json")
        version, slots = engine_build(_read_json(run / "manifest.json"))
        flip_margins = s["margin_logit_quantiles_flip"]
        rows.append(
            [
                s.get("engine") or run.name,
                version,
                slots,
                s.get("method") or "-",
                s["dataset"],
                s["sequences"],
                ",".join(map(str, s["batch_sizes"])),
                s["max_new_tokens"],
                s["steps"],
                s["flips"],
                _pct(s["flip_rate"]),
                s.get("synchronous_steps", "-"),
                s.get("first_divergence_flips", "-"),
                _pct(s.get("first_divergence_flip_rate")),
                _num(flip_margins.get("q50")),
                _num(flip_margins.get("q100")),
                f"{s['sequences_diverged']}/{s['sequences']}",
                _pct(s["determinism"]),
                _pct(s.get("drift_share")),
                _num(s.get("max_logprob_drift")),
                solo_repeat_text(s),
                _num(s["solo_tokens_per_s"]),
                _num(s["batched_tokens_per_s"]),
            ]
        )
    return [
        "## Engines side by side",
        "",
        "steps/flips: as the run's method measured them (teacher-forced in process: every step; an endpoint: "
        "up to the first divergence); synchronous steps/flips: up to the first divergence of the free-running "
        "sequences, for every engine alike; drift: share of same-token steps whose top-5 logprobs differ.",
        "",
    ] + _table(
        [
            "engine",
            "version / build",
            "slots",
            "method",
            "dataset",
            "requests",
            "batch",
            "tokens",
            "steps",
            "flips",
            "flip rate",
            "synchronous steps",
            "flips",
            "rate",
            "margin at flips (median)",
            "(max)",
            "diverged",
            "determinism",
            "drift",
            "max drift",
            "solo twice",
            "solo tok/s",
            "batched tok/s",
        ],
        rows,
    )


def schema_note(version) -> str:
    """Which table schema a run was written with; an older one is upgraded on read."""
    from mgbench import SCHEMA_VERSION

    if version is None or str(version) == SCHEMA_VERSION:
        return f"schema {version or '-'}"
    return f"schema {version} (read as {SCHEMA_VERSION})"


def command_line(manifest: dict) -> str:
    """The command as it was typed: the kernel-family variables it ran under, then its argv."""
    import shlex

    variables = [f"{k}={v}" for k, v in (manifest.get("kernel_environment") or {}).items() if v is not None]
    return " ".join(variables + [shlex.quote(arg) for arg in manifest.get("argv", [])])


def _run_lines(run: Path, kind: str, out: Path, prefix: str) -> list[str]:
    manifest = _read_json(run / "manifest.json")
    options = dict(manifest.get("options", {}))
    if kind == "calibrate":  # calibrate's model and datasets live in its calibration.json
        document = _read_json(run / "calibration.json")
        options.update(model=document.get("model"), dataset=", ".join(document.get("datasets", [])))
    return [
        f"## {kind}: {run.name}",
        "",
        f"model `{options.get('model', '-')}`, dataset `{options.get('dataset', '-')}`, device "
        f"{manifest.get('device_name', '-')}, torch {manifest.get('torch', '-')}, transformers "
        f"{manifest.get('transformers', '-')}, mgbench git {str(manifest.get('git_revision', '-'))[:10]}, "
        f"{schema_note(manifest.get('schema_version'))}",
        "",
        f"Command: `{command_line(manifest)}`",
        "",
    ] + SECTIONS[kind](run, out, prefix)


def section_markdown(run: Path) -> str:
    """One run's report.md section as text without its plots (for a CI job's step summary)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mgbench-section-") as scratch:
        lines = _run_lines(run, run_kind(run), Path(scratch), "")
    return "\n".join(line for line in lines if not line.startswith("!["))


def render(runs: list[Path], out: Path) -> Path:
    """Write out/report.md (and its PNGs) for the given run directories."""
    kinds = [run_kind(run) for run in runs]
    unknown = [str(r) for r, k in zip(runs, kinds) if k not in SECTIONS]
    if unknown:
        raise UserError(f"cannot report on {', '.join(unknown)}: unknown command in manifest.json")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot create it ({exc.strerror}); choose a writable directory") from exc
    lines = ["# mgbench report", ""]
    flips_runs = [run for run, kind in zip(runs, kinds) if kind == "flips"]
    if len(flips_runs) > 1:
        lines += engines_side_by_side(flips_runs)
    for index, (run, kind) in enumerate(zip(runs, kinds)):
        lines += _run_lines(run, kind, out, f"{index}-")
    path = out / "report.md"
    temporary = out / ".report.md.tmp"  # report.md appears whole, after its plots
    temporary.write_text("\n".join(lines))
    temporary.replace(path)
    return path

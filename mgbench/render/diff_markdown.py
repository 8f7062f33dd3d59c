"""report.md's section for a `mgbench diff` run: the runs, the pairwise identical-share matrix, the
divergences, the manifests' differences and the histogram of margins at divergence."""

from __future__ import annotations

import json
from pathlib import Path

from mgbench.errors import UserError
from mgbench.render.diff_terminal import kernel_family, margin_headers, share_text
from mgbench.render.md_cells import _copy_plots, _num, _table, _value

PLOT = "divergence_margins.png"
SHOWN = 50  # divergences listed per pair (all are in the run's diff.parquet)


def diff_section(run: Path, out: Path, prefix: str) -> list[str]:
    try:
        s = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{run / 'summary.json'}: cannot read ({exc})") from exc
    names = s["matrix"]["names"]
    by_pair = {(p["run_a"], p["run_b"]): p for p in s["pairs"]}
    lines = [f"{'Batched outputs per batch size' if s['mode'] == 'batched' else 'Solo outputs'} of {s['model']}:", ""]
    lines += _table(
        ["run", "engine", "device", "kernel family", "outputs", "tokens", "path"],
        [
            [
                r["name"],
                r["engine"],
                r["device_name"] or "-",
                kernel_family(r["kernel_environment"]),
                r["outputs"],
                _num(r["max_new_tokens"]),
                f"`{r['path']}`",
            ]
            for r in s["runs"]
        ],
    )
    lines += ["Identical outputs, pair by pair:", ""]
    lines += _table(
        ["", *names],
        [
            [a, *("" if a == b else share_text(by_pair.get((a, b)) or by_pair.get((b, a))) for b in names)]
            for a in names
        ],
    )
    if s.get("required_identical") is not None:
        verdict = "PASS" if s["passed"] else "FAIL"
        lines += [f"Required identical share {s['required_identical']}: {verdict} (lowest {share_lowest(s)}).", ""]
    for pair in s["pairs"]:
        m = pair["margins_at_divergence"]
        lines += [
            f"**{pair['run_a']} vs {pair['run_b']}**: {share_text(pair)} identical (paired by {pair['paired_by']}"
            + (f", first {pair['compared_tokens']} tokens" if pair["compared_tokens"] else "")
            + f"); margins known at {m['known']} of {m['divergences']} divergences, {m['ties']} exact ties, "
            f"wider margin median {_num(m['wider_margin_median'])}, max {_num(m['wider_margin_max'])}.",
            "",
        ]
        if pair["divergences"]:
            batched = s["mode"] == "batched"
            lines += _table(
                [
                    "request",
                    "id",
                    *(["batch", "policy"] if batched else []),
                    "step",
                    f"token {pair['run_a']}",
                    f"token {pair['run_b']}",
                    *margin_headers(pair),
                ],
                [
                    [
                        f"`{d['request']}`",
                        d["request_id_a"],
                        *([d["batch_size"], d["variant"]] if batched else []),
                        d["step"],
                        "end" if d["token_a"] is None else d["token_a"],
                        "end" if d["token_b"] is None else d["token_b"],
                        _num(d["margin_a"]),
                        _num(d["margin_b"]),
                    ]
                    for d in pair["divergences"][:SHOWN]
                ],
            )
            if len(pair["divergences"]) > SHOWN:
                lines += [f"... {len(pair['divergences']) - SHOWN} more in diff.parquet.", ""]
    if s["manifest_differences"]:
        lines += ["What differs between the runs' manifests:", ""]
        lines += _table(
            ["key", *names],
            [[f"`{d['key']}`", *(_value(v, 80) for v in d["values"])] for d in s["manifest_differences"]],
        )
    return lines + _copy_plots(run, out, prefix, (PLOT,))


def share_lowest(summary: dict) -> str:
    return "-" if summary["min_identical_share"] is None else f"{100 * summary['min_identical_share']:.2f}%"

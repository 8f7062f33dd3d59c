"""report.md lines for the probes (stock and fixed-order) and for what a run's determinism is measured against."""

from __future__ import annotations

import json
from pathlib import Path

from mgbench.render.md_cells import _num, _pct, _table
from mgbench.runs.schema import FIXED_ORDER_INVARIANT


def reference_text(summary: dict) -> str:
    """What a run's determinism is measured against, short (old runs: stock solo)."""
    if summary.get("kernels") == "fixed-order":
        return "fixed-order solo"
    return "stock solo (batch-invariant mode)" if summary.get("batch_invariant") else "stock solo"


def fixed_order_lines(summary: dict) -> list[str]:
    """A flips or compare run's fixed-order plan and how often its reference equals stock solo."""
    fixed = summary.get("fixed_order")
    if not fixed:
        return []
    plan, stock = fixed["plan"], fixed["stock_solo"]
    modules = ", ".join(f"{n} modules {form}" for form, n in plan["modules"].items()) or "every module as is"
    lines = [
        f"Fixed-order kernels: attention {plan['attention']}; {modules}; tile size T: "
        f"{plan.get('tile_rows') or 'none needed'}. Determinism is measured against solo "
        f"decoding through the same kernels; that reference equals stock solo output on {stock['identical']} of "
        f"{stock['requests']} sequences. Invariant by construction: {FIXED_ORDER_INVARIANT}."
    ]
    return lines + [f"- fallback: {line}" for line in plan["fallbacks"]] + [""]


def fixed_order_probe_lines(probe: dict) -> list[str]:
    m, check = probe["machine"], probe["chunk_vs_steps"]
    lines = [
        f"Machine: {m.get('gpu') or m['cpu']}, torch CPU capability {m['cpu_capability']}; fixed-order forms on "
        f"{probe['rows']} real prompts (lengths {min(probe['prompt_lengths'])}-{max(probe['prompt_lengths'])}), "
        f"every row at batch sizes {probe['batch_sizes'][0]}-{probe['batch_sizes'][-1]} against itself alone.",
        "",
        "| part | form | modules | exact | rows differing | max abs diff | ms | chosen |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in probe["verdicts"]:
        ms = "-" if v["ms"] is None else f"{v['ms']:.3g}"
        lines.append(
            f"| {v['part']} | {v.get('label', v['form'])} | {v['modules']} | {'yes' if v['exact'] else '**no**'} | "
            f"{v['rows_differing']} | {v['max_abs_diff']:.3g} | {ms} | {'chosen' if v['chosen'] else ''} |"
        )
    lines += [
        "",
        f"A chunk of {check['tokens']} tokens in one forward vs step by step: {check['rows_differing']} of "
        f"{check['rows']} logit rows differ.",
        "",
    ]
    return lines + [f"- fallback: {line}" for line in probe["plan"]["fallbacks"]]


def probe_section(run: Path, out: Path, prefix: str) -> list[str]:
    p = json.loads((run / "probe.json").read_text())
    if p.get("kind") == "mgbench.fixed_order_probe":
        return fixed_order_probe_lines(p)
    m = p["machine"]
    lines = [
        f"Machine: {m.get('gpu') or m['cpu']}, torch CPU capability {m['cpu_capability']}, {p['rows']} rows "
        f"(pads {p['pad_lens'][0]}-{p['pad_lens'][-1]}).",
        "",
    ]
    lines += _table(
        ["op", "module / shape", "n", "invariant", "max abs diff", "differs at", "batch-invariant form"],
        [
            [
                f["op"],
                f["name"],
                f["modules"],
                "yes" if f["invariant"] else "**no**",
                _num(f["max_abs_diff"]),
                f"{f['axis']} {', '.join(map(str, f['varies_at']))}" if f["varies_at"] else "-",
                "-" if f["form"] == "batched" else f["form"],
            ]
            for f in p["findings"]
        ],
    )
    lines += [
        f"Decode step: plain {p['plain_step_ms']:.1f} ms, batch-invariant {p['invariant_step_ms']:.1f} ms "
        f"({_pct(p['invariant_step_increment'])}); exact on the probe batch: "
        f"{'yes' if p['batch_invariant_exact'] else 'NO'}.",
        "",
    ]
    return lines

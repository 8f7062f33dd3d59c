"""The probes' tables in the terminal: `mgbench probe` (stock kernels) and `--kernels fixed-order`."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from mgbench.render.terminal import _fmt, _pct, _spans, _yes


def render_fixed_order_probe(console: Console, probe: dict, model: str, dtype: str) -> None:
    machine = probe["machine"]
    where = machine.get("gpu") or f"{machine['cpu']}, torch CPU capability {machine['cpu_capability']}"
    table = Table(
        title=f"mgbench probe --kernels fixed-order: {model} ({dtype}) on {where}; {probe['rows']} real prompts "
        f"(lengths {min(probe['prompt_lengths'])}-{max(probe['prompt_lengths'])}), batch sizes "
        f"{_spans(probe['batch_sizes'])}, every row against itself alone"
    )
    for column in ("part", "form", "modules", "exact", "rows differing", "max |diff|", "ms", "chosen"):
        table.add_column(column, justify="left" if column in ("part", "form") else "right")
    for v in probe["verdicts"]:
        table.add_row(
            v["part"],
            v.get("label", v["form"]),  # probes written before tiles have no label
            str(v["modules"]),
            _yes(v["exact"]),
            str(v["rows_differing"]),
            _fmt(v["max_abs_diff"], 3),
            _fmt(v["ms"], 3),
            "chosen" if v["chosen"] else "",
        )
    console.print(table)
    tile = probe["plan"].get("tile_rows")
    console.print(
        f"tile size T: {tile} rows" if tile else "tile size T: none needed (no part runs in chunks or tiles)",
        f"(tried {', '.join(map(str, probe.get('tile_rows_tried', []))) or '-'})",
        highlight=False,
    )
    check = probe["chunk_vs_steps"]
    console.print(
        f"a chunk of {check['tokens']} tokens in one forward vs step by step: {check['rows_differing']}/"
        f"{check['rows']} logit rows differ: exact {_yes(check['exact'])}"
    )
    for line in probe["plan"]["fallbacks"]:
        console.print(f"[bold yellow]fallback: {line}[/]")


def render_probe(console: Console, probe: dict, model: str, dtype: str) -> None:
    machine = probe["machine"]
    where = machine.get("gpu") or f"{machine['cpu']}, torch CPU capability {machine['cpu_capability']}"
    table = Table(
        title=f"mgbench probe: {model} ({dtype}) on {where}; {probe['rows']} rows, pads {_spans(probe['pad_lens'])}"
    )
    for column, justify in (
        ("op", "left"),
        ("module / shape", "left"),
        ("n", "right"),
        ("invariant", "center"),
        ("max |diff|", "right"),
        ("differs at", "left"),
        ("batch-invariant form", "left"),
        ("batched ms", "right"),
        ("form ms", "right"),
    ):
        table.add_column(column, justify=justify)
    for f in probe["findings"]:
        differs = f"{f['axis']} {_spans(f['varies_at'])}" if f["varies_at"] else "-"
        form = "-" if f["form"] == "batched" else f["form"]
        table.add_row(
            f["op"],
            f["name"],
            str(f["modules"]),
            _yes(f["invariant"]),
            _fmt(f["max_abs_diff"], 3),
            differs,
            form,
            _fmt(f["batched_ms"], 3),
            _fmt(f["form_ms"], 3),
        )
    console.print(table)
    increment = probe["invariant_step_increment"]
    console.print(
        f"decode step: plain {probe['plain_step_ms']:.1f} ms, batch-invariant {probe['invariant_step_ms']:.1f} ms "
        f"({_pct(increment)}); batch-invariant mode exact on the probe batch: {_yes(probe['batch_invariant_exact'])}"
    )

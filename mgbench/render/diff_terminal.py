"""`mgbench diff` in the terminal (rich): the runs, the identical-share matrix, each pair's
divergences and what differs between the manifests."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from mgbench.render.md_cells import _num, _pct, _value


def share_text(pair: dict | None) -> str:
    return "-" if pair is None else f"{pair['identical']}/{pair['paired']} ({_pct(pair['identical_share'])})"


def render_diff(console: Console, summary: dict, shown: int = 20) -> None:
    """`shown`: divergences listed per pair (all of them are in summary.json and diff.parquet)."""
    outputs = "batched outputs (per batch size)" if summary["mode"] == "batched" else "solo outputs"
    runs = Table(title=f"mgbench diff: {summary['model']}, {outputs} of the same requests")
    for column in ("run", "engine", "device", "kernel family", "outputs", "tokens", "schema", "path"):
        runs.add_column(column, justify="right" if column in ("outputs", "tokens", "schema") else "left")
    for run in summary["runs"]:
        runs.add_row(
            run["name"],
            run["engine"],
            run["device_name"] or "-",
            kernel_family(run["kernel_environment"]),
            str(run["outputs"]),
            _num(run["max_new_tokens"]),
            run["schema_version_read"],
            run["path"],
        )
    console.print(runs)

    names = summary["matrix"]["names"]
    by_pair = {(p["run_a"], p["run_b"]): p for p in summary["pairs"]}
    matrix = Table(title="identical outputs, pair by pair (paired requests)")
    matrix.add_column("")
    for name in names:
        matrix.add_column(name, justify="right")
    for a in names:
        matrix.add_row(a, *("" if a == b else share_text(by_pair.get((a, b)) or by_pair.get((b, a))) for b in names))
    console.print(matrix)

    for pair in summary["pairs"]:
        line = (
            f"[bold]{pair['run_a']} vs {pair['run_b']}[/]: {share_text(pair)} identical, paired by {pair['paired_by']}"
        )
        if pair["only_in_a"] or pair["only_in_b"]:
            line += (
                f"; unpaired: {pair['only_in_a']} only in {pair['run_a']}, {pair['only_in_b']} only in {pair['run_b']}"
            )
        if pair["compared_tokens"]:
            line += f"; first {pair['compared_tokens']} tokens compared (the runs' max-new-tokens differ)"
        console.print(line, highlight=False)
        if not pair["divergences"]:
            continue
        table = Table(show_edge=False)
        for column in ("request", "id", *(("batch", "policy") if summary["mode"] == "batched" else ()), "step"):
            table.add_column(column, justify="left" if column in ("request", "policy") else "right")
        for column in (f"token {pair['run_a']}", f"token {pair['run_b']}", *margin_headers(pair)):
            table.add_column(column, justify="right")
        for d in pair["divergences"][:shown]:
            table.add_row(
                d["request"],
                str(d["request_id_a"])
                if d["request_id_a"] == d["request_id_b"]
                else f"{d['request_id_a']}/{d['request_id_b']}",
                *((str(d["batch_size"]), d["variant"]) if summary["mode"] == "batched" else ()),
                str(d["step"]),
                "end" if d["token_a"] is None else str(d["token_a"]),
                "end" if d["token_b"] is None else str(d["token_b"]),
                _num(d["margin_a"]),
                _num(d["margin_b"]),
            )
        console.print(table)
        if len(pair["divergences"]) > shown:
            console.print(f"... {len(pair['divergences']) - shown} more (diff.parquet, summary.json)")

    differences = summary["manifest_differences"]
    if differences:
        table = Table(title="what differs between the runs' manifests")
        table.add_column("key")
        for name in names:
            table.add_column(name)
        for difference in differences:
            table.add_row(difference["key"], *(_value(v) for v in difference["values"]))
        console.print(table)
    else:
        console.print("the runs' manifests agree on every compared key")


def margin_headers(pair: dict) -> tuple[str, str]:
    return f"solo margin {pair['run_a']}", f"solo margin {pair['run_b']}"


def kernel_family(environment: dict | None) -> str:
    """ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA as set for the run; 'native' where unset; '-' for a
    run recorded before manifests kept them."""
    if environment is None:
        return "-"
    capability, isa = environment.get("ATEN_CPU_CAPABILITY"), environment.get("ONEDNN_MAX_CPU_ISA")
    if capability is None and isa is None:
        return "native"
    return f"{capability or 'native'} / {isa or 'native'}"

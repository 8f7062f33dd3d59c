"""The `mgbench` Typer app: one command per module in this folder, assembled here."""

from __future__ import annotations

import sys

import typer

from mgbench.cli import calibrate, catalogue, compare, diff, flips, probe, report, verify

app = typer.Typer(
    help="Audit and benchmark batch-invariance of greedy LLM decoding (MarginGate).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


app.command()(flips.flips)
app.command()(calibrate.calibrate)
app.command()(verify.verify)
app.command()(compare.compare)
app.command()(probe.probe)
app.command()(diff.diff)
app.command("report")(report.report_command)
app.command()(catalogue.models)
app.command()(catalogue.datasets)


def main() -> None:  # pragma: no cover - `python -m mgbench`
    app(prog_name="mgbench")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

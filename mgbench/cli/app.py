"""The `mgbench` Typer app: one command per module in this folder, assembled here."""

from __future__ import annotations

import sys

import typer

from mgbench.cli import calibrate, catalogue, compare, diff, flips, probe, report, verify
from mgbench.cli.exits import OneLineErrors, plain_help, version_callback

# Help is plain text wrapped to the terminal (up to 200 columns): rich's panels cut option names,
# defaults and examples with "…" in a narrow terminal or a pipe.
WIDE = {"max_content_width": 200}

app = typer.Typer(
    cls=OneLineErrors,
    help="Audit and benchmark batch-invariance of greedy LLM decoding (MarginGate).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings=WIDE,
)


@app.callback()
def main_options(
    version: bool = typer.Option(
        False,
        "--version",
        callback=version_callback,
        is_eager=True,
        help="Print the version (and git revision in a checkout), torch and transformers, then exit.",
    ),
) -> None:
    """Audit and benchmark batch-invariance of greedy LLM decoding (MarginGate)."""


for function, name in (
    (flips.flips, "flips"),
    (calibrate.calibrate, "calibrate"),
    (verify.verify, "verify"),
    (compare.compare, "compare"),
    (probe.probe, "probe"),
    (diff.diff, "diff"),
    (report.report_command, "report"),
    (catalogue.models, "models"),
    (catalogue.datasets, "datasets"),
):
    help_text = plain_help(function.__doc__)
    summary = " ".join(help_text.split("\n\n")[0].split())  # listed whole under Commands, not cut at 45 characters
    app.command(name, help=help_text, short_help=summary, context_settings=WIDE)(function)


def main() -> None:  # pragma: no cover - `python -m mgbench`
    app(prog_name="mgbench")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

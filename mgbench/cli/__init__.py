"""The command line: the Typer app (app.py), one module per command, shared options and errors."""

from mgbench.cli.app import app, main

__all__ = ["app", "main"]

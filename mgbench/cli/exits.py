"""The one place that turns errors into a line on stderr and an exit code."""

from __future__ import annotations

from contextlib import contextmanager

import typer
from rich.markup import escape

from mgbench.errors import NothingToDo, UserError
from mgbench.render.console import err_console


@contextmanager
def user_errors(debug: bool):
    """Bad input -> one line on stderr and exit code 2 (the traceback only with --debug); work
    already done -> one line on stderr and exit code 0."""
    try:
        yield
    except NothingToDo as exc:
        err_console.print(f"[green]done:[/] {escape(str(exc))}", highlight=False, soft_wrap=True, emoji=False)
        raise typer.Exit(0) from None
    except UserError as exc:
        if debug:
            err_console.print_exception()
        # The message as written: a path or value holding [brackets] or :name: is not rich markup or an emoji.
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True, emoji=False)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err_console.print(
            "[bold red]interrupted:[/] nothing was published (flips and verify keep their finished "
            "groups: the same command with --resume continues)"
        )
        raise typer.Exit(130) from None

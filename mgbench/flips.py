"""The flips pipeline: dataset -> prompts -> audit (group by group) -> part files -> published run.

Shared by `mgbench flips` and by `mgbench calibrate`, which records its traces through it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa

from . import analysis, data, results
from .audit import AuditRecords, ProgressFn, audit_groups
from .config import RunOptions
from .oom import SplitFn
from .parts import RunWriter, finish_run, owned_groups
from .sharding import Shard

SCHEMAS = {"steps": results.STEPS_SCHEMA, "sequences": results.SEQUENCES_SCHEMA}


@dataclass
class PreparedRun:
    options: RunOptions
    config: data.DatasetConfig
    requests: list[data.Request]
    max_new_tokens: int
    shard: Shard = field(default_factory=Shard)
    resume: bool = False
    owned: frozenset[int] = frozenset({0})  # group indices this shard decodes
    # The CI gate's verdict on the finished run's (summary, tables), written into the summary.
    gate: Callable[[dict, dict[str, pa.Table]], dict] | None = None

    def wanted(self, done: set[int]) -> Callable[[int], bool]:
        """Groups still to decode here: this shard's, less those an interrupted run committed."""
        return lambda group: group in self.owned and group not in done


def prepare(options: RunOptions, shard: Shard = Shard(), resume: bool = False) -> PreparedRun:
    """Everything that can fail on bad input, checked before a model is loaded."""
    config = data.load_config(options.dataset)
    requests = data.select_requests(config, data.read_records(config), options.limit, options.seed)
    # Groups are cut from the requests by the largest batch size, whatever their order.
    owned = frozenset(owned_groups(math.ceil(len(requests) / max(options.batch_sizes)), shard))
    return PreparedRun(options, config, requests, options.max_new_tokens or config.max_new_tokens, shard, resume,
                       owned)


def fingerprint(command: str, run: PreparedRun, extra: dict | None = None) -> dict:
    """What must not change between an interrupted run and its --resume, or between shards."""
    return {"command": command, "options": {**asdict(run.options), "max_new_tokens": run.max_new_tokens},
            "requests": [r.request_id for r in run.requests], **(extra or {})}


def group_record(records: AuditRecords) -> dict:
    """The timings of one group, kept beside its table parts (JSON keys are strings)."""
    return {
        "solo_tokens": records.solo_tokens, "solo_seconds": records.solo_seconds,
        "batched_tokens": {str(b): n for b, n in records.batched_tokens.items()},
        "batched_seconds": {str(b): s for b, s in records.batched_seconds.items()},
        "oom_splits": records.oom_splits,
    }


def summarize(run: PreparedRun, tables: dict[str, pa.Table], group_records: list[dict]) -> dict:
    """Summary of a flips run from its tables and its groups' timings."""
    options = run.options
    solo_tokens = sum(r["solo_tokens"] for r in group_records)
    solo_seconds = sum(r["solo_seconds"] for r in group_records)
    tokens, seconds = {}, {}
    for record in group_records:
        for b, n in record["batched_tokens"].items():
            tokens[b] = tokens.get(b, 0) + n
            seconds[b] = seconds.get(b, 0.0) + record["batched_seconds"][b]
    batched_seconds = sum(seconds.values())
    return {
        "model": options.model,
        "dataset": run.config.name,
        "prefill": options.prefill,
        "batch_invariant": options.batch_invariant,
        "max_new_tokens": run.max_new_tokens,
        "batch_sizes": list(options.batch_sizes),
        **analysis.summarize_flips(tables["steps"].to_pandas(), tables["sequences"].to_pandas()),
        "solo_tokens_per_s": solo_tokens / solo_seconds if solo_seconds > 0 else None,
        "batched_tokens_per_s": sum(tokens.values()) / batched_seconds if batched_seconds > 0 else None,
        "batched_tokens_per_s_by_batch_size": {
            b: tokens[b] / s if s > 0 else None for b, s in sorted(seconds.items(), key=lambda kv: int(kv[0]))
        },
        "oom_splits": [split for record in group_records for split in record["oom_splits"]],
    }


def with_gate(run: PreparedRun, summary: dict, tables: dict[str, pa.Table]) -> dict:
    """The summary, with the CI gate's verdict on it when the run has a gate (flips and verify)."""
    if run.gate is not None:
        summary["gate"] = run.gate(summary, tables)
    return summary


def open_writer(run: PreparedRun, out: Path) -> RunWriter:
    return RunWriter(out, run.shard, fingerprint("flips", run), run.resume)


def record_flips(lm, run: PreparedRun, out: Path, on_progress: ProgressFn, on_split: SplitFn = lambda b, h: None,
                 writer: RunWriter | None = None, probe=None) -> tuple[dict, bool]:
    """Decode, analyse and publish one flips run (or shard); (summary, whole run complete?).

    Groups already committed by an interrupted run are not decoded again. A batch-invariant run
    decodes under the plan of `probe` (a ProbeReport of this model on this machine)."""
    options, config = run.options, run.config
    writer = writer or open_writer(run, out)
    summarize_run = lambda tables, records: with_gate(run, summarize(run, tables, records), tables)  # noqa: E731
    if writer.finishing_only:
        return finish_run(writer, SCHEMAS, summarize_run, None)
    prompts = [data.encode(lm.tokenizer, config, request.text) for request in run.requests]
    for index, records in audit_groups(
        lm.model, lm.tokenizer, run.requests, prompts, options, run.max_new_tokens, config.name, lm.device,
        wanted=run.wanted(writer.done_groups()), on_progress=on_progress, on_split=on_split,
        plan=probe.plan if probe is not None else None,
    ):
        writer.commit(index, {"steps": results.steps_table(records.steps, options.model, config.name),
                              "sequences": results.sequences_table(records.sequences, options.model)},
                      group_record(records))
    run_manifest = results.manifest(
        "flips", {**asdict(options), "max_new_tokens": run.max_new_tokens, "shard": str(run.shard)}, lm.device,
        {"dtype": lm.dtype, "attn": lm.attn, "model_source": lm.source, "dataset_config": asdict(config),
         **({"probe": probe.to_dict()} if probe is not None else {})},
    )
    return finish_run(writer, SCHEMAS, summarize_run, run_manifest)

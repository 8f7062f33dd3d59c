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
from .grouping import AuditRecords, ProgressFn
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
    endpoint: object | None = None  # EndpointOptions when a served model is audited (else in-process)
    engine_label: str | None = None  # set once the engine is open (summaries name it)
    inputs: list[dict] = field(default_factory=list)  # recorded runs read (a --baseline), for the manifest

    def wanted(self, done: set[int]) -> Callable[[int], bool]:
        """Groups still to decode here: this shard's, less those an interrupted run committed."""
        return lambda group: group in self.owned and group not in done


def prepare(options: RunOptions, shard: Shard = Shard(), resume: bool = False, endpoint=None) -> PreparedRun:
    """Everything that can fail on bad input, checked before a model is loaded or a server contacted."""
    config = data.load_config(options.dataset)
    requests = data.select_requests(config, data.read_records(config), options.limit, options.seed)
    # Groups are cut from the requests by the largest batch size, whatever their order.
    owned = frozenset(owned_groups(math.ceil(len(requests) / max(options.batch_sizes)), shard))
    return PreparedRun(options, config, requests, options.max_new_tokens or config.max_new_tokens, shard, resume,
                       owned, endpoint=endpoint)


def fingerprint(command: str, run: PreparedRun, extra: dict | None = None) -> dict:
    """What must not change between an interrupted run and its --resume, or between shards."""
    endpoint = {"endpoint": run.endpoint.fingerprint()} if run.endpoint is not None else {}
    return {"command": command, "options": {**asdict(run.options), "max_new_tokens": run.max_new_tokens},
            "requests": [r.request_id for r in run.requests], **endpoint, **(extra or {})}


def group_record(records: AuditRecords) -> dict:
    """The timings of one group, kept beside its table parts (JSON keys are strings)."""
    return {
        "solo_tokens": records.solo_tokens, "solo_seconds": records.solo_seconds,
        "batched_tokens": {str(b): n for b, n in records.batched_tokens.items()},
        "batched_seconds": {str(b): s for b, s in records.batched_seconds.items()},
        "oom_splits": records.oom_splits,
        **records.extra,
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
    steps = tables["steps"].to_pandas()
    return {
        "model": options.model,
        "dataset": run.config.name,
        "engine": run.engine_label,
        "method": analysis.step_method(steps),
        "prefill": options.prefill,
        "batch_invariant": options.batch_invariant,
        "max_new_tokens": run.max_new_tokens,
        "batch_sizes": list(options.batch_sizes),
        **analysis.summarize_flips(steps, tables["sequences"].to_pandas()),
        "solo_tokens_per_s": solo_tokens / solo_seconds if solo_seconds > 0 else None,
        "batched_tokens_per_s": sum(tokens.values()) / batched_seconds if batched_seconds > 0 else None,
        "batched_tokens_per_s_by_batch_size": {
            b: tokens[b] / s if s > 0 else None for b, s in sorted(seconds.items(), key=lambda kv: int(kv[0]))
        },
        "oom_splits": [split for record in group_records for split in record["oom_splits"]],
        **solo_repeat_summary(group_records),
    }


def solo_repeat_summary(group_records: list[dict]) -> dict:
    """An endpoint's determinism at batch size 1 (solo vs solo again), summed over groups; {}
    for the in-process engine, whose solo decoding runs once."""
    repeats = [record["solo_repeat"] for record in group_records if "solo_repeat" in record]
    if not repeats:
        return {}
    total = {key: sum(r[key] for r in repeats) for key in ("requests", "requests_differing", "steps",
                                                             "logprob_steps_differing")}
    total["max_logprob_drift"] = max(r["max_logprob_drift"] for r in repeats)
    total["differing"] = [d for r in repeats for d in r["differing"]]
    total["deterministic"] = total["requests_differing"] == 0 and total["logprob_steps_differing"] == 0
    return {"solo_repeat": total}


def with_gate(run: PreparedRun, summary: dict, tables: dict[str, pa.Table]) -> dict:
    """The summary, with the CI gate's verdict on it when the run has a gate (flips and verify)."""
    if run.gate is not None:
        summary["gate"] = run.gate(summary, tables)
    return summary


def open_writer(run: PreparedRun, out: Path) -> RunWriter:
    return RunWriter(out, run.shard, fingerprint("flips", run), run.resume)


def record_flips(engine, run: PreparedRun, out: Path, on_progress: ProgressFn,
                 on_split: SplitFn = lambda b, h: None, writer: RunWriter | None = None) -> tuple[dict, bool]:
    """Decode, analyse and publish one flips run (or shard) through `engine` (an
    engines.AuditEngine; None when only finishing a sharded run); (summary, whole run complete?).

    Groups already committed by an interrupted run are not decoded again."""
    options, config = run.options, run.config
    writer = writer or open_writer(run, out)
    summarize_run = lambda tables, records: with_gate(run, summarize(run, tables, records), tables)  # noqa: E731
    if writer.finishing_only:
        return finish_run(writer, SCHEMAS, summarize_run, None)
    run.engine_label = engine.label
    prompts = [data.encode(engine.tokenizer, config, request.text) for request in run.requests]
    for index, records in engine.audit(run, prompts, run.wanted(writer.done_groups()), on_progress, on_split):
        writer.commit(index, {"steps": results.steps_table(records.steps, options.model, config.name),
                              "sequences": results.sequences_table(records.sequences, options.model)},
                      group_record(records))
    return finish_run(writer, SCHEMAS, summarize_run, engine.manifest(run))

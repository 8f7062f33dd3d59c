"""The flips pipeline: dataset -> prompts -> audit (group by group) -> part files -> published run.

Shared by `mgbench flips` and by `mgbench calibrate`, which records its traces through it.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from mgbench.analysis import figures, gate
from mgbench.analysis.gate import GateSpec
from mgbench.analysis.step_aggregates import StepAggregates, aggregate
from mgbench.assets import datasets
from mgbench.assets.models import load_tokenizer
from mgbench.engines.endpoint.engine import EndpointEngine
from mgbench.engines.inprocess.engine import InProcessEngine
from mgbench.engines.interface import AuditRecords, engine_kind
from mgbench.pipelines.prepared import PreparedRun, fingerprint, prepare, with_gate
from mgbench.pipelines.probe import fixed_order_summary, kernels_for_run, probe_if_invariant
from mgbench.pipelines.session import attach_gate, finish_output, gate_lines, load_with_status, shard_status, warn_split
from mgbench.render import terminal
from mgbench.render.console import console, err_console, pass_progress
from mgbench.render.junit import flips_junit, write_junit
from mgbench.runs import rundir, schema
from mgbench.runs.groups import ProgressFn
from mgbench.runs.oom import SplitFn
from mgbench.runs.options import RunOptions, reference_of
from mgbench.runs.parts import RunWriter, finish_run
from mgbench.runs.placement import Placement, output_dir

SCHEMAS = {"steps": schema.STEPS_SCHEMA, "sequences": schema.SEQUENCES_SCHEMA}


def group_record(records: AuditRecords) -> dict:
    """The timings of one group, kept beside its table parts (JSON keys are strings)."""
    return {
        "solo_tokens": records.solo_tokens,
        "solo_seconds": records.solo_seconds,
        "batched_tokens": {str(b): n for b, n in records.batched_tokens.items()},
        "batched_seconds": {str(b): s for b, s in records.batched_seconds.items()},
        "oom_splits": records.oom_splits,
        **records.extra,
    }


def summarize(run: PreparedRun, steps: StepAggregates, sequences: pd.DataFrame, group_records: list[dict]) -> dict:
    """Summary of a flips run from its steps' aggregates, its sequences and its groups' timings."""
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
        "engine": run.engine_label,
        "method": figures.step_method(steps),
        "prefill": options.prefill,
        "batch_invariant": options.batch_invariant,
        "kernels": options.kernels,
        "reference": reference_of(options.kernels),
        **fixed_order_figures(group_records),
        "max_new_tokens": run.max_new_tokens,
        "batch_sizes": list(options.batch_sizes),
        "axes": list(options.axes),
        **prefill_axes_facts(group_records),
        **figures.summarize_flips(steps, sequences),
        "solo_tokens_per_s": solo_tokens / solo_seconds if solo_seconds > 0 else None,
        "batched_tokens_per_s": sum(tokens.values()) / batched_seconds if batched_seconds > 0 else None,
        "batched_tokens_per_s_by_batch_size": {
            b: tokens[b] / s if s > 0 else None for b, s in sorted(seconds.items(), key=lambda kv: int(kv[0]))
        },
        "oom_splits": [split for record in group_records for split in record["oom_splits"]],
        **solo_repeat_summary(group_records),
    }


def prefill_axes_facts(group_records: list[dict]) -> dict:
    """Where a run with prefill axes cut its prompts (the same in every group): {} without them."""
    cuts = next((record["prefill_axes"] for record in group_records if "prefill_axes" in record), None)
    return {"prefill_axes": cuts} if cuts else {}


def fixed_order_figures(group_records: list[dict]) -> dict:
    """A fixed-order run's plan (from its probe) and how many of its solo outputs equal stock solo
    outputs, summed over groups; {} for a stock run."""
    groups = [record["fixed_order"] for record in group_records if "fixed_order" in record]
    if not groups:
        return {}
    stock = {key: sum(g["stock_solo"].get(key, 0) for g in groups) for key in ("requests", "identical")}
    return {"fixed_order": {**{k: v for k, v in groups[0].items() if k != "stock_solo"}, "stock_solo": stock}}


def solo_repeat_summary(group_records: list[dict]) -> dict:
    """An endpoint's determinism at batch size 1 (solo vs solo again), summed over groups; {}
    for the in-process engine, whose solo decoding runs once."""
    repeats = [record["solo_repeat"] for record in group_records if "solo_repeat" in record]
    if not repeats:
        return {}
    total = {
        key: sum(r[key] for r in repeats)
        for key in ("requests", "requests_differing", "steps", "logprob_steps_differing")
    }
    total["max_logprob_drift"] = max(r["max_logprob_drift"] for r in repeats)
    total["differing"] = [d for r in repeats for d in r["differing"]]
    total["deterministic"] = total["requests_differing"] == 0 and total["logprob_steps_differing"] == 0
    return {"solo_repeat": total}


def open_writer(run: PreparedRun, out: Path) -> RunWriter:
    return RunWriter(out, run.shard, fingerprint("flips", run), run.resume)


def record_flips(
    engine,
    run: PreparedRun,
    out: Path,
    on_progress: ProgressFn,
    on_split: SplitFn = lambda b, h: None,
    writer: RunWriter | None = None,
) -> tuple[dict, bool]:
    """Decode, analyse and publish one flips run (or shard) through `engine` (an
    engines.AuditEngine; None when only finishing a sharded run); (summary, whole run complete?).

    Groups already committed by an interrupted run are not decoded again."""
    options, config = run.options, run.config
    writer = writer or open_writer(run, out)

    def summarize_run(tables: dict, records: list[dict]) -> dict:
        """The steps table (Arrow, or a sharded run's part files) streamed once into the aggregates
        that the summary and the gate share; the sequences (one row each) read whole."""
        steps = aggregate(tables["steps"], pairs=run.has_baseline)
        summary = summarize(run, steps, tables["sequences"].to_pandas(), records)
        return with_gate(run, summary, {"steps": steps, "sequences": tables["sequences"]})

    if writer.finishing_only:
        return finish_run(writer, SCHEMAS, summarize_run, None, streamed=("steps",))
    run.engine_label = engine.label
    prompts = [datasets.encode(engine.tokenizer, config, request.text) for request in run.requests]
    for index, records in engine.audit(run, prompts, run.wanted(writer.done_groups()), on_progress, on_split):
        writer.commit(
            index,
            {
                "steps": schema.steps_table(records.steps, options.model, config.name),
                "sequences": schema.sequences_table(records.sequences, options.model),
            },
            group_record(records),
        )
    return finish_run(writer, SCHEMAS, summarize_run, engine.manifest(run), streamed=("steps",))


def in_process_engine(lm, run, label: str | None = None):
    """The in-process engine on a loaded model (None: a shard only finishing, nothing to decode)."""
    if lm is None:
        return None
    kernels, fixed_probe = kernels_for_run(lm, run)
    facts = fixed_order_summary(fixed_probe) if fixed_probe is not None else None
    engine = InProcessEngine(lm, probe_if_invariant(lm, run), kernels, facts)
    engine.label = label or engine.label
    return engine


def record_with_progress(engine, run, out: Path, writer=None) -> tuple[dict, bool]:
    """One flips recording with progress bars for its passes (an endpoint's solo repeat too)."""
    name = run.config.name
    batched = "batched (concurrent)" if run.endpoint is not None else "batched (forced + free)"
    with pass_progress(
        f"{name}: solo (batch size 1)",
        f"{name}: {batched}",
        len(run.requests),
        run.options.passes_per_request,
        f"{name}: solo again" if run.endpoint is not None else None,
    ) as advance:
        return record_flips(engine, run, out, advance, warn_split, writer)


def open_engine(options: RunOptions, run, endpoint_options, label: str | None):
    """The engine a flips run decodes through: the server at --endpoint, or the model in process."""
    if endpoint_options is None:
        return in_process_engine(load_with_status(options), run, label)
    tokenizer, source = load_tokenizer(options.model)
    with err_console.status(f"connecting to {endpoint_options.base}"):
        engine = EndpointEngine.open(endpoint_options, tokenizer, source, run)
    info = engine.info
    err_console.print(
        f"endpoint: {engine.label}, model {info.served_model!r}, prompts as {info.prompt_format}"
        + (f" ({'; '.join(info.notes)})" if info.notes else ""),
        highlight=False,
    )
    return engine


def run_flips(
    options: RunOptions,
    placement: Placement,
    out: Path,
    spec: GateSpec,
    junit: Path | None,
    json_out: bool,
    endpoint_options=None,
    label: str | None = None,
) -> bool:
    """`mgbench flips` from validated options to a published run directory and its report;
    False when the run's determinism gate failed."""
    run = prepare(options, placement.shard, placement.resume, endpoint_options)
    baseline = attach_gate(run, spec, "flips", {"engine": engine_kind(run)})
    with output_dir(placement, out) as target, open_writer(run, target) as writer:
        engine = None if writer.finishing_only else open_engine(options, run, endpoint_options, label)
        try:
            if baseline is not None and engine is not None:
                gate.check_baseline_prompts(
                    baseline,
                    {r.request_id: datasets.encode(engine.tokenizer, run.config, r.text) for r in run.requests},
                )
            summary, complete = record_with_progress(engine, run, target, writer)
        finally:
            if engine is not None:
                engine.close()
    if not placement.writes:
        return True
    sequences = rundir.read_own_table(out, "sequences", schema.SEQUENCES_SCHEMA, placement.shard).to_pandas()
    if junit is not None:
        write_junit(junit, flips_junit(summary))

    def render() -> None:
        terminal.render_flips(console, summary, figures.batch_pad_lengths(sequences))
        shard_status(placement, out, complete)

    finish_output(out, summary, json_out, render)
    gate_lines(summary)
    return (summary.get("gate") or {"passed": True})["passed"]

"""`mgbench verify`: free-running batched decoding under verification policies, each output
compared with its solo reference, over batch sizes and (needle mode) positions in the batch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from mgbench.analysis import figures
from mgbench.analysis.divergence import first_divergence
from mgbench.analysis.gate import GateSpec
from mgbench.assets import datasets
from mgbench.assets.needle import batch_layouts, filler_prompts
from mgbench.engines.inprocess.audit import eos_token_ids, pad_token_id, solo_groups
from mgbench.engines.inprocess.kernels.batch_invariant import InvariancePlan, decoding_mode
from mgbench.engines.inprocess.kernels.sets import STOCK, Kernels, row_prefills
from mgbench.engines.inprocess.verification.loop import run_free
from mgbench.engines.inprocess.verification.spec import PolicySpec
from mgbench.pipelines.prepared import PreparedRun, fingerprint, prepare, with_gate
from mgbench.pipelines.probe import fixed_order_summary, kernels_for_run, probe_if_invariant
from mgbench.pipelines.session import attach_gate, finish_output, gate_lines, load_with_status, shard_status, warn_split
from mgbench.render import terminal
from mgbench.render.console import console, pass_progress
from mgbench.render.junit import junit_xml, write_junit
from mgbench.runs import rundir, schema
from mgbench.runs.groups import ProgressFn, batch_id_base, wanted_groups
from mgbench.runs.oom import SplitFn, recording_splits, run_splitting_on_oom
from mgbench.runs.options import RunOptions, reference_of
from mgbench.runs.parts import RunWriter, finish_run
from mgbench.runs.placement import Placement, output_dir
from mgbench.runs.schema import VERIFY_SEQUENCES_SCHEMA, VERIFY_STEP_FIELDS, VERIFY_STEPS_SCHEMA


@dataclass
class VerifyRecords:
    steps: list[dict] = field(default_factory=list)
    sequences: list[dict] = field(default_factory=list)
    shortfalls: list[dict] = field(default_factory=list)
    seconds: dict[tuple[str, int], float] = field(default_factory=dict)  # (policy label, batch size) -> decode s
    oom_splits: list[dict] = field(default_factory=list)  # batches retried smaller after out-of-memory


def group_record(records: VerifyRecords) -> dict:
    """Timings, shortfalls and out-of-memory splits of one group, kept beside its table parts."""
    return {
        "seconds": [{"policy": label, "batch_size": b, "seconds": t} for (label, b), t in records.seconds.items()],
        "shortfalls": records.shortfalls,
        "oom_splits": records.oom_splits,
    }


def verify_groups(
    lm,
    run: PreparedRun,
    specs: list[PolicySpec],
    needle: bool,
    wanted: Callable[[int], bool],
    on_progress: ProgressFn,
    on_split: SplitFn,
    plan: InvariancePlan | None = None,
    kernels: Kernels = STOCK,
) -> Iterator[tuple[int, VerifyRecords]]:
    """Yield (group index, records of that group) for every wanted group, in decoding order.
    With a `plan` (the batch-invariant mode) every batch decodes under it, policies on top."""
    model, tokenizer, options, device = lm.model, lm.tokenizer, run.options, lm.device
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = pad_token_id(tokenizer, eos_ids)
    prompts = [datasets.encode(tokenizer, run.config, r.text) for r in run.requests]
    fillers = filler_prompts(run, tokenizer, 16) if needle else []
    filler_tensors = [torch.tensor(p, dtype=torch.long, device=device) for p in fillers]
    groups = wanted_groups(prompts, options, wanted, on_progress)
    group_size = max(options.batch_sizes)
    with torch.inference_mode():
        for index, group, tensors, solos in solo_groups(
            model, prompts, groups, run.max_new_tokens, eos_ids, device, kernels
        ):
            on_progress("solo", len(group))
            records = VerifyRecords()
            batch_id = batch_id_base(index, group_size, len(options.batch_sizes) * len(specs))
            split = recording_splits(records.oom_splits, on_split)

            for spec in specs:
                for batch_size in options.batch_sizes:
                    for batch in _batches(group, batch_size, tensors, solos, needle, filler_tensors, run, options.seed):

                        def run_batch(chosen, batch=batch):
                            part = batch.part(chosen)
                            return part, _run_batch(model, run, spec, pad_id, eos_ids, part, plan, kernels)

                        for _, (part, (free, policy)) in run_splitting_on_oom(
                            batch.members, run_batch, split, len(batch.prompts)
                        ):
                            ran = len(part.prompts)
                            key = (spec.label, ran)
                            records.seconds[key] = records.seconds.get(key, 0.0) + free.decode_seconds
                            for shortfall in policy.verifier.shortfalls:
                                if shortfall["row"] in part.rows:
                                    request = run.requests[part.members[part.rows.index(shortfall["row"])]]
                                    records.shortfalls.append(
                                        {
                                            "policy": spec.label,
                                            "batch_size": ran,
                                            "request_id": request.request_id,
                                            **shortfall,
                                        }
                                    )
                            for i, row in zip(part.members, part.rows):
                                _append(
                                    records,
                                    run,
                                    spec,
                                    batch_id,
                                    row,
                                    ran,
                                    free,
                                    prompts[i],
                                    run.requests[i].request_id,
                                    solos[i].tokens.tolist(),
                                )
                            batch_id += 1
                        on_progress("batched", len(batch.members))
            yield index, records


@dataclass
class Batch:
    """One batch to verify: the verified requests, their rows, and every row's prompt and solo
    references (None for needle fillers, which are decoded but not checked)."""

    members: list[int]
    rows: list[int]
    prompts: list
    prefills: list
    solos: list

    def part(self, chosen: list[int]) -> "Batch":
        """The batch of only `chosen` members, for an out-of-memory retry (plain batches only:
        there every row is a member)."""
        if len(chosen) == len(self.members):
            return self
        picked = [self.members.index(i) for i in chosen]
        return Batch(
            list(chosen),
            list(range(len(chosen))),
            *([values[k] for k in picked] for values in (self.prompts, self.prefills, self.solos)),
        )


def _run_batch(model, run, spec, pad_id, eos_ids, batch: Batch, plan: InvariancePlan | None, kernels=STOCK):
    with kernels.active(model):
        prefills = row_prefills(model, batch.prompts, batch.prefills)
    policy = spec.build(model, batch.prompts, prefills, batch.solos, run.max_new_tokens, kernels=kernels)
    # A replay policy's batch decodes with the stock kernels (it verifies with `kernels`).
    decoding = STOCK if spec.repair == "replay" else kernels
    with decoding_mode(model, batch.prompts, plan), decoding.active(model):
        free = run_free(
            model, batch.prompts, prefills, run.options.prefill, pad_id, run.max_new_tokens, eos_ids, policy, decoding
        )
    return free, policy


def _batches(group, batch_size, tensors, solos, needle, fillers, run, seed):
    """The batches of one group at one batch size (needle.batch_layouts), with every row's prompt
    and, for the verified rows, their solo references."""
    for members, rows, slots in batch_layouts(group, batch_size, needle, run.requests, len(fillers), seed):
        references = [solos[j] if kind == "request" else None for kind, j in slots]
        yield Batch(
            members,
            rows,
            [tensors[j] if kind == "request" else fillers[j] for kind, j in slots],
            [None if solo is None else solo.row_prefill for solo in references],
            references,
        )


def _append(records, run, spec, batch_id, row, batch_size, free, prompt, request_id, solo_ids):
    batched_ids = free.tokens[row]
    n = len(batched_ids)
    solo_padded = np.full(n, -1, dtype=np.int64)
    solo_padded[: min(n, len(solo_ids))] = solo_ids[:n]
    divergence = first_divergence(solo_ids, batched_ids)
    common = {
        "model": run.options.model,
        "dataset": run.config.name,
        "policy": spec.label,
        "repair": spec.repair if spec.kind != "none" else "none",
    }
    records.steps.append(
        {
            **{k: [v] * n for k, v in common.items()},
            "request_id": np.full(n, request_id, dtype=np.int64),
            "batch_id": np.full(n, batch_id, dtype=np.int32),
            "row": np.full(n, row, dtype=np.int32),
            "batch_size": np.full(n, batch_size, dtype=np.int32),
            "pad_len": np.full(n, free.pad_lens[row], dtype=np.int32),
            "step": np.arange(n, dtype=np.int32),
            "solo_token": solo_padded,
            "batched_token": np.array(batched_ids, dtype=np.int64),
            "matches_solo": solo_padded == np.array(batched_ids),
            "margin": np.array(free.margin[row], dtype=np.float32),
            "margin_ulp": np.array(free.margin_ulp[row], dtype=np.float32),
            "triggered": np.array(free.triggered[row], dtype=bool),
            "repaired": np.array(free.repaired[row], dtype=bool),
        }
    )
    records.sequences.append(
        {
            **common,
            "request_id": request_id,
            "batch_id": batch_id,
            "row": row,
            "batch_size": batch_size,
            "pad_len": free.pad_lens[row],
            "prompt_len": len(prompt),
            "solo_ids": solo_ids,
            "batched_ids": batched_ids,
            "first_divergence": divergence,
            "identical": divergence is None,
            "steps": n,
            "triggers": int(sum(free.triggered[row])),
            "repairs": int(sum(free.repaired[row])),
            **{name: free.per_sequence(row)[name] for name in ("replays", "replayed", "rollbacks", "discarded")},
        }
    )


def steps_table(records: VerifyRecords) -> pa.Table:
    columns = {}
    for name, _ in VERIFY_STEP_FIELDS:
        parts = [r[name] for r in records.steps]
        columns[name] = np.concatenate([np.asarray(p) for p in parts]) if parts else []
    table = pa.Table.from_pydict(columns, schema=VERIFY_STEPS_SCHEMA)
    # -1 marks steps past the solo output's end: store them as nulls.
    solo = table["solo_token"]
    index = table.schema.get_field_index("solo_token")
    return table.set_column(
        index,
        VERIFY_STEPS_SCHEMA.field("solo_token"),
        pc.if_else(pc.equal(solo, -1), pa.scalar(None, pa.int64()), solo),
    )


def sequences_table(records: VerifyRecords) -> pa.Table:
    return pa.Table.from_pylist(records.sequences, schema=VERIFY_SEQUENCES_SCHEMA)


SCHEMAS = {"steps": VERIFY_STEPS_SCHEMA, "sequences": VERIFY_SEQUENCES_SCHEMA}


def summarize(
    run: PreparedRun,
    specs: list[PolicySpec],
    needle: bool,
    required: float | None,
    tables: dict[str, pa.Table],
    group_records: list[dict],
) -> dict:
    """Summary of a verify run from its sequences table and its groups' timings and shortfalls."""
    seconds: dict[tuple[str, int], float] = {}
    for record in group_records:
        for entry in record["seconds"]:
            key = (entry["policy"], entry["batch_size"])
            seconds[key] = seconds.get(key, 0.0) + entry["seconds"]
    margin = next((s for s in specs if s.kind == "margin"), None)
    return {
        "model": run.options.model,
        "dataset": run.config.name,
        "prefill": run.options.prefill,
        "needle": needle,
        "batch_invariant": run.options.batch_invariant,
        "kernels": run.options.kernels,
        "reference": reference_of(run.options.kernels),
        "batch_sizes": list(run.options.batch_sizes),
        "max_new_tokens": run.max_new_tokens,
        "threshold": margin.tau if margin else None,
        "threshold_unit": margin.unit if margin else None,
        **figures.summarize_verify(
            tables["sequences"].to_pandas(), seconds, [s for r in group_records for s in r["shortfalls"]], required
        ),
        "oom_splits": [split for record in group_records for split in record["oom_splits"]],
    }


def open_writer(run: PreparedRun, specs: list[PolicySpec], needle: bool, out) -> RunWriter:
    return RunWriter(
        out, run.shard, fingerprint("verify", run, {"policies": [s.label for s in specs], "needle": needle}), run.resume
    )


def record_verify(
    lm,
    run: PreparedRun,
    specs: list[PolicySpec],
    needle: bool,
    required: float | None,
    writer: RunWriter,
    on_progress: ProgressFn,
    on_split: SplitFn,
    probe=None,
    kernels: Kernels = STOCK,
    fixed_probe=None,
) -> tuple[dict, bool]:
    """Decode, analyse and publish one verify run (or shard); (summary, whole run complete?)."""

    def summarize_run(tables, records) -> dict:
        return with_gate(run, summarize(run, specs, needle, required, tables, records), tables)

    if writer.finishing_only:
        return finish_run(writer, SCHEMAS, summarize_run, None)
    for index, records in verify_groups(
        lm,
        run,
        specs,
        needle,
        run.wanted(writer.done_groups()),
        on_progress,
        on_split,
        probe.plan if probe is not None else None,
        kernels,
    ):
        writer.commit(
            index, {"steps": steps_table(records), "sequences": sequences_table(records)}, group_record(records)
        )
    manifest = rundir.manifest(
        "verify",
        {
            **asdict(run.options),
            "policies": [s.label for s in specs],
            "needle": needle,
            "require_determinism": required,
            "shard": str(run.shard),
        },
        lm.device,
        {
            "dtype": lm.dtype,
            "attn": lm.attn,
            "model_source": lm.source,
            **({"probe": probe.to_dict()} if probe is not None else {}),
            "kernels": kernels.name,
            **({"fixed_order": fixed_order_summary(fixed_probe)} if fixed_probe is not None else {}),
        },
        inputs=run.inputs,
    )
    return finish_run(writer, SCHEMAS, summarize_run, manifest)


def run_verify(
    options: RunOptions,
    placement: Placement,
    specs: list[PolicySpec],
    needle: bool,
    required: float | None,
    junit: Path | None,
    json_out: bool,
    out: Path,
    gate_spec: GateSpec,
) -> bool:
    """`mgbench verify` from validated options to a published run directory and its report;
    False when a policy fell short of --require-determinism or the baseline gate failed."""
    run = prepare(options, placement.shard, placement.resume)
    attach_gate(run, gate_spec, "verify", {"policies": [s.label for s in specs], "needle": needle})
    with output_dir(placement, out) as target, open_writer(run, specs, needle, target) as writer:
        lm = None if writer.finishing_only else load_with_status(options)
        probe = probe_if_invariant(lm, run)
        kernels, fixed_probe = kernels_for_run(lm, run, replays=[s for s in specs if s.verify_calls])
        with pass_progress(
            "solo (batch size 1)",
            f"batched x {len(specs)} policies",
            len(run.requests),
            len(options.batch_sizes) * len(specs),
        ) as advance:
            summary, complete = record_verify(
                lm, run, specs, needle, required, writer, advance, warn_split, probe, kernels, fixed_probe
            )
    if not placement.writes:
        return True
    if junit is not None:
        sequences = rundir.read_own_table(out, "sequences", schema.VERIFY_SEQUENCES_SCHEMA, placement.shard)
        sequences = sequences.to_pandas()
        write_junit(junit, junit_xml(sequences, 1.0 if required is None else required))

    def render() -> None:
        terminal.render_verify(console, summary)
        shard_status(placement, out, complete)

    finish_output(out, summary, json_out, render)
    gate_lines(summary)
    gate_failed = summary.get("gate") is not None and not summary["gate"]["passed"]
    return summary["passed"] is not False and not gate_failed

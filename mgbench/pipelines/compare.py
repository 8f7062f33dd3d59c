"""`mgbench compare`: the same prompts and batches decoded under every policy, timed in one process.

Configurations: `none` (plain batched), `always`, `margin<TAU` and `oracle`, each with `column`
and `exact` repair; `batch-invariant` (stock kernels, each row made to reproduce stock solo
decoding, as planned by a probe); `fixed-order kernels` (every forward in kernels whose reduction
order is fixed by construction: determinism against solo through the same kernels, the road vLLM
and SGLang deploy); and `solo` (each request alone, sequentially). Every row names its reference.
Every configuration decodes the same batches after
one warm-up pass; prefill is done alone once and shared, so timings cover the decode steps.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import pyarrow as pa
import torch

from mgbench import SCHEMA_VERSION
from mgbench.analysis import figures
from mgbench.analysis.divergence import first_divergence
from mgbench.assets import datasets
from mgbench.engines.inprocess.audit import alone_or_stop, eos_token_ids, pad_token_id
from mgbench.engines.inprocess.kernels.batch_invariant import InvariancePlan, decoding_mode
from mgbench.engines.inprocess.kernels.sets import Kernels
from mgbench.engines.inprocess.metrics import margins
from mgbench.engines.inprocess.runners import run_solo
from mgbench.engines.inprocess.stopwatch import Stopwatch, synchronize
from mgbench.engines.inprocess.verification.gates import MarginGate
from mgbench.engines.inprocess.verification.loop import run_free
from mgbench.engines.inprocess.verification.spec import verify_shape
from mgbench.errors import UserError
from mgbench.pipelines.compare_configs import (  # noqa: F401 (re-export)
    Config,
    Decoded,
    config_reference,
    configurations,
    replay_pairs,
    replay_specs,
)
from mgbench.pipelines.prepared import PreparedRun, prepare
from mgbench.pipelines.probe import fixed_order_probe_for_run, fixed_order_summary, probe_for_run, run_summary
from mgbench.pipelines.session import finish_output, load_with_status, warn_split
from mgbench.render import plots, terminal
from mgbench.render.console import console, err_console, progress_bar
from mgbench.runs import rundir, schema
from mgbench.runs.groups import ProgressFn, order_requests
from mgbench.runs.oom import run_shrinking_on_oom
from mgbench.runs.options import RunOptions
from mgbench.runs.placement import Placement

BREAKDOWN = ("gate", "decision_sync", "reference_forward", "cache_ops")


def _decode_config(
    config: Config, lm, batches, solos, run: PreparedRun, eos_ids, pad_id, stopwatch, plan: InvariancePlan, fixed
):
    """Decode every batch under one configuration: (seconds, outputs per request, triggers (the
    verifications), repairs (the rollbacks), replay counts: {"replayed", "discarded", ...})."""
    model = lm.model
    seconds, outputs, triggers, repairs, counts = 0.0, {}, 0, 0, {"replayed": 0, "discarded": 0}
    for members, prompts in batches:
        if config.name == "solo":
            for i, prompt in zip(members, prompts):
                result = run_solo(model, prompt, run.max_new_tokens, eos_ids)
                seconds += result.decode_seconds
                outputs[i] = result.tokens.tolist()
            continue
        prefills = [solos[i].row_prefill for i in members]
        kernels, fixed_solos = fixed
        if config.name == "batch-invariant":
            with decoding_mode(model, prompts, plan):
                free = run_free(model, prompts, prefills, "alone", pad_id, run.max_new_tokens, eos_ids)
        elif config.name == "fixed-order kernels":
            # Its rows start from the fixed-order solo runs' prefills: the same computation, in its kernels.
            prefills = [fixed_solos[i].row_prefill for i in members]
            with kernels.active(model):
                free = run_free(model, prompts, prefills, "alone", pad_id, run.max_new_tokens, eos_ids, kernels=kernels)
        else:
            if config.replays:  # verified against fixed-order solo: from its prefills
                prefills = [fixed_solos[i].row_prefill for i in members]
            policy = config.spec.build(
                model, prompts, prefills, [solos[i] for i in members], run.max_new_tokens, stopwatch, kernels
            )
            free = run_free(model, prompts, prefills, "alone", pad_id, run.max_new_tokens, eos_ids, policy)
        seconds += free.decode_seconds
        triggers += sum(free.records["verifications"])
        repairs += sum(free.records["rollbacks"])
        outputs.update(dict(zip(members, free.tokens)))
        counts["replayed"] += sum(free.records["replayed"])
        counts["discarded"] += sum(free.records["discarded"])
        if config.replays:
            counts["verify_forwards"] = counts.get("verify_forwards", 0) + free.forwards
            counts["verify_slots"] = counts.get("verify_slots", 0) + free.fed
        if config.spec is not None:
            for row, i in enumerate(members):  # per sequence: what verification did to it
                counts.setdefault("per_sequence", {})[i] = free.per_sequence(row)
    return seconds, outputs, triggers, repairs, counts


def gate_cost(lm, members, solos, tau: float, unit: str, repeats: int = 50) -> dict:
    """Time of the gate alone (top-2, comparison, the host sync of its decision) on real logits of
    one batch (each row's first step, from its prefill)."""
    logits = torch.stack([solos[i].row_prefill.logits for i in members])
    gate = MarginGate(tau, unit)
    gate.low(*margins(logits)).nonzero().tolist()  # warm-up
    synchronize(logits.device)
    start = time.perf_counter()
    for _ in range(repeats):
        gate.low(*margins(logits)).nonzero().tolist()
    synchronize(logits.device)
    return {"gate_seconds_per_step": (time.perf_counter() - start) / repeats}


def time_configurations(
    lm,
    run: PreparedRun,
    tau: float,
    unit: str,
    batch_size: int,
    repeats: int,
    on_progress: ProgressFn,
    only: tuple[str, ...] | None = None,
    tile_rows: int | None = None,
) -> tuple[pd.DataFrame, dict]:
    model, tokenizer, device = lm.model, lm.tokenizer, lm.device
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = pad_token_id(tokenizer, eos_ids)
    prompts = [datasets.encode(tokenizer, run.config, r.text) for r in run.requests]
    order = order_requests(prompts, run.options.sort_by_length)
    tensors = {i: torch.tensor(prompts[i], dtype=torch.long, device=device) for i in order}
    batches = [
        (order[s : s + batch_size], [tensors[i] for i in order[s : s + batch_size]])
        for s in range(0, len(order), batch_size)
    ]
    configs = configurations(tau, unit, only)
    rows, sequences = [], []
    probe = probe_for_run(lm, run, batch_size) if any(c.name == "batch-invariant" for c in configs) else None
    uses_fixed = any(c.replays or c.name == "fixed-order kernels" for c in configs)
    # The probe checks every forward the replays make: W tokens of one row, N x W packed, and a
    # verify batch of N rows of W tokens against the same rows' steps.
    calls, verify_rows, verify_tokens = verify_shape([c.spec for c in configs if c.replays])
    fixed_probe = (
        fixed_order_probe_for_run(lm, run, batch_size, max(2, verify_tokens), tile_rows, calls, verify_rows)
        if uses_fixed
        else None
    )
    if fixed_probe is not None and not fixed_probe.chunk_vs_steps["exact"]:
        check = fixed_probe.chunk_vs_steps
        err_console.print(
            f"[bold yellow]fixed-order: a verify batch of {check['verify_rows']} rows x {check['tokens']} tokens "
            f"differs from its steps ({check['rows_differing']}/{check['rows']} rows): the replay "
            "policies are not exact against their reference here[/]",
            highlight=False,
        )
    kernels = Kernels("fixed-order", fixed_probe.plan) if fixed_probe is not None else None
    plan = probe.plan if probe is not None else None
    # One batch's solo references at a time (memory bounded by the batch): every configuration
    # and repeat decodes that batch before the next, and each configuration's figures are summed
    # over the batches.
    decoded = {(repeat, c.name): Decoded() for repeat in range(repeats) for c in configs}
    references: dict[str, dict] = {"stock solo": {}, "fixed-order solo": {}}
    stopwatches = {c.name: Stopwatch(device) for c in configs if c.spec is not None and not c.replays}
    iterations, extra = 0, {}
    with torch.inference_mode():
        for number, batch in enumerate(batches):
            members, _ = batch
            solos = {
                i: alone_or_stop(lambda i=i: run_solo(model, tensors[i], run.max_new_tokens, eos_ids)) for i in members
            }
            fixed_solos = {}
            if kernels is not None:
                # Both references prefill each request alone with the stock kernels: one prefill serves both.
                with kernels.active(model):
                    fixed_solos = {
                        i: alone_or_stop(
                            lambda i=i: run_solo(
                                model, tensors[i], run.max_new_tokens, eos_ids, kernels, solos[i].row_prefill
                            )
                        )
                        for i in members
                    }
            references["stock solo"].update({i: solos[i].tokens.tolist() for i in members})
            references["fixed-order solo"].update({i: fixed_solos[i].tokens.tolist() for i in fixed_solos})
            on_progress("solo", len(members))
            if number == 0:
                extra.update(gate_cost(lm, members, solos, tau, unit))
                for config in configs:  # warm-up pass on the first batch, not recorded
                    _decode_config(config, lm, [batch], solos, run, eos_ids, pad_id, None, plan, (kernels, fixed_solos))
                on_progress("warmup", 1)
            for repeat in range(repeats):
                for config in configs:
                    stopwatch = stopwatches.get(config.name) if repeat == 0 else None
                    decoded[repeat, config.name].add(
                        *_decode_config(
                            config, lm, [batch], solos, run, eos_ids, pad_id, stopwatch, plan, (kernels, fixed_solos)
                        )
                    )
                    on_progress("configs", 1 / len(batches))
            # batched decode iterations: each batch runs as long as its longest row
            iterations += max(len(decoded[0, "none"].outputs[i]) for i in members) - 1
        for repeat in range(repeats):
            for config in configs:
                result = decoded[repeat, config.name]
                outputs = result.outputs
                reference = references[config_reference(config)]
                identical = sum(first_divergence(reference[i], outputs[i]) is None for i in order)
                if repeat == 0:
                    for i, record in result.per_sequence.items():
                        sequences.append(
                            {
                                "config": config.name,
                                "reference": config_reference(config),
                                "request_id": run.requests[i].request_id,
                                "tokens": len(outputs[i]),
                                "first_divergence": first_divergence(reference[i], outputs[i]),
                                **record,
                            }
                        )
                stopwatch = stopwatches.get(config.name) if repeat == 0 else None
                rows.append(
                    {
                        "config": config.name,
                        "policy": config.spec.kind if config.spec else config.name,
                        "repair": config.spec.repair if config.spec and config.spec.kind != "none" else "",
                        "reference": config_reference(config),
                        "repeat": repeat,
                        "seconds": result.seconds,
                        "tokens": sum(len(outputs[i]) - 1 for i in order),
                        "sequences": len(order),
                        "identical": identical,
                        "steps": sum(len(outputs[i]) for i in order),
                        "triggers": result.triggers,
                        "repairs": result.repairs,
                        **result.counts,
                        **{
                            f"t_{name}": (stopwatch.seconds.get(name, 0.0) if stopwatch else None) for name in BREAKDOWN
                        },
                    }
                )
        stock, fixed = references["stock solo"], references["fixed-order solo"]
        extra.update(
            {
                **({"batch_invariant": run_summary(probe)} if probe is not None else {}),
                **(
                    {
                        "fixed_order": {
                            **fixed_order_summary(fixed_probe),
                            "stock_solo": {
                                "requests": len(order),
                                "identical": sum(stock[i] == fixed[i] for i in order),
                            },
                        }
                    }
                    if fixed_probe is not None
                    else {}
                ),
            }
        )
    table = pd.DataFrame(rows)
    plain_step = table.loc[table["config"] == "none", "seconds"].median() / max(1, iterations)
    extra["plain_batched_step_seconds"] = plain_step
    extra["gate_share_of_step"] = extra["gate_seconds_per_step"] / plain_step if plain_step > 0 else None
    extra["replay_sequences"] = sequences  # written as replay_sequences.parquet, not into summary.json
    return table, extra


def clean(value):
    """NaN -> None: null in JSON."""
    return None if isinstance(value, float) and value != value else value


def run_compare(
    options: RunOptions,
    placement: Placement,
    tau: float | None,
    unit: str,
    repeats: int,
    out: Path,
    json_out: bool = False,
    only: tuple[str, ...] | None = None,
    tile_rows: int | None = None,
) -> None:
    """`mgbench compare` from validated options to compare.parquet, its plots and its report."""
    chosen = configurations(tau, unit, only)  # an unknown --only prefix fails before anything loads
    if tile_rows is not None and not any(c.replays or c.name == "fixed-order kernels" for c in chosen):
        raise UserError("--tile-rows sets the fixed-order kernels' tile: --only leaves no fixed-order configuration")
    configs = len(chosen)
    run = prepare(options)
    if placement.writes:
        rundir.prepare_out_dir(out)
    lm = load_with_status(options)
    with progress_bar() as progress:
        tasks = {
            "solo": progress.add_task("solo references", total=len(run.requests)),
            "warmup": progress.add_task("warm-up", total=1),
            "configs": progress.add_task(f"{configs} configs x {repeats} repeats", total=configs * repeats),
        }

        def shrink(batch_size: int, half: int) -> None:
            warn_split(batch_size, half)
            for task in tasks.values():
                progress.reset(task)

        batch_size, (runs, extra) = run_shrinking_on_oom(
            options.batch_sizes[0],
            lambda size: time_configurations(
                lm, run, tau, unit, size, repeats, lambda phase, n: progress.advance(tasks[phase], n), only, tile_rows
            ),
            shrink,
        )
    table = figures.compare_table(runs)
    replay_sequences = pd.DataFrame(extra.pop("replay_sequences"))
    summary = {
        "model": options.model,
        "dataset": run.config.name,
        "batch_size": batch_size,
        "requested_batch_size": options.batch_sizes[0],
        "sequences": len(run.requests),
        "max_new_tokens": run.max_new_tokens,
        "repeats": repeats,
        "threshold": tau,
        "threshold_unit": unit,
        **extra,
        "configs": [{k: clean(v) for k, v in row.items()} for row in table.to_dict("records")],
        "reductions": [figures.reductions(runs, repair) for repair in ("column", "exact")],
        # Over the same stock decoding unverified (start-aligned), so the increments are verification alone.
        "replay_reductions": [
            {
                "window": window.label,
                "gate": gate.label,
                "base": "none (start-aligned)",
                **figures.reduction_between(runs, window.label, gate.label, "none (start-aligned)"),
            }
            for window, gate in replay_pairs(replay_specs(tau, unit))
            if window.label in set(runs["config"]) and gate.label in set(runs["config"])
        ],
        "breakdown": [
            {k: clean(v) for k, v in row.items()}
            for row in runs[runs["repeat"] == 0][["config", *[f"t_{b}" for b in BREAKDOWN]]]
            .dropna(subset=["t_gate"])
            .to_dict("records")
        ],
    }
    manifest = rundir.manifest(
        "compare",
        {**asdict(options), "tile_rows": tile_rows, "threshold": tau, "threshold_unit": unit, "repeats": repeats},
        lm.device,
        {"dtype": lm.dtype, "attn": lm.attn, "model_source": lm.source},
    )
    if not placement.writes:
        return
    compare_table = pa.Table.from_pandas(runs, preserve_index=False)
    compare_table = compare_table.replace_schema_metadata({schema.SCHEMA_KEY: SCHEMA_VERSION.encode()})
    tables = {"compare": compare_table}
    if not replay_sequences.empty:  # one row per (policy configuration, request), first repeat
        replay_table = pa.Table.from_pandas(
            replay_sequences.astype({"first_divergence": "Int64"}), preserve_index=False
        )
        tables["replay_sequences"] = replay_table.replace_schema_metadata({schema.SCHEMA_KEY: SCHEMA_VERSION.encode()})
    rundir.publish_run(
        out,
        tables,
        {"summary": summary, "manifest": manifest},
        lambda staging: plots.compare_plots(table, staging),
    )
    finish_output(out, summary, json_out, lambda: terminal.render_compare(console, summary))

"""The batched-vs-solo audit: groups requests, runs solo and batched passes, yields records.

For each group of requests (the largest batch size), every request is decoded alone once;
then for each batch size the group is split into batches that run teacher-forced (flips,
margins, K/V perturbation) and free-running (sequence-level determinism). Each prefill axis
(prefix-cache, chunked-prefill) then decodes every request alone again, teacher-forced and
free-running, from its prompt prefilled in pieces: the same records, tagged with their axis. Records come out one
group at a time (the unit that is committed, resumed and sharded), so memory stays bounded by
one group.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import torch

from mgbench.analysis.divergence import first_divergence
from mgbench.assets.datasets import Request
from mgbench.engines.inprocess.kernels.batch_invariant import InvariancePlan, decoding_mode
from mgbench.engines.inprocess.kernels.sets import STOCK, Kernels
from mgbench.engines.inprocess.prefill_axes import cut_points, prefill_cut, prefix_tokens
from mgbench.engines.inprocess.runners import run_solo, run_teacher_forced
from mgbench.engines.inprocess.verification.loop import run_free
from mgbench.engines.interface import AuditRecords
from mgbench.errors import UserError
from mgbench.runs.groups import ProgressFn, batch_id_base, wanted_groups
from mgbench.runs.oom import SplitFn, recording_splits, run_splitting_on_oom
from mgbench.runs.options import RunOptions


def eos_token_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def pad_token_id(tokenizer, eos_ids: set[int]) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)


def alone_or_stop(run: Callable[[], object]):
    """`run()` of one request alone; out of memory there stops the run with the one-line error."""
    [(_, result)] = run_splitting_on_oom([None], lambda _: run(), lambda batch_size, half: None)
    return result


def solo_groups(
    model,
    prompts: list[list[int]],
    groups: list[tuple[int, list[int]]],
    max_new_tokens: int,
    eos_ids: set[int],
    device: str,
    kernels: Kernels = STOCK,
):
    """Yield (group index, group, prompt tensors, solo results) for each (index, group) given.

    Solo references (tokens and per-step margins, never logits) are computed once per group and
    dropped with it. They run through `kernels` (the run's reference); a request too large to
    decode alone stops the run with the out-of-memory line."""
    for index, group in groups:
        tensors = {i: torch.tensor(prompts[i], dtype=torch.long, device=device) for i in group}
        with kernels.active(model):
            solos = {
                i: alone_or_stop(lambda i=i: run_solo(model, tensors[i], max_new_tokens, eos_ids, kernels))
                for i in group
            }
        yield index, group, tensors, solos


def audit_groups(
    model,
    tokenizer,
    requests: list[Request],
    prompts: list[list[int]],
    options: RunOptions,
    max_new_tokens: int,
    dataset: str,
    device: str,
    wanted: Callable[[int], bool] = lambda index: True,
    on_progress: ProgressFn = lambda phase, n: None,
    on_split: SplitFn = lambda batch_size, half: None,
    plan: InvariancePlan | None = None,
    kernels: Kernels = STOCK,
    kernel_facts: dict | None = None,
) -> Iterator[tuple[int, AuditRecords]]:
    """Yield (group index, records of that group) for every wanted group, in decoding order.

    Each request is decoded alone in lockstep with its first batch (the teacher-forced pass
    compares each step's logits and drops them), and re-decoded beside its batch at every
    further batch size, so memory stays bounded by the batch's caches whatever max_new_tokens.
    Solo decoding runs inside the out-of-memory splitter with its batch. With a `plan` (the
    batch-invariant mode) every batched forward runs under it; with fixed-order `kernels` every
    forward does, the solo reference's included, and each group's records carry `kernel_facts`
    (the probe's plan) and its fixed-order vs stock solo agreement."""
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = pad_token_id(tokenizer, eos_ids)
    prefix = prefix_tokens(options, prompts)  # of the whole run's prompts: the same K in every group
    if "prefix-cache" in options.axes and prefix < 1:
        raise UserError("the prompts share no prefix for the prefix-cache axis to cache: give --prefix-tokens K")
    groups = wanted_groups(prompts, options, wanted, on_progress)
    group_size = max(options.batch_sizes)
    batch_sizes = options.batch_sizes if "batch" in options.axes else ()

    def run_batch(members):
        batch_prompts = [tensors[i] for i in members]
        with kernels.active(model):
            forced = run_teacher_forced(
                model,
                batch_prompts,
                [solos.get(i) for i in members],
                options.prefill,
                pad_id,
                max_new_tokens,
                eos_ids,
                kernels,
                lambda: decoding_mode(model, batch_prompts, plan),
            )
            with decoding_mode(model, batch_prompts, plan):
                free = run_free(
                    model,
                    batch_prompts,
                    [s.row_prefill for s in forced.solos],
                    options.prefill,
                    pad_id,
                    max_new_tokens,
                    eos_ids,
                    kernels=kernels,
                )
        return forced, free

    def run_cut(request: int, axis: str):
        """One request alone, from its prompt prefilled in pieces where `axis` cuts it."""
        prompt = tensors[request]
        with kernels.active(model):
            cut = prefill_cut(model, prompt, cut_points(axis, len(prompt), prefix, options.chunk_tokens))
            forced = run_teacher_forced(
                model, [prompt], [solos.get(request)], "alone", pad_id, max_new_tokens, eos_ids, kernels, prefills=[cut]
            )
            free = run_free(model, [prompt], [cut], "alone", pad_id, max_new_tokens, eos_ids, kernels=kernels)
        return forced, free

    with torch.inference_mode():
        for index, group in groups:
            tensors = {i: torch.tensor(prompts[i], dtype=torch.long, device=device) for i in group}
            solos: dict = {}  # request -> its solo result, from its first batch on
            records = AuditRecords()
            batch_id = batch_id_base(index, group_size, options.passes_per_request)
            split = recording_splits(records.oom_splits, on_split)

            def record(members, forced, free, axis: str = "batch"):
                nonlocal batch_id
                fresh = [i for i in members if i not in solos]
                solos.update(zip(members, forced.solos))
                if fresh:  # this batch decoded its requests' solo references
                    records.solo_tokens += sum(len(solos[i].tokens) - 1 for i in fresh)
                    records.solo_seconds += forced.solo_seconds
                    on_progress("solo", len(fresh))
                ran = len(members)
                if axis == "batch":  # throughput by batch size: the batch axis's alone
                    records.batched_tokens[ran] = records.batched_tokens.get(ran, 0) + sum(
                        len(t) - 1 for t in free.tokens
                    )
                    records.batched_seconds[ran] = records.batched_seconds.get(ran, 0.0) + free.decode_seconds
                for row, i in enumerate(members):
                    _append_rows(
                        records,
                        requests[i],
                        prompts[i],
                        dataset,
                        batch_id,
                        row,
                        ran,
                        forced.pad_lens[row],
                        forced.rows[row],
                        solos[i],
                        free.tokens[row],
                        free.triggered[row],
                        free.repaired[row],
                        axis,
                    )
                batch_id += 1
                on_progress("batched", ran)

            for batch_size in batch_sizes:
                for start in range(0, len(group), batch_size):
                    for members, (forced, free) in run_splitting_on_oom(
                        group[start : start + batch_size], run_batch, split
                    ):
                        record(members, forced, free)
            for axis in options.prefill_axes:
                for i in group:
                    record([i], *alone_or_stop(lambda i=i, axis=axis: run_cut(i, axis)), axis=axis)
            if options.prefill_axes:
                records.extra["prefill_axes"] = {
                    **({"prefix_tokens": prefix} if "prefix-cache" in options.axes else {}),
                    **({"chunk_tokens": options.chunk_tokens} if "chunked-prefill" in options.axes else {}),
                }
            if kernels.fixed_order:
                records.extra["fixed_order"] = {
                    **(kernel_facts or {}),
                    "stock_solo": stock_solo_agreement(
                        model, [tensors[i] for i in group], [solos[i] for i in group], max_new_tokens, eos_ids
                    ),
                }
            yield index, records


def stock_solo_agreement(model, prompts, solos, max_new_tokens: int, eos_ids: set[int]) -> dict:
    """How many fixed-order solo outputs equal the stock kernels' solo outputs (each request
    decoded alone once more, stock, outside the fixed-order block)."""
    stock = [run_solo(model, p, max_new_tokens, eos_ids).tokens for p in prompts]
    return {"requests": len(prompts), "identical": sum(torch.equal(a, s.tokens) for a, s in zip(stock, solos))}


def _append_rows(
    records,
    request,
    prompt,
    dataset,
    batch_id,
    row,
    batch_size,
    pad_len,
    forced_row,
    solo,
    batched_ids,
    triggered,
    repaired,
    axis: str,
) -> None:
    steps = len(forced_row["flipped"])
    records.steps.append(
        {
            "request_id": np.full(steps, request.request_id, dtype=np.int64),
            "batch_id": np.full(steps, batch_id, dtype=np.int32),
            "row": np.full(steps, row, dtype=np.int32),
            "batch_size": np.full(steps, batch_size, dtype=np.int32),
            "pad_len": np.full(steps, pad_len, dtype=np.int32),
            "axis": axis,  # one per row: steps_table repeats it over the steps
            "method": np.full(steps, "teacher-forced"),
            "step": np.arange(steps, dtype=np.int32),
            **forced_row,
        }
    )
    solo_ids = solo.tokens.tolist()
    divergence = first_divergence(solo_ids, batched_ids)
    records.sequences.append(
        {
            "request_id": request.request_id,
            "dataset": dataset,
            "batch_id": batch_id,
            "row": row,
            "batch_size": batch_size,
            "pad_len": pad_len,
            "axis": axis,
            "prompt_len": len(prompt),
            "prompt_ids": prompt,
            "solo_ids": solo_ids,
            "solo_margins": solo.margins.tolist(),  # every solo step's top-1 minus top-2 logit
            "batched_ids": batched_ids,
            "first_divergence": divergence,
            "identical": divergence is None,
            "triggers": int(sum(triggered)),
            "repairs": int(sum(repaired)),
        }
    )

"""The batched-vs-solo audit: groups requests, runs solo and batched passes, yields records.

For each group of requests (the largest batch size), every request is decoded alone once;
then for each batch size the group is split into batches that run teacher-forced (flips,
margins, K/V perturbation) and free-running (sequence-level determinism). Records come out one
group at a time (the unit that is committed, resumed and sharded), so memory stays bounded by
one group.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import torch

from mgbench.analysis.divergence import first_divergence
from mgbench.assets.datasets import Request
from mgbench.engines.inprocess.batch_invariant import InvariancePlan, decoding_mode
from mgbench.engines.inprocess.kernels import STOCK, Kernels
from mgbench.engines.inprocess.runners import run_free, run_solo, run_teacher_forced
from mgbench.engines.interface import AuditRecords
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


def solo_groups(
    model,
    prompts: list[list[int]],
    groups: list[tuple[int, list[int]]],
    max_new_tokens: int,
    eos_ids: set[int],
    device: str,
    kernels: Kernels = STOCK,
    stock_agreement: dict | None = None,
):
    """Yield (group index, group, prompt tensors, solo results) for each (index, group) given.

    Solo references are computed once per group and dropped with it, which bounds memory. They
    run through `kernels` (the run's reference); with fixed-order kernels and a `stock_agreement`
    dict, each request is also decoded alone with the stock kernels and the dict counts, per group
    (cleared at each), how many fixed-order solo outputs equal the stock ones."""
    for index, group in groups:
        tensors = {i: torch.tensor(prompts[i], dtype=torch.long, device=device) for i in group}
        with kernels.active(model):
            solos = {i: run_solo(model, tensors[i], max_new_tokens, eos_ids, kernels) for i in group}
        if kernels.fixed_order and stock_agreement is not None:
            stock = {i: run_solo(model, tensors[i], max_new_tokens, eos_ids).tokens for i in group}
            stock_agreement.clear()
            stock_agreement.update(
                requests=len(group), identical=sum(torch.equal(stock[i], solos[i].tokens) for i in group)
            )
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

    With a `plan` (the batch-invariant mode) every batched pass runs under it; with fixed-order
    `kernels` every pass does, the solo reference included, and each group's records carry
    `kernel_facts` (the probe's plan) and its fixed-order vs stock solo agreement."""
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = pad_token_id(tokenizer, eos_ids)
    groups = wanted_groups(prompts, options, wanted, on_progress)
    group_size = max(options.batch_sizes)

    def run_batch(members):
        batch_prompts = [tensors[i] for i in members]
        batch_solos = [solos[i] for i in members]
        with decoding_mode(model, batch_prompts, plan), kernels.active(model):
            forced = run_teacher_forced(model, batch_prompts, batch_solos, options.prefill, pad_id, kernels)
            free = run_free(
                model,
                batch_prompts,
                [s.row_prefill for s in batch_solos],
                options.prefill,
                pad_id,
                max_new_tokens,
                eos_ids,
                kernels=kernels,
            )
        return forced, free

    agreement: dict = {}
    with torch.inference_mode():
        for index, group, tensors, solos in solo_groups(
            model, prompts, groups, max_new_tokens, eos_ids, device, kernels, agreement
        ):
            records = AuditRecords()
            if kernels.fixed_order:
                records.extra["fixed_order"] = {**(kernel_facts or {}), "stock_solo": dict(agreement)}
            records.solo_tokens += sum(len(s.tokens) - 1 for s in solos.values())
            records.solo_seconds += sum(s.decode_seconds for s in solos.values())
            on_progress("solo", len(group))
            batch_id = batch_id_base(index, group_size, len(options.batch_sizes))
            split = recording_splits(records.oom_splits, on_split)

            for batch_size in options.batch_sizes:
                for start in range(0, len(group), batch_size):
                    for members, (forced, free) in run_splitting_on_oom(
                        group[start : start + batch_size], run_batch, split
                    ):
                        ran = len(members)
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
                                solos[i].tokens.tolist(),
                                free.tokens[row],
                                free.triggered[row],
                                free.repaired[row],
                            )
                        batch_id += 1
                        on_progress("batched", ran)
            yield index, records


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
    solo_ids,
    batched_ids,
    triggered,
    repaired,
) -> None:
    steps = len(forced_row["flipped"])
    records.steps.append(
        {
            "request_id": np.full(steps, request.request_id, dtype=np.int64),
            "batch_id": np.full(steps, batch_id, dtype=np.int32),
            "row": np.full(steps, row, dtype=np.int32),
            "batch_size": np.full(steps, batch_size, dtype=np.int32),
            "pad_len": np.full(steps, pad_len, dtype=np.int32),
            "method": np.full(steps, "teacher-forced"),
            "step": np.arange(steps, dtype=np.int32),
            **forced_row,
        }
    )
    divergence = first_divergence(solo_ids, batched_ids)
    records.sequences.append(
        {
            "request_id": request.request_id,
            "dataset": dataset,
            "batch_id": batch_id,
            "row": row,
            "batch_size": batch_size,
            "pad_len": pad_len,
            "prompt_len": len(prompt),
            "prompt_ids": prompt,
            "solo_ids": solo_ids,
            "batched_ids": batched_ids,
            "first_divergence": divergence,
            "identical": divergence is None,
            "triggers": int(sum(triggered)),
            "repairs": int(sum(repaired)),
        }
    )

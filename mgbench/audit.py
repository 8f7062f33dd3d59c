"""The batched-vs-solo audit: groups requests, runs solo and batched passes, yields records.

For each group of requests (the largest batch size), every request is decoded alone once;
then for each batch size the group is split into batches that run teacher-forced (flips,
margins, K/V perturbation) and free-running (sequence-level determinism). Solo results are
kept only for the current group, so memory stays bounded by one group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from .config import RunOptions
from .data import Request
from .engine.runners import run_free, run_solo, run_teacher_forced

# on_progress(phase, advance): phase is "solo" or "batched"; advance counts requests.
ProgressFn = Callable[[str, int], None]


@dataclass
class AuditRecords:
    steps: list[dict] = field(default_factory=list)  # one dict of equal-length columns per batch row
    sequences: list[dict] = field(default_factory=list)  # one dict per (request, batch size)
    solo_tokens: int = 0
    solo_seconds: float = 0.0
    batched_tokens: dict[int, int] = field(default_factory=dict)
    batched_seconds: dict[int, float] = field(default_factory=dict)


def eos_token_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def pad_token_id(tokenizer, eos_ids: set[int]) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)


def first_divergence(reference: list[int], candidate: list[int]) -> int | None:
    """Index of the first differing token; a length difference counts at the shorter end."""
    for index, (a, b) in enumerate(zip(reference, candidate)):
        if a != b:
            return index
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


def order_requests(prompts: list[list[int]], sort_by_length: bool) -> list[int]:
    """Indices in decoding order: arrival order, or longest prompt first to shrink padding."""
    order = list(range(len(prompts)))
    if sort_by_length:
        order.sort(key=lambda i: (-len(prompts[i]), i))
    return order


def solo_groups(model, prompts: list[list[int]], order: list[int], group_size: int, max_new_tokens: int,
                eos_ids: set[int], device: str):
    """Yield (group, prompt tensors, solo results) per group of `group_size` requests in decoding order.

    Solo references are computed once per group and dropped with it, which bounds memory."""
    for group_start in range(0, len(order), group_size):
        group = order[group_start : group_start + group_size]
        tensors = {i: torch.tensor(prompts[i], dtype=torch.long, device=device) for i in group}
        yield group, tensors, {i: run_solo(model, tensors[i], max_new_tokens, eos_ids) for i in group}


def run_audit(
    model,
    tokenizer,
    requests: list[Request],
    prompts: list[list[int]],
    options: RunOptions,
    max_new_tokens: int,
    dataset: str,
    device: str,
    on_progress: ProgressFn = lambda phase, n: None,
) -> AuditRecords:
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = pad_token_id(tokenizer, eos_ids)
    order = order_requests(prompts, options.sort_by_length)
    group_size = max(options.batch_sizes)
    records = AuditRecords()
    batch_id = 0
    with torch.inference_mode():
        for group, tensors, solos in solo_groups(model, prompts, order, group_size, max_new_tokens, eos_ids, device):
            records.solo_tokens += sum(len(s.tokens) - 1 for s in solos.values())
            records.solo_seconds += sum(s.decode_seconds for s in solos.values())
            on_progress("solo", len(group))
            for batch_size in options.batch_sizes:
                for start in range(0, len(group), batch_size):
                    members = group[start : start + batch_size]
                    batch_prompts = [tensors[i] for i in members]
                    batch_solos = [solos[i] for i in members]
                    forced = run_teacher_forced(model, batch_prompts, batch_solos, options.prefill, pad_id)
                    free = run_free(
                        model, batch_prompts, [s.row_prefill for s in batch_solos], options.prefill, pad_id,
                        max_new_tokens, eos_ids,
                    )
                    records.batched_tokens[batch_size] = records.batched_tokens.get(batch_size, 0) + sum(
                        len(t) - 1 for t in free.tokens
                    )
                    records.batched_seconds[batch_size] = records.batched_seconds.get(batch_size, 0.0) + free.decode_seconds
                    for row, i in enumerate(members):
                        _append_rows(records, requests[i], prompts[i], dataset, batch_id, row, len(members),
                                     forced.pad_lens[row], forced.rows[row], solos[i].tokens.tolist(),
                                     free.tokens[row], free.triggered[row], free.repaired[row])
                    batch_id += 1
                    on_progress("batched", len(members))
    return records


def _append_rows(records, request, prompt, dataset, batch_id, row, batch_size, pad_len, forced_row,
                 solo_ids, batched_ids, triggered, repaired) -> None:
    steps = len(forced_row["flipped"])
    records.steps.append(
        {
            "request_id": np.full(steps, request.request_id, dtype=np.int64),
            "batch_id": np.full(steps, batch_id, dtype=np.int32),
            "row": np.full(steps, row, dtype=np.int32),
            "batch_size": np.full(steps, batch_size, dtype=np.int32),
            "pad_len": np.full(steps, pad_len, dtype=np.int32),
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

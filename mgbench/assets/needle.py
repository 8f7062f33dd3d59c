"""Batches of a group: consecutive requests, or (needle mode) each audited request at a seeded row
among filler requests from the same dataset. Shared by verify and the endpoint audit."""

from __future__ import annotations

import random

from mgbench.assets import datasets


def needle_layout(request_id: int, batch_size: int, fillers: int, seed: int) -> tuple[int, list[int]]:
    """(row of the request, filler indices) for needle mode, deterministic per request and batch size."""
    rng = random.Random(f"{seed}:{request_id}:{batch_size}")
    return rng.randrange(batch_size), [rng.randrange(fillers) for _ in range(batch_size - 1)]


def filler_prompts(run, tokenizer, count: int) -> list[list[int]]:
    """Prompts of dataset records outside the run's selection (a PreparedRun), to fill needle batches."""
    chosen = {r.request_id for r in run.requests}
    records = datasets.read_records(run.config)
    pool = [i for i in range(len(records)) if i not in chosen] or [r.request_id for r in run.requests]
    picks = random.Random(run.options.seed + 1).sample(pool, min(count, len(pool)))
    return [datasets.encode(tokenizer, run.config, datasets.prompt_text(run.config, records[i])) for i in picks]


def batch_layouts(group: list[int], batch_size: int, needle: bool, requests, filler_count: int, seed: int):
    """Yield (audited request indices, their rows, the batch's slots) per batch of one group at one
    batch size; a slot is ("request", request index) or ("filler", filler index)."""
    if not needle:
        for start in range(0, len(group), batch_size):
            members = group[start : start + batch_size]
            yield members, list(range(len(members))), [("request", i) for i in members]
        return
    for i in group:
        row, picks = needle_layout(requests[i].request_id, batch_size, filler_count, seed)
        slots = [("filler", p) for p in picks]
        slots.insert(row, ("request", i))
        yield [i], [row], slots

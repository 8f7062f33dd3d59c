"""The black-box audit of a served model: solo, batched at each size, solo again (docs/engines.md).

Groups of requests are the same as the in-process engine's (the largest batch size), and so are
the records each group yields: the flips pipeline commits, resumes and summarises both alike.
Per group: every request alone, one at a time (the reference); then at each batch size the
group's requests in concurrent batches released together (or, in needle mode, each request
among B-1 fillers); with the prefix-cache axis, each request sent twice more, the first filling
the server's prompt cache afresh and the second reusing it (warm); with the repeat axis, the
group's requests as one load (arrivals staggered) sent twice, the second compared with the
first; then every request alone again. A request whose two solo runs disagree is "not
deterministic at batch size 1": counted apart and left out of the comparisons with solo.
"""

from __future__ import annotations

import uuid

from mgbench.analysis.divergence import (
    Decoded,
    first_divergence,
    first_divergence_columns,
    repeat_agreement,
    step_margins,
)
from mgbench.assets.needle import batch_layouts
from mgbench.engines.endpoint.client import EndpointClient
from mgbench.engines.endpoint.release import release_staggered, release_together
from mgbench.engines.interface import AuditRecords
from mgbench.runs.groups import batch_id_base

NO_PAD = None  # a server's padding (if any) is not visible through its API: null in the tables
REPEAT_GAP_S = 0.02  # the repeat axis's arrivals, 20 ms apart: the order decides what the server batches


class SoloRepeat:
    """Solo vs solo again over one group: the server's determinism at batch size 1."""

    def __init__(self):
        self.requests, self.requests_differing, self.steps, self.logprob_steps_differing = 0, 0, 0, 0
        self.max_logprob_drift = 0.0
        self.differing: list[dict] = []

    def add(self, request_id: int, first: Decoded, second: Decoded) -> bool:
        """Record one request's two solo runs; True when their tokens agree."""
        agreement = repeat_agreement(first, second)
        self.requests += 1
        self.steps += agreement["steps"]
        self.logprob_steps_differing += agreement["logprob_steps_differing"]
        self.max_logprob_drift = max(self.max_logprob_drift, agreement["max_logprob_drift"])
        if agreement["first_divergence"] is not None:
            self.requests_differing += 1
            self.differing.append({"request_id": request_id, "first_divergence": agreement["first_divergence"]})
        return agreement["first_divergence"] is None

    def to_dict(self) -> dict:
        return {
            "requests": self.requests,
            "requests_differing": self.requests_differing,
            "steps": self.steps,
            "logprob_steps_differing": self.logprob_steps_differing,
            "max_logprob_drift": self.max_logprob_drift,
            "differing": self.differing,
        }


def _append(
    records: AuditRecords,
    request,
    prompt,
    dataset,
    batch_id,
    row,
    batch_size,
    solo: Decoded,
    batched: Decoded,
    axis: str,
) -> None:
    """One perturbed answer against its reference (`solo`: the request alone; the repeat axis: the
    load's first run) as step and sequence rows."""
    columns = first_divergence_columns(solo, batched)
    steps = len(columns["step"])
    records.steps.append(
        {
            "request_id": [request.request_id] * steps,
            "batch_id": [batch_id] * steps,
            "row": [row] * steps,
            "batch_size": [batch_size] * steps,
            "pad_len": NO_PAD,
            "axis": axis,
            **columns,
        }
    )
    divergence = first_divergence(solo.token_ids, batched.token_ids)
    records.sequences.append(
        {
            "request_id": request.request_id,
            "dataset": dataset,
            "batch_id": batch_id,
            "row": row,
            "batch_size": batch_size,
            "pad_len": NO_PAD,
            "axis": axis,
            "prompt_len": len(prompt),
            "prompt_ids": prompt,
            "solo_ids": solo.token_ids,
            "solo_margins": step_margins(solo),
            "batched_ids": batched.token_ids,
            "first_divergence": divergence,
            "identical": divergence is None,
            "triggers": 0,
            "repairs": 0,
        }
    )


async def _solo_pass(client: EndpointClient, members, prompts, texts, max_new_tokens, on_progress, phase):
    """Each request alone, one at a time: (results by request index, tokens, seconds)."""
    results, tokens, seconds = {}, 0, 0.0
    for i in members:
        [answer], elapsed = await release_together([lambda i=i: client.complete(prompts[i], texts[i], max_new_tokens)])
        results[i], tokens, seconds = answer, tokens + len(answer.token_ids), seconds + elapsed
        on_progress(phase, 1)
    return results, tokens, seconds


async def _prefix_cache_pass(client: EndpointClient, members, prompts, texts, max_new_tokens, on_progress):
    """Each request sent twice in a row: the first fills the server's cache with its whole prompt
    computed afresh, the second finds it cached. The second, warm answers by request index."""
    warm = {}
    for i in members:
        key = f"mgbench-warm-{uuid.uuid4().hex}"  # this pair's cache, shared with no other request
        await client.complete(prompts[i], texts[i], max_new_tokens, warm=key, fill=True)
        warm[i] = await client.complete(prompts[i], texts[i], max_new_tokens, warm=key)
        on_progress("batched", 1)
    return warm


async def _repeat_pass(client: EndpointClient, members, prompts, texts, max_new_tokens, on_progress):
    """The same concurrent load sent twice, arrivals staggered: (first run's answers, second run's)."""
    runs = []
    for _ in range(2):
        calls = [lambda i=i: client.complete(prompts[i], texts[i], max_new_tokens) for i in members]
        runs.append(await release_staggered(calls, REPEAT_GAP_S))
        on_progress("batched", len(members))
    return runs


async def audit_group(
    client: EndpointClient,
    index: int,
    group: list[int],
    run,
    prompts: list[list[int]],
    texts: list[str],
    fillers: list[tuple[list[int], str]],
    on_progress,
) -> AuditRecords:
    """Records of one group: solo, each axis (batched at every size, warm, the load twice), solo
    again (see the module doc)."""
    options = run.options
    records = AuditRecords()
    solos, records.solo_tokens, records.solo_seconds = await _solo_pass(
        client, group, prompts, texts, run.max_new_tokens, on_progress, "solo"
    )
    batch_id = batch_id_base(index, max(options.batch_sizes), options.passes_per_request)
    perturbed = []  # (axis, request index, batch id, row, batch size, answer), each against its solo answer
    for batch_size in options.batch_sizes if "batch" in options.axes else ():
        for members, rows, batch in batch_layouts(
            group, batch_size, run.endpoint.needle, run.requests, len(fillers), options.seed
        ):

            def call(kind, j):
                ids, text = (prompts[j], texts[j]) if kind == "request" else fillers[j]
                return lambda: client.complete(ids, text, run.max_new_tokens)

            answers, seconds = await release_together([call(kind, j) for kind, j in batch])
            size = len(batch)
            records.batched_tokens[size] = records.batched_tokens.get(size, 0) + sum(len(a.token_ids) for a in answers)
            records.batched_seconds[size] = records.batched_seconds.get(size, 0.0) + seconds
            perturbed += [("batch", i, batch_id, row, size, answers[row]) for i, row in zip(members, rows)]
            batch_id += 1
            on_progress("batched", len(members))
    if "prefix-cache" in options.axes:
        warm = await _prefix_cache_pass(client, group, prompts, texts, run.max_new_tokens, on_progress)
        for i in group:
            perturbed.append(("prefix-cache", i, batch_id, 0, 1, warm[i]))
            batch_id += 1
    repeats = []  # (request index, batch id, row, load size, first run's answer, second run's)
    if "repeat" in options.axes:
        size = max(options.batch_sizes)
        for start in range(0, len(group), size):
            members = group[start : start + size]
            first, second = await _repeat_pass(client, members, prompts, texts, run.max_new_tokens, on_progress)
            repeats += [(i, batch_id, row, len(members), first[row], second[row]) for row, i in enumerate(members)]
            batch_id += 2
    again, _, _ = await _solo_pass(client, group, prompts, texts, run.max_new_tokens, on_progress, "solo-repeat")
    repeat = SoloRepeat()
    stable = {i for i in group if repeat.add(run.requests[i].request_id, solos[i], again[i])}
    name = run.config.name
    for axis, i, batch_id, row, size, answer in perturbed:
        if i in stable:  # an unstable reference would count the server's own nondeterminism as flips
            _append(records, run.requests[i], prompts[i], name, batch_id, row, size, solos[i], answer, axis)
    for i, batch_id, row, size, first, second in repeats:  # against the load's first run, not solo
        _append(records, run.requests[i], prompts[i], name, batch_id, row, size, first, second, "repeat")
    records.extra["solo_repeat"] = repeat.to_dict()
    return records

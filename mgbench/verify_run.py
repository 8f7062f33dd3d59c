"""`mgbench verify`: free-running batched decoding under verification policies, each output
compared with its solo reference, over batch sizes and (needle mode) positions in the batch."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from . import SCHEMA_VERSION, data
from .audit import ProgressFn, eos_token_ids, first_divergence, order_requests, pad_token_id, solo_groups
from .engine.policies import PolicySpec
from .engine.runners import row_prefills, run_free
from .flips import PreparedRun
from .results import PLACEMENT_FIELDS, SCHEMA_KEY, TOKEN_IDS

VERIFY_STEP_FIELDS = [
    *PLACEMENT_FIELDS, ("policy", pa.string()), ("repair", pa.string()), ("step", pa.int32()), ("solo_token", pa.int64()), ("batched_token", pa.int64()),
    ("matches_solo", pa.bool_()), ("margin", pa.float32()), ("margin_ulp", pa.float32()),
    ("triggered", pa.bool_()), ("repaired", pa.bool_()),
]
VERIFY_SEQUENCE_FIELDS = [
    *PLACEMENT_FIELDS, ("policy", pa.string()), ("repair", pa.string()), ("prompt_len", pa.int32()), ("solo_ids", TOKEN_IDS), ("batched_ids", TOKEN_IDS),
    ("first_divergence", pa.int32()), ("identical", pa.bool_()), ("steps", pa.int32()), ("triggers", pa.int32()),
    ("repairs", pa.int32()),
]
VERIFY_STEPS_SCHEMA = pa.schema(VERIFY_STEP_FIELDS, metadata={SCHEMA_KEY: SCHEMA_VERSION.encode(), b"mgbench.table": b"verify_steps"})
VERIFY_SEQUENCES_SCHEMA = pa.schema(VERIFY_SEQUENCE_FIELDS, metadata={SCHEMA_KEY: SCHEMA_VERSION.encode(), b"mgbench.table": b"verify_sequences"})


@dataclass
class VerifyRecords:
    steps: list[dict] = field(default_factory=list)
    sequences: list[dict] = field(default_factory=list)
    shortfalls: list[dict] = field(default_factory=list)
    seconds: dict[tuple[str, int], float] = field(default_factory=dict)  # (policy label, batch size) -> decode s


def needle_layout(request_id: int, batch_size: int, fillers: int, seed: int) -> tuple[int, list[int]]:
    """(row of the request, filler indices) for needle mode, deterministic per request and batch size."""
    rng = random.Random(f"{seed}:{request_id}:{batch_size}")
    return rng.randrange(batch_size), [rng.randrange(fillers) for _ in range(batch_size - 1)]


def filler_prompts(run: PreparedRun, tokenizer, count: int) -> list[list[int]]:
    """Prompts of dataset records outside the verified selection, to fill needle batches."""
    chosen = {r.request_id for r in run.requests}
    records = data.read_records(run.config)
    pool = [i for i in range(len(records)) if i not in chosen] or [r.request_id for r in run.requests]
    picks = random.Random(run.options.seed + 1).sample(pool, min(count, len(pool)))
    return [data.encode(tokenizer, run.config, data.prompt_text(run.config, records[i])) for i in picks]


def run_verify(lm, run: PreparedRun, specs: list[PolicySpec], needle: bool, on_progress: ProgressFn) -> VerifyRecords:
    model, tokenizer, options, device = lm.model, lm.tokenizer, run.options, lm.device
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = pad_token_id(tokenizer, eos_ids)
    prompts = [data.encode(tokenizer, run.config, r.text) for r in run.requests]
    fillers = filler_prompts(run, tokenizer, 16) if needle else []
    filler_tensors = [torch.tensor(p, dtype=torch.long, device=device) for p in fillers]
    order = order_requests(prompts, options.sort_by_length)
    group_size = max(options.batch_sizes)
    records = VerifyRecords()
    batch_id = 0
    with torch.inference_mode():
        for group, tensors, solos in solo_groups(model, prompts, order, group_size, run.max_new_tokens, eos_ids, device):
            on_progress("solo", len(group))
            for spec in specs:
                for batch_size in options.batch_sizes:
                    for members, rows, batch_prompts, references in _batches(
                        group, batch_size, tensors, solos, needle, filler_tensors, run, options.seed
                    ):
                        prefills = row_prefills(model, batch_prompts, references["prefills"])
                        policy = spec.build(model, batch_prompts, prefills, references["logits"], run.max_new_tokens)
                        free = run_free(model, batch_prompts, prefills, options.prefill, pad_id,
                                        run.max_new_tokens, eos_ids, policy)
                        key = (spec.label, batch_size)
                        records.seconds[key] = records.seconds.get(key, 0.0) + free.decode_seconds
                        for shortfall in getattr(getattr(policy, "verifier", None), "shortfalls", []):
                            if shortfall["row"] in rows:
                                request = run.requests[members[rows.index(shortfall["row"])]]
                                records.shortfalls.append({"policy": spec.label, "batch_size": batch_size,
                                                           "request_id": request.request_id, **shortfall})
                        for i, row in zip(members, rows):
                            _append(records, run, spec, batch_id, row, len(batch_prompts), free, prompts[i],
                                    run.requests[i].request_id, solos[i].tokens.tolist())
                        batch_id += 1
                        on_progress("batched", len(members))
    return records


def _batches(group, batch_size, tensors, solos, needle, fillers, run, seed):
    """(members, their rows, batch prompts, references) for each batch of a group.

    References are the solo prefills and logits of each row, None for needle fillers."""
    if not needle:
        for start in range(0, len(group), batch_size):
            members = group[start : start + batch_size]
            yield members, list(range(len(members))), [tensors[i] for i in members], {
                "prefills": [solos[i].row_prefill for i in members],
                "logits": [solos[i].logits for i in members],
            }
        return
    for i in group:
        row, picks = needle_layout(run.requests[i].request_id, batch_size, len(fillers), seed)
        batch_prompts = [fillers[p] for p in picks]
        batch_prompts.insert(row, tensors[i])
        prefills = [None] * batch_size
        logits = [None] * batch_size
        prefills[row], logits[row] = solos[i].row_prefill, solos[i].logits
        yield [i], [row], batch_prompts, {"prefills": prefills, "logits": logits}


def _append(records, run, spec, batch_id, row, batch_size, free, prompt, request_id, solo_ids):
    batched_ids = free.tokens[row]
    n = len(batched_ids)
    solo_padded = np.full(n, -1, dtype=np.int64)
    solo_padded[: min(n, len(solo_ids))] = solo_ids[:n]
    divergence = first_divergence(solo_ids, batched_ids)
    common = {"model": run.options.model, "dataset": run.config.name, "policy": spec.label, "repair":
              spec.repair if spec.kind != "none" else "none"}
    records.steps.append({
        **{k: [v] * n for k, v in common.items()},
        "request_id": np.full(n, request_id, dtype=np.int64), "batch_id": np.full(n, batch_id, dtype=np.int32),
        "row": np.full(n, row, dtype=np.int32), "batch_size": np.full(n, batch_size, dtype=np.int32),
        "pad_len": np.full(n, free.pad_lens[row], dtype=np.int32), "step": np.arange(n, dtype=np.int32),
        "solo_token": solo_padded, "batched_token": np.array(batched_ids, dtype=np.int64),
        "matches_solo": solo_padded == np.array(batched_ids), "margin": np.array(free.margin[row], dtype=np.float32),
        "margin_ulp": np.array(free.margin_ulp[row], dtype=np.float32),
        "triggered": np.array(free.triggered[row], dtype=bool), "repaired": np.array(free.repaired[row], dtype=bool),
    })
    records.sequences.append({
        **common, "request_id": request_id, "batch_id": batch_id, "row": row, "batch_size": batch_size,
        "pad_len": free.pad_lens[row], "prompt_len": len(prompt), "solo_ids": solo_ids, "batched_ids": batched_ids,
        "first_divergence": divergence, "identical": divergence is None, "steps": n,
        "triggers": int(sum(free.triggered[row])), "repairs": int(sum(free.repaired[row])),
    })


def steps_table(records: VerifyRecords) -> pa.Table:
    columns = {}
    for name, _ in VERIFY_STEP_FIELDS:
        parts = [r[name] for r in records.steps]
        columns[name] = np.concatenate([np.asarray(p) for p in parts]) if parts else []
    table = pa.Table.from_pydict(columns, schema=VERIFY_STEPS_SCHEMA)
    # -1 marks steps past the solo output's end: store them as nulls.
    solo = table["solo_token"]
    index = table.schema.get_field_index("solo_token")
    return table.set_column(index, VERIFY_STEPS_SCHEMA.field("solo_token"),
                            pc.if_else(pc.equal(solo, -1), pa.scalar(None, pa.int64()), solo))


def sequences_table(records: VerifyRecords) -> pa.Table:
    return pa.Table.from_pylist(records.sequences, schema=VERIFY_SEQUENCES_SCHEMA)

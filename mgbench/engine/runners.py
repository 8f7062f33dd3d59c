"""Runners: solo reference, teacher-forced batched audit, free-running batched with a policy."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .cache import LayerKV, cache_layers, clone_layers, columns_of_row
from .decode import assemble_prefilled, decode_step, prefill_alone, prefill_batched
from .metrics import kv_relative_delta, step_metrics
from .policies import NoVerification, Policy, StepContext

PREFILL_MODES = ("alone", "batched")


def synchronize(device) -> None:
    """Wait for queued kernels so wall-clock readings cover the work they claim to."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class SoloResult:
    tokens: torch.Tensor  # [n] generated tokens, EOS included when reached
    logits: torch.Tensor  # [n, vocab] in the model's dtype
    prefill: LayerKV  # the prompt's cache at batch size 1, as left by prefill
    kv_columns: torch.Tensor  # [layers, 2, kv_heads, n, head_dim]: K/V of each step's input token
    decode_seconds: float  # steps 1..n-1 (prefill excluded)


@dataclass
class TeacherForcedResult:
    pad_lens: list[int]
    rows: list[dict]  # per row: metric name -> numpy array over the row's steps


@dataclass
class FreeRunResult:
    pad_lens: list[int]
    tokens: list[list[int]]  # per row, up to and including EOS
    triggered: list[list[bool]]
    repaired: list[list[bool]]
    decode_seconds: float


def run_solo(model, prompt: torch.Tensor, max_new_tokens: int, eos_ids: set[int]) -> SoloResult:
    """Greedy decoding of one request alone: batch size 1, no padding."""
    logits, cache = prefill_alone(model, prompt)
    prefill = clone_layers(cache_layers(cache))
    all_logits, tokens = [logits], [int(logits.argmax())]
    mask = torch.ones((1, len(prompt)), dtype=torch.long, device=prompt.device)
    synchronize(prompt.device)
    start = time.perf_counter()
    for step in range(1, max_new_tokens):
        if tokens[-1] in eos_ids:
            break
        token = torch.tensor([tokens[-1]], device=prompt.device)
        position = torch.tensor([len(prompt) + step - 1], device=prompt.device)
        logits, mask = decode_step(model, cache, token, position, mask)
        all_logits.append(logits[0])
        tokens.append(int(logits[0].argmax()))
    synchronize(prompt.device)
    seconds = time.perf_counter() - start
    kv = columns_of_row(cache, 0, len(prompt) - 1, len(tokens))
    return SoloResult(torch.tensor(tokens, device=prompt.device), torch.stack(all_logits), prefill, kv, seconds)


def prefill_for_batch(model, prompts, solos, prefill: str, pad_id: int):
    """Batched cache after the prompts: (first-step logits [B, vocab], cache, mask, pad_lens).

    `alone` reuses the solo prefills: a prefill at batch size 1 without padding is the same
    computation in both runs, and serving engines also prefill each request on arrival.
    """
    if prefill == "alone":
        cache, mask, pads = assemble_prefilled(model, [s.prefill for s in solos])
        return torch.stack([s.logits[0] for s in solos]), cache, mask, pads
    if prefill == "batched":
        return prefill_batched(model, prompts, pad_id)
    raise ValueError(f"unknown prefill mode {prefill!r}")


def run_teacher_forced(model, prompts, solos: list[SoloResult], prefill: str, pad_id: int) -> TeacherForcedResult:
    """Batched decoding fed the solo token at every step, so prefixes stay identical."""
    lengths = [len(s.tokens) for s in solos]
    steps = max(lengths)
    device = prompts[0].device
    # Rows whose solo output ended early are fed padding and their extra steps discarded.
    solo_tokens = torch.full((len(solos), steps), pad_id, dtype=torch.long, device=device)
    solo_logits = torch.zeros((len(solos), steps, solos[0].logits.shape[-1]), dtype=solos[0].logits.dtype, device=device)
    for row, solo in enumerate(solos):
        solo_tokens[row, : lengths[row]] = solo.tokens
        solo_logits[row, : lengths[row]] = solo.logits
    prompt_lens = torch.tensor([len(p) for p in prompts], device=device)

    logits, cache, mask, pads = prefill_for_batch(model, prompts, solos, prefill, pad_id)
    per_step = [step_metrics(logits, solo_logits[:, 0])]
    for step in range(1, steps):
        logits, mask = decode_step(model, cache, solo_tokens[:, step - 1], prompt_lens + step - 1, mask)
        per_step.append(step_metrics(logits, solo_logits[:, step]))

    columns = {name: torch.stack([m[name] for m in per_step], dim=1).cpu().numpy() for name in per_step[0]}
    rows = []
    for row, solo in enumerate(solos):
        n = lengths[row]
        batched_kv = columns_of_row(cache, row, pads[row] + len(prompts[row]) - 1, n)
        kv_mean, kv_max = kv_relative_delta(batched_kv, solo.kv_columns)
        record = {name: values[row, :n] for name, values in columns.items()}
        record["kv_delta_mean"] = kv_mean.cpu().numpy()
        record["kv_delta_max"] = kv_max.cpu().numpy()
        rows.append(record)
    return TeacherForcedResult(pads, rows)


def run_free(
    model,
    prompts,
    solos: list[SoloResult] | None,
    prefill: str,
    pad_id: int,
    max_new_tokens: int,
    eos_ids: set[int],
    policy: Policy | None = None,
) -> FreeRunResult:
    """Free-running batched greedy decoding: each row continues from its own emitted tokens."""
    policy = policy or NoVerification()
    device = prompts[0].device
    batch = len(prompts)
    prompt_lens = torch.tensor([len(p) for p in prompts], device=device)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)

    logits, cache, mask, pads = prefill_for_batch(model, prompts, solos, prefill, pad_id)
    active = torch.ones(batch, dtype=torch.bool, device=device)
    decision = policy.decide(StepContext(0, logits, cache, mask, pads, active))
    history = [(decision.tokens, decision.triggered, decision.repaired, active)]
    synchronize(device)
    start = time.perf_counter()
    for step in range(1, max_new_tokens):
        active = active & ~torch.isin(history[-1][0], eos)
        if not bool(active.any()):
            break
        fed = torch.where(active, history[-1][0], torch.full_like(history[-1][0], pad_id))
        logits, mask = decode_step(model, cache, fed, prompt_lens + step - 1, mask)
        decision = policy.decide(StepContext(step, logits, cache, mask, pads, active))
        history.append((decision.tokens, decision.triggered & active, decision.repaired & active, active))
    synchronize(device)
    seconds = time.perf_counter() - start

    tokens, triggered, repaired, alive = (torch.stack(t, dim=1).cpu() for t in zip(*history))
    keep = [alive[row].nonzero().flatten().tolist() for row in range(batch)]
    return FreeRunResult(
        pad_lens=pads,
        tokens=[tokens[row, idx].tolist() for row, idx in enumerate(keep)],
        triggered=[triggered[row, idx].tolist() for row, idx in enumerate(keep)],
        repaired=[repaired[row, idx].tolist() for row, idx in enumerate(keep)],
        decode_seconds=seconds,
    )

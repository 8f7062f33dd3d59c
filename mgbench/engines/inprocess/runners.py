"""Runners: solo reference, teacher-forced batched audit, free-running batched with a policy."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mgbench.engines.inprocess.cache import LayerKV
from mgbench.engines.inprocess.decode import RowPrefill
from mgbench.engines.inprocess.kernels import STOCK, Kernels, PaddedDecoder, row_prefills  # noqa: F401 (re-export)
from mgbench.engines.inprocess.metrics import kv_relative_delta, margins, step_metrics
from mgbench.engines.inprocess.policies import NoVerification, Policy
from mgbench.engines.inprocess.step import StepContext


def synchronize(device) -> None:
    """Wait for queued kernels so wall-clock readings cover the work they claim to."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class DecodeTimer:
    """Elapsed seconds of a decode loop: CUDA events on a GPU (queued with the kernels they
    bracket), perf_counter after a synchronize elsewhere."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.started = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            return self.begin.elapsed_time(self.end) / 1000.0
        return time.perf_counter() - self.started


@dataclass
class SoloResult:
    tokens: torch.Tensor  # [n] generated tokens, EOS included when reached
    logits: torch.Tensor  # [n, vocab] in the model's dtype
    prefill: LayerKV  # the prompt's cache at batch size 1, as left by prefill
    kv_columns: torch.Tensor  # [layers, 2, kv_heads, n, head_dim]: K/V of each step's input token
    decode_seconds: float  # steps 1..n-1 (prefill excluded)

    @property
    def row_prefill(self) -> RowPrefill:
        return RowPrefill(self.logits[0], self.prefill)


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
    margin: list[list[float]]  # batched top-1/top-2 margin of each emitted step
    margin_ulp: list[list[float]]
    decode_seconds: float


def run_solo(
    model, prompt: torch.Tensor, max_new_tokens: int, eos_ids: set[int], kernels: Kernels = STOCK
) -> SoloResult:
    """Greedy decoding of one request alone: batch size 1, no padding, through `kernels`."""
    decoder = kernels.solo(model, prompt, max_new_tokens)
    all_logits, tokens = [decoder.logits[0]], [int(decoder.logits[0].argmax())]
    timer = DecodeTimer(prompt.device)
    for step in range(1, max_new_tokens):
        if tokens[-1] in eos_ids:
            break
        token = torch.tensor([tokens[-1]], device=prompt.device)
        position = torch.tensor([len(prompt) + step - 1], device=prompt.device)
        logits = decoder.step(token, position)
        all_logits.append(logits[0])
        tokens.append(int(logits[0].argmax()))
    seconds = timer.seconds()
    kv = decoder.columns(0, len(prompt) - 1, len(tokens))
    prefill = decoder.prefill
    return SoloResult(torch.tensor(tokens, device=prompt.device), torch.stack(all_logits), prefill.layers, kv, seconds)


def prefill_for_batch(model, prompts, prefills: list[RowPrefill] | None, prefill: str, pad_id: int):
    """Batched stock cache after the prompts: (first-step logits [B, vocab], cache, mask, pad_lens)."""
    decoder = PaddedDecoder(model, prompts, prefills, prefill, pad_id)
    return decoder.logits, decoder.cache, decoder.mask, decoder.pads


def run_teacher_forced(
    model, prompts, solos: list[SoloResult], prefill: str, pad_id: int, kernels: Kernels = STOCK
) -> TeacherForcedResult:
    """Batched decoding fed the solo token at every step, so prefixes stay identical."""
    lengths = [len(s.tokens) for s in solos]
    steps = max(lengths)
    device = prompts[0].device
    # Rows whose solo output ended early are fed padding and their extra steps discarded.
    solo_tokens = torch.full((len(solos), steps), pad_id, dtype=torch.long, device=device)
    solo_logits = torch.zeros(
        (len(solos), steps, solos[0].logits.shape[-1]), dtype=solos[0].logits.dtype, device=device
    )
    for row, solo in enumerate(solos):
        solo_tokens[row, : lengths[row]] = solo.tokens
        solo_logits[row, : lengths[row]] = solo.logits
    prompt_lens = torch.tensor([len(p) for p in prompts], device=device)

    decoder = kernels.batch(model, prompts, [s.row_prefill for s in solos], prefill, pad_id, steps)
    per_step = [step_metrics(decoder.logits, solo_logits[:, 0])]
    for step in range(1, steps):
        logits = decoder.step(solo_tokens[:, step - 1], prompt_lens + step - 1)
        per_step.append(step_metrics(logits, solo_logits[:, step]))

    columns = {name: torch.stack([m[name] for m in per_step], dim=1).cpu().numpy() for name in per_step[0]}
    rows = []
    for row, solo in enumerate(solos):
        n = lengths[row]
        batched_kv = decoder.columns(row, len(prompts[row]) - 1, n)
        kv_mean, kv_max = kv_relative_delta(batched_kv, solo.kv_columns)
        record = {name: values[row, :n] for name, values in columns.items()}
        record["kv_delta_mean"] = kv_mean.cpu().numpy()
        record["kv_delta_max"] = kv_max.cpu().numpy()
        rows.append(record)
    return TeacherForcedResult(decoder.pads, rows)


def run_free(
    model,
    prompts,
    prefills: list[RowPrefill | None] | None,
    prefill: str,
    pad_id: int,
    max_new_tokens: int,
    eos_ids: set[int],
    policy: Policy | None = None,
    kernels: Kernels = STOCK,
) -> FreeRunResult:
    """Free-running batched greedy decoding: each row continues from its own emitted tokens.

    Under `--prefill alone` the step-0 token comes from each row's prefill alone, which is the
    reference itself, so the policy first acts at step 1.
    """
    policy = policy or NoVerification()
    device = prompts[0].device
    batch = len(prompts)
    prompt_lens = torch.tensor([len(p) for p in prompts], device=device)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)

    decoder = kernels.batch(model, prompts, prefills, prefill, pad_id, max_new_tokens)
    logits, cache, pads = decoder.logits, decoder.cache, decoder.pads
    active = torch.ones(batch, dtype=torch.bool, device=device)
    first = NoVerification() if prefill == "alone" else policy
    decision = first.decide(StepContext(0, logits, cache, pads, active, None, None, []))
    history = [(decision.tokens, decision.triggered, decision.repaired, active, *margins(logits))]
    emitted = [decision.tokens]
    timer = DecodeTimer(device)
    for step in range(1, max_new_tokens):
        active = active & ~torch.isin(emitted[-1], eos)
        if not bool(active.any()):
            break
        fed = torch.where(active, emitted[-1], torch.full_like(emitted[-1], pad_id))
        positions = prompt_lens + step - 1
        logits = decoder.step(fed, positions)
        decision = policy.decide(StepContext(step, logits, cache, pads, active, fed, positions, emitted))
        emitted.append(decision.tokens)
        history.append(
            (decision.tokens, decision.triggered & active, decision.repaired & active, active, *margins(logits))
        )
    seconds = timer.seconds()

    tokens, triggered, repaired, alive, margin, margin_ulp = (torch.stack(t, dim=1).cpu() for t in zip(*history))
    keep = [alive[row].nonzero().flatten().tolist() for row in range(batch)]

    def pick(table: torch.Tensor) -> list[list]:  # each row's alive steps
        return [table[row, idx].tolist() for row, idx in enumerate(keep)]

    return FreeRunResult(pads, pick(tokens), pick(triggered), pick(repaired), pick(margin), pick(margin_ulp), seconds)

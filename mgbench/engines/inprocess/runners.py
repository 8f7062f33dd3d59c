"""Runners: the solo reference and the teacher-forced batched audit (free-running decoding under a
policy is `verification/loop.py`)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from mgbench.analysis.divergence import first_divergence
from mgbench.engines.inprocess.decode import RowPrefill
from mgbench.engines.inprocess.host_heap import trim_host_heap
from mgbench.engines.inprocess.kernels.sets import STOCK, Kernels, PaddedDecoder, row_prefills  # noqa: F401 (re-export)
from mgbench.engines.inprocess.metrics import TOP_LOGPROBS, kv_relative_delta, step_metrics
from mgbench.engines.inprocess.stopwatch import DecodeTimer, SectionTimer
from mgbench.errors import UserError


@dataclass
class SoloResult:
    """A request decoded alone, kept in a size bounded by its tokens (never its logits): what
    policies, diagnostics and later lockstep passes read from the solo reference."""

    tokens: torch.Tensor  # [n] generated tokens, EOS included when reached
    margins: torch.Tensor  # [n] float32 top-1 minus top-2 logit of each step
    top_ids: torch.Tensor  # [n, TOP_LOGPROBS] the step's highest logits' ids
    top_logits: torch.Tensor  # [n, TOP_LOGPROBS] float32 their values
    row_prefill: RowPrefill  # the prompt's first-step logits and batch-of-one cache, as prefill left them
    decode_seconds: float | None  # steps 1..n-1 (prefill excluded); None when timed with other lanes


@dataclass
class TeacherForcedResult:
    pad_lens: list[int]
    rows: list[dict]  # per row: metric name -> numpy array over the row's steps
    solos: list[SoloResult]  # each row's solo reference (the one given, or the one decoded in lockstep)
    solo_seconds: float  # the solo lanes' decode steps (steps 1..), all rows together


def solo_summary(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a solo result keeps of each step's logits [B, vocab]: (token, margin, top ids, top values)."""
    top = logits.float().topk(TOP_LOGPROBS, dim=-1)
    return logits.argmax(-1), top.values[..., 0] - top.values[..., 1], top.indices, top.values


SUMMARY_FIELDS = ("tokens", "margins", "top_ids", "top_logits")  # SoloResult's names for solo_summary's tuple


class StepColumns:
    """Per-step figures of a batch's rows, written into buffers allocated once ([rows, steps, ...]
    each, at the first step). Kept as a new small tensor per step instead, they would sit between
    the freed step buffers and fragment the host heap (its resident size then grows with the
    tokens, host_heap.py)."""

    def __init__(self, steps: int):
        self.steps, self.count, self.buffers = steps, 0, {}

    def put(self, values: dict[str, torch.Tensor]) -> None:
        if not self.buffers:
            self.buffers = {k: v.new_empty((v.shape[0], self.steps, *v.shape[1:])) for k, v in values.items()}
        for name, value in values.items():
            self.buffers[name][:, self.count] = value
        self.count += 1

    def __getitem__(self, name: str) -> torch.Tensor:
        """Column `name` over the steps put so far."""
        return self.buffers[name][:, : self.count]

    def put_solo_summary(self, logits: torch.Tensor) -> None:
        """One step's `solo_summary` of logits [rows, vocab]."""
        self.put(dict(zip(SUMMARY_FIELDS, solo_summary(logits))))

    def solo_result(self, row: int, row_prefill: RowPrefill, length: int, seconds: float | None = None) -> SoloResult:
        """Row `row`'s first `length` steps of solo summaries, as a SoloResult of its own (copies)."""
        kept = (self[name][row, :length].clone() for name in SUMMARY_FIELDS)
        return SoloResult(*kept, row_prefill, seconds)


def run_solo(
    model,
    prompt: torch.Tensor,
    max_new_tokens: int,
    eos_ids: set[int],
    kernels: Kernels = STOCK,
    prefill: RowPrefill | None = None,
) -> SoloResult:
    """Greedy decoding of one request alone: batch size 1, no padding, through `kernels`; from the
    prompt's stock `prefill` alone where it was computed before (both kernel sets prefill so)."""
    decoder = kernels.solo(model, prompt, max_new_tokens, prefill)
    steps = StepColumns(max_new_tokens)
    steps.put_solo_summary(decoder.logits)
    tokens = [int(steps["tokens"][0, -1])]
    timer = DecodeTimer(prompt.device)
    for step in range(1, max_new_tokens):
        if tokens[-1] in eos_ids:
            break
        trim_host_heap(step, prompt.device)
        token = torch.tensor([tokens[-1]], device=prompt.device)
        position = torch.tensor([len(prompt) + step - 1], device=prompt.device)
        steps.put_solo_summary(decoder.step(token, position))
        tokens.append(int(steps["tokens"][0, -1]))
    seconds = timer.seconds()
    return steps.solo_result(0, decoder.prefill, steps.count, seconds)


def prefill_for_batch(model, prompts, prefills: list[RowPrefill] | None, prefill: str, pad_id: int):
    """Batched stock cache after the prompts: (first-step logits [B, vocab], cache, mask, pad_lens)."""
    decoder = PaddedDecoder(model, prompts, prefills, prefill, pad_id)
    return decoder.logits, decoder.cache, decoder.mask, decoder.pads


def run_teacher_forced(
    model,
    prompts,
    solos: list[SoloResult | None],
    prefill: str,
    pad_id: int,
    max_new_tokens: int | None = None,
    eos_ids: set[int] = frozenset(),
    kernels: Kernels = STOCK,
    batch_mode=nullcontext,
    prefills: list[RowPrefill] | None = None,
) -> TeacherForcedResult:
    """Batched decoding fed the solo token at every step, so prefixes stay identical.

    The solo reference runs in lockstep, one solo lane per row stepping beside the batch, so each
    step's solo logits are compared and dropped: memory is the caches and a few floats per step,
    whatever max_new_tokens. A row with a known solo result re-decodes it (fed its tokens; the
    same computation, so the same logits); a row without one decodes greedily and returns its
    result (`max_new_tokens` then bounds it; by default the known results' longest length).
    `batch_mode()` is entered around the batch's forwards only (the batch-invariant mode must not
    touch the solo lanes). `prefills`: the batch's own row prefills (a prefill axis's, cut into
    pieces), instead of the solo lanes' (with --prefill alone)."""
    device = prompts[0].device
    if max_new_tokens is None:
        max_new_tokens = max(len(s.tokens) for s in solos)
    lanes = [
        kernels.solo(model, p, max_new_tokens, None if s is None else s.row_prefill) for p, s in zip(prompts, solos)
    ]
    known = [None if s is None else s.tokens.tolist() for s in solos]
    with batch_mode():
        own = prefills or [lane.prefill for lane in lanes]
        decoder = kernels.batch(model, prompts, own, prefill, pad_id, max_new_tokens)
    prompt_lens = torch.tensor([len(p) for p in prompts], device=device)
    solo_logits = torch.stack([lane.logits[0] for lane in lanes])
    per_step, summaries = StepColumns(max_new_tokens), StepColumns(max_new_tokens)
    per_step.put(step_metrics(decoder.logits, solo_logits))
    summaries.put_solo_summary(solo_logits)
    tokens = summaries["tokens"][:, 0].tolist()
    lengths = [None] * len(prompts)  # a row's solo length, once its lane has ended
    timer = SectionTimer(device)
    for step in range(1, max_new_tokens):
        for row, token in enumerate(tokens):
            if lengths[row] is None and (token in eos_ids or (known[row] is not None and step == len(known[row]))):
                lengths[row] = step
        active = [row for row in range(len(prompts)) if lengths[row] is None]
        if not active:
            break
        trim_host_heap(step, device)
        # Rows whose solo output ended are fed padding; their extra steps are discarded.
        fed = [tokens[row] if lengths[row] is None else pad_id for row in range(len(prompts))]
        fed = torch.tensor(fed, dtype=torch.long, device=device)
        solo_logits = torch.zeros_like(solo_logits)
        with timer:
            for row in active:
                solo_logits[row] = lanes[row].step(fed[row : row + 1], prompt_lens[row : row + 1] + step - 1)[0]
        with batch_mode():
            logits = decoder.step(fed, prompt_lens + step - 1)
        per_step.put(step_metrics(logits, solo_logits))
        summaries.put_solo_summary(solo_logits)
        tokens = summaries["tokens"][:, -1].tolist()
    lengths = [per_step.count if n is None else n for n in lengths]
    for row, expected in enumerate(known):
        _check_repeat(expected, summaries["tokens"][row, : lengths[row]].tolist())

    columns = {name: per_step[name].cpu().numpy() for name in per_step.buffers}
    rows, results = [], []
    for row, prompt in enumerate(prompts):
        n = lengths[row]
        # K/V of each step's input token, read from the two caches at the end (the caches hold them anyway).
        batched_kv = decoder.columns(row, len(prompt) - 1, n)
        kv_mean, kv_max = kv_relative_delta(batched_kv, lanes[row].columns(0, len(prompt) - 1, n))
        record = {name: values[row, :n] for name, values in columns.items()}
        record["kv_delta_mean"] = kv_mean.cpu().numpy()
        record["kv_delta_max"] = kv_max.cpu().numpy()
        rows.append(record)
        results.append(solos[row] or summaries.solo_result(row, lanes[row].prefill, n))
    return TeacherForcedResult(decoder.pads, rows, results, timer.seconds())


def _check_repeat(expected: list[int] | None, decoded: list[int]) -> None:
    """A re-decoded solo reference must give the tokens it gave before: the tables compare
    batches against one reference, so a device whose solo decoding does not repeat is reported."""
    if expected is not None and decoded != expected:
        step = first_divergence(expected, decoded)
        got = decoded[step] if step < len(decoded) else "the end"
        raise UserError(
            f"solo decoding does not repeat on this device: a request decoded alone again gave {got} "
            f"instead of {expected[step] if step < len(expected) else 'the end'} at step {step}, so the "
            "batch sizes of one run would be compared with different references; sweep one batch size "
            "per run (--batch-size)"
        )

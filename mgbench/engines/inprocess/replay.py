"""Verification against the fixed-order reference by replay: LLM-42's decode-verify-rollback
(`window`) and MarginGate on the same reference (`margin`).

Rows decode with the stock kernels inside the batch, over a start-aligned cache (each row at its
own positions, so one row can move back while the others go on). A row's unverified tokens are
replayed in one forward through the fixed-order kernels over its verified cache, teacher-forced on
the tokens it emitted: the first position whose fixed-order argmax differs takes that token, the
later ones are discarded and the row decodes on from there (a rollback). The verified tokens' K/V
in the batch become the replay's. A replayed chunk equals step-by-step fixed-order decoding (the
probe checks it), so every verified token is the fixed-order solo token.

- `window` (microsoft/llm-42): a row is replayed once it has W unverified tokens, and at its end.
- `margin` (MarginGate): a row is replayed when its batched top-1/top-2 margin falls below TAU,
  over every token since its last verified one; with `end_check` also at its end (then the output
  equals the fixed-order reference by construction), without it the gate alone stands behind the
  tail after the last trigger, as in the paper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mgbench.engines.inprocess.aligned_cache import StartAlignedCache, StockAlignedCache
from mgbench.engines.inprocess.fixed_order import aligned_attention, fixed_order_forward, module_forms
from mgbench.engines.inprocess.kernels import Kernels, row_prefills
from mgbench.engines.inprocess.metrics import margins
from mgbench.engines.inprocess.runners import DecodeTimer

REPLAY_POLICIES = ("window", "margin", "none")  # none: the same stock decoding, never verified


@dataclass(frozen=True)
class ReplaySpec:
    kind: str  # "window", "margin" or "none"
    window: int = 64
    tau: float | None = None
    unit: str = "logit"
    end_check: bool = True

    def __post_init__(self) -> None:
        if self.kind not in REPLAY_POLICIES:
            raise ValueError(f"unknown replay policy {self.kind!r}")
        if self.kind == "window" and self.window < 1:
            raise ValueError("window policy needs W >= 1")
        if self.kind == "margin" and (self.tau is None or not math.isfinite(self.tau) or self.tau <= 0):
            raise ValueError("margin policy needs a finite threshold TAU > 0")

    @property
    def label(self) -> str:
        if self.kind == "window":
            return f"window W={self.window}"
        if self.kind == "none":
            return "none (start-aligned)"
        unit = "ulp" if self.unit == "ulp" else ""
        return f"margin<{self.tau:.4g}{unit}/replay{'' if self.end_check else ' (no end check)'}"


@dataclass
class ReplayResult:
    tokens: list[list[int]]  # per row, up to and including EOS
    verifications: list[int] = field(default_factory=list)  # replays per row
    replayed: list[int] = field(default_factory=list)  # tokens replayed per row
    rollbacks: list[int] = field(default_factory=list)
    discarded: list[int] = field(default_factory=list)  # emitted tokens thrown away by rollbacks
    triggers: list[int] = field(default_factory=list)  # steps whose gate fired (margin) per row
    steps: list[int] = field(default_factory=list)  # batched decode steps each row took part in
    decode_seconds: float = 0.0


class _Row:
    def __init__(self, prompt_len: int, first: int):
        self.prompt_len, self.tokens, self.verified = prompt_len, [first], 1  # the prefill's token is the reference's
        self.done = False
        self.verifications = self.replayed = self.rollbacks = self.discarded = self.triggers = self.steps = 0

    @property
    def next_position(self) -> int:
        return self.prompt_len + len(self.tokens) - 1


REPLAY_CHUNK = 64  # tokens per replay forward: the chunk size the probe checks against steps


def _replay(model, kernels: Kernels, fixed: StartAlignedCache, stock: StockAlignedCache, r: int, row: _Row) -> None:
    """Verify row `r`'s unverified tokens by fixed-order forwards of at most REPLAY_CHUNK tokens
    (memory stays bounded by the chunk, not by the tail); roll back at the first mismatch."""
    v, end = row.verified, len(row.tokens)
    if end <= v:
        return
    device = stock.keys[0].device
    row.verifications += 1
    verified = v
    while verified < end:
        stop = min(end, verified + REPLAY_CHUNK)
        inputs = torch.tensor(row.tokens[verified - 1 : stop - 1], device=device).view(1, -1)
        positions = (row.prompt_len + verified - 1 + torch.arange(stop - verified, device=device)).view(1, -1)
        with module_forms(model, kernels.plan):
            predicted = fixed_order_forward(model, fixed.row(r), inputs, positions)[0].argmax(-1).tolist()
        row.replayed += stop - verified
        mismatch = next((j for j, token in enumerate(predicted) if token != row.tokens[verified + j]), None)
        if mismatch is not None:
            row.rollbacks, row.discarded = row.rollbacks + 1, row.discarded + (end - verified - mismatch - 1)
            row.tokens = row.tokens[: verified + mismatch] + [predicted[mismatch]]
            verified += mismatch + 1
            break
        verified = stop
    stock.copy_row_from(fixed, r, row.prompt_len + v - 1, verified - v)  # the verified inputs' K/V
    row.verified = verified


def run_replay_verified(
    model,
    prompts: list[torch.Tensor],
    pad_id: int,
    max_new_tokens: int,
    eos_ids: set[int],
    spec: ReplaySpec,
    kernels: Kernels,
    prefills=None,
) -> ReplayResult:
    """Free-running batched decoding, verified by replay against the fixed-order reference.

    `prefills` (RowPrefill per row, None to compute) must be fixed-order ones: computed alone
    inside `kernels.active`, as the fixed-order solo runs compute theirs."""
    if not kernels.fixed_order:
        raise ValueError("replay verification needs fixed-order kernels (its reference)")
    device = prompts[0].device
    with kernels.active(model):
        prefills = row_prefills(model, prompts, prefills)
    layers = [p.layers for p in prefills]
    lengths = [len(p) for p in prompts]
    fixed = StartAlignedCache.from_prefills(layers, max_new_tokens + 1, kernels.plan.chunk, lengths)
    stock = StockAlignedCache.from_prefills(layers, max_new_tokens + 1, lengths)
    rows = [_Row(len(p), int(pre.logits.argmax())) for p, pre in zip(prompts, prefills)]
    eos = set(eos_ids)
    timer = DecodeTimer(device)
    with aligned_attention(model, kernels.plan):
        for row in rows:
            row.done = _finished(row, eos, max_new_tokens) and row.verified == len(row.tokens)
        while not all(row.done for row in rows):
            inputs = torch.tensor([pad_id if r.done else r.tokens[-1] for r in rows], device=device)
            positions = torch.tensor([r.next_position for r in rows], device=device)
            logits = fixed_order_forward(model, stock, inputs.view(-1, 1), positions.view(-1, 1))[:, -1]
            # One host copy per step: tokens (exact in float32 below 2**24) and both margins.
            tokens, margin, margin_ulp = torch.stack([logits.argmax(-1).float(), *margins(logits)]).tolist()
            tokens = [int(t) for t in tokens]
            for r, row in enumerate(rows):
                if row.done:
                    continue
                row.tokens.append(tokens[r])
                row.steps += 1
                ended = _finished(row, eos, max_new_tokens)
                low = (margin_ulp[r] if spec.unit == "ulp" else margin[r]) < (spec.tau or 0.0)
                if spec.kind == "none":
                    verify = False
                elif spec.kind == "window":
                    verify = ended or len(row.tokens) - row.verified >= spec.window
                else:
                    row.triggers += int(low)
                    verify = low or (ended and spec.end_check)
                if verify:
                    _replay(model, kernels, fixed, stock, r, row)
                    ended = _finished(row, eos, max_new_tokens)
                unchecked_tail = spec.kind == "none" or (spec.kind == "margin" and not spec.end_check)
                row.done = ended and (row.verified == len(row.tokens) or unchecked_tail)
    seconds = timer.seconds()
    return ReplayResult(
        [r.tokens for r in rows],
        [r.verifications for r in rows],
        [r.replayed for r in rows],
        [r.rollbacks for r in rows],
        [r.discarded for r in rows],
        [r.triggers for r in rows],
        [r.steps for r in rows],
        seconds,
    )


def _finished(row: _Row, eos: set[int], max_new_tokens: int) -> bool:
    return row.tokens[-1] in eos or len(row.tokens) >= max_new_tokens

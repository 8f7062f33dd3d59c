"""Verification against the fixed-order reference by replay: LLM-42's decode-verify-rollback
(`window`) and MarginGate on the same reference (`margin`).

Rows decode with the stock kernels inside the batch, over a start-aligned cache (each row at its
own positions, so one row can move back while the others go on). A row's unverified tokens are
replayed through the fixed-order kernels over its verified cache, teacher-forced on the tokens it
emitted: the first position whose fixed-order argmax differs takes that token, the later ones are
discarded and the row decodes on from there (a rollback). The verified tokens' K/V in the batch
become the replay's. A replayed chunk equals step-by-step fixed-order decoding (the probe checks
it, at the verify batch's own shape), so every verified token is the fixed-order solo token.

Replays are scheduled as LLM-42 schedules them (microsoft/llm-42, `llm42_worker.py`): verify
batches of exactly N rows of W tokens, each row fed its last verified token and then its
unverified ones, padded to W; ready rows first, then rows not yet ready (verified early, for free),
then dummy rows (an empty spare row of the cache fed padding), one forward per verify batch. The
shape never changes: a run that cannot fill a batch pads it. N = 1 replays each ready row alone
over exactly its unverified tokens (chunks of at most W, no padding): the per-row replay, so one
run shows what packing buys.

- `window` (LLM-42): a row is ready once it has W unverified tokens, and at its end.
- `margin` (MarginGate): a row is ready when its batched top-1/top-2 margin falls below TAU; with
  `end_check` also at its end (then the output equals the fixed-order reference by construction),
  without it the gate alone stands behind the tail after the last trigger, as in the paper. A
  ready row verifies at once, or (`wait`) waits for company: until N rows are ready, one of them
  holds W unverified tokens or one has ended.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mgbench.engines.inprocess.aligned_cache import StartAlignedCache, StockAlignedCache
from mgbench.engines.inprocess.fixed_order import aligned_attention, fixed_order_forward, module_forms
from mgbench.engines.inprocess.kernels import Kernels, row_prefills
from mgbench.engines.inprocess.metrics import margins
from mgbench.engines.inprocess.runners import DecodeTimer, FreeRunResult

REPLAY_POLICIES = ("window", "margin", "none")  # none: the same stock decoding, never verified


VERIFY_ROWS, VERIFY_TOKENS = 8, 64  # LLM-42's server defaults: N rows per verify batch, W tokens per row


@dataclass(frozen=True)
class ReplaySpec:
    kind: str  # "window", "margin" or "none"
    window: int = VERIFY_TOKENS  # W: the window's trigger, and the tokens of a verify row
    rows: int = VERIFY_ROWS  # N: rows per verify batch (1: each ready row replayed alone, unpadded)
    tau: float | None = None
    unit: str = "logit"
    end_check: bool = True
    wait: bool = False  # margin: a triggered row waits for company (N ready, W tokens, or an end)

    def __post_init__(self) -> None:
        if self.kind not in REPLAY_POLICIES:
            raise ValueError(f"unknown replay policy {self.kind!r}")
        if self.window < 1 or self.rows < 1:
            raise ValueError("a verify batch needs W >= 1 tokens and N >= 1 rows")
        if self.kind == "margin" and (self.tau is None or not math.isfinite(self.tau) or self.tau <= 0):
            raise ValueError("margin policy needs a finite threshold TAU > 0")

    @property
    def shape(self) -> str:
        return f"N={self.rows}" if self.rows > 1 else "per row"

    @property
    def label(self) -> str:
        if self.kind == "window":
            return f"window W={self.window}, {self.shape}"
        if self.kind == "none":
            return "none (start-aligned)"
        unit = "ulp" if self.unit == "ulp" else ""
        wait = ", waits" if self.wait else ""
        tail = "" if self.end_check else " (no end check)"
        return f"margin<{self.tau:.4g}{unit}/replay {self.shape}{wait}{tail}"

    @property
    def repair(self) -> str:
        """How a caught flip is repaired, in the words verify's tables use for every policy."""
        return "none" if self.kind == "none" else "replay"

    @property
    def verify_calls(self) -> list[int]:
        """Row counts of the fixed-order forwards this policy makes besides decode steps (what the
        probe must find exact): N x W packed, or 1..W tokens of one row."""
        if self.kind == "none":
            return []
        return [self.rows * self.window] if self.rows > 1 else list(range(1, self.window + 1))


def replay_policy_specs(
    policies: str, tau: float | None, unit: str, window: int | None = None, rows: int | None = None
) -> list:
    """--policy of a fixed-order run as specs: `none` (the fixed-order kernels decode, nothing to
    verify), `window` and `margin` (stock decoding verified by replay against fixed-order solo, in
    verify batches of `rows` x `window`)."""
    from mgbench.engines.inprocess.policies import PolicySpec  # the stock policies' spec, for `none`
    from mgbench.errors import UserError

    kinds = [p.strip() for p in policies.split(",") if p.strip()]
    allowed = ("none", "window", "margin")
    for kind in kinds:
        if kind not in allowed:
            raise UserError(
                f"--policy {kind!r} with --kernels fixed-order: choose from {', '.join(allowed)} (always and "
                "oracle replay stock solo decoding, another reference)"
            )
    if not kinds:
        raise UserError("--policy needs at least one value")
    for name, value in (("--window", window), ("--verify-rows", rows)):
        if value is not None and not 1 <= value <= 4096:
            raise UserError(f"{name} {value}: use a whole number from 1 to 4096")
    if "margin" in kinds and (tau is None or not (tau == tau and 0 < tau < 1e6)):
        raise UserError("--policy margin needs --threshold TAU (a finite margin above 0) or --threshold-from")
    shape = {"window": window or VERIFY_TOKENS, "rows": VERIFY_ROWS if rows is None else rows}
    return [
        PolicySpec("none")
        if kind == "none"
        else ReplaySpec(kind, tau=tau if kind == "margin" else None, unit=unit, **shape)
        for kind in kinds
    ]


def verify_shape(specs: list[ReplaySpec]) -> tuple[list[int], int, int]:
    """What the fixed-order probe must check for these policies: (row counts of their forwards,
    the largest verify batch's rows, the most tokens per verify row)."""
    calls = sorted({m for s in specs for m in s.verify_calls})
    rows = max((s.rows for s in specs if s.kind != "none" and s.rows > 1), default=0)
    tokens = max((s.window for s in specs if s.kind != "none"), default=0)
    return calls, rows, tokens


@dataclass
class ReplayResult:
    tokens: list[list[int]]  # per row, up to and including EOS
    verifications: list[int] = field(default_factory=list)  # verify forwards each row took part in
    replayed: list[int] = field(default_factory=list)  # tokens verified per row (its own, not padding)
    rollbacks: list[int] = field(default_factory=list)
    discarded: list[int] = field(default_factory=list)  # emitted tokens thrown away by rollbacks
    triggers: list[int] = field(default_factory=list)  # steps whose gate fired (margin) per row
    steps: list[int] = field(default_factory=list)  # batched decode steps each row took part in
    decode_seconds: float = 0.0
    forwards: int = 0  # verify forwards (packed batches, or per-row replay chunks)
    fed: int = 0  # token slots those forwards computed: verified tokens, padding and dummy rows
    # Per row and emitted token (aligned with `tokens`): the batched margins of the step that
    # emitted it (logit, ulp), whether the row's gate fired there, whether a rollback put it there.
    margin: list[list[float]] = field(default_factory=list)
    margin_ulp: list[list[float]] = field(default_factory=list)
    triggered: list[list[bool]] = field(default_factory=list)
    repaired: list[list[bool]] = field(default_factory=list)

    def as_free_run(self) -> FreeRunResult:
        """The run in free-running decoding's per-step record (verify's tables): the final tokens,
        the batched margins of the steps that emitted them, where the gate fired and where a
        rollback put the reference's token; a start-aligned cache has no padding."""
        rows = len(self.tokens)
        fields = (self.tokens, self.triggered, self.repaired, self.margin, self.margin_ulp)
        return FreeRunResult([0] * rows, *fields, self.decode_seconds)


class _Row:
    def __init__(self, prompt_len: int, first: int, margin: tuple[float, float] = (math.nan, math.nan)):
        self.prompt_len, self.tokens, self.verified = prompt_len, [first], 1  # the prefill's token is the reference's
        self.done = self.ended = self.ready = False
        self.verifications = self.replayed = self.rollbacks = self.discarded = self.triggers = self.steps = 0
        # per emitted token: (margin, margin in ulps, gate fired, put there by a rollback)
        self.marks: list[tuple[float, float, bool, bool]] = [(*margin, False, False)]

    def emit(self, token: int, margin: float, margin_ulp: float) -> None:
        self.tokens.append(token)
        self.marks.append((margin, margin_ulp, False, False))
        self.steps += 1

    @property
    def next_position(self) -> int:
        return self.prompt_len + len(self.tokens) - 1

    @property
    def unverified(self) -> int:
        return len(self.tokens) - self.verified

    def check(self, predicted: list[int]) -> int:
        """Take the reference's predictions for the next unverified tokens: verify up to the first
        mismatch, where the row takes the reference's token and drops the rest (a rollback).
        Returns the tokens verified."""
        v, end = self.verified, len(self.tokens)
        mismatch = next((j for j, token in enumerate(predicted) if token != self.tokens[v + j]), None)
        self.replayed += len(predicted) if mismatch is None else mismatch + 1
        if mismatch is None:
            self.verified += len(predicted)
            return len(predicted)
        self.rollbacks, self.discarded = self.rollbacks + 1, self.discarded + (end - v - mismatch - 1)
        self.tokens = self.tokens[: v + mismatch] + [predicted[mismatch]]
        margin, margin_ulp, fired, _ = self.marks[v + mismatch]  # the batched step that emitted the wrong token
        self.marks = self.marks[: v + mismatch] + [(margin, margin_ulp, fired, True)]
        self.verified = len(self.tokens)
        return mismatch + 1


REPLAY_CHUNK = VERIFY_TOKENS  # the longest per-row replay forward by default (W)


class _Verifier:
    """Replays through the fixed-order kernels and the K/V copy of what they verify into the batch."""

    def __init__(self, model, kernels: Kernels, fixed: StartAlignedCache, stock: StockAlignedCache, spec, pad_id):
        self.model, self.kernels, self.fixed, self.stock, self.spec, self.pad_id = (
            model,
            kernels,
            fixed,
            stock,
            spec,
            pad_id,
        )
        self.dummy = stock.batch  # the cache's spare row: every dummy row of a verify batch
        self.forwards = self.fed = 0

    def _forward(self, cache: StartAlignedCache, inputs: list[list[int]], starts: list[int]) -> list[list[int]]:
        """Fixed-order argmax of every fed position: rows of equal length fed at starts.."""
        device = self.stock.keys[0].device
        tokens = torch.tensor(inputs, device=device)
        positions = torch.tensor(starts, device=device).view(-1, 1) + torch.arange(tokens.shape[1], device=device)
        with module_forms(self.model, self.kernels.plan):
            predicted = fixed_order_forward(self.model, cache, tokens, positions).argmax(-1).tolist()
        self.forwards, self.fed = self.forwards + 1, self.fed + tokens.numel()
        return predicted

    def _settle(self, r: int, row: _Row, before: int) -> None:
        """The verified inputs' K/V from the replay into the batch's cache."""
        self.stock.copy_row_from(self.fixed, r, row.prompt_len + before - 1, row.verified - before)

    def alone(self, r: int, row: _Row) -> None:
        """Row r by itself over exactly its unverified tokens, in chunks of at most W."""
        before = row.verified
        while row.unverified > 0:
            row.verifications += 1
            v, count = row.verified, min(row.unverified, self.spec.window)
            inputs = [row.tokens[v - 1 : v - 1 + count]]
            predicted = self._forward(self.fixed.row(r), inputs, [row.prompt_len + v - 1])[0]
            if row.check(predicted) < count:
                break
        self._settle(r, row, before)

    def packed(self, rows: list[_Row], ready: list[int]) -> None:
        """Verify batches of exactly N rows of W tokens until every ready row is verified: ready rows
        first, then rows not ready (most unverified tokens first), then dummy rows."""
        n, w = self.spec.rows, self.spec.window
        queue = [r for r in ready if rows[r].unverified > 0]
        while queue:
            members, queue = queue[:n], queue[n:]
            spare = sorted(
                (
                    r
                    for r, row in enumerate(rows)
                    if r not in members and r not in queue and row.unverified > 0 and not row.done
                ),
                key=lambda r: -rows[r].unverified,
            )
            members += spare[: n - len(members)]
            inputs, starts, counts = [], [], []
            for r in members:
                row = rows[r]
                count = min(row.unverified, w)
                fed = row.tokens[row.verified - 1 : row.verified - 1 + count]
                inputs.append(fed + [self.pad_id] * (w - count))
                starts.append(row.prompt_len + row.verified - 1)
                counts.append(count)
            dummies = n - len(members)
            inputs += [[self.pad_id] * w] * dummies
            starts += [0] * dummies
            cache_rows = members + [self.dummy] * dummies
            packed = self.fixed.gather(cache_rows, max(starts) + w)
            predicted = self._forward(packed, inputs, starts)
            self.fixed.scatter(cache_rows, packed)
            for r, count, row_predicted in zip(members, counts, predicted):
                row, before = rows[r], rows[r].verified
                row.verifications += 1
                if row.check(row_predicted[:count]) == count and row.unverified > 0 and r in ready:
                    queue.append(r)  # more than W tokens: the next batch takes the rest
                self._settle(r, row, before)


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
    checked, largest = kernels.plan.rows_checked, max(spec.verify_calls, default=0)
    if checked is not None and largest > checked:  # a vendor GEMM may change kernel past what was probed
        raise ValueError(
            f"{spec.label} makes {largest}-row fixed-order calls; the plan was probed up to {checked} rows "
            "(probe with calls=spec.verify_calls)"
        )
    device = prompts[0].device
    with kernels.active(model):
        prefills = row_prefills(model, prompts, prefills)
    layers = [p.layers for p in prefills]
    lengths = [len(p) for p in prompts]
    # Room for a verify row's padding past the last token, and one spare row: the dummy rows.
    verifies, packed = spec.kind != "none", spec.kind != "none" and spec.rows > 1
    room = max_new_tokens + 1 + (spec.window if packed else 0)
    fixed = None  # the unverified base (`none`) never replays
    if verifies:
        fixed = StartAlignedCache.from_prefills(layers, room, kernels.plan.chunk, lengths, int(packed))
    stock = StockAlignedCache.from_prefills(layers, max_new_tokens + 1, lengths)
    rows = [
        _Row(len(p), int(pre.logits.argmax()), tuple(m.item() for m in margins(pre.logits.view(1, -1).float())))
        for p, pre in zip(prompts, prefills)
    ]
    verifier = _Verifier(model, kernels, fixed, stock, spec, pad_id)
    eos = set(eos_ids)
    unchecked_tail = spec.kind == "none" or (spec.kind == "margin" and not spec.end_check)
    timer = DecodeTimer(device)
    with aligned_attention(model, kernels.plan):
        for row in rows:
            row.ended = _finished(row, eos, max_new_tokens)
            row.done = row.ended and row.verified == len(row.tokens)
        while not all(row.done for row in rows):
            inputs = torch.tensor([pad_id if r.done or r.ended else r.tokens[-1] for r in rows], device=device)
            positions = torch.tensor([r.next_position for r in rows], device=device)
            logits = fixed_order_forward(model, stock, inputs.view(-1, 1), positions.view(-1, 1))[:, -1]
            # One host copy per step: tokens (exact in float32 below 2**24) and both margins.
            tokens, margin, margin_ulp = torch.stack([logits.argmax(-1).float(), *margins(logits)]).tolist()
            for r, row in enumerate(rows):
                if row.done or row.ended:
                    continue
                row.emit(int(tokens[r]), margin[r], margin_ulp[r])
                row.ended = _finished(row, eos, max_new_tokens)
                low = (margin_ulp[r] if spec.unit == "ulp" else margin[r]) < (spec.tau or 0.0)
                fired = False
                if spec.kind == "window":
                    fired = row.unverified >= spec.window
                    row.ready = row.ended or fired
                elif spec.kind == "margin":
                    fired = low
                    row.triggers += int(low)
                    row.ready = row.ready or low or (row.ended and spec.end_check)
                row.marks[-1] = (*row.marks[-1][:2], fired, False)
            _verify_ready(verifier, rows, spec)
            for row in rows:
                row.ended = _finished(row, eos, max_new_tokens)
                row.done = row.ended and (row.verified == len(row.tokens) or unchecked_tail)
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
        verifier.forwards,
        verifier.fed,
        *([[mark[k] for mark in r.marks] for r in rows] for k in range(4)),
    )


def _verify_ready(verifier: _Verifier, rows: list[_Row], spec: ReplaySpec) -> None:
    """This step's verification: the ready rows, per row or packed; a waiting margin row verifies
    once N rows are ready, one of them holds W unverified tokens or one has ended."""
    ready = [r for r, row in enumerate(rows) if row.ready and not row.done]
    if not ready:
        return
    if spec.wait and spec.rows > 1:
        due = len(ready) >= spec.rows or any(rows[r].ended or rows[r].unverified >= spec.window for r in ready)
        if not due:
            return
    if spec.rows == 1:
        for r in ready:
            verifier.alone(r, rows[r])
    else:
        verifier.packed(rows, ready)
    for r in ready:
        rows[r].ready = False


def _finished(row: _Row, eos: set[int], max_new_tokens: int) -> bool:
    return row.tokens[-1] in eos or len(row.tokens) >= max_new_tokens

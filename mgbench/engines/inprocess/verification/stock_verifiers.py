"""Verification of a flagged row's step on a reference path, and repair of the batched cache.

Two repair modes:

- `column` (the MarginGate paper's): the row alone at batch size 1 over its own unpadded cache
  as the batch left it. On an argmax mismatch it takes the reference token and overwrites the
  K/V column of this step. Cheap, but its reference sees a K/V history computed inside the
  batch, so it is not guaranteed to equal the solo token (near-ties are common in BF16).

- `exact`: each row keeps a lazily advanced *shadow*: a batch-of-one cache holding the solo
  computation of the row's own emitted prefix. When the row is flagged at step t, the shadow
  replays the emitted tokens it has not seen yet, one decode step at a time exactly as the solo
  runner does (a chunked forward is not bitwise equal to single steps), so its logits are the
  solo logits. On mismatch the row takes the solo token and its whole batched history is
  overwritten with the shadow's, so the batch continues from a solo-exact cache. The cost is the
  replay: batch-1 decoding of every row up to its last verified step. No cheaper path gives
  solo tokens in general, because the solo logits depend on the solo K/V of every earlier column.

At step 0 (the prefill's token, verified only under `--prefill batched`) both modes take the
row's prefill alone as the reference and, on mismatch, its prompt cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mgbench.engines.inprocess.cache import cache_from_layers, cache_layers, clone_layers, read_column, write_column
from mgbench.engines.inprocess.decode import RowPrefill, decode_step, prefill_alone
from mgbench.engines.inprocess.stopwatch import NoStopwatch
from mgbench.engines.inprocess.verification.step import StepContext

REPAIR_MODES = ("column", "exact")


def overwrite_row_history(cache, row: int, pad_len: int, source) -> None:
    """Copy a batch-of-one cache into row `row` of the batched cache, right after its padding."""
    for layer, (k, v) in zip(cache.layers, cache_layers(source)):
        length = k.shape[-2]
        layer.keys[row, :, pad_len : pad_len + length] = k[0]
        layer.values[row, :, pad_len : pad_len + length] = v[0]


class _PrefillReference:
    def __init__(
        self, model, prompts: list[torch.Tensor], prefills: list[RowPrefill | None], solos=None, stopwatch=None
    ):
        self.model, self.prompts, self.prefills = model, prompts, list(prefills)
        self.clock = stopwatch or NoStopwatch()
        # Diagnostics only: with the solo results known, every verification whose reference token
        # differs from the solo token on a still-identical prefix is logged as a shortfall.
        self.solos = solos
        self.shortfalls: list[dict] = []

    def check_reference(self, ctx: StepContext, row: int, reference: torch.Tensor) -> None:
        solo = self.solos[row] if self.solos is not None else None
        if solo is None or ctx.step >= len(solo.tokens):
            return
        solo_token = int(solo.tokens[ctx.step])
        if int(reference.argmax()) == solo_token:
            return
        prefix = ctx.emitted[row][: ctx.step]
        if prefix != solo.tokens[: ctx.step].tolist():
            return  # already diverged earlier: not a new shortfall
        ref_top = reference.float().topk(2).values
        batched_top = ctx.logits[row].float().topk(2).values
        # The solo result keeps its top logits only (never a whole step's): the distance is
        # measured over the solo's top ids.
        at_solo_top = (reference.float()[solo.top_ids[ctx.step]] - solo.top_logits[ctx.step]).abs().max()
        self.shortfalls.append(
            {
                "row": row,
                "step": ctx.step,
                "solo_token": solo_token,
                "reference_token": int(reference.argmax()),
                "batched_margin": float(batched_top[0] - batched_top[1]),
                "reference_margin": float(ref_top[0] - ref_top[1]),
                "solo_margin": float(solo.margins[ctx.step]),
                "reference_vs_solo_max_abs_diff_at_solo_top": float(at_solo_top),
            }
        )

    def prefill_of(self, row: int) -> RowPrefill:
        if self.prefills[row] is None:
            logits, cache = prefill_alone(self.model, self.prompts[row])
            self.prefills[row] = RowPrefill(logits, clone_layers(cache_layers(cache)))
        return self.prefills[row]

    def verify_prefill(self, ctx: StepContext, row: int) -> tuple[int, bool, int]:
        reference = self.prefill_of(row)
        self.check_reference(ctx, row, reference.logits)
        token = int(reference.logits.argmax())
        if token == int(ctx.logits[row].argmax()):
            return token, False, 1
        overwrite_row_history(ctx.cache, row, ctx.pad_lens[row], cache_from_layers(reference.layers, self.model.config))
        return token, True, 1


class ColumnVerifier(_PrefillReference):
    name = "column"

    def verify(self, ctx: StepContext, row: int) -> tuple[int, bool, int]:
        if ctx.step == 0:
            return self.verify_prefill(ctx, row)
        pad = ctx.pad_lens[row]
        with self.clock.section("cache_ops"):
            # The row's history as the batch left it, without this step's column (torch.cat in
            # the cache update copies, so the batched tensors are not touched).
            history = [(k[row : row + 1, :, pad:-1], v[row : row + 1, :, pad:-1]) for k, v in cache_layers(ctx.cache)]
            reference = cache_from_layers(history, self.model.config)
        length = history[0][0].shape[-2]
        with self.clock.section("reference_forward"):
            mask = torch.ones((1, length), dtype=torch.long, device=ctx.logits.device)
            logits, _ = decode_step(self.model, reference, ctx.fed[row : row + 1], ctx.positions[row : row + 1], mask)
        self.check_reference(ctx, row, logits[0])
        with self.clock.section("decision_sync"):
            token, batched_token = int(logits[0].argmax()), int(ctx.logits[row].argmax())
        if token == batched_token:
            return token, False, 1
        with self.clock.section("cache_ops"):
            write_column(ctx.cache, row, pad + length, read_column(reference, 0, length))
        return token, True, 1


@dataclass
class Shadow:
    cache: object  # batch-of-one DynamicCache: the solo computation of the emitted prefix
    mask: torch.Tensor
    fed: int  # emitted tokens already replayed
    logits: torch.Tensor  # solo logits of step `fed`


class ExactVerifier(_PrefillReference):
    name = "exact"

    def __init__(self, model, prompts, prefills, solos=None, stopwatch=None):
        super().__init__(model, prompts, prefills, solos, stopwatch)
        self.shadows: list[Shadow | None] = [None] * len(prompts)

    def shadow_of(self, row: int) -> Shadow:
        if self.shadows[row] is None:
            prefill = self.prefill_of(row)
            with self.clock.section("cache_ops"):
                cache = cache_from_layers(clone_layers(prefill.layers), self.model.config)
            mask = torch.ones((1, len(self.prompts[row])), dtype=torch.long, device=prefill.logits.device)
            self.shadows[row] = Shadow(cache, mask, 0, prefill.logits)
        return self.shadows[row]

    def advance(self, ctx: StepContext, row: int) -> tuple[Shadow, int]:
        """Replay the row's emitted tokens up to this step, one solo decode step each: (the
        shadow, the steps replayed)."""
        shadow = self.shadow_of(row)
        device = ctx.logits.device
        prompt_len = len(self.prompts[row])
        with self.clock.section("decision_sync"):
            pending = ctx.emitted[row][shadow.fed : ctx.step]
        with self.clock.section("reference_forward"):
            self._replay(shadow, pending, prompt_len, device)
        shadow.fed = ctx.step
        return shadow, len(pending)

    def _replay(self, shadow: Shadow, pending: list[int], prompt_len: int, device) -> None:
        for offset, token in enumerate(pending):
            position = torch.tensor([prompt_len + shadow.fed + offset], device=device)
            logits, shadow.mask = decode_step(
                self.model, shadow.cache, torch.tensor([token], device=device), position, shadow.mask
            )
            shadow.logits = logits[0]

    def verify(self, ctx: StepContext, row: int) -> tuple[int, bool, int]:
        if ctx.step == 0:
            return self.verify_prefill(ctx, row)
        shadow, replayed = self.advance(ctx, row)
        self.check_reference(ctx, row, shadow.logits)
        with self.clock.section("decision_sync"):
            token, batched_token = int(shadow.logits.argmax()), int(ctx.logits[row].argmax())
        if token == batched_token:
            return token, False, replayed
        with self.clock.section("cache_ops"):
            overwrite_row_history(ctx.cache, row, ctx.pad_lens[row], shadow.cache)
        return token, True, replayed


class StockRepair:
    """The free-running loop's verifier against stock solo: the batch decodes over `kernels`' own
    decoder, and each flagged step is checked at once by `reference` (None: never verified), its
    token replaced on a mismatch (a rollback that discards nothing)."""

    def __init__(self, reference: ColumnVerifier | ExactVerifier | None):
        self.reference = reference
        self.shortfalls = reference.shortfalls if reference is not None else []
        self.forwards = self.fed = 0

    def open(self, model, prompts, prefills, prefill: str, pad_id: int, room: int, kernels):
        self.decoder = kernels.batch(model, prompts, prefills, prefill, pad_id, room)
        return self.decoder

    def settle(self, ctx: StepContext, rows, flagged: list[int]) -> None:
        for r in flagged:
            token, _, computed = self.reference.verify(ctx, r)
            self.forwards, self.fed = self.forwards + computed, self.fed + computed
            rows[r].check_last(token, computed)

    def settled(self, row) -> bool:
        return True  # the tail after the last flagged step stands unchecked


def make_verifier(mode: str, model, prompts, prefills, solos=None, stopwatch=None):
    if mode == "column":
        return StockRepair(ColumnVerifier(model, prompts, prefills, solos, stopwatch))
    if mode == "exact":
        return StockRepair(ExactVerifier(model, prompts, prefills, solos, stopwatch))
    if mode == "none":
        return StockRepair(None)
    raise ValueError(f"unknown repair mode {mode!r}")

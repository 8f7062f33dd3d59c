"""The two kernel sets a run decodes with, behind one small decoder interface the runners use.

- `stock`: the model's own kernels over a left-padded cache (plain batched decoding; with
  `--batch-invariant`, a plan that makes each row reproduce stock solo decoding).
- `fixed-order`: the fixed-order kernels over a start-aligned cache (`fixed_order.py`), for the
  batch and for the solo reference alike.

A decoder holds one batch's cache: `logits` after the prefill, `step(tokens, positions)` for one
token per row, `columns(row, start, count)` for a row's K/V at its own positions 0.., `pads`, and
`decoding()`, the block its steps run inside. `StockAlignedDecoder` (stock kernels over a
start-aligned cache) is the decoding that verification by replay checks.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from mgbench.engines.inprocess.cache import cache_from_layers, cache_layers, clone_layers, columns_of_row
from mgbench.engines.inprocess.decode import RowPrefill, assemble_prefilled, decode_step, prefill_alone, prefill_batched
from mgbench.engines.inprocess.kernels.aligned_cache import StartAlignedCache, StockAlignedCache
from mgbench.engines.inprocess.kernels.fixed_order import (
    FixedOrderPlan,
    aligned_attention,
    fixed_order_forward,
    fixed_order_kernels,
    fixed_order_step,
)
from mgbench.runs.options import KERNEL_SETS


def row_prefills(model, prompts, known: list | None = None) -> list[RowPrefill]:
    """Each row's prefill alone, reusing the ones already computed (solo runs keep theirs)."""
    known = known or [None] * len(prompts)
    rows = []
    for prompt, prefill in zip(prompts, known):
        if prefill is None:
            logits, cache = prefill_alone(model, prompt)
            prefill = RowPrefill(logits, clone_layers(cache_layers(cache)))
        rows.append(prefill)
    return rows


class PaddedDecoder:
    """Stock kernels over a left-padded cache.

    `alone` assembles the rows' prefills computed at batch size 1 (the solo runs' own: a prefill
    alone without padding is the same computation in both runs; serving engines also prefill
    each request on arrival); `batched` runs one left-padded prefill."""

    def __init__(self, model, prompts, prefills, prefill: str, pad_id: int):
        self.model = model
        if prefill == "alone":
            rows = row_prefills(model, prompts, prefills)
            self.cache, self.mask, self.pads = assemble_prefilled(model, [p.layers for p in rows])
            self.logits = torch.stack([p.logits for p in rows])
        elif prefill == "batched":
            self.logits, self.cache, self.mask, self.pads = prefill_batched(model, prompts, pad_id)
        else:
            raise ValueError(f"unknown prefill mode {prefill!r}")

    def decoding(self):
        return nullcontext()

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits, self.mask = decode_step(self.model, self.cache, tokens, positions, self.mask)
        return logits

    def columns(self, row: int, start: int, count: int) -> torch.Tensor:
        return columns_of_row(self.cache, row, self.pads[row] + start, count)


class SoloDecoder(PaddedDecoder):
    """Stock kernels, one request alone: its own unpadded cache, as the prefill left it."""

    def __init__(self, model, prompt: torch.Tensor, prefill: RowPrefill | None = None):
        self.model, self.pads = model, [0]
        if prefill is None:
            logits, self.cache = prefill_alone(model, prompt)
            prefill = RowPrefill(logits, clone_layers(cache_layers(self.cache)))
        else:  # the same prompt cache again (a copy: decoding appends to it)
            self.cache = cache_from_layers(clone_layers(prefill.layers), model.config)
        self.prefill = prefill
        self.logits = prefill.logits.view(1, -1)
        self.mask = torch.ones((1, len(prompt)), dtype=torch.long, device=prompt.device)


class AlignedDecoder:
    """Fixed-order kernels over a start-aligned cache (inside `fixed_order_kernels`); prefill
    alone per request with the stock kernels, shared with the solo reference."""

    def __init__(self, model, prompts, prefills, room: int, plan: FixedOrderPlan):
        self.model, self.pads = model, [0] * len(prompts)
        rows = row_prefills(model, prompts, prefills)
        self.prefill = rows[0]
        self.logits = torch.stack([p.logits for p in rows])
        self.dtype = self.logits.dtype
        lengths = [len(p) for p in prompts]
        self.cache = StartAlignedCache.from_prefills([p.layers for p in rows], room, plan.chunk, lengths)

    def decoding(self):
        return nullcontext()  # the caller's `Kernels.active` block

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return fixed_order_step(self.model, self.cache, tokens, positions)

    def columns(self, row: int, start: int, count: int) -> torch.Tensor:
        return self.cache.columns_of_row(row, start, count, self.dtype)


class StockAlignedDecoder:
    """Stock kernels over a start-aligned cache: each row at its own positions, so one row can move
    back (a rollback) while the others go on. Its steps run inside `decoding()`, which gives the
    stock attention each row's own keys (the plan's chunk is not used by the stock kernels)."""

    def __init__(self, model, prefills: list[RowPrefill], lengths: list[int], room: int, plan: FixedOrderPlan):
        self.model, self.plan, self.pads = model, plan, [0] * len(prefills)
        self.logits = torch.stack([p.logits for p in prefills])
        self.cache = StockAlignedCache.from_prefills([p.layers for p in prefills], room + 1, lengths)

    def decoding(self):
        return aligned_attention(self.model, self.plan)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return fixed_order_forward(self.model, self.cache, tokens.view(-1, 1), positions.view(-1, 1))[:, -1]


@dataclass(frozen=True)
class Kernels:
    """The kernel set of a run: `stock`, or `fixed-order` with the plan the probe chose."""

    name: str = "stock"
    plan: FixedOrderPlan | None = None

    def __post_init__(self) -> None:
        if self.name not in KERNEL_SETS:
            raise ValueError(f"unknown kernels {self.name!r}")
        if self.name == "fixed-order" and self.plan is None:
            raise ValueError("fixed-order kernels need a plan")

    @property
    def fixed_order(self) -> bool:
        return self.name == "fixed-order"

    def active(self, model):
        """The block every forward of the run (solo reference included) runs inside."""
        return fixed_order_kernels(model, self.plan) if self.fixed_order else nullcontext()

    def batch(self, model, prompts, prefills, prefill: str, pad_id: int, room: int):
        """A decoder for this batch; `room`: tokens each row may still add after its prompt."""
        if self.fixed_order:
            if prefill != "alone":
                raise ValueError("fixed-order kernels prefill each request alone")
            return AlignedDecoder(model, prompts, prefills, room, self.plan)
        return PaddedDecoder(model, prompts, prefills, prefill, pad_id)

    def solo(self, model, prompt: torch.Tensor, room: int, prefill: RowPrefill | None = None):
        """A decoder for one request alone, from its `prefill` when it was computed before."""
        if self.fixed_order:
            return AlignedDecoder(model, [prompt], [prefill], room, self.plan)
        return SoloDecoder(model, prompt, prefill)


STOCK = Kernels()

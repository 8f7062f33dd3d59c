"""What a stock verifier sees of one decode step (read by the loop and the verifiers, so neither
imports the other)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepContext:
    step: int
    logits: torch.Tensor  # [B, vocab] batched logits of this step
    cache: object  # the batched DynamicCache, after this step's columns were written
    pad_lens: list[int]
    fed: torch.Tensor | None  # [B] tokens fed at this step (None at step 0: the prefill)
    positions: torch.Tensor | None  # [B] positions of the fed tokens
    live: list[int]  # rows that emitted a token at this step
    emitted: list[list[int]]  # per row, its tokens so far: steps 0..step (this step's batched token last)

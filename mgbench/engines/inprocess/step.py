"""What a policy and a verifier see of one decode step (read by both, so neither imports the other)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepContext:
    step: int
    logits: torch.Tensor  # [B, vocab] batched logits of this step
    cache: object  # the batched DynamicCache, after this step's columns were written
    pad_lens: list[int]
    active: torch.Tensor  # [B] bool: rows that have not finished yet
    fed: torch.Tensor | None  # [B] tokens fed at this step (None at step 0: the prefill)
    positions: torch.Tensor | None  # [B] positions of the fed tokens
    emitted: list[torch.Tensor]  # tokens emitted at steps 0..step-1, each [B]

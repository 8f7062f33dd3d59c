"""Per-step policies of the free-running batched decoder (what it does with each step's logits).

A policy sees the step's batched logits and may verify rows and repair the cache; it
returns the tokens to emit and which rows it verified (`triggered`) and corrected (`repaired`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class StepContext:
    step: int
    logits: torch.Tensor  # [B, vocab] batched logits of this step
    cache: object  # the batched DynamicCache, after this step's columns were written
    mask: torch.Tensor  # [B, seq] attention mask of the batched cache
    pad_lens: list[int]
    active: torch.Tensor  # [B] bool: rows that have not finished yet


@dataclass
class StepDecision:
    tokens: torch.Tensor  # [B]
    triggered: torch.Tensor  # [B] bool
    repaired: torch.Tensor  # [B] bool


class Policy(Protocol):
    name: str

    def decide(self, ctx: StepContext) -> StepDecision: ...


class NoVerification:
    """Plain batched greedy decoding: the fast token, never checked."""

    name = "none"

    def decide(self, ctx: StepContext) -> StepDecision:
        none = torch.zeros(ctx.logits.shape[0], dtype=torch.bool, device=ctx.logits.device)
        return StepDecision(ctx.logits.argmax(-1), none, none)


def make_policy(spec: str) -> Policy:
    if spec == "none":
        return NoVerification()
    raise ValueError(f"unknown policy {spec!r}")

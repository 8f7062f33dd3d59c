"""Per-step policies of the free-running batched decoder (what it does with each step's logits).

A policy is a gate (which rows to verify this step) and a verifier (`verifiers.py`:
the reference computation and the cache repair). It returns the tokens to emit and which rows
it verified (`triggered`) and corrected (`repaired`).

- `none`: plain batched greedy decoding, never checked.
- `always`: verify every row at every step (the per-token always-on baseline).
- `margin`: MarginGate, verify rows whose batched top-1/top-2 margin is below TAU (logit or ulp).
- `oracle`: verify exactly the steps whose batched argmax differs from the recorded solo token:
  the floor on triggers, which needs the solo reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from mgbench.engines.inprocess.metrics import margins
from mgbench.engines.inprocess.step import StepContext
from mgbench.engines.inprocess.stopwatch import NoStopwatch
from mgbench.engines.inprocess.verifiers import REPAIR_MODES, make_verifier
from mgbench.errors import UserError

POLICIES = ("none", "always", "margin", "oracle")
MARGIN_UNITS = ("logit", "ulp")


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


class AlwaysGate:
    def flags(self, ctx: StepContext) -> torch.Tensor:
        return torch.ones(ctx.logits.shape[0], dtype=torch.bool, device=ctx.logits.device)


@dataclass
class MarginGate:
    tau: float
    unit: str = "logit"

    def flags(self, ctx: StepContext) -> torch.Tensor:
        margin, margin_ulp = margins(ctx.logits)
        return (margin_ulp if self.unit == "ulp" else margin) < self.tau


class OracleGate:
    """Flags the steps whose batched argmax differs from the solo token at the same step."""

    def __init__(self, solos: list, steps: int):
        device = next(solo.tokens.device for solo in solos if solo is not None)
        self.reference = torch.full((len(solos), steps), -1, dtype=torch.long, device=device)
        for row, solo in enumerate(solos):
            if solo is not None:  # rows without a reference (needle fillers) are never flagged
                self.reference[row, : min(len(solo.tokens), steps)] = solo.tokens[:steps]

    def flags(self, ctx: StepContext) -> torch.Tensor:
        expected = self.reference[:, ctx.step]
        return (expected >= 0) & (ctx.logits.argmax(-1) != expected)


class VerifyingPolicy:
    def __init__(self, name: str, gate, verifier, stopwatch=None):
        self.name, self.gate, self.verifier = name, gate, verifier
        self.clock = stopwatch or NoStopwatch()

    def decide(self, ctx: StepContext) -> StepDecision:
        tokens = ctx.logits.argmax(-1)
        with self.clock.section("gate"):
            flagged = self.gate.flags(ctx) & ctx.active
        repaired = torch.zeros_like(flagged)
        with self.clock.section("decision_sync"):
            rows = flagged.nonzero().flatten().tolist()  # one host sync per step
        for row in rows:
            token, fixed = self.verifier.verify(ctx, row)
            if fixed:
                tokens[row] = token
                repaired[row] = True
        return StepDecision(tokens, flagged, repaired)


@dataclass(frozen=True)
class PolicySpec:
    """A policy as configured by the user; `build` makes one per batch (verifiers hold per-row state)."""

    kind: str
    repair: str = "exact"
    tau: float | None = None
    unit: str = "logit"

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"unknown policy {self.kind!r}")
        if self.kind == "margin" and (self.tau is None or not math.isfinite(self.tau) or self.tau <= 0):
            raise ValueError("policy margin needs a finite threshold TAU > 0")
        if self.unit not in MARGIN_UNITS:
            raise ValueError(f"unknown margin unit {self.unit!r}")

    @property
    def label(self) -> str:
        if self.kind == "none":
            return "none"
        gate = f"margin<{self.tau:.4g}{'ulp' if self.unit == 'ulp' else ''}" if self.kind == "margin" else self.kind
        return f"{gate}/{self.repair}"

    def build(self, model, prompts, prefills, solos=None, steps: int = 0, stopwatch=None) -> Policy:
        """`solos` (per row a SoloResult, or None for rows without a reference) drive the oracle
        gate and the shortfall diagnostics; they never feed a verification."""
        if self.kind == "none":
            return NoVerification()
        if self.kind == "always":
            gate = AlwaysGate()
        elif self.kind == "margin":
            gate = MarginGate(self.tau, self.unit)
        else:
            if solos is None:
                raise ValueError("the oracle policy needs the solo reference")
            gate = OracleGate(solos, steps)
        verifier = make_verifier(self.repair, model, prompts, prefills, solos, stopwatch)
        return VerifyingPolicy(self.label, gate, verifier, stopwatch)


def policy_specs(policies: str, repairs: str, tau: float | None, unit: str) -> list[PolicySpec]:
    """--policy and --repair (comma lists) as validated specs; `none` runs once, unrepaired."""
    kinds = [p.strip() for p in policies.split(",") if p.strip()]
    modes = [r.strip() for r in repairs.split(",") if r.strip()]
    for kind in kinds:
        if kind not in POLICIES:
            raise UserError(f"--policy {kind!r}: choose from {', '.join(POLICIES)}")
    for mode in modes:
        if mode not in REPAIR_MODES:
            raise UserError(f"--repair {mode!r}: choose from {', '.join(REPAIR_MODES)}")
    if not kinds or not modes:
        raise UserError("--policy and --repair need at least one value each")
    if "margin" in kinds:
        if tau is None:
            raise UserError("--policy margin needs --threshold TAU or --threshold-from calibration.json")
        if not (tau == tau and 0 < tau < 1e6):
            raise UserError(f"threshold {tau}: use a finite margin above 0 (a logit or ulp margin, e.g. 0.5)")
    specs = []
    for kind in kinds:
        for mode in modes if kind != "none" else ["exact"]:
            specs.append(PolicySpec(kind, mode, tau if kind == "margin" else None, unit))
    return specs

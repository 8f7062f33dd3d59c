"""A verification policy as the user configures it: a gate (`gates.py`), a reference and a verifier.

- against stock solo: `none`, `always`, `margin` (MarginGate) and `oracle`, each flagged step checked
  at once by `column` (the paper's repair) or `exact` (a solo shadow) repair (`stock_verifiers.py`);
- against fixed-order solo: `window` (LLM-42) and `margin`, verified by `replay` with rollback in
  verify batches of N rows of W tokens (`replay.py`); `none` with `replay` is the same stock decoding
  over the start-aligned cache, never verified (the replays' base).

One loop runs them all (`loop.py`); `build` makes the gate and verifier of one batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mgbench.engines.inprocess.stopwatch import NoStopwatch
from mgbench.engines.inprocess.verification.gates import AlwaysGate, MarginGate, NoGate, OracleGate, WindowGate
from mgbench.engines.inprocess.verification.replay import ReplayRepair
from mgbench.engines.inprocess.verification.stock_verifiers import make_verifier
from mgbench.errors import UserError

POLICIES = ("none", "always", "margin", "oracle", "window")
STOCK_REPAIRS = ("column", "exact")  # against stock solo
REPAIR_MODES = (*STOCK_REPAIRS, "replay")  # replay: against fixed-order solo
FIXED_ORDER_POLICIES = ("none", "window", "margin")
MARGIN_UNITS = ("logit", "ulp")
VERIFY_ROWS, VERIFY_TOKENS = 8, 64  # LLM-42's server defaults: N rows per verify batch, W tokens per row


@dataclass
class Policy:
    """One batch's gate and verifier (verifiers hold per-row state), with the run's stopwatch."""

    spec: "PolicySpec"
    gate: object
    verifier: object
    clock: object


@dataclass(frozen=True)
class PolicySpec:
    kind: str
    repair: str = "exact"
    tau: float | None = None
    unit: str = "logit"
    window: int = VERIFY_TOKENS  # W: the window's trigger, and the tokens of a verify row
    rows: int = VERIFY_ROWS  # N: rows per verify batch (1: each ready row replayed alone, unpadded)
    end_check: bool = True  # replay: every row verified at its end too
    wait: bool = False  # replay: a flagged row waits for company (N ready, W tokens, or an end)

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise ValueError(f"unknown policy {self.kind!r}")
        if self.repair not in REPAIR_MODES:
            raise ValueError(f"unknown repair mode {self.repair!r}")
        if self.kind == "margin" and (self.tau is None or not math.isfinite(self.tau) or self.tau <= 0):
            raise ValueError("policy margin needs a finite threshold TAU > 0")
        if self.unit not in MARGIN_UNITS:
            raise ValueError(f"unknown margin unit {self.unit!r}")
        if (self.kind == "window" and self.repair != "replay") or (
            self.kind in ("always", "oracle") and self.repair == "replay"
        ):
            raise ValueError(f"policy {self.kind} with repair {self.repair}: window replays, always and oracle do not")
        if self.window < 1 or self.rows < 1:
            raise ValueError("a verify batch needs W >= 1 tokens and N >= 1 rows")

    @property
    def reference(self) -> str:
        """Whose solo output the policy reproduces: replays reproduce fixed-order solo."""
        return "fixed-order" if self.repair == "replay" else "stock"

    @property
    def shape(self) -> str:
        return f"N={self.rows}" if self.rows > 1 else "per row"

    @property
    def label(self) -> str:
        if self.kind == "none":
            return "none (start-aligned)" if self.repair == "replay" else "none"
        if self.kind == "window":
            gate = f"window W={self.window}"
        elif self.kind == "margin":
            gate = f"margin<{self.tau:.4g}{'ulp' if self.unit == 'ulp' else ''}"
        else:
            gate = self.kind
        if self.repair != "replay":
            return f"{gate}/{self.repair}"
        wait = " (waits)" if self.wait and self.rows > 1 else ""
        tail = "" if self.end_check else " (no end check)"
        return f"{gate}/replay {self.shape}{wait}{tail}"

    @property
    def verify_calls(self) -> list[int]:
        """Row counts of the fixed-order forwards a replay policy makes besides decode steps (what
        the probe must find exact): N x W packed, or 1..W tokens of one row."""
        if self.repair != "replay" or self.kind == "none":
            return []
        return [self.rows * self.window] if self.rows > 1 else list(range(1, self.window + 1))

    def build(self, model, prompts, prefills, solos=None, steps: int = 0, stopwatch=None, kernels=None) -> Policy:
        """`solos` (per row a SoloResult, or None for rows without a reference) drive the oracle gate
        and the stock verifiers' shortfall diagnostics; they never feed a verification. `kernels`:
        the fixed-order kernels a replay verifies with."""
        clock = stopwatch or NoStopwatch()
        if self.kind == "none":
            gate = NoGate()
        elif self.kind == "always":
            gate = AlwaysGate()
        elif self.kind == "margin":
            gate = MarginGate(self.tau, self.unit)
        elif self.kind == "window":
            gate = WindowGate(self.window)
        else:
            if solos is None:
                raise ValueError("the oracle policy needs the solo reference")
            gate = OracleGate(solos)
        if self.repair == "replay":
            checked, largest = kernels.plan.rows_checked, max(self.verify_calls, default=0)
            if checked is not None and largest > checked:  # a vendor GEMM may change kernel past what was probed
                raise ValueError(
                    f"{self.label} makes {largest}-row fixed-order calls; the plan was probed up to {checked} "
                    "rows (probe with calls=spec.verify_calls)"
                )
            verifies = self.kind != "none"
            verifier = ReplayRepair(kernels, self.rows, self.window, self.end_check, self.wait, verifies)
        else:
            mode = "none" if self.kind == "none" else self.repair
            verifier = make_verifier(mode, model, prompts, prefills, solos, stopwatch)
        return Policy(self, gate, verifier, clock)


def _threshold(kinds: list[str], tau: float | None) -> None:
    if "margin" in kinds:
        if tau is None:
            raise UserError("--policy margin needs --threshold TAU or --threshold-from calibration.json")
        if not (tau == tau and 0 < tau < 1e6):
            raise UserError(f"threshold {tau}: use a finite margin above 0 (a logit or ulp margin, e.g. 0.5)")


def policy_specs(
    policies: str,
    repairs: str,
    tau: float | None,
    unit: str,
    kernels: str = "stock",
    window: int | None = None,
    rows: int | None = None,
) -> list[PolicySpec]:
    """--policy and --repair (comma lists) as validated specs. On the stock kernels every policy runs
    with every stock repair (`none` once, unrepaired); on the fixed-order kernels `none` is their
    own decoding and `window` and `margin` verify stock decoding by replay, in verify batches of
    `rows` x `window`."""
    kinds = [p.strip() for p in policies.split(",") if p.strip()]
    modes = [r.strip() for r in repairs.split(",") if r.strip()]
    if not kinds or (not modes and kernels != "fixed-order"):
        raise UserError("--policy and --repair need at least one value each")
    if kernels == "fixed-order":
        for kind in kinds:
            if kind not in FIXED_ORDER_POLICIES:
                raise UserError(
                    f"--policy {kind!r} with --kernels fixed-order: choose from {', '.join(FIXED_ORDER_POLICIES)} "
                    "(always and oracle repair against stock solo decoding, another reference)"
                )
        for name, value in (("--window", window), ("--verify-rows", rows)):
            if value is not None and not 1 <= value <= 4096:
                raise UserError(f"{name} {value}: use a whole number from 1 to 4096")
        _threshold(kinds, tau)
        shape = {"window": window or VERIFY_TOKENS, "rows": VERIFY_ROWS if rows is None else rows}
        return [
            PolicySpec("none")
            if kind == "none"
            # MarginGate's triggered rows wait for company: verifying each trigger at once in a full
            # N x W batch cost 5.4x as much on the AMX Xeon (compare, math500, batch 8; docs/fixed-order.md).
            else PolicySpec(kind, "replay", tau if kind == "margin" else None, unit, **shape, wait=kind == "margin")
            for kind in kinds
        ]
    for kind in kinds:
        if kind not in POLICIES or kind == "window":
            stock = [p for p in POLICIES if p != "window"]
            hint = " (window replays against fixed-order solo: add --kernels fixed-order)" if kind == "window" else ""
            raise UserError(f"--policy {kind!r}: choose from {', '.join(stock)}{hint}")
    for mode in modes:
        if mode not in STOCK_REPAIRS:
            raise UserError(f"--repair {mode!r}: choose from {', '.join(STOCK_REPAIRS)}")
    _threshold(kinds, tau)
    specs = []
    for kind in kinds:
        for mode in modes if kind != "none" else ["exact"]:
            specs.append(PolicySpec(kind, mode, tau if kind == "margin" else None, unit))
    return specs


def verify_shape(specs: list[PolicySpec]) -> tuple[list[int], int, int]:
    """What the fixed-order probe must check for these policies: (row counts of their forwards,
    the largest verify batch's rows, the most tokens per verify row)."""
    replays = [s for s in specs if s.verify_calls]
    calls = sorted({m for s in replays for m in s.verify_calls})
    rows = max((s.rows for s in replays if s.rows > 1), default=0)
    tokens = max((s.window for s in replays), default=0)
    return calls, rows, tokens

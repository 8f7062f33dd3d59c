"""Gates: which rows a policy verifies after a batched step, read on the host from the step's
token and margins (copied once per step for the records anyway).

- `none`: never. `always`: every row at every step (the per-token always-on baseline).
- `margin`: MarginGate, the rows whose batched top-1/top-2 margin is below TAU (logit or ulp).
- `oracle`: exactly the steps whose batched token differs from the recorded solo token (the floor
  on triggers, which needs the solo reference).
- `window`: LLM-42's, a row holding W unverified tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from mgbench.engines.inprocess.verification.rows import Row


class NoGate:
    def fired(self, step: int, r: int, row: Row) -> bool:
        return False


class AlwaysGate:
    def fired(self, step: int, r: int, row: Row) -> bool:
        return True


@dataclass
class MarginGate:
    tau: float
    unit: str = "logit"

    def low(self, margin, margin_ulp):
        """The gate's comparison, on floats or on [B] tensors alike."""
        return (margin_ulp if self.unit == "ulp" else margin) < self.tau

    def fired(self, step: int, r: int, row: Row) -> bool:
        return bool(self.low(*row.marks[-1][:2]))


class OracleGate:
    """The steps whose batched token differs from the solo token at the same step."""

    def __init__(self, solos: list):
        # rows without a reference (needle fillers) are never flagged
        self.reference = [None if solo is None else solo.tokens.tolist() for solo in solos]

    def fired(self, step: int, r: int, row: Row) -> bool:
        expected = self.reference[r]
        return expected is not None and step < len(expected) and row.tokens[-1] != expected[step]


@dataclass
class WindowGate:
    window: int

    def fired(self, step: int, r: int, row: Row) -> bool:
        return row.unverified >= self.window

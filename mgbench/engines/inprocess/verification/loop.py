"""Free-running batched greedy decoding under a policy: the one loop every policy runs in.

Each row continues from its own emitted tokens. After each batched step the gate reads the step's
tokens and margins (one host copy per step) and flags rows; the verifier settles them: a stock
verifier checks the flagged step at once and replaces its token on a mismatch, a replay verifier
checks a row's unverified tokens against the fixed-order reference and rolls the row back to the
first mismatch (its decoder keeps each row at its own positions). A row is done once it has ended
and its verifier needs nothing more of it. Under `--prefill alone` the step-0 token comes from each
row's prefill alone, which is the reference itself, so the gate first acts at step 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mgbench.engines.inprocess.host_heap import trim_host_heap
from mgbench.engines.inprocess.kernels.sets import STOCK, Kernels
from mgbench.engines.inprocess.metrics import margins
from mgbench.engines.inprocess.stopwatch import DecodeTimer
from mgbench.engines.inprocess.verification.rows import Row
from mgbench.engines.inprocess.verification.spec import Policy, PolicySpec
from mgbench.engines.inprocess.verification.step import StepContext

RECORDS = ("verifications", "replayed", "rollbacks", "discarded", "triggers", "steps")


@dataclass
class FreeRunResult:
    pad_lens: list[int]
    tokens: list[list[int]]  # per row, up to and including EOS
    # Per row and emitted token (aligned with `tokens`): where the gate fired, where a repair put
    # the reference's token, and the batched top-1/top-2 margins of the step that emitted it.
    triggered: list[list[bool]]
    repaired: list[list[bool]]
    margin: list[list[float]]
    margin_ulp: list[list[float]]
    decode_seconds: float
    # Per row, what verification did (Row's counters): verifications it took part in, reference
    # tokens computed for it, repairs (rollbacks), emitted tokens those threw away, gate firings,
    # batched decode steps.
    records: dict[str, list[int]] = field(default_factory=dict)
    forwards: int = 0  # reference forwards (verify batches, replay chunks, shadow steps)
    fed: int = 0  # token slots those forwards computed (padding and dummy rows included)

    @classmethod
    def of(cls, rows: list[Row], pads: list[int], seconds: float, verifier) -> "FreeRunResult":
        marks = [[[mark[k] for mark in row.marks] for row in rows] for k in range(4)]
        margin, margin_ulp, triggered, repaired = marks
        records = {name: [getattr(row, name) for row in rows] for name in RECORDS}
        tokens = [row.tokens for row in rows]
        return cls(
            pads, tokens, triggered, repaired, margin, margin_ulp, seconds, records, verifier.forwards, verifier.fed
        )

    def per_sequence(self, row: int) -> dict:
        """Row `row`'s replay record, as compare's per-sequence table names it."""
        r = {name: values[row] for name, values in self.records.items()}
        return {
            "replays": r["verifications"],
            "replayed": r["replayed"],
            "rollbacks": r["rollbacks"],
            "discarded": r["discarded"],
            "gate_triggers": r["triggers"],
            "batched_steps": r["steps"],
        }


def run_free(
    model,
    prompts,
    prefills,
    prefill: str,
    pad_id: int,
    max_new_tokens: int,
    eos_ids: set[int],
    policy: Policy | None = None,
    kernels: Kernels = STOCK,
) -> FreeRunResult:
    """Decode the batch under `policy` (default: plain, never verified) with `kernels`' decoder (a
    replay verifier brings its own: stock kernels over a start-aligned cache)."""
    policy = policy or PolicySpec("none").build(model, prompts, prefills)
    device = prompts[0].device
    eos = set(eos_ids)
    decoder = policy.verifier.open(model, prompts, prefills, prefill, pad_id, max_new_tokens, kernels)
    first = torch.stack([decoder.logits.argmax(-1).float(), *margins(decoder.logits)]).tolist()
    verified = 1 if prefill == "alone" else 0
    rows = [Row(len(p), int(t), (m, u), verified) for p, t, m, u in zip(prompts, *first)]
    with decoder.decoding():
        live = list(range(len(rows)))
        if prefill != "alone":
            ctx = StepContext(
                0, decoder.logits, decoder.cache, decoder.pads, None, None, live, [r.tokens for r in rows]
            )
            _verify(policy, ctx, rows)
        _finish(policy, rows, eos, max_new_tokens)
        timer = DecodeTimer(device)  # decode steps only, as before the loops merged: not step 0's verification
        step = 0
        while not all(row.done for row in rows):
            step += 1
            trim_host_heap(step, device)
            live = [r for r, row in enumerate(rows) if not (row.done or row.ended)]
            fed = torch.tensor([pad_id if row.done or row.ended else row.tokens[-1] for row in rows], device=device)
            positions = torch.tensor([row.next_position for row in rows], device=device)
            logits = decoder.step(fed, positions)
            # One host copy per step: tokens (exact in float32 below 2**24) and both margins.
            tokens, margin, margin_ulp = torch.stack([logits.argmax(-1).float(), *margins(logits)]).tolist()
            for r in live:
                rows[r].emit(int(tokens[r]), margin[r], margin_ulp[r])
                rows[r].ended = rows[r].finished(eos, max_new_tokens)
            ctx = StepContext(step, logits, decoder.cache, decoder.pads, fed, positions, live, [r.tokens for r in rows])
            _verify(policy, ctx, rows)
            _finish(policy, rows, eos, max_new_tokens)
    return FreeRunResult.of(rows, decoder.pads, timer.seconds(), policy.verifier)


def _verify(policy: Policy, ctx: StepContext, rows: list[Row]) -> None:
    """The gate on the rows that emitted at this step, then the verifier."""
    with policy.clock.section("gate"):
        flagged = [r for r in ctx.live if policy.gate.fired(ctx.step, r, rows[r])]
    for r in flagged:
        rows[r].fire()
    policy.verifier.settle(ctx, rows, flagged)


def _finish(policy: Policy, rows: list[Row], eos: set[int], max_new_tokens: int) -> None:
    """A repair may have replaced an ending token: a row ends on its tokens as they now stand."""
    for row in rows:
        row.ended = row.finished(eos, max_new_tokens)
        row.done = row.ended and policy.verifier.settled(row)

"""The verifier against the fixed-order reference: replay with rollback, for LLM-42's window gate
and MarginGate alike (the gates are `gates.py`'s; the loop is `loop.py`'s).

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

A row is ready when its gate fires (the window: W unverified tokens; MarginGate: a margin below
TAU) and, with the end check, at its end (then the output equals the fixed-order reference by
construction; without it the gate alone stands behind the tail after the last trigger, as in the
paper). Ready rows verify at once, or (`wait`) wait for company: until N rows are ready, one of
them holds W unverified tokens or one has ended.
"""

from __future__ import annotations

import torch

from mgbench.engines.inprocess.kernels.aligned_cache import StartAlignedCache
from mgbench.engines.inprocess.kernels.fixed_order import fixed_order_forward, module_forms
from mgbench.engines.inprocess.kernels.sets import Kernels, StockAlignedDecoder, row_prefills
from mgbench.engines.inprocess.verification.rows import Row


class ReplayRepair:
    """Replays through the fixed-order kernels, and the K/V copy of what they verify into the batch.
    `rows` N and `window` W shape the verify batches; `verifies` False: the same stock decoding over
    the start-aligned cache, never verified (the replays' base)."""

    def __init__(self, kernels: Kernels, rows: int, window: int, end_check: bool, wait: bool, verifies: bool = True):
        if not kernels.fixed_order:
            raise ValueError("replay verification needs fixed-order kernels (its reference)")
        self.kernels, self.rows, self.window = kernels, rows, window
        self.end_check, self.wait, self.verifies = end_check, wait, verifies
        self.forwards = self.fed = 0
        self.shortfalls: list[dict] = []  # the stock verifiers' diagnostic; a replay has none

    def open(self, model, prompts, prefills, prefill: str, pad_id: int, room: int, kernels=None):
        """The stock decoder over a start-aligned cache, and the fixed-order cache the replays run
        over (one spare row: the dummy rows). `prefills` must be fixed-order ones (computed alone
        inside `kernels.active`, as the fixed-order solo runs compute theirs)."""
        if prefill != "alone":
            raise ValueError("verification by replay prefills each request alone")
        self.model, self.pad_id = model, pad_id
        with self.kernels.active(model):
            prefills = row_prefills(model, prompts, prefills)
        layers, lengths = [p.layers for p in prefills], [len(p) for p in prompts]
        self.stock = StockAlignedDecoder(model, prefills, lengths, room, self.kernels.plan)
        packed = self.rows > 1
        if self.verifies:  # room for a verify row's padding past the last token
            extra = room + 1 + (self.window if packed else 0)
            self.fixed = StartAlignedCache.from_prefills(layers, extra, self.kernels.plan.chunk, lengths, int(packed))
        return self.stock

    def settle(self, ctx, rows: list[Row], flagged: list[int]) -> None:
        """Rows whose gate fired (or that ended, with the end check) become ready; the ready rows
        are verified now, or (`wait`) once there is company."""
        if not self.verifies:
            return
        for r in ctx.live:
            row = rows[r]
            row.ready = row.ready or r in flagged or (row.ended and self.end_check)
        ready = [r for r, row in enumerate(rows) if row.ready and not row.done]
        if not ready or (self.wait and self.rows > 1 and not self._due(rows, ready)):
            return
        if self.rows == 1:
            for r in ready:
                self.alone(r, rows[r])
        else:
            self.packed(rows, ready)
        for r in ready:
            rows[r].ready = False

    def settled(self, row: Row) -> bool:
        """Whether an ended row needs nothing more: all verified, or its tail stands unchecked."""
        return not self.verifies or not self.end_check or row.verified == len(row.tokens)

    def _due(self, rows: list[Row], ready: list[int]) -> bool:
        """A waiting row verifies once N rows are ready, one holds W unverified tokens or one has ended."""
        return len(ready) >= self.rows or any(rows[r].ended or rows[r].unverified >= self.window for r in ready)

    def _forward(self, cache: StartAlignedCache, inputs: list[list[int]], starts: list[int]) -> list[list[int]]:
        """Fixed-order argmax of every fed position: rows of equal length fed at starts.."""
        device = self.fixed.keys[0].device
        tokens = torch.tensor(inputs, device=device)
        positions = torch.tensor(starts, device=device).view(-1, 1) + torch.arange(tokens.shape[1], device=device)
        with module_forms(self.model, self.kernels.plan):
            predicted = fixed_order_forward(self.model, cache, tokens, positions).argmax(-1).tolist()
        self.forwards, self.fed = self.forwards + 1, self.fed + tokens.numel()
        return predicted

    def _settle(self, r: int, row: Row, before: int) -> None:
        """The verified inputs' K/V from the replay into the batch's cache."""
        self.stock.cache.copy_row_from(self.fixed, r, row.prompt_len + before - 1, row.verified - before)

    def alone(self, r: int, row: Row) -> None:
        """Row r by itself over exactly its unverified tokens, in chunks of at most W."""
        before = row.verified
        while row.unverified > 0:
            row.verifications += 1
            v, count = row.verified, min(row.unverified, self.window)
            inputs = [row.tokens[v - 1 : v - 1 + count]]
            predicted = self._forward(self.fixed.row(r), inputs, [row.prompt_len + v - 1])[0]
            if row.check(predicted) < count:
                break
        self._settle(r, row, before)

    def packed(self, rows: list[Row], ready: list[int]) -> None:
        """Verify batches of exactly N rows of W tokens until every ready row is verified: ready rows
        first, then rows not ready (most unverified tokens first), then dummy rows."""
        n, w = self.rows, self.window
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
            cache_rows = members + [self.fixed.batch - 1] * dummies  # the cache's spare row
            packed = self.fixed.gather(cache_rows, max(starts) + w)
            predicted = self._forward(packed, inputs, starts)
            self.fixed.scatter(cache_rows, packed)
            for r, count, row_predicted in zip(members, counts, predicted):
                row, before = rows[r], rows[r].verified
                row.verifications += 1
                if row.check(row_predicted[:count]) == count and row.unverified > 0 and r in ready:
                    queue.append(r)  # more than W tokens: the next batch takes the rest
                self._settle(r, row, before)

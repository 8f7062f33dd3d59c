"""One batch row as the free-running loop keeps it: the tokens it emitted, how many of them are
verified, and what verification did to it (the per-sequence replay records)."""

from __future__ import annotations


class Row:
    def __init__(self, prompt_len: int, first: int, margin: tuple[float, float], verified: int):
        # `verified`: 1 when the prefill's token is the reference's (each request prefilled alone).
        self.prompt_len, self.tokens, self.verified = prompt_len, [first], verified
        self.done = self.ended = self.ready = False
        self.verifications = self.replayed = self.rollbacks = self.discarded = self.triggers = self.steps = 0
        # per emitted token: (margin, margin in ulps, gate fired, put there by a repair)
        self.marks: list[tuple[float, float, bool, bool]] = [(*margin, False, False)]

    def emit(self, token: int, margin: float, margin_ulp: float) -> None:
        self.tokens.append(token)
        self.marks.append((margin, margin_ulp, False, False))
        self.steps += 1

    def fire(self) -> None:
        """The gate fired on the last emitted token."""
        self.marks[-1] = (*self.marks[-1][:2], True, False)
        self.triggers += 1

    @property
    def next_position(self) -> int:
        return self.prompt_len + len(self.tokens) - 1

    @property
    def unverified(self) -> int:
        return len(self.tokens) - self.verified

    def check(self, predicted: list[int]) -> int:
        """Take the reference's predictions for the next unverified tokens: verify up to the first
        mismatch, where the row takes the reference's token and drops the rest (a rollback).
        Returns the tokens verified."""
        v, end = self.verified, len(self.tokens)
        mismatch = next((j for j, token in enumerate(predicted) if token != self.tokens[v + j]), None)
        self.replayed += len(predicted) if mismatch is None else mismatch + 1
        if mismatch is None:
            self.verified += len(predicted)
            return len(predicted)
        self.rollbacks, self.discarded = self.rollbacks + 1, self.discarded + (end - v - mismatch - 1)
        self.tokens = self.tokens[: v + mismatch] + [predicted[mismatch]]
        margin, margin_ulp, fired, _ = self.marks[v + mismatch]  # the batched step that emitted the wrong token
        self.marks = self.marks[: v + mismatch] + [(margin, margin_ulp, fired, True)]
        self.verified = len(self.tokens)
        return mismatch + 1

    def check_last(self, token: int, computed: int) -> bool:
        """A verification of the last emitted token alone (the stock verifiers', which accept the
        unflagged tokens before it unchecked): `computed` reference tokens went into it."""
        self.verifications += 1
        self.verified = len(self.tokens) - 1
        self.check([token])
        self.replayed += computed - 1  # check counted the token itself
        return self.marks[-1][3]

    def finished(self, eos: set[int], max_new_tokens: int) -> bool:
        return self.tokens[-1] in eos or len(self.tokens) >= max_new_tokens

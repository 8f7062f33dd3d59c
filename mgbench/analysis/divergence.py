"""First divergence, margins and drift from emitted tokens and top-k logprobs (no torch).

Shared by both engines: the in-process audit uses `first_divergence` for its free-running
sequences; the endpoint audit builds its whole step table here, because a black box gives only
tokens and top-k logprobs. Both runs share every prefix up to and including the first differing
token, so each of those steps is a synchronous step and the first divergence is the flip.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TopLogprobs = dict[int, float]  # token id -> logprob, one step's top-k


@dataclass(frozen=True)
class Decoded:
    """One greedy completion as a black box reports it."""

    token_ids: list[int]
    top_logprobs: list[TopLogprobs]  # per generated token


def first_divergence(reference: list[int], candidate: list[int]) -> int | None:
    """Index of the first differing token; a length difference counts at the shorter end."""
    for index, (a, b) in enumerate(zip(reference, candidate)):
        if a != b:
            return index
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


def top2_margin(top: TopLogprobs) -> float:
    """Top-1 minus top-2 logprob, by value (on a bf16 tie a server may list the emitted token
    second). Equal to the logit margin: log-softmax subtracts one constant per step."""
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1]


def step_margins(decoded: Decoded) -> list[float | None]:
    """The top-2 margin of every generated token (the sequences table's solo_margins); None where
    the server listed fewer than 2 top logprobs (unknown, never guessed)."""
    tops = list(decoded.top_logprobs[: len(decoded.token_ids)])
    tops += [{}] * (len(decoded.token_ids) - len(tops))
    return [top2_margin(top) if len(top) >= 2 else None for top in tops]


def logprob_drift(a: TopLogprobs, b: TopLogprobs) -> float:
    """Max |a - b| over the ids both top-k lists hold (0.0 when they share none)."""
    return max((abs(a[i] - b[i]) for i in a.keys() & b.keys()), default=0.0)


def synchronous_steps(reference: list[int], candidate: list[int]) -> int:
    """Steps both runs share, the first divergence included (it is the flip)."""
    divergence = first_divergence(reference, candidate)
    shared = min(len(reference), len(candidate))
    return shared if divergence is None else min(divergence + 1, shared)


def first_divergence_columns(solo: Decoded, batched: Decoded) -> dict:
    """Step columns of one (solo, batched) pair, steps 0..first divergence: tokens, flip, the
    batched and solo margins and the logprob drift. What a black box cannot measure (ulp margin,
    logit distance, K/V perturbation) is None: null in the table, never zero."""
    steps = synchronous_steps(solo.token_ids, batched.token_ids)
    solo_tokens = np.asarray(solo.token_ids[:steps], dtype=np.int64)
    batched_tokens = np.asarray(batched.token_ids[:steps], dtype=np.int64)
    return {
        "method": np.full(steps, "first-divergence"),
        "step": np.arange(steps, dtype=np.int32),
        "solo_token": solo_tokens,
        "batched_token": batched_tokens,
        "flipped": solo_tokens != batched_tokens,
        "margin": np.array([top2_margin(t) for t in batched.top_logprobs[:steps]], dtype=np.float32),
        "margin_ulp": None,
        "solo_margin": np.array([top2_margin(t) for t in solo.top_logprobs[:steps]], dtype=np.float32),
        "max_abs_logit_diff": None,
        "logprob_drift": np.array(
            [logprob_drift(a, b) for a, b in zip(solo.top_logprobs[:steps], batched.top_logprobs[:steps])],
            dtype=np.float32,
        ),
        "kv_delta_mean": None,
        "kv_delta_max": None,
    }


def repeat_agreement(first: Decoded, second: Decoded) -> dict:
    """Solo against solo again: where they first differ, steps compared on the agreeing prefix,
    how many of those steps' logprobs differ and by how much (a deterministic server: 0, 0.0)."""
    divergence = first_divergence(first.token_ids, second.token_ids)
    agreeing = min(len(first.token_ids), len(second.token_ids)) if divergence is None else divergence
    drifts = [logprob_drift(a, b) for a, b in zip(first.top_logprobs[:agreeing], second.top_logprobs[:agreeing])]
    return {
        "first_divergence": divergence,
        "steps": agreeing,
        "logprob_steps_differing": sum(d > 0 for d in drifts),
        "max_logprob_drift": max(drifts, default=0.0),
    }

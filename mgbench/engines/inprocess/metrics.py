"""Per-step metrics on logits: margins, flips, logit and K/V distances (all float32)."""

from __future__ import annotations

import torch


def top2_margin(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-1 minus top-2 logit, top-1 logit) per row, in float32."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1], top[..., 0]


# frexp's exponent of the smallest normal bf16 (2**-126 = 0.5 * 2**-125): below it, at zero and
# among the subnormals, the bf16 spacing stays 2**-133.
_BF16_MIN_NORMAL_EXPONENT = -125


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """BF16 spacing above |x|, the gap to the next larger bf16: bf16 keeps 8 significant bits, so
    ulp = 2**(exponent - 8) with frexp's exponent (1.0 -> 2**-7); 2**-133 at zero and subnormals;
    NaN at infinities and NaN (no spacing to speak of)."""
    magnitude = x.float().abs()
    exponent = torch.frexp(magnitude).exponent.clamp(min=_BF16_MIN_NORMAL_EXPONENT)
    exponent = torch.where(magnitude == 0, _BF16_MIN_NORMAL_EXPONENT, exponent)
    ulp = torch.ldexp(torch.ones_like(magnitude), exponent - 8)
    return torch.where(magnitude.isfinite(), ulp, torch.nan)


def margins(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(margin in logits, the same margin in BF16 ulps at the top-1 logit) per row."""
    margin, top1 = top2_margin(logits)
    return margin, margin / bf16_ulp(top1)


# Top logprobs compared per step: the default an endpoint audit asks for, kept equal in-process
# so the two engines' drift columns mean the same.
TOP_LOGPROBS = 5


def logprob_drift(batched_logits: torch.Tensor, solo_logits: torch.Tensor, k: int = TOP_LOGPROBS) -> torch.Tensor:
    """Max |solo - batched| log-softmax over the ids in both rows' top-k, per row (float32).

    The same quantity an endpoint audit reads from top-k logprobs (ids only one side lists have
    no value on the other side, as over an API)."""
    batched, solo = batched_logits.float().log_softmax(-1), solo_logits.float().log_softmax(-1)
    solo_ids, batched_ids = solo.topk(k, dim=-1).indices, batched.topk(k, dim=-1).indices
    shared = (solo_ids.unsqueeze(-1) == batched_ids.unsqueeze(-2)).any(-1)
    diff = (solo.gather(-1, solo_ids) - batched.gather(-1, solo_ids)).abs()
    return torch.where(shared, diff, torch.zeros_like(diff)).amax(-1)


def step_metrics(batched_logits: torch.Tensor, solo_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Compare batched vs solo logits of one step, row by row ([B, vocab] each)."""
    margin, margin_ulp = margins(batched_logits)
    solo_margin, _ = top2_margin(solo_logits)
    batched_token = batched_logits.argmax(-1)
    solo_token = solo_logits.argmax(-1)
    return {
        "batched_token": batched_token,
        "solo_token": solo_token,
        "flipped": batched_token != solo_token,
        "margin": margin,
        "margin_ulp": margin_ulp,
        "solo_margin": solo_margin,
        "max_abs_logit_diff": (batched_logits.float() - solo_logits.float()).abs().amax(-1),
        "logprob_drift": logprob_drift(batched_logits, solo_logits),
    }


def kv_relative_delta(batched: torch.Tensor, solo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Relative L2 distance per column between K/V stacks [layers, 2, heads, steps, dim].

    Returns (mean over layers, max over layers), each [steps].
    """
    b, s = batched.float(), solo.float()
    diff = (b - s).pow(2).sum(dim=(1, 2, 4)).sqrt()
    norm = s.pow(2).sum(dim=(1, 2, 4)).sqrt().clamp(min=torch.finfo(torch.float32).tiny)
    rel = diff / norm  # [layers, steps]
    return rel.mean(0), rel.amax(0)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in float32, NaN differences ignored (0.0 when nothing is comparable)."""
    d = (a.float() - b.float()).abs()
    d = d[~d.isnan()]
    return float(d.max()) if d.numel() else 0.0

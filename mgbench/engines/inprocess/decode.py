"""Forward passes as small pure functions (prefill alone, padded prefill, one decode step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mgbench.engines.inprocess.cache import LayerKV, cache_from_layers, cache_layers, left_pad_stack


@dataclass
class RowPrefill:
    """A row's prefill computed alone: the first-step logits and its batch-of-one cache."""

    logits: torch.Tensor  # [vocab]
    layers: LayerKV


def forward_last_logits(model, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
    """Logits of the last position of every row, [batch, vocab], in the model's dtype."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1, :]


def prefill_alone(model, prompt_ids: torch.Tensor) -> tuple[torch.Tensor, object]:
    """Prefill one unpadded prompt at batch size 1: (logits [vocab], cache)."""
    ids = prompt_ids.view(1, -1)
    cache = cache_from_layers([], model.config)
    positions = torch.arange(ids.shape[1], device=ids.device).view(1, -1)
    logits = forward_last_logits(model, ids, torch.ones_like(ids), positions, cache)
    return logits[0], cache


def prefill_in_pieces(model, prompt_ids: torch.Tensor, cuts: list[int]) -> tuple[torch.Tensor, object]:
    """Prefill one unpadded prompt at batch size 1 in pieces cut at `cuts` (ascending, inside the
    prompt), each piece a forward over the cache the earlier ones left, as a prefix-cache hit or a
    chunked-prefill scheduler computes it: (logits [vocab] of the last position, cache)."""
    ids = prompt_ids.view(1, -1)
    cache = cache_from_layers([], model.config)
    bounds = [0, *cuts, ids.shape[1]]
    for start, end in zip(bounds, bounds[1:]):
        positions = torch.arange(start, end, device=ids.device).view(1, -1)
        mask = torch.ones((1, end), dtype=torch.long, device=ids.device)
        logits = forward_last_logits(model, ids[:, start:end], mask, positions, cache)
    return logits[0], cache


def left_padded_batch(prompts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(input_ids, attention_mask, pad_lens) for left-padded prompts."""
    total = max(len(p) for p in prompts)
    device = prompts[0].device
    ids = torch.full((len(prompts), total), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), total), dtype=torch.long, device=device)
    pads = []
    for row, prompt in enumerate(prompts):
        pad = total - len(prompt)
        ids[row, pad:] = prompt
        mask[row, pad:] = 1
        pads.append(pad)
    return ids, mask, pads


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only real tokens, as HF generate derives them (pads get 0)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def prefill_batched(model, prompts: list[torch.Tensor], pad_id: int):
    """Prefill the left-padded batch in one forward: (logits [B, vocab], cache, mask, pad_lens)."""
    ids, mask, pads = left_padded_batch(prompts, pad_id)
    cache = cache_from_layers([], model.config)
    logits = forward_last_logits(model, ids, mask, positions_from_mask(mask), cache)
    return logits, cache, mask, pads


def assemble_prefilled(model, row_caches: list[LayerKV]):
    """Batch caches prefilled alone into one left-padded cache: (cache, mask, pad_lens)."""
    cache, pads = left_pad_stack(row_caches, model.config)
    total = cache_layers(cache)[0][0].shape[-2]
    device = row_caches[0][0][0].device
    mask = torch.ones((len(row_caches), total), dtype=torch.long, device=device)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return cache, mask, pads


def decode_step(model, cache, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
    """Feed one token per row: (logits [B, vocab], mask grown by the new column)."""
    mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
    logits = forward_last_logits(model, tokens.view(-1, 1), mask, positions.view(-1, 1), cache)
    return logits, mask

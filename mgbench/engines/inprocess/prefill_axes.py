"""The prefill axes in process: a request decoded alone, its prompt prefilled in pieces.

- `prefix-cache`: the prompt's first K tokens prefilled in an earlier forward and reused, the rest
  prefilled over them (what a prefix-cache hit computes); K is the prefix every prompt of the run
  shares (a chat template's system turn, a few-shot block) unless the run names it.
- `chunked-prefill`: the prompt prefilled in chunks of C tokens, each over the cache of the ones
  before (what a chunked-prefill scheduler computes).

Decoding after the prefill is the solo reference's own, so whatever differs from it comes from
where the prompt was cut.
"""

from __future__ import annotations

import torch

from mgbench.engines.inprocess.cache import cache_layers, clone_layers
from mgbench.engines.inprocess.decode import RowPrefill, prefill_in_pieces
from mgbench.runs.options import RunOptions


def shared_prefix_length(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with (0 for a single prompt: nothing is shown to be shared)."""
    if len(prompts) < 2:
        return 0
    length = 0
    for column in zip(*prompts):
        if any(token != column[0] for token in column):
            break
        length += 1
    return length


def prefix_tokens(options: RunOptions, prompts: list[list[int]]) -> int:
    """K of the prefix-cache axis: --prefix-tokens, or the prefix the run's prompts share."""
    return options.prefix_tokens if options.prefix_tokens is not None else shared_prefix_length(prompts)


def cut_points(axis: str, prompt_len: int, prefix: int, chunk: int) -> list[int]:
    """Where `axis` cuts a prompt of `prompt_len` tokens (a cut leaves at least one token on each
    side: a prompt no longer than the prefix keeps its last token for the second forward)."""
    if axis == "prefix-cache":
        return [min(prefix, prompt_len - 1)] if prompt_len > 1 and prefix > 0 else []
    if axis == "chunked-prefill":
        return list(range(chunk, prompt_len, chunk))
    raise ValueError(f"not a prefill axis: {axis!r}")


def prefill_cut(model, prompt: torch.Tensor, cuts: list[int]) -> RowPrefill:
    """The prompt's prefill in pieces, as a row prefill the decoders start from."""
    logits, cache = prefill_in_pieces(model, prompt, cuts)
    return RowPrefill(logits, clone_layers(cache_layers(cache)))

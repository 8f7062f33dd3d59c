"""Batch-invariant attention for these CPUs: each row attends over its own unpadded keys exactly
as it would alone, so padded batched decoding reproduces solo decoding bitwise (given linear
layers and norms that are already batch-invariant, as measured on AVX2 CPUs).

It is registered through transformers' attention interface and used as a context manager, in
the style of batch_invariant_ops. It is the other road to determinism, the baseline that
`mgbench compare` prices against MarginGate. On a GPU, batch-invariant kernels play this role.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "mgbench_per_row_sdpa"
_PAD_LENS: ContextVar[list[int] | None] = ContextVar("mgbench_pad_lens", default=None)


def per_row_sdpa(module, query, key, value, attention_mask, **kwargs):
    pads = _PAD_LENS.get()
    if pads is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[2] != 1:
        raise ValueError("per-row attention covers decode steps; prefill each request alone")
    # The mask a solo decode step gets is None (no padding): give each row exactly that call.
    rows = [
        sdpa_attention_forward(module, query[r : r + 1], key[r : r + 1, :, pad:], value[r : r + 1, :, pad:], None, **kwargs)[0]
        for r, pad in enumerate(pads)
    ]
    return torch.cat(rows), None


AttentionInterface.register(NAME, per_row_sdpa)
# The same mask builder as SDPA, so solo calls under this implementation match plain SDPA.
AttentionMaskInterface.register(NAME, sdpa_mask)


@contextmanager
def per_row_attention(model, pad_lens: list[int]):
    """Decode steps inside the block attend per row over unpadded keys (`pad_lens` of the batch)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    token = _PAD_LENS.set(list(pad_lens))
    try:
        yield
    finally:
        _PAD_LENS.reset(token)
        model.set_attn_implementation(previous)

"""Batch-invariant decoding: every part of a decode step that varies with the batch, made invariant.

Two parts can vary (measured by `invariance_probe.py` on the machine at hand):

- attention over a left-padded cache: each row's output equals the call it gets alone (its own
  unpadded keys, no mask), per row or in an exact grouped form the probe measured
  (`attention_forms.py`);
- row-wise modules (linear layers, norms, ...) whose kernel depends on the row count: those the
  probe found varying run in an exact form it measured, chunks of row counts whose results equal
  the row alone, or (linear layers) one batched matrix-vector product per row.

Applied as a context manager in the style of batch_invariant_ops; nothing is left behind on the
model or the attention registry's selection when the block ends. Its reference is plain solo
decoding: inside the block a padded batch reproduces each row's solo logits bitwise.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mgbench.engines.inprocess.kernels.attention_forms import PER_ROW, AttentionForm, BatchAttention

# --- attention -------------------------------------------------------------------------------

AttentionWrapper = Callable[..., tuple]  # wrapper(base_fn, module, query, key, value, mask, **kwargs)


def base_attention(implementation: str, module) -> Callable:
    """The attention function an implementation name stands for (eager lives in the model's module)."""
    if implementation == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]


@contextmanager
def wrapped_attention(model, tag: str, wrapper: AttentionWrapper):
    """Route every attention call of `model` through `wrapper`, which receives the function the
    model would have called. Registered as a named implementation with the same mask builder, so
    the wrapper sees exactly the mask and arguments of the plain call."""
    previous = model.config._attn_implementation
    name = f"mgbench_{tag}_{previous}"

    def attention(module, query, key, value, attention_mask, **kwargs):
        return wrapper(base_attention(previous, module), module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[previous])
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


_BATCH: ContextVar[BatchAttention | None] = ContextVar("mgbench_batch_attention", default=None)


def _invariant_attention(base, module, query, key, value, attention_mask, **kwargs):
    batch = _BATCH.get()
    # Forwards of another row count (a verifier's batch-of-one reference, a prefill alone) have no
    # padding: the plain call is already the solo call.
    if batch is None or query.shape[0] != len(batch.pads):
        return base(module, query, key, value, attention_mask, **kwargs)
    if query.shape[2] != 1:
        raise ValueError("batch-invariant attention covers decode steps; prefill each request alone")
    return batch(base, module, query, key, value, **kwargs), None


@contextmanager
def invariant_attention(model, pad_lens: list[int], form: AttentionForm = PER_ROW):
    """Decode steps of this batch (`pad_lens` per row) attend as each row alone, in `form`."""
    token = _BATCH.set(BatchAttention(pad_lens, form))
    try:
        with wrapped_attention(model, "invariant", _invariant_attention):
            yield
    finally:
        _BATCH.reset(token)


# --- row-wise modules ------------------------------------------------------------------------


@dataclass(frozen=True)
class RowForm:
    """An exact way to run a row-wise module over a batch.

    `chunks`: the module's own forward over consecutive chunks whose row counts are in `sizes`
    (measured to equal each row alone; 1 always is); `bmm`: a linear layer as one
    matrix-vector product per row in a single batched matmul."""

    kind: str  # "chunks" or "bmm"
    sizes: tuple[int, ...] = (1,)

    @property
    def label(self) -> str:
        if self.kind == "bmm":
            return "bmm (one GEMV per row)"
        return (
            "per row"
            if self.sizes == (1,)
            else f"chunks of {'/'.join(map(str, sorted(self.sizes, reverse=True)))} rows"
        )


def chunk_sizes(rows: int, allowed: tuple[int, ...]) -> list[int]:
    """Split `rows` into consecutive chunks, largest allowed size first (1 is always allowed)."""
    sizes, left = [], rows
    usable = sorted(set(allowed) | {1}, reverse=True)
    while left:
        size = next(s for s in usable if s <= left)
        sizes.append(size)
        left -= size
    return sizes


def run_in_chunks(forward, x: torch.Tensor, allowed: tuple[int, ...]) -> torch.Tensor:
    if x.shape[0] in allowed or x.shape[0] == 1:
        return forward(x)
    parts, start = [], 0
    for size in chunk_sizes(x.shape[0], allowed):
        parts.append(forward(x[start : start + size]))
        start += size
    return torch.cat(parts)


def linear_as_gemv(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x [B, n, in] @ W^T as B batched products with the same weight (no row-count dependence)."""
    weight = module.weight.t().unsqueeze(0).expand(x.shape[0], -1, -1)
    out = torch.bmm(x.reshape(x.shape[0], -1, x.shape[-1]), weight)
    if module.bias is not None:
        out = out + module.bias
    return out.reshape(*x.shape[:-1], module.weight.shape[0])


def apply_form(module, form: RowForm, x: torch.Tensor, forward=None) -> torch.Tensor:
    """Run `module` (its `forward`, by default the class's) on batch `x` in the exact form `form`."""
    forward = forward or type(module).forward.__get__(module)
    if form.kind == "bmm":
        return linear_as_gemv(module, x)
    return run_in_chunks(forward, x, form.sizes)


@contextmanager
def invariant_modules(model, forms: dict[str, RowForm]):
    """Modules named in `forms` run in their exact form; their own forward comes back afterwards."""
    named = dict(model.named_modules())
    patched = []
    try:
        for name, form in forms.items():
            module = named[name]
            original = module.forward
            module.forward = lambda x, module=module, form=form, original=original: apply_form(
                module, form, x, original
            )
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward  # the instance attribute shadowed the class's forward


@dataclass(frozen=True)
class InvariancePlan:
    """What the batch-invariant mode changes on this machine (from a probe)."""

    forms: dict[str, RowForm] = field(default_factory=dict)  # varying module name -> exact form
    attention: AttentionForm = PER_ROW  # the fastest attention form the probe found exact

    def describe(self) -> dict:
        labels: dict[str, list[str]] = {}
        for name, form in self.forms.items():
            labels.setdefault(form.label, []).append(name)
        return {
            "attention": self.attention.label,
            "modules": {label: names for label, names in labels.items()},
        }


@contextmanager
def batch_invariant(model, pad_lens: list[int], plan: InvariancePlan):
    """Decode steps of this padded batch reproduce each row's solo decoding bitwise."""
    with ExitStack() as stack:
        stack.enter_context(invariant_attention(model, pad_lens, plan.attention))
        stack.enter_context(invariant_modules(model, plan.forms))
        yield


def alone_pad_lens(prompts: list) -> list[int]:
    """Pad lengths of a batch assembled from prefills computed alone (left padding to the longest)."""
    total = max(len(p) for p in prompts)
    return [total - len(p) for p in prompts]


def decoding_mode(model, prompts: list, plan: InvariancePlan | None):
    """The batch-invariant mode for this batch when a plan is given, else plain batched decoding."""
    return nullcontext() if plan is None else batch_invariant(model, alone_pad_lens(prompts), plan)

"""Fixed-order kernels: every decode forward, the solo reference's included, computes each row
with reductions whose order is fixed by construction, so a row gets the same bits alone and in
any batch. The reference is solo decoding through these same kernels (what vLLM's
VLLM_BATCH_INVARIANT=1, SGLang's deterministic mode and Thinking Machines' batch_invariant_ops
promise), not stock solo decoding (what `--batch-invariant` reproduces, at solo cost).

- Attention over a start-aligned cache (`aligned_cache.py`): scores over head_dim only, as
  fixed-shape per-item products (one [G, head_dim] x [head_dim, CHUNK] matmul per chunk of keys,
  row and query), in float32; the softmax's max is order-free; P@V and its denominator are summed
  within each chunk by one fixed-shape product (the values carry a ones column), then across
  chunks by a sequential scan (cumsum) from
  position 0, so keys past a row's end (masked, exact zeros) never reorder its sums. A multi-token
  forward runs its queries one at a time, each with a decode step's per-item products and reductions.
- Row-wise modules (linear layers, the lm_head, norms, ...) in the first form the probe found exact
  on this machine, in this order: as they are; "never one row" (a one-row input runs as two
  identical rows, where every row count from 2 up equals two); chunks of at most T rows; tiles of
  exactly T rows, the last zero-padded, so the vendor kernel only ever sees one shape; per row (the
  fallback, exact by construction). T is the probe's cheapest exact one, or the user's.

Prefill stays alone per request with the stock kernels: it is one call per request, the same in
the solo and the batched run.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from mgbench.engines.inprocess.kernels.aligned_cache import StartAlignedCache, StockAlignedCache, chunks_for
from mgbench.engines.inprocess.kernels.batch_invariant import wrapped_attention

CHUNK = 64  # keys per reduction chunk (the probe checks it)
_CACHE: ContextVar[StartAlignedCache | None] = ContextVar("mgbench_fixed_order_cache", default=None)


def fixed_order_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scaling: float,
    window: int | None = None,
    softcap: float | None = None,
    masks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """query [B, heads, q, head_dim]; keys [n, B, kv_heads, head_dim, chunk] (each chunk transposed:
    the scores' product reads it contiguous, 40% faster than a transposed view here), values
    [n, B, kv_heads, chunk, value_width(head_dim)] whose column head_dim is ones (`with_ones`: the P@V product
    sums the softmax's denominator in the same fixed-shape call), float32 (start-aligned);
    positions [B, q] of the queries. Returns [B, q, heads, head_dim] in the query's dtype. Key j is
    visible to a query at position p iff j <= p (and p - j < window); `masks` is `key_masks` of
    these arguments when the caller keeps it (one per step and window)."""
    n, batch, kv_heads, chunk, width = values.shape
    heads, q = query.shape[1], query.shape[2]
    hiding, visible = masks if masks is not None else key_masks(positions, n, chunk, window)
    if q > 1:
        # One query token at a time: each makes a decode step's products (the same item shapes; the
        # chunks past its position are masked zeros), and K/V are not copied once per query token
        # (expanded over q, a packed replay window of 64 tokens copied the cache 64 times).
        return torch.cat(
            [
                fixed_order_attention(
                    query[:, :, i : i + 1],
                    keys,
                    values,
                    positions[:, i : i + 1],
                    scaling,
                    window,
                    softcap,
                    (hiding[:, :, i : i + 1], visible[:, :, i : i + 1]),
                )
                for i in range(q)
            ],
            dim=1,
        )
    group, head_dim = heads // kv_heads, query.shape[-1]
    items = n * batch * kv_heads
    # The scaling goes into the query (one [B, heads, q, d] product instead of one over every score);
    # exact when it is a power of two, as 1/sqrt(head_dim) is for head_dim 64 or 256.
    qf = (query.float() * scaling).view(batch, kv_heads, group, q, head_dim).permute(0, 3, 1, 2, 4)
    qe = qf.unsqueeze(0).expand(n, batch, q, kv_heads, group, head_dim).reshape(items, group, head_dim)
    ke = keys.reshape(items, head_dim, chunk)  # q = 1: a view of a contiguous cache (a row's slice is copied)
    ve = values.reshape(items, chunk, width)
    scores = torch.bmm(qe, ke).view(n, batch, q, kv_heads, group, chunk)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    top = torch.add(scores, hiding).amax(dim=(0, 5), keepdim=True)  # a max is exact in any order
    # Visible keys get exp(score - top), clamped at exp(-87) ~ 1.7e-38 from below (a term that
    # small vanishes beside the top key's 1 in every sum; the same clamp alone and in any batch).
    # Hidden keys are clamped to that range, then zeroed: exp of -inf, or of anything that
    # underflows, takes a slow path (10x the time of the whole exp here).
    p = scores.sub_(top).clamp_(-87.0, 0.0).exp_().mul_(visible)
    # P@V and its denominator (the ones column) per chunk, then chunk by chunk from position 0:
    # keys past a row's end (exact zeros) never reorder its sums.
    pv = torch.bmm(p.view(items, group, chunk), ve).view(n, batch, q, kv_heads, group, width).cumsum(0)[-1]
    out = pv[..., :head_dim] / pv[..., head_dim : head_dim + 1]  # [B, q, kvh, G, d]
    return out.to(query.dtype).reshape(batch, q, heads, head_dim)


def key_masks(
    positions: torch.Tensor, n: int, chunk: int, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hiding, visible) [n, B, q, 1, 1, chunk] float32: -inf / 0 where a key is hidden from the query
    (past its position, or out of its window), 0 / 1 where it is visible."""
    batch, q = positions.shape
    key_pos = torch.arange(n * chunk, device=positions.device).view(n, 1, 1, chunk)
    query_pos = positions.view(1, batch, q, 1)
    hidden = key_pos > query_pos
    if window is not None:
        hidden |= key_pos <= query_pos - window
    hidden = hidden.view(n, batch, q, 1, 1, chunk)
    hiding = torch.zeros(hidden.shape, device=positions.device).masked_fill_(hidden, float("-inf"))
    return hiding, (~hidden).float()


def per_row_attention(query, keys, values, positions, *args) -> torch.Tensor:
    """Each row alone over its own chunks (the call its solo decoding makes): the fallback form."""
    rows, furthest = [], positions.max(-1).values.tolist()  # one host sync, not one per row
    for r in range(query.shape[0]):
        n = chunks_for(furthest[r] + 1, values.shape[3])
        rows.append(
            fixed_order_attention(
                query[r : r + 1], keys[:n, r : r + 1], values[:n, r : r + 1], positions[r : r + 1], *args
            )
        )
    return torch.cat(rows)


ATTENTION_FORMS = {"batched": "fixed_order_attention", "per-row": "per_row_attention"}


def attention_in_form(form: str):
    """The attention function of a form, looked up at call time (a test can plant a variant)."""
    return globals()[ATTENTION_FORMS[form]]


def attention_arguments(module, kwargs: dict) -> tuple:
    """(scaling, sliding window, softcap) of an attention call, as the model's layer passes them."""
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    return kwargs.get("scaling") or module.scaling, window, kwargs.get("softcap")


_FORM: ContextVar[str] = ContextVar("mgbench_fixed_order_attention_form", default="batched")


def _attention(base, module, query, key, value, attention_mask, **kwargs):
    cache = _CACHE.get()
    if cache is None:  # a prefill alone (or any forward without the aligned cache): stock kernels
        return base(module, query, key, value, attention_mask, **kwargs)
    if isinstance(cache, StockAlignedCache):  # stock kernels over each row's own keys (replay-verified decoding)
        return base(
            module, query, key, value, cache.mask_for(attention_arguments(module, kwargs)[1], query.dtype), **kwargs
        )
    form, arguments = _FORM.get(), attention_arguments(module, kwargs)
    if form != "batched":
        return attention_in_form(form)(query, key, value, cache.positions, *arguments), None
    masks = cache.mask_for(
        arguments[1], lambda: key_masks(cache.positions, value.shape[0], value.shape[3], arguments[1])
    )
    return attention_in_form(form)(query, key, value, cache.positions, *arguments, masks), None


# --- row-wise modules ------------------------------------------------------------------------

# The forms a row-wise module can run in, cheapest first; the probe takes the first it finds exact.
# A vendor GEMM picks its kernel (and its reduction order) from the row count: oneDNN on an AMX
# Xeon changes kernel above 32 rows, cuBLAS picks tiles and split-K by M. "chunks" keeps every call
# at T rows or fewer (exact where every such count is); "tiles" gives every call exactly T rows, the
# last zero-padded, so the kernel only ever sees [T, features]: what a GPU needs. Per row is the
# solo call itself, exact by construction, and the fallback.
ROW_FORMS = ("as-is", "never-one-row", "chunks", "tiles", "per-row")
TILED_FORMS = ("chunks", "tiles")


def never_one_row(forward, rows: torch.Tensor, tile: int | None = None) -> torch.Tensor:
    """[rows, features]: a one-row input runs as two identical rows (materialized, not a stride-0 view)."""
    return forward(torch.cat([rows, rows]))[:1] if rows.shape[0] == 1 else forward(rows)


def in_chunks(forward, rows: torch.Tensor, tile: int) -> torch.Tensor:
    """[rows, features] in consecutive calls of at most `tile` rows (per row: tile 1)."""
    if rows.shape[0] <= tile:
        return forward(rows)
    return torch.cat([forward(part) for part in rows.split(tile)])


def in_tiles(forward, rows: torch.Tensor, tile: int) -> torch.Tensor:
    """[rows, features] in calls of exactly `tile` rows, the last one zero-padded (a solo row is one
    padded tile); the padding's outputs are dropped."""
    count = rows.shape[0]
    short = -count % tile
    if short:
        rows = torch.cat([rows, rows.new_zeros((short, rows.shape[1]))])
    return in_chunks(forward, rows, tile)[:count]


def per_row(forward, rows: torch.Tensor, tile: int | None = None) -> torch.Tensor:
    return in_chunks(forward, rows, 1)


_RUNNERS = {"never-one-row": never_one_row, "chunks": in_chunks, "tiles": in_tiles, "per-row": per_row}


def run_in_form(forward, form: str, x: torch.Tensor, tile: int | None = None) -> torch.Tensor:
    """`forward` on x [..., features] in `form` (`tile`: T of chunks and tiles). The changed forms see
    the rows as one 2-D matrix [rows, features] (a batch step's [B, 1, d] and a replay's [1, q, d]
    alike: the GEMM's own view)."""
    if form == "as-is":
        return forward(x)
    if form in TILED_FORMS and not tile:
        raise ValueError(f"form {form!r} needs a tile size")
    rows = x.reshape(-1, x.shape[-1])
    out = _RUNNERS[form](forward, rows, tile)
    return out.reshape(*x.shape[:-1], *out.shape[1:])  # an embedding's [rows, 1] ids give [rows, 1, H]


def form_label(form: str, tile: int | None) -> str:
    """How a form is said in status lines and reports ("chunks of <= 32 rows", "tiles of 32 rows")."""
    if form == "chunks":
        return f"chunks of <= {tile} rows"
    if form == "tiles":
        return f"tiles of {tile} rows (zero-padded)"
    return form


@dataclass(frozen=True)
class FixedOrderPlan:
    """What the fixed-order mode runs on this machine (from `fixed_order_probe`).

    `forms`: module name -> form for every row-wise module not run as is; `tile`: T, the rows per
    call of the "chunks" and "tiles" forms (None where no module needs one)."""

    chunk: int = CHUNK
    forms: dict[str, str] = field(default_factory=dict)
    attention: str = "batched"  # or "per-row" where the probe found the batched form not exact
    fallbacks: tuple[str, ...] = ()  # lines saying which parts fell back to per row, and why
    tile: int | None = None
    rows_checked: int | None = None  # the most rows in one call the probe found it exact at (None: not probed)

    def __post_init__(self) -> None:
        if any(form in TILED_FORMS for form in self.forms.values()) and not self.tile:
            raise ValueError("a plan with chunks or tiles needs its tile size")

    def describe(self) -> dict:
        labels: dict[str, list[str]] = {}
        for name, form in self.forms.items():
            labels.setdefault(form_label(form, self.tile), []).append(name)
        how = "one call for the batch" if self.attention == "batched" else "per row (fallback)"
        return {
            "attention": f"fixed-order ({how}; fp32, {self.chunk}-key chunks from position 0, start-aligned cache)",
            "modules": {form: len(names) for form, names in labels.items()},
            "tile_rows": self.tile,
            "rows_checked": self.rows_checked,
            "fallbacks": list(self.fallbacks),
        }


@contextmanager
def module_forms(model, plan: FixedOrderPlan):
    """Modules named in the plan's forms run in their form inside fixed-order forwards (a prefill
    alone keeps the stock kernels, as the module docstring says); their own forward comes back afterwards."""
    named = dict(model.named_modules())
    patched = []  # (module, the instance forward it had, if any: a hook's)
    try:
        for name, form in plan.forms.items():
            module = named[name]
            previous = module.__dict__.get("forward")
            forward = previous or type(module).forward.__get__(module)
            module.forward = lambda x, forward=forward, form=form: (
                run_in_form(forward, form, x, plan.tile) if isinstance(_CACHE.get(), StartAlignedCache) else forward(x)
            )
            patched.append((module, previous))
        yield
    finally:
        for module, previous in reversed(patched):
            if previous is None:
                del module.forward  # the instance attribute shadowed the class's forward
            else:
                module.forward = previous


@contextmanager
def aligned_attention(model, plan: FixedOrderPlan):
    """Attention routed by the cache a forward carries: a `StartAlignedCache` takes the fixed-order
    attention in the plan's form, a `StockAlignedCache` the stock kernel over each row's own keys,
    none (a prefill alone) the stock kernel as the model would call it."""
    with ExitStack() as stack:
        form = _FORM.set(plan.attention)
        stack.callback(_FORM.reset, form)
        stack.enter_context(wrapped_attention(model, "fixed_order", _attention))
        yield


@contextmanager
def fixed_order_kernels(model, plan: FixedOrderPlan):
    """Inside the block, forwards fed through `fixed_order_step` run the fixed-order kernels;
    a forward without the aligned cache (a prefill alone) runs the stock attention."""
    with ExitStack() as stack:
        stack.enter_context(aligned_attention(model, plan))
        stack.enter_context(module_forms(model, plan))
        yield


def fixed_order_forward(model, cache, tokens: torch.Tensor, positions: torch.Tensor):
    """Feed tokens [B, q] at positions [B, q] through the model (inside `fixed_order_kernels`, or
    `aligned_attention` for a `StockAlignedCache`): logits [B, q, vocab] of every fed position."""
    cache.feed(positions)
    token = _CACHE.set(cache)
    try:
        # A prepared 4D mask is passed through untouched, so transformers builds none; the
        # attention masks by position itself.
        placeholder = torch.ones((tokens.shape[0], 1, 1, 1), dtype=torch.bool, device=tokens.device)
        out = model(input_ids=tokens, attention_mask=placeholder, position_ids=positions, cache=cache, use_cache=True)
    finally:
        _CACHE.reset(token)
    return out.logits


def fixed_order_step(model, cache: StartAlignedCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One decode step: one token per row [B] at its position [B]; logits [B, vocab]."""
    return fixed_order_forward(model, cache, tokens.view(-1, 1), positions.view(-1, 1))[:, -1, :]

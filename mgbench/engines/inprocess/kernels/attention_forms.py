"""Exact forms of decode-step attention over a left-padded batch: each row's output bitwise equal
to the call it gets alone (its own unpadded keys, no mask), with fewer calls than one per row.

- `per-row`: one call per row over its unpadded keys. Exact by construction; always the fallback.
- `aligned groups of W`: rows whose pad lengths agree modulo W share one masked SDPA call, the
  keys sliced so that every row's pad is a multiple of W. A CPU flash-attention kernel reduces a
  row's keys in W-wide vector lanes and splits the keys into blocks of a fixed size; when the pad
  is a whole number of lanes and the keys fit one block, the masked positions add exact zeros to
  the lanes the solo call fills, in the same order. Whether that holds for a kernel, a machine
  and a W is measured by the probe, never assumed: a form it did not find exact is not used.

Pads stay constant while a batch decodes (every row grows by one key per step), so the groups
are fixed for the batch; rows of a group that are not adjacent are gathered (a copy of their
keys), adjacent ones are sliced (a view).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mgbench.engines.inprocess.metrics import max_abs_diff

ALIGNMENTS = (8, 16, 32, 64)  # lane widths tried, smallest first (fewest groups)
KV_BLOCK = 512  # keys per block of the CPU flash kernel: longer keys are split, and the probe checks it


@dataclass(frozen=True)
class AttentionForm:
    kind: str = "per-row"  # or "aligned"
    align: int = 1  # W of aligned groups
    max_keys: int = KV_BLOCK  # a group whose keys are longer runs per row

    @property
    def label(self) -> str:
        if self.kind == "aligned":
            return f"aligned groups (pads mod {self.align}, one masked SDPA call per group, up to {self.max_keys} keys)"
        return "per row (unpadded keys, as alone)"


PER_ROW = AttentionForm()


def row_alone_attention(base, module, query, key, value, row: int, pad: int, **kwargs) -> torch.Tensor:
    """Row `row`'s attention output computed as alone: its unpadded keys, no mask (a solo decode
    step has no padding to mask). [1, q_len, heads, head_dim]."""
    return base(
        module, query[row : row + 1], key[row : row + 1, :, pad:], value[row : row + 1, :, pad:], None, **kwargs
    )[0]


def per_row(base, module, query, key, value, pads: list[int], **kwargs) -> torch.Tensor:
    rows = [row_alone_attention(base, module, query, key, value, r, pad, **kwargs) for r, pad in enumerate(pads)]
    return torch.cat(rows)


def aligned_groups(pads: list[int], align: int) -> list[tuple[list[int], int]]:
    """(rows, shift) per group: rows whose pads agree modulo `align`; slicing `shift` keys off the
    front leaves each row of the group a pad that is a multiple of `align`. The shift is the
    group's smallest pad, so the group's call spans its longest row's keys, not the batch's."""
    groups: dict[int, list[int]] = {}
    for row, pad in enumerate(pads):
        groups.setdefault(pad % align, []).append(row)
    return [(rows, min(pads[r] for r in rows)) for _, rows in sorted(groups.items())]


def sdpa_call(module, query, key, value, mask, scaling):
    """The SDPA call transformers makes for one unmasked decode step (grouped-query heads shared
    by `enable_gqa`), with an additive mask; output [B, q_len, heads, head_dim] like the model's."""
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


class BatchAttention:
    """Decode-step attention of one padded batch in one form. Built once per batch: the groups,
    their row indices and (per key length, shared by every layer of a step) their masks."""

    def __init__(self, pads: list[int], form: AttentionForm):
        self.pads, self.form = list(pads), form
        self.groups = aligned_groups(self.pads, form.align) if form.kind == "aligned" else []
        self._indices: dict[tuple, torch.Tensor] = {}
        self._masks: tuple[int, list] | None = None  # (total keys, per-group masks)

    def _index(self, rows: list[int], device) -> torch.Tensor:
        key = (tuple(rows), str(device))
        if key not in self._indices:
            self._indices[key] = torch.tensor(rows, device=device)
        return self._indices[key]

    def _take(self, tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Rows of a batch: a view when they are adjacent, else a gathered copy."""
        if rows[-1] - rows[0] == len(rows) - 1:
            return tensor[rows[0] : rows[-1] + 1]
        return tensor.index_select(0, self._index(rows, tensor.device))

    def _group_masks(self, total: int, dtype, device) -> list:
        if self._masks is None or self._masks[0] != total:
            masks = []
            for rows, shift in self.groups:
                keys = total - shift
                if keys > self.form.max_keys:  # this group runs per row: no mask
                    masks.append(None)
                    continue
                pads = torch.tensor([self.pads[r] - shift for r in rows], device=device).view(-1, 1, 1, 1)
                mask = torch.zeros((len(rows), 1, 1, keys), dtype=dtype, device=device)
                masks.append(mask.masked_fill_(torch.arange(keys, device=device) < pads, float("-inf")))
            self._masks = (total, masks)
        return self._masks[1]

    def __call__(self, base, module, query, key, value, **kwargs) -> torch.Tensor:
        if self.form.kind != "aligned":
            return per_row(base, module, query, key, value, self.pads, **kwargs)
        out = torch.empty(
            (query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), dtype=query.dtype, device=query.device
        )
        masks = self._group_masks(key.shape[2], query.dtype, query.device)
        for (rows, shift), mask in zip(self.groups, masks):
            if mask is None:  # past one kernel block: per row, exact by construction
                for row in rows:
                    out[row : row + 1] = row_alone_attention(
                        base, module, query, key, value, row, self.pads[row], **kwargs
                    )
                continue
            k, v = self._take(key, rows)[:, :, shift:], self._take(value, rows)[:, :, shift:]
            result = sdpa_call(module, self._take(query, rows), k, v, mask, kwargs.get("scaling"))
            out.index_copy_(0, self._index(rows, query.device), result)
        return out


def attend(base, module, query, key, value, pads: list[int], form: AttentionForm, **kwargs) -> torch.Tensor:
    """Decode-step attention of a padded batch in `form` (one call; a decode loop keeps a
    `BatchAttention` for the batch instead)."""
    return BatchAttention(pads, form)(base, module, query, key, value, **kwargs)


def rows_differing(out: torch.Tensor, reference: torch.Tensor) -> tuple[list[int], float]:
    """(rows of `out` not bitwise equal to the same rows of `reference`, max |diff| over them)."""
    rows = (~(out == reference).reshape(out.shape[0], -1).all(-1)).nonzero().flatten().tolist()
    return rows, max((max_abs_diff(out[r], reference[r]) for r in rows), default=0.0)


def form_verdict(calls, pads: list[int], form: AttentionForm) -> tuple[bool, float, list[int]]:
    """(exact, max |diff|, pad lengths of the rows that differ) of `form` against the per-row
    reference of every call. `calls`: (base, module, query, key, value, kwargs, reference)."""
    worst, differing = 0.0, set()
    for base, module, q, k, v, kwargs, reference in calls:
        rows, diff = rows_differing(attend(base, module, q, k, v, pads, form, **kwargs), reference)
        differing |= {pads[r] for r in rows}
        worst = max(worst, diff)
    return not differing, worst, sorted(differing)


def grouping_pads(rows: int, align: int) -> list[int]:
    """Pads that put several rows in each aligned group at different multiples of `align`: rows go
    in pairs, a pair's two rows one `align` apart, pairs alternating between residues 0 and
    align/2 + 1 (two rows already share a group). The probe's own pads (0, 1, 2, ...) leave every
    group a single row while rows <= align, so a form checked only there is exact vacuously (an
    8-lane grouping passed there and failed on a 16-lane CPU's real pads)."""
    return [(r // 2 % 2) * (align // 2 + 1) + align * (r % 2 + r // 4 % 2) for r in range(rows)]


def repadded_call(call, pads: list[int], new_pads: list[int], keys: int) -> tuple:
    """A captured call (base, module, query, key, value, kwargs) whose rows sit at `new_pads` in
    `keys` more positions than the largest of them: each row's own real keys, cycled where it has
    fewer than it now needs. Returns the call with its per-row reference, as `form_verdict` takes it."""
    base, module, query, key, value, kwargs = call
    total = max(new_pads) + keys
    k = key.new_zeros((key.shape[0], key.shape[1], total, key.shape[3]))
    v = value.new_zeros((value.shape[0], value.shape[1], total, value.shape[3]))
    for r, (old, new) in enumerate(zip(pads, new_pads)):
        taken = old + torch.arange(total - new, device=key.device) % (key.shape[2] - old)
        k[r, :, new:] = key[r, :, taken]
        v[r, :, new:] = value[r, :, taken]
    return base, module, query, k, v, kwargs, per_row(base, module, query, k, v, new_pads, **kwargs)


def regrouped_calls(calls: list[tuple], pads: list[int], align: int):
    """The first and last captured calls at `grouping_pads`, at every length of 64 consecutive ones
    (64-127 keys past the largest pad): whether a masked group call equals the solo calls depends on
    the key count too (on a 16-lane CPU, 8-aligned groups differed at 36 of 64 lengths). Made one at
    a time (each holds its own K/V and per-row reference: all at once would be gigabytes at 64 rows
    of a large model)."""
    new_pads = grouping_pads(len(pads), align)
    for call in (calls[0], calls[-1]):
        for keys in range(64, 128):
            yield repadded_call(call[:6], pads, new_pads, keys)


def aligned_verdict(checks, calls, pads: list[int], form: AttentionForm) -> tuple[bool, float, list[int]]:
    """`form_verdict` of an aligned form on the probe's checks (its calls and synthetic ones) and on
    its real `calls` re-padded so that the groups hold several rows (`regrouped_calls`); differing
    pads are those of either axis."""
    exact, worst, differing = form_verdict(checks, pads, form)
    ok, diff, more = form_verdict(regrouped_calls(calls, pads, form.align), grouping_pads(len(pads), form.align), form)
    return exact and ok, max(worst, diff), sorted(set(differing) | set(more))


def synthetic_long_calls(call, pads: list[int], lengths=(KV_BLOCK // 2 + 3, KV_BLOCK, KV_BLOCK + 40)) -> list[tuple]:
    """The captured call's module on random keys of other lengths (up to a kernel block and past
    it), so a form is checked beyond the probe prompt's length: call tuples with their per-row
    references."""
    base, module, query, key, value, kwargs = call
    generator = torch.Generator(device="cpu").manual_seed(0)
    made = []
    for length in lengths:
        total = max(length, max(pads) + 2)
        shape = (key.shape[0], key.shape[1], total, key.shape[3])
        k = torch.randn(shape, generator=generator).to(key.dtype).to(key.device)
        v = torch.randn(shape, generator=generator).to(value.dtype).to(value.device)
        made.append((base, module, query, k, v, kwargs, per_row(base, module, query, k, v, pads, **kwargs)))
    return made

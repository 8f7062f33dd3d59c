"""Which form of each part the fixed-order mode can run on this machine, measured on real activations.

The probe decodes a few steps of `rows` real prompts of unequal lengths together through the
fixed-order kernels, capturing every row-wise leaf module's input and every attention call of the
first, middle and last layer (and the lm_head). Each captured op is then recomputed on the first
m rows for every m in `batch_sizes(rows, tiles)` (1-16, every 8th up to the largest, and T-1, T,
T+1, 2T+1 around each tile size T tried) and on all rows in reverse order (a row's bits must not
depend on its position in a call nor on the other rows' content), and compared bitwise, row by
row, with the row computed alone through the same form: the reference a solo run computes. A form
is exact when no row differs anywhere. The plan takes, per part, the first exact form in the order
`as-is`, `never-one-row`, `chunks` of at most T rows, `tiles` of exactly T rows, `per-row`
(attention: `batched`, `per-row`); per row is exact by construction (the solo call itself), so a
part never lacks a form, and a fallback is said with its cost. T is the tried size whose plan
costs least for a decode step at the probe's batch size (each form timed on the probe batch; a
one-row step breaks ties), or the one the user set: tiles of 64 cost nothing at 64 rows and pad a
solo step to 64 rows, which `--tile-rows` trades back where small batches matter.

It also checks that a chunk of tokens fed in one forward gives the logits of the same tokens fed
step by step (verification as a chunk needs that equality), and times each form.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from mgbench.engines.inprocess.kernels.aligned_cache import StartAlignedCache, chunks_for
from mgbench.engines.inprocess.kernels.fixed_order import (
    CHUNK,
    ROW_FORMS,
    FixedOrderPlan,
    attention_in_form,
    fixed_order_forward,
    fixed_order_kernels,
    fixed_order_step,
    form_label,
    run_in_form,
    wrapped_attention,
)
from mgbench.engines.inprocess.kernels.form_checks import POOL_ROWS, _Capture, _compare, _form_differs
from mgbench.engines.inprocess.kernels.invariance_probe import _time_ms  # synchronizes on CUDA
from mgbench.engines.inprocess.kernels.sets import row_prefills
from mgbench.engines.inprocess.metrics import max_abs_diff

ATTENTION_FORMS = ("batched", "per-row")
TILE_ROWS = (8, 16, 32, 64)  # the tile sizes T the probe tries where no row-count-free form is exact


@dataclass
class FormVerdict:
    part: str  # e.g. "linear mlp.down_proj 1536->576", "attention"
    form: str
    modules: int  # modules of the model the verdict covers (checked on the sampled layers)
    exact: bool
    rows_differing: int  # (row, batch size) pairs that differ from the row alone
    max_abs_diff: float
    ms: float | None  # one call over all probe rows
    chosen: bool = False
    tile: int | None = None  # T of a chunks or tiles form
    ms_one_row: float | None = None  # one call on one row (a solo step; tiles pad it to T rows)

    @property
    def label(self) -> str:
        return form_label(self.form, self.tile)


@dataclass
class FixedOrderProbe:
    rows: int
    batch_sizes: list[int]
    prompt_lengths: list[int]
    chunk: int
    verdicts: list[FormVerdict]
    plan: FixedOrderPlan
    chunk_vs_steps: dict  # {"tokens", "rows", "rows_differing", "max_abs_diff", "exact"}
    seconds: float = 0.0
    tiles_tried: list[int] = field(default_factory=list)

    @property
    def fallbacks(self) -> tuple[str, ...]:
        return self.plan.fallbacks

    def to_dict(self) -> dict:
        return {
            "kind": "mgbench.fixed_order_probe",
            "rows": self.rows,
            "batch_sizes": self.batch_sizes,
            "prompt_lengths": self.prompt_lengths,
            "chunk": self.chunk,
            "plan": self.plan.describe(),
            "verdicts": [{**asdict(v), "label": v.label} for v in self.verdicts],
            "chunk_vs_steps": self.chunk_vs_steps,
            "tile_rows_tried": self.tiles_tried,
            "seconds": self.seconds,
        }


def tile_sizes(rows: int, tile: int | None = None) -> list[int]:
    """The tile sizes T to try: the user's, else TILE_ROWS up to `rows` (the smallest always)."""
    if tile is not None:
        if tile < 1:
            raise ValueError(f"a tile holds at least one row (got {tile})")
        return [tile]
    return [t for t in TILE_ROWS if t <= max(rows, TILE_ROWS[0])]


def batch_sizes(rows: int, tiles: list[int] = (), calls: list[int] = ()) -> list[int]:
    """Every size from 1 to 16, then every 8th, then the largest: the sizes runs use; around each
    tile size T, T-1, T, T+1 and 2T+1 (a call's rows across a tile's edge); and `calls`, the row
    counts of the run's other fixed-order forwards (a replay's tokens, a verify batch's N x W)."""
    largest = max([rows, *calls])
    sizes = set(range(1, min(rows, 16) + 1)) | set(range(24, rows + 1, 8)) | {rows} | set(calls)
    for t in tiles:
        sizes |= {m for m in (t - 1, t, t + 1, 2 * t + 1) if 1 <= m <= largest}
    return sorted(sizes)


def part_labels(model) -> dict[str, str]:
    """Leaf module name -> its part: linears by shape (a GEMM's kernel is chosen by shape and
    dtype, whatever the weights: k_proj and v_proj of 576->192 share one verdict, so rows where
    either shows the vendor's row-count dependence count for both), other modules by name."""
    shorts: dict[tuple, set[str]] = {}
    keys = {}
    for name, module in model.named_modules():
        if next(module.children(), None) is not None:
            continue
        short = ".".join(p for p in name.split(".") if not p.isdigit() and p not in ("model", "layers"))
        if isinstance(module, torch.nn.Linear):
            key = (module.in_features, module.out_features, module.bias is not None, module.weight.dtype)
            shorts.setdefault(key, set()).add(short)
            keys[name] = key
        else:
            keys[name] = f"{type(module).__name__} {short}"
    return {
        name: key if isinstance(key, str) else f"linear {', '.join(sorted(shorts[key]))} {key[0]}->{key[1]}"
        for name, key in keys.items()
    }


def _module_verdicts(model, capture: _Capture, sizes: list[int], tiles: list[int]) -> list[FormVerdict]:
    """Per part, forms in order until one is exact (as is, never one row), else chunks and tiles at
    every tried T (tiles only where chunks of that T are not exact), and per row, each timed."""
    named, labels = dict(model.named_modules()), part_labels(model)
    by_label: dict[str, list[str]] = {}
    for name in capture.modules:
        by_label.setdefault(labels[name], []).append(name)
    verdicts = []
    for label, names in by_label.items():
        forwards = {name: type(named[name]).forward.__get__(named[name]) for name in names}
        first = capture.modules[names[0]][0]

        def verdict(form: str, tile: int | None = None) -> FormVerdict:
            differing, worst = 0, 0.0
            if form != "per-row":  # per row is the solo call itself: exact by construction
                for name in names:
                    captured = capture.modules[name] + capture.pool.get(name, [])
                    many = torch.cat([c.reshape(-1, first.shape[-1]) for c in captured])[:POOL_ROWS]
                    for i, x in enumerate(capture.modules[name]):  # the larger calls once, on the real rows
                        d, w = _form_differs(forwards[name], form, tile, x, sizes, many if i == 0 else None)
                        differing, worst = differing + d, max(worst, w)
            ms = _time_ms(lambda: run_in_form(forwards[names[0]], form, first, tile), first.device)
            # Chunks, per row and as is make the same call on one row: one timing for all of them, so
            # noise on identical calls cannot choose T (only tiles pad a solo row, to T rows).
            one = (
                as_is_one_row
                if form in ("chunks", "per-row")
                else _time_ms(lambda: run_in_form(forwards[names[0]], form, first[:1], tile), first.device)
            )
            return FormVerdict(label, form, len(names), differing == 0, differing, worst, ms, tile=tile, ms_one_row=one)

        part = [verdict("as-is")]
        as_is_one_row = part[0].ms_one_row
        if not part[-1].exact:
            part.append(verdict("never-one-row"))
        if not part[-1].exact:
            largest = max(sizes)
            for tile in tiles:
                if tile < largest:  # chunks of T >= every call's rows are the calls as they are
                    part.append(verdict("chunks", tile))
                if tile >= largest or not part[-1].exact:
                    part.append(verdict("tiles", tile))
            part.append(verdict("per-row"))
        verdicts += part
    return verdicts


def _attention_verdicts(capture: _Capture, sizes: list[int], chunk: int) -> list[FormVerdict]:
    verdicts = []
    for form in ATTENTION_FORMS:
        attend = attention_in_form(form)
        differing, worst = 0, 0.0
        for query, keys, values, positions, args in capture.attention:
            alone = []
            for r in range(query.shape[0]):
                n = chunks_for(int(positions[r].max()) + 1, chunk)
                alone.append(
                    attend(query[r : r + 1], keys[:n, r : r + 1], values[:n, r : r + 1], positions[r : r + 1], *args)
                )
            for m in sizes:
                n = chunks_for(int(positions[:m].max()) + 1, chunk)
                out = attend(query[:m], keys[:n, :m], values[:n, :m], positions[:m], *args)
                d, w = _compare(out, alone[:m])
                differing, worst = differing + d, max(worst, w)
        query, keys, values, positions, args = capture.attention[0]
        ms = _time_ms(lambda: attend(query, keys, values, positions, *args), query.device)
        verdicts.append(FormVerdict("attention", form, len(capture.attention), differing == 0, differing, worst, ms))
    return verdicts


def _first_exact(verdicts: list[FormVerdict], order: tuple[str, ...], tile: int | None) -> FormVerdict:
    """The first exact form of one part in `order`, among its forms at `tile` (or of no tile)."""
    usable = [v for v in verdicts if v.exact and v.tile in (None, tile)]
    if not usable:  # per row, said as a fallback (the attention's per-row form is checked, not assumed)
        return next(v for v in verdicts if v.form == "per-row")
    return min(usable, key=lambda v: order.index(v.form))


def _fallback_line(verdicts: list[FormVerdict], chosen: FormVerdict) -> str | None:
    """A part that falls back to per row, said with what the batch form got wrong and the cost."""
    if chosen.form != "per-row" or verdicts[0].form == "per-row":
        return None
    first = verdicts[0]
    cost = f"{chosen.ms:.3g} ms per row against {first.ms:.3g} ms batched" if chosen.ms and first.ms else ""
    return (
        f"{first.part}: no batched form is exact here ({first.rows_differing} rows differ as is, "
        f"max |diff| {first.max_abs_diff:.3g}); it runs per row ({cost} on the probe batch)"
    )


def _plan_cost(by_part: dict[str, list[FormVerdict]], counts: dict[str, int], tile: int | None) -> tuple[float, float]:
    """(ms of a decode step at the probe's batch size, of a one-row step) through every row-wise
    module in its form at `tile`, times its part's modules in the model (`counts`). T is chosen for
    the batched step, what the mode costs at this load (and what `compare` times); the one-row step
    (a solo reference step; tiles pad it to T rows) breaks ties. The attention does not depend on T."""
    batched = solo = 0.0
    for part, verdicts in by_part.items():
        if part != "attention":
            chosen = _first_exact(verdicts, ROW_FORMS, tile)
            batched += (chosen.ms or 0.0) * counts[part]
            solo += (chosen.ms_one_row or 0.0) * counts[part]
    return batched, solo


def plan_from(
    model, verdicts: list[FormVerdict], chunk: int, tiles: list[int] = (), rows_checked: int | None = None
) -> FixedOrderPlan:
    """The plan: each part's first exact form, applied to every module of that part, at the tried
    tile size whose plan costs least for the probed batch's step (None where no part needs one)."""
    by_part: dict[str, list[FormVerdict]] = {}
    for v in verdicts:
        by_part.setdefault(v.part, []).append(v)
    labels = part_labels(model)
    counts = {part: sum(label == part for label in labels.values()) for part in by_part}
    needs_tile = any(v.tile is not None for v in verdicts)
    tile = min(tiles, key=lambda t: _plan_cost(by_part, counts, t)) if needs_tile and tiles else None
    forms, fallbacks, attention, tiled = {}, [], "batched", False
    for part, part_verdicts in by_part.items():
        order = ATTENTION_FORMS if part == "attention" else ROW_FORMS
        chosen = _first_exact(part_verdicts, order, tile)
        for v in part_verdicts:
            v.chosen = v is chosen
        fallback = _fallback_line(part_verdicts, chosen)
        if fallback:
            fallbacks.append(fallback)
        if part == "attention":
            attention = chosen.form
        elif chosen.form != "as-is":
            tiled |= chosen.tile is not None
            forms.update({name: chosen.form for name, label in labels.items() if label == part})
    return FixedOrderPlan(chunk, forms, attention, tuple(fallbacks), tile if tiled else None, rows_checked)


def _chunk_vs_steps(model, prompts, prefills, plan: FixedOrderPlan, tokens: int, verify_rows: int = 0) -> dict:
    """The same tokens fed as one chunk and step by step, from the same prefill: logits bitwise?
    With `verify_rows` the chunk is a verify batch of that many rows, the real rows first and empty
    dummy rows after them (fed padding at positions 0..), as packed replays feed it."""
    feed = torch.stack([p.logits.argmax() for p in prefills]).view(-1, 1).repeat(1, tokens)
    lengths = torch.tensor([len(p) for p in prompts], device=feed.device)
    positions = lengths.view(-1, 1) + torch.arange(tokens, device=feed.device)
    real, dummies = feed.shape[0], max(0, verify_rows - feed.shape[0])
    with fixed_order_kernels(model, plan):
        cache = StartAlignedCache.from_prefills([p.layers for p in prefills], tokens, plan.chunk, spare=dummies)
        packed_feed = torch.cat([feed, feed.new_zeros((dummies, tokens))])
        packed_positions = torch.cat([positions, torch.arange(tokens, device=feed.device).repeat(dummies, 1)])
        chunked = fixed_order_forward(model, cache, packed_feed, packed_positions)[:real]
        cache = StartAlignedCache.from_prefills([p.layers for p in prefills], tokens, plan.chunk)
        stepped = torch.stack([fixed_order_step(model, cache, feed[:, t], positions[:, t]) for t in range(tokens)], 1)
    rows = chunked.shape[0] * tokens
    differing = int((~(chunked == stepped).all(-1)).sum())
    return {
        "tokens": tokens,
        "rows": rows,
        "verify_rows": real + dummies,
        "rows_differing": differing,
        "max_abs_diff": max_abs_diff(chunked, stepped),
        "exact": differing == 0,
    }


def probe_fixed_order(
    model,
    prompts: list[torch.Tensor],
    rows: int,
    steps: int = 3,
    chunk: int = CHUNK,
    chunk_tokens: int = 8,
    tile: int | None = None,
    calls: list[int] = (),
    verify_rows: int = 0,
    prefills: list | None = None,
) -> FixedOrderProbe:
    """Probe the fixed-order forms on `rows` real prompts (cycled if fewer), `steps` decode steps;
    chunks and tiles at `tile` rows if given, else at each of TILE_ROWS that fits. `calls`: row
    counts of the run's other fixed-order forwards (replays), checked too; `verify_rows`: the
    chunk of `chunk_tokens` is checked as a verify batch of that many rows (dummies after the real
    ones), as packed replays run it. `prefills`: the prompts' stock prefills alone where a caller
    has them (the solo runs reuse them too): a prefill is most of a short probe's time."""
    started = time.perf_counter()
    chosen = [prompts[i % len(prompts)] for i in range(rows)]
    known = [prefills[i % len(prompts)] for i in range(rows)] if prefills is not None else None
    tiles = tile_sizes(max([rows, *calls]), tile)
    sizes = batch_sizes(rows, tiles, calls)
    with torch.inference_mode():
        prefills = row_prefills(model, chosen, known)
        trial = FixedOrderPlan(chunk)  # everything as is while activations are captured
        capture = _Capture(model, rows)
        with fixed_order_kernels(model, trial), capture, wrapped_attention(model, "probe", capture.record):
            cache = StartAlignedCache.from_prefills([p.layers for p in prefills], steps, chunk)
            tokens = torch.stack([p.logits.argmax() for p in prefills])
            lengths = torch.tensor([len(p) for p in chosen], device=tokens.device)
            for step in range(steps):
                tokens = fixed_order_step(model, cache, tokens, lengths + step).argmax(-1)
            if max(calls, default=0) > rows:  # distinct real rows for the replays' larger calls
                capture.pooling, count = True, -(-POOL_ROWS // rows)
                cache = StartAlignedCache.from_prefills([p.layers for p in prefills], count, chunk)
                feed = tokens.view(-1, 1).repeat(1, count)
                fixed_order_forward(model, cache, feed, lengths.view(-1, 1) + torch.arange(count, device=feed.device))
        verdicts = _module_verdicts(model, capture, sizes, tiles) + _attention_verdicts(
            capture, [m for m in sizes if m <= rows], chunk
        )
        plan = plan_from(model, verdicts, chunk, tiles, max(sizes))
        few = min(rows, 4)
        chunk_check = _chunk_vs_steps(model, chosen[:few], prefills[:few], plan, chunk_tokens, verify_rows)
    return FixedOrderProbe(
        rows, sizes, [len(p) for p in chosen], chunk, verdicts, plan, chunk_check, time.perf_counter() - started, tiles
    )

"""Which form of each part the fixed-order mode can run on this machine, measured on real activations.

The probe decodes a few steps of `rows` real prompts of unequal lengths together through the
fixed-order kernels, capturing every row-wise leaf module's input and every attention call of the
first, middle and last layer (and the lm_head). Each captured op is then recomputed on the first
m rows for every m in `batch_sizes(rows)` (1, 2, 3, ... up to the largest) and compared bitwise,
row by row, with the row computed alone through the same form: the reference a solo run computes.
A form is exact when no row differs at any size. The plan takes, per part, the first exact form
in the order `as-is`, `never-one-row`, `per-row` (attention: `batched`, `per-row`); per row is
exact by construction (the solo call itself), so a part never lacks a form, and a fallback is said.

It also checks that a chunk of tokens fed in one forward gives the logits of the same tokens fed
step by step (verification as a chunk needs that equality), and times each form.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from mgbench.engines.inprocess.aligned_cache import StartAlignedCache, chunks_for
from mgbench.engines.inprocess.fixed_order import (
    _CACHE,
    CHUNK,
    FixedOrderPlan,
    attention_arguments,
    attention_in_form,
    fixed_order_forward,
    fixed_order_kernels,
    fixed_order_step,
    run_in_form,
    wrapped_attention,
)
from mgbench.engines.inprocess.invariance_probe import _time_ms  # synchronizes on CUDA
from mgbench.engines.inprocess.kernels import row_prefills
from mgbench.engines.inprocess.metrics import max_abs_diff

ROW_FORMS = ("as-is", "never-one-row", "per-row")
ATTENTION_FORMS = ("batched", "per-row")


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
            "verdicts": [asdict(v) for v in self.verdicts],
            "chunk_vs_steps": self.chunk_vs_steps,
            "seconds": self.seconds,
        }


def batch_sizes(rows: int) -> list[int]:
    """Every size from 1 to 16, then every 8th, then the largest: the sizes runs use."""
    sizes = list(range(1, min(rows, 16) + 1)) + list(range(24, rows + 1, 8))
    return sorted(set(sizes + [rows]))


def sampled_layers(model) -> set[int]:
    layers = model.config.num_hidden_layers
    return {0, layers // 2, layers - 1}


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return next((int(p) for p in parts if p.isdigit()), None)


def _label(name: str, module) -> str:
    short = ".".join(p for p in name.split(".") if not p.isdigit() and p not in ("model", "layers"))
    if isinstance(module, torch.nn.Linear):
        return f"linear {short} {module.in_features}->{module.out_features}"
    return f"{type(module).__name__} {short}"


def _compare(batched: torch.Tensor, alone: list[torch.Tensor]) -> tuple[int, float]:
    """(rows of `batched` not bitwise equal to the row computed alone, max |diff| over them)."""
    differing, worst = 0, 0.0
    for r, ref in enumerate(alone):
        if not torch.equal(batched[r : r + 1], ref):
            differing += 1
            worst = max(worst, max_abs_diff(batched[r : r + 1], ref))
    return differing, worst


class _Capture:
    """Inputs of row-wise leaf modules and attention calls during fixed-order steps (sampled layers)."""

    def __init__(self, model, batch: int):
        self.model, self.batch, self.layers = model, batch, sampled_layers(model)
        self.modules: dict[str, list[torch.Tensor]] = {}
        self.attention: list[tuple] = []
        self.handles = []

    def __enter__(self):
        for name, module in self.model.named_modules():
            layer = _layer_of(name)
            if next(module.children(), None) is None and (layer is None or layer in self.layers):
                self.handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def _hook(self, name):
        def hook(module, args, kwargs, output):
            # Only ops that take one tensor whose rows are the batch's can run per row.
            one_tensor = len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)
            if one_tensor and isinstance(output, torch.Tensor) and args[0].shape[0] == self.batch:
                self.modules.setdefault(name, []).append(args[0])

        return hook

    def record(self, base, module, query, key, value, mask, **kwargs):
        cache = _CACHE.get()
        if cache is not None and query.shape[0] == self.batch and module.layer_idx in self.layers:
            args = attention_arguments(module, kwargs)
            self.attention.append((query, key.clone(), value.clone(), cache.positions.clone(), args))
        return base(module, query, key, value, mask, **kwargs)

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def _module_verdicts(model, capture: _Capture, sizes: list[int]) -> list[FormVerdict]:
    named = dict(model.named_modules())
    by_label: dict[str, list[str]] = {}
    for name in capture.modules:
        by_label.setdefault(_label(name, named[name]), []).append(name)
    verdicts = []
    for label, names in by_label.items():
        forms = ROW_FORMS if isinstance(named[names[0]], torch.nn.Linear) else ("as-is", "per-row")
        for form in forms:
            differing, worst = 0, 0.0
            for name in names:
                module = named[name]
                forward = type(module).forward.__get__(module)
                for x in capture.modules[name]:
                    alone = [run_in_form(forward, form, x[r : r + 1]) for r in range(x.shape[0])]
                    for m in sizes:
                        d, w = _compare(run_in_form(forward, form, x[:m]), alone[:m])
                        differing, worst = differing + d, max(worst, w)
            module = named[names[0]]
            forward, x = type(module).forward.__get__(module), capture.modules[names[0]][0]
            ms = _time_ms(lambda: run_in_form(forward, form, x), x.device)
            verdicts.append(FormVerdict(label, form, len(names), differing == 0, differing, worst, ms))
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


def _choose(verdicts: list[FormVerdict], order: tuple[str, ...]) -> tuple[str, str | None]:
    """(chosen form, a fallback line or None) for one part's verdicts."""
    exact = {v.form for v in verdicts if v.exact}
    form = next((f for f in order if f in exact), "per-row")
    for v in verdicts:
        v.chosen = v.form == form
    if form == "per-row" and "per-row" != order[0]:
        first, chosen = verdicts[0], next(v for v in verdicts if v.form == "per-row")
        cost = f"{chosen.ms:.3g} ms per row against {first.ms:.3g} ms batched" if chosen.ms and first.ms else ""
        return form, (
            f"{first.part}: no batched form is exact here ({first.rows_differing} rows differ as is, "
            f"max |diff| {first.max_abs_diff:.3g}); it runs per row ({cost} on the probe batch)"
        )
    return form, None


def plan_from(model, verdicts: list[FormVerdict], chunk: int) -> FixedOrderPlan:
    """The plan: each part's first exact form, applied to every module of that part."""
    named = dict(model.named_modules())
    by_part: dict[str, list[FormVerdict]] = {}
    for v in verdicts:
        by_part.setdefault(v.part, []).append(v)
    forms, fallbacks, attention = {}, [], "batched"
    for part, part_verdicts in by_part.items():
        order = ATTENTION_FORMS if part == "attention" else ROW_FORMS
        form, fallback = _choose(part_verdicts, order)
        if fallback:
            fallbacks.append(fallback)
        if part == "attention":
            attention = form
        elif form != "as-is":
            forms.update({name: form for name, m in named.items() if _part_matches(part, name, m)})
    return FixedOrderPlan(chunk, forms, attention, tuple(fallbacks))


def _part_matches(part: str, name: str, module) -> bool:
    return next(module.children(), None) is None and _label(name, module) == part


def _chunk_vs_steps(model, prompts, prefills, plan: FixedOrderPlan, tokens: int) -> dict:
    """The same tokens fed as one chunk and step by step, from the same prefill: logits bitwise?"""
    feed = torch.stack([p.logits.argmax() for p in prefills]).view(-1, 1).repeat(1, tokens)
    lengths = torch.tensor([len(p) for p in prompts], device=feed.device)
    positions = lengths.view(-1, 1) + torch.arange(tokens, device=feed.device)
    with fixed_order_kernels(model, plan):
        cache = StartAlignedCache.from_prefills([p.layers for p in prefills], tokens, plan.chunk)
        chunked = fixed_order_forward(model, cache, feed, positions)
        cache = StartAlignedCache.from_prefills([p.layers for p in prefills], tokens, plan.chunk)
        stepped = torch.stack([fixed_order_step(model, cache, feed[:, t], positions[:, t]) for t in range(tokens)], 1)
    rows = chunked.shape[0] * tokens
    differing = int((~(chunked == stepped).all(-1)).sum())
    return {
        "tokens": tokens,
        "rows": rows,
        "rows_differing": differing,
        "max_abs_diff": max_abs_diff(chunked, stepped),
        "exact": differing == 0,
    }


def probe_fixed_order(
    model, prompts: list[torch.Tensor], rows: int, steps: int = 3, chunk: int = CHUNK, chunk_tokens: int = 8
) -> FixedOrderProbe:
    """Probe the fixed-order forms on `rows` real prompts (cycled if fewer), `steps` decode steps."""
    started = time.perf_counter()
    chosen = [prompts[i % len(prompts)] for i in range(rows)]
    sizes = batch_sizes(rows)
    with torch.inference_mode():
        prefills = row_prefills(model, chosen)
        trial = FixedOrderPlan(chunk)  # everything as is while activations are captured
        capture = _Capture(model, rows)
        with fixed_order_kernels(model, trial), capture, wrapped_attention(model, "probe", capture.record):
            cache = StartAlignedCache.from_prefills([p.layers for p in prefills], steps, chunk)
            tokens = torch.stack([p.logits.argmax() for p in prefills])
            lengths = torch.tensor([len(p) for p in chosen], device=tokens.device)
            for step in range(steps):
                tokens = fixed_order_step(model, cache, tokens, lengths + step).argmax(-1)
        verdicts = _module_verdicts(model, capture, sizes) + _attention_verdicts(capture, sizes, chunk)
        plan = plan_from(model, verdicts, chunk)
        few = min(rows, 4)
        chunk_check = _chunk_vs_steps(model, chosen[:few], prefills[:few], plan, chunk_tokens)
    return FixedOrderProbe(
        rows, sizes, [len(p) for p in chosen], chunk, verdicts, plan, chunk_check, time.perf_counter() - started
    )

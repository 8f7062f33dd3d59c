"""What the fixed-order probe checks a form on: real activations captured during fixed-order decode
steps (`_Capture`: every row-wise leaf module's input and every attention call of the sampled
layers, plus, for replays' larger calls, the inputs of a many-token forward), and a form's rows
against the same rows computed alone (`_form_differs`)."""

from __future__ import annotations

import torch

from mgbench.engines.inprocess.kernels.fixed_order import _CACHE, attention_arguments, run_in_form
from mgbench.engines.inprocess.metrics import max_abs_diff


def sampled_layers(model) -> set[int]:
    layers = model.config.num_hidden_layers
    return {0, layers // 2, layers - 1}


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return next((int(p) for p in parts if p.isdigit()), None)


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
        self.pool: dict[str, list[torch.Tensor]] = {}  # inputs of a many-token forward (`pooling`)
        self.pooling = False
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
                (self.pool if self.pooling else self.modules).setdefault(name, []).append(args[0])

        return hook

    def record(self, base, module, query, key, value, mask, **kwargs):
        cache = _CACHE.get()
        if cache is not None and not self.pooling and query.shape[0] == self.batch and module.layer_idx in self.layers:
            args = attention_arguments(module, kwargs)
            self.attention.append((query, key.clone(), value.clone(), cache.positions.clone(), args))
        return base(module, query, key, value, mask, **kwargs)

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


POOL_ROWS = 128  # distinct real rows a call larger than the probe batch is checked on


def _form_differs(
    forward, form: str, tile: int | None, x: torch.Tensor, sizes: list[int], many: torch.Tensor | None = None
) -> tuple[int, float]:
    """(rows differing from the row alone, max |diff|) of `form` on captured rows x: on the first m
    rows for every m in `sizes`, and on all rows reversed (other positions, other neighbours). A
    size past x's rows (a replay's call) takes the distinct real rows `many` (cycled past their
    count): 4 rows repeated 16 times passed where 64 distinct rows differ (oneDNN, AMX Xeon)."""
    rows = x.shape[0]
    alone = [run_in_form(forward, form, x[r : r + 1], tile) for r in range(rows)]
    many_alone = None
    differing, worst = 0, 0.0
    for m in sizes:
        if m <= rows or many is None:
            index = torch.arange(m, device=x.device) % rows
            d, w = _compare(run_in_form(forward, form, x[index], tile), [alone[r % rows] for r in range(m)])
        else:
            if many_alone is None:
                many_alone = [run_in_form(forward, form, many[r : r + 1], tile) for r in range(many.shape[0])]
            index = torch.arange(m, device=x.device) % many.shape[0]
            d, w = _compare(run_in_form(forward, form, many[index], tile), [many_alone[r] for r in index.tolist()])
        differing, worst = differing + d, max(worst, w)
    d, w = _compare(run_in_form(forward, form, x.flip(0), tile).flip(0), alone)
    return differing + d, max(worst, w)

"""Which parts of one decode step are batch-invariant on this machine, measured on the model's own ops.

One real decode step is run on a left-padded batch whose rows have pad lengths 0, 1, 2, ... (each
row a prefix of one prompt, prefilled alone), with every leaf module's input and output and every
attention call captured. Each captured op is then replayed on each row alone (what the solo run
computes) and on the first m rows for every row count m, and compared bitwise. Attention is
compared with the row's call over its own unpadded keys. For every op that varies, the probe
measures exact forms (chunks of row counts that agree, one GEMV per row) and keeps the fastest:
that is the batch-invariant mode's plan, checked end to end against solo decoding.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from mgbench.engines.inprocess.cache import clone_layers
from mgbench.engines.inprocess.decode import RowPrefill, assemble_prefilled, decode_step
from mgbench.engines.inprocess.kernels.attention_forms import (
    ALIGNMENTS,
    KV_BLOCK,
    PER_ROW,
    AttentionForm,
    aligned_verdict,
    attend,
    per_row,
    rows_differing,
    synthetic_long_calls,
)
from mgbench.engines.inprocess.kernels.batch_invariant import (
    InvariancePlan,
    RowForm,
    apply_form,
    batch_invariant,
    wrapped_attention,
)
from mgbench.engines.inprocess.kernels.sets import row_prefills
from mgbench.engines.inprocess.metrics import max_abs_diff
from mgbench.engines.inprocess.stopwatch import synchronize
from mgbench.runs.machine import machine_facts  # noqa: F401 (re-export)


@dataclass
class OpFinding:
    op: str  # linear, lm_head, norm, activation, embedding, other, attention, argmax, decode step, ...
    name: str  # e.g. "mlp.down_proj 1536->576" or "sdpa"
    modules: int  # how many modules of the model this line covers
    invariant: bool
    max_abs_diff: float
    varies_at: list[int]  # row counts (axis "rows") or pad lengths (axis "pad") that differ
    axis: str
    form: str = "batched"  # what the batch-invariant mode runs
    batched_ms: float | None = None  # one call over all probe rows
    form_ms: float | None = None


@dataclass
class ProbeReport:
    machine: dict
    rows: int
    pad_lens: list[int]
    findings: list[OpFinding]
    plan: InvariancePlan
    plain_rows_differing: list[int]  # rows of a plain batched step whose logits differ from solo
    invariant_rows_differing: list[int]  # the same under the batch-invariant plan (must be empty)
    varying_op_rows: list[int]  # rows where some op differs from the row alone
    plain_step_ms: float
    invariant_step_ms: float
    seconds: float = 0.0

    @property
    def varies(self) -> bool:
        return bool(self.plain_rows_differing) or any(not f.invariant for f in self.findings)

    @property
    def exact(self) -> bool:
        return not self.invariant_rows_differing

    @property
    def step_increment(self) -> float | None:
        """Extra time of a batch-invariant step over a plain one, on the probe batch."""
        return self.invariant_step_ms / self.plain_step_ms - 1 if self.plain_step_ms else None

    def to_dict(self) -> dict:
        return {
            "kind": "mgbench.probe",
            "machine": self.machine,
            "rows": self.rows,
            "pad_lens": self.pad_lens,
            "varies": self.varies,
            "batch_invariant_exact": self.exact,
            "plain_rows_differing": self.plain_rows_differing,
            "invariant_rows_differing": self.invariant_rows_differing,
            "plain_step_ms": self.plain_step_ms,
            "invariant_step_ms": self.invariant_step_ms,
            "invariant_step_increment": self.step_increment,
            "varying_op_rows": self.varying_op_rows,
            "plan": self.plan.describe(),
            "findings": [asdict(f) for f in self.findings],
            "seconds": self.seconds,
        }


def probe_batch(model, prompt: torch.Tensor, rows: int):
    """Rows that are prefixes of one prompt, shortened by 0, 1, 2, ... tokens, so that the batch
    assembled from them sits at pad lengths 0, 1, 2, ...; each is fed its prompt's next token.

    The prompt is prefilled once and each row's cache is a slice of it: solo and batched steps
    then start from identical caches (the probe measures the decode step, not the prefill).
    Returns (row prefills, fed tokens, positions)."""
    length = len(prompt)
    if length < 2:
        raise ValueError("the probe needs a prompt of at least 2 tokens")
    [full] = row_prefills(model, [prompt])
    cuts = [length - (r % (length - 1)) for r in range(rows)]
    prefills = [
        RowPrefill(full.logits, [(k[:, :, :n].clone(), v[:, :, :n].clone()) for k, v in full.layers]) for n in cuts
    ]
    tokens = torch.stack([full.logits.argmax() if n == length else prompt[n] for n in cuts])
    return prefills, tokens, torch.tensor(cuts, device=prompt.device)


def _equal_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[rows] bool: row r of a equals row r of b bitwise."""
    return (a == b).reshape(a.shape[0], -1).all(-1) | (a.isnan() & b.isnan()).reshape(a.shape[0], -1).all(-1)


def _time_ms(fn, device, repeats: int = 3, setup=None) -> float:
    """Median milliseconds of `fn()` (after one warm-up call), synchronized on `device`. With
    `setup`, each call is `fn(setup())` and only `fn` is timed: what it consumes (a fresh cache a
    decode step grows) is built before the clock starts."""
    call = fn if setup is None else (lambda: fn(setup()))
    call()
    synchronize(device)
    times = []
    for _ in range(repeats):
        args = () if setup is None else (setup(),)
        synchronize(device)
        start = time.perf_counter()
        fn(*args)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1000


def _role(name: str, module) -> tuple[str, str]:
    """(op kind, display name) of a leaf module, e.g. ("linear", "mlp.down_proj 1536->576")."""
    short = ".".join(part for part in name.split(".") if not part.isdigit() and part not in ("model", "layers"))
    if isinstance(module, torch.nn.Linear):
        kind = "lm_head" if name.endswith("lm_head") else "linear"
        return kind, f"{short} {module.in_features}->{module.out_features}"
    if isinstance(module, torch.nn.Embedding):
        return "embedding", short
    cls = type(module).__name__
    if "Norm" in cls:
        return "norm", f"{short} ({cls})"
    if "Act" in cls or cls in ("SiLU", "GELU", "ReLU", "Tanh"):
        return "activation", f"{short} ({cls})"
    return "other", f"{short} ({cls})"


class _Capture:
    """Inputs and outputs of one batched decode step: row-wise leaf modules and attention calls."""

    def __init__(self, model, batch: int):
        self.model, self.batch = model, batch
        self.modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.attention: list[tuple] = []
        self.handles = []

    def __enter__(self):
        for name, module in self.model.named_modules():
            if next(module.children(), None) is None:
                self.handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def _hook(self, name):
        def hook(module, args, kwargs, output):
            # Only ops whose rows are the batch's rows and that take one tensor can run per row.
            if (
                len(args) == 1
                and not kwargs
                and isinstance(args[0], torch.Tensor)
                and isinstance(output, torch.Tensor)
                and args[0].shape[:1] == output.shape[:1] == (self.batch,)
            ):
                self.modules[name] = (args[0], output)

        return hook

    def record_attention(self, base, module, query, key, value, mask, **kwargs):
        out = base(module, query, key, value, mask, **kwargs)
        self.attention.append((base, module, query, key, value, kwargs, out[0]))
        return out

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def _module_findings(model, capture: _Capture, device) -> tuple[list[OpFinding], dict[str, RowForm], set[int]]:
    named = dict(model.named_modules())
    groups: dict[tuple[str, str], list[str]] = {}
    for name in capture.modules:
        groups.setdefault(_role(name, named[name]), []).append(name)
    findings, forms, varying_rows = [], {}, set()
    for (kind, label), names in groups.items():
        rows = capture.modules[names[0]][0].shape[0]
        varies_at, max_diff, allowed, bmm_exact = set(), 0.0, set(range(1, rows + 1)), True
        for name in names:
            module = named[name]
            x, y = capture.modules[name]
            alone = torch.cat([module(x[r : r + 1]) for r in range(rows)])
            differs = ~_equal_rows(y, alone)
            varying_rows |= set(differs.nonzero().flatten().tolist())
            if bool(differs.any()):
                varies_at.add(rows)
                allowed.discard(rows)
                max_diff = max(max_diff, max_abs_diff(y, alone))
            for m in range(2, rows):
                part = module(x[:m])
                if not bool(_equal_rows(part, alone[:m]).all()):
                    varies_at.add(m)
                    allowed.discard(m)
                    max_diff = max(max_diff, max_abs_diff(part, alone[:m]))
            if isinstance(module, torch.nn.Linear):
                bmm_exact &= bool(_equal_rows(apply_form(module, RowForm("bmm"), x), alone).all())
        finding = OpFinding(kind, label, len(names), not varies_at, max_diff, sorted(varies_at), "rows")
        if varies_at:
            finding.form, finding.batched_ms, finding.form_ms, form = _cheapest_form(
                named[names[0]], capture.modules[names[0]][0], tuple(sorted(allowed)), bmm_exact, device
            )
            forms.update({name: form for name in names})
        findings.append(finding)
    return findings, forms, varying_rows


def _cheapest_form(module, x, allowed: tuple[int, ...], bmm_exact: bool, device):
    """(label, batched ms, form ms, form): the fastest exact form, timed on the probe batch."""
    candidates = [RowForm("chunks", allowed or (1,))]
    if bmm_exact and isinstance(module, torch.nn.Linear):
        candidates.append(RowForm("bmm"))
    timed = [(_time_ms(lambda f=f: apply_form(module, f, x), device), f) for f in candidates]
    ms, form = min(timed, key=lambda t: t[0])
    return form.label, _time_ms(lambda: module(x), device), ms, form


def _padding_mask(pads: list[int], key: torch.Tensor) -> torch.Tensor:
    """The boolean mask (True: attend) a plain batched decode step passes over left padding."""
    return (torch.arange(key.shape[2], device=key.device) >= torch.tensor(pads, device=key.device).view(-1, 1))[
        :, None, None, :
    ]


def _attention_findings(capture: _Capture, pad_lens: list[int], implementation: str, device):
    """The plain attention call against each row alone, then every candidate exact form with its
    verdict and time; (findings, the fastest exact form, rows where plain attention differs)."""
    varies_at, max_diff, differing_rows, calls = set(), 0.0, set(), []
    for base, module, query, key, value, kwargs, out in capture.attention:
        reference = per_row(base, module, query, key, value, pad_lens, **kwargs)
        calls.append((base, module, query, key, value, kwargs, reference))
        rows, diff = rows_differing(out, reference)
        differing_rows |= set(rows)
        varies_at |= {pad_lens[r] for r in rows}
        max_diff = max(max_diff, diff)
    plain = OpFinding(
        "attention",
        f"{implementation} over left padding",
        len(capture.attention),
        not varies_at,
        max_diff,
        sorted(varies_at),
        "pad",
    )
    synthetic = synthetic_long_calls(calls[0][:6], pad_lens)
    checks = calls + synthetic
    candidates = [(PER_ROW, (True, 0.0, []))]
    if implementation == "sdpa":  # the grouped form calls SDPA itself: only an SDPA model's solo call
        for align in ALIGNMENTS:
            form = AttentionForm("aligned", align)
            candidates.append((form, aligned_verdict(checks, calls, pad_lens, form)))
    # Timed on the probe's own call and on one-block-long random keys: a form that only wins on
    # short keys (the probe prompt) would lose at serving lengths.
    timing = [calls[0], next(c for c in synthetic if c[3].shape[2] == KV_BLOCK)]

    def plain_ms(call) -> float:
        base, module, query, key, value, kwargs, _ = call
        mask = _padding_mask(pad_lens, key)
        return _time_ms(lambda: base(module, query, key, value, mask, **kwargs), device)

    def form_ms(call, form: AttentionForm) -> float:
        base, module, query, key, value, kwargs, _ = call
        return _time_ms(lambda: attend(base, module, query, key, value, pad_lens, form, **kwargs), device)

    timing_batched_ms = sum(plain_ms(call) for call in timing)
    findings, timed = [plain], []
    for form, (exact, diff, differing) in candidates:
        ms = sum(form_ms(call, form) for call in timing)
        finding = OpFinding("attention form", form.label, len(capture.attention), exact, diff, differing, "pad")
        finding.batched_ms, finding.form_ms = timing_batched_ms, ms
        findings.append(finding)
        if exact:
            timed.append((ms, form))
    best_ms, chosen = min(timed, key=lambda t: t[0])
    for finding, (form, _) in zip(findings[1:], candidates):
        finding.form = "chosen" if form == chosen else ("not exact: never used" if not finding.invariant else "")
    plain.form, plain.batched_ms, plain.form_ms = chosen.label, timing_batched_ms, best_ms  # on the timing calls
    return findings, chosen, differing_rows


def _assembled(model, prefills: list[RowPrefill]):
    return assemble_prefilled(model, [clone_layers(p.layers) for p in prefills])


def probe_model(model, prompt: torch.Tensor, rows: int = 16) -> ProbeReport:
    """Measure which parts of a decode step over `rows` padded rows (prefixes of `prompt`) are
    batch-invariant here."""
    started = time.perf_counter()
    device = prompt.device
    implementation = model.config._attn_implementation
    with torch.inference_mode():
        prefills, tokens, positions = probe_batch(model, prompt, rows)
        solo = []
        for prefill, token, position in zip(prefills, tokens, positions):
            cache, mask, _ = _assembled(model, [prefill])
            solo.append(decode_step(model, cache, token.view(1), position.view(1), mask)[0][0])
        solo = torch.stack(solo)

        cache, mask, pads = _assembled(model, prefills)
        capture = _Capture(model, rows)
        with capture, wrapped_attention(model, "probe", capture.record_attention):
            plain, _ = decode_step(model, cache, tokens, positions, mask)
        plain_differing = (~_equal_rows(plain, solo)).nonzero().flatten().tolist()

        findings, forms, varying_rows = _module_findings(model, capture, device)
        attention, attention_form, attention_rows = _attention_findings(capture, pads, implementation, device)
        findings += attention
        argmax_alone = torch.stack([plain[r : r + 1].argmax(-1)[0] for r in range(rows)])
        argmax_ok = torch.equal(plain.argmax(-1), argmax_alone)
        findings.append(OpFinding("argmax", "greedy token", 1, argmax_ok, 0.0, [] if argmax_ok else [rows], "rows"))
        plan = InvariancePlan(forms, attention_form)

        def fresh_cache():
            """The padded batch's cache assembled from the rows' prefills (a step grows it)."""
            return _assembled(model, prefills)[:2]

        def batched_step(cache_and_mask):
            """One batched step from `cache_and_mask`, in the mode entered around it."""
            cache, mask = cache_and_mask
            return decode_step(model, cache, tokens, positions, mask)[0]

        with batch_invariant(model, pads, plan):
            invariant = batched_step(fresh_cache())
        invariant_differing = (~_equal_rows(invariant, solo)).nonzero().flatten().tolist()
        findings.append(
            OpFinding(
                "decode step",
                "plain batched vs solo logits",
                1,
                not plain_differing,
                max_abs_diff(plain, solo),
                sorted({pads[r] for r in plain_differing}),
                "pad",
            )
        )
        findings.append(
            OpFinding(
                "decode step",
                "batch-invariant mode vs solo logits",
                1,
                not invariant_differing,
                max_abs_diff(invariant, solo),
                sorted({pads[r] for r in invariant_differing}),
                "pad",
                "the plan above",
            )
        )
        # The step alone: the padded cache (thousands of small copies at 64 rows) is assembled
        # before each timed call and the mode entered once, both outside the clock.
        plain_ms = _time_ms(batched_step, device, setup=fresh_cache)
        with batch_invariant(model, pads, plan):
            invariant_ms = _time_ms(batched_step, device, setup=fresh_cache)
    return ProbeReport(
        machine_facts(device),
        rows,
        pads,
        findings,
        plan,
        plain_differing,
        invariant_differing,
        sorted(varying_rows | attention_rows),
        plain_ms,
        invariant_ms,
        time.perf_counter() - started,
    )

"""Plain batched decoding, fixed-order kernels and the batch-invariant mode side by side, in one process.

For each batch size: the same requests (the first B of one seeded sample), prefilled alone once
and shared; free-running decode steps timed in each mode, the modes interleaved in every repeat
(median of --repeats, after a warm-up); sequence determinism of each mode against ITS reference;
and the teacher-forced logits of every row and step compared with that reference bitwise.

- plain: stock kernels; reference stock solo.
- start-aligned: stock kernels over the start-aligned cache the replay policies decode on, never
  verified (`none (start-aligned)` in `mgbench compare`); reference stock solo. Between plain and
  fixed-order, it tells the cost of the cache from the cost of the kernels.
- fixed-order: every forward in the fixed-order kernels (`--kernels fixed-order`, planned by its
  probe at each batch size, as a run at that `--batch-size` plans it); reference solo through the
  same kernels (one solo pass per distinct plan).
- fixed-order-per-row: the same plan with every chunks or tiles form run per row instead (what the
  mode ran before it had tiles); reference solo through its own kernels.
- batch-invariant: stock kernels, each row made to reproduce stock solo (`--batch-invariant`,
  planned by its probe); reference stock solo.

    .venv/bin/python examples/bench_batch_invariant.py --batch-sizes 8,32,64 --max-new-tokens 32
    .venv/bin/python examples/bench_batch_invariant.py --modes plain,fixed-order --dataset gsm8k
    # PLANTED: every linear sums in two rounded halves above 32 rows (a stand-in for the AMX Xeon's oneDNN)
    .venv/bin/python examples/bench_batch_invariant.py --plant-split-k-above 32 --batch-sizes 64 \
        --modes plain,fixed-order,fixed-order-per-row
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from mgbench.assets import datasets
from mgbench.assets.models import load_model
from mgbench.engines.inprocess.audit import eos_token_ids, pad_token_id
from mgbench.engines.inprocess.kernels.batch_invariant import decoding_mode
from mgbench.engines.inprocess.kernels.fixed_order import TILED_FORMS, FixedOrderPlan
from mgbench.engines.inprocess.kernels.fixed_order_probe import probe_fixed_order
from mgbench.engines.inprocess.kernels.invariance_probe import probe_model
from mgbench.engines.inprocess.kernels.sets import STOCK, Kernels
from mgbench.engines.inprocess.runners import row_prefills, run_solo, run_teacher_forced
from mgbench.engines.inprocess.verification.loop import run_free
from mgbench.engines.inprocess.verification.spec import PolicySpec
from mgbench.pipelines.probe import plan_line
from mgbench.runs.machine import cpu_name

MODES = ("plain", "start-aligned", "fixed-order", "fixed-order-per-row", "batch-invariant")
LABELS = {"start-aligned": "none (start-aligned)"}
REFERENCE = {"fixed-order": "fixed-order solo", "fixed-order-per-row": "fixed-order solo (per-row plan)"}


def plant_split_k(model, above: int) -> None:
    """PLANTED VARIANCE (tests/helpers.py's SplitKAboveLinear): every linear layer and the lm_head
    sums its inputs in two rounded halves above `above` rows."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests"))
    from helpers import SplitKAboveLinear

    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, SplitKAboveLinear(module, above))


def per_row_instead(plan: FixedOrderPlan) -> FixedOrderPlan:
    """The plan with every chunks or tiles form run per row (the fallback before tiles existed)."""
    forms = {name: "per-row" if form in TILED_FORMS else form for name, form in plan.forms.items()}
    return FixedOrderPlan(plan.chunk, forms, plan.attention, plan.fallbacks)


def interleaved(runs: dict, repeats: int) -> dict:
    """mode -> (median decode seconds, tokens of the first repeat); every mode once per repeat."""
    for run in runs.values():
        run()  # warm-up
    results = {mode: [] for mode in runs}
    for _ in range(repeats):
        for mode, run in runs.items():
            results[mode].append(run())
    return {mode: (statistics.median(r.decode_seconds for r in rs), rs[0].tokens) for mode, rs in results.items()}


def determinism(tokens: list[list[int]], solo: list[list[int]]) -> float:
    """Share of sequences equal to their solo decoding."""
    return sum(t == s for t, s in zip(tokens, solo)) / len(solo)


def modules_changed(plan) -> str:
    """The varying row-wise modules and their exact form, by module kind ("mlp.down_proj x30: per row")."""
    kinds: dict[tuple[str, str], int] = {}
    for name, form in plan.forms.items():
        kind = ".".join(part for part in name.split(".") if not part.isdigit()).removeprefix("model.layers.")
        kinds[(kind, form.label)] = kinds.get((kind, form.label), 0) + 1
    return "; ".join(f"{kind} x{count}: {label}" for (kind, label), count in sorted(kinds.items())) or "none"


@dataclass
class Decoded:
    decode_seconds: float
    tokens: list[list[int]]


def over_batches(decode, batches) -> Callable[[], Decoded]:
    """Decode every batch in turn: decode seconds summed, tokens in request order."""

    def run() -> Decoded:
        results = [decode(members) for members in batches]
        return Decoded(sum(r.decode_seconds for r in results), [t for r in results for t in r.tokens])

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dataset", default="math500")
    parser.add_argument("--limit", type=int, default=64, help="requests, decoded in batches of each size")
    parser.add_argument("--batch-sizes", default="8,32,64")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), help="plain is always run (the increments' base)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tile-rows", type=int, default=None, help="T of the fixed-order chunks and tiles")
    parser.add_argument("--plant-split-k-above", type=int, default=None, help="PLANTED: see plant_split_k")
    args = parser.parse_args()
    if args.tile_rows is not None and args.tile_rows < 1:
        parser.error(f"--tile-rows must be at least 1 (got {args.tile_rows})")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    modes = ["plain"] + [m for m in args.modes.split(",") if m in MODES and m != "plain"]
    console = Console(width=220)  # one line per batch size and mode, also in a log file
    lm = load_model(args.model, "bf16", args.device, "sdpa")
    model, n = lm.model, args.max_new_tokens
    if args.plant_split_k_above:
        plant_split_k(model, args.plant_split_k_above)
    config = datasets.load_config(args.dataset)
    requests = datasets.select_requests(config, datasets.read_records(config), args.limit, seed=0)
    prompts = [torch.tensor(datasets.encode(lm.tokenizer, config, r.text), device=lm.device) for r in requests]
    eos = eos_token_ids(model, lm.tokenizer)
    pad = pad_token_id(lm.tokenizer, eos)
    table = Table(
        title=f"decoding modes side by side: {args.model}, {args.dataset}, {len(prompts)} requests, {n} tokens, "
        f"{cpu_name() if str(lm.device) == 'cpu' else torch.cuda.get_device_name(lm.device)} "
        f"({torch.backends.cpu.get_cpu_capability()})"
        + (f", PLANTED split-K above {args.plant_split_k_above} rows" if args.plant_split_k_above else "")
    )
    for column in (
        "batch",
        "mode",
        "reference",
        "forms",
        "tok/s",
        "decode time vs plain",
        "determinism",
        "logit rows != reference",
    ):
        table.add_column(column)
    with torch.inference_mode():
        solos = [run_solo(model, p, n, eos) for p in prompts]
        prefills = row_prefills(model, prompts)
        references = {"plain": solos, "batch-invariant": solos}
        fixed_modes = [m for m in modes if m in ("start-aligned", "fixed-order", "fixed-order-per-row")]
        kernels_of, forms = {"plain": STOCK, "batch-invariant": STOCK}, {"plain": "stock"}
        fixed_prefills, known_plans = {}, {}

        def fixed_order_for(size: int) -> None:
            """Probe at this batch size (what `--kernels fixed-order --batch-size B` does); the solo
            reference of each plan through its own kernels, once per distinct plan."""
            probe = probe_fixed_order(model, prompts, rows=max(2, size), tile=args.tile_rows)
            plans = {"fixed-order": probe.plan, "fixed-order-per-row": per_row_instead(probe.plan)}
            for mode in ("fixed-order", "fixed-order-per-row"):
                if mode in modes or (mode == "fixed-order" and "start-aligned" in modes):
                    kernels_of[mode] = Kernels("fixed-order", plans[mode])
                    kernels, key = kernels_of[mode], repr(plans[mode])
                    if key not in known_plans:
                        with kernels.active(model):
                            known_plans[key] = [run_solo(model, p, n, eos, kernels) for p in prompts]
                    references[mode] = known_plans[key]
                    fixed_prefills[mode] = [s.row_prefill for s in references[mode]]  # prefills in its kernels
                    forms[mode] = plan_line(plans[mode])
            references["start-aligned"], forms["start-aligned"] = solos, "stock over the start-aligned cache"
            console.print(
                f"batch {size}: fixed-order probe ({probe.seconds:.0f} s): {forms['fixed-order']}; chunk vs steps "
                f"{probe.chunk_vs_steps}",
                style="dim",
            )

        for size in sizes:
            if fixed_modes:
                fixed_order_for(size)
            batches = [list(range(s, min(s + size, len(prompts)))) for s in range(0, len(prompts), size)]

            def take(values, members):
                return [values[i] for i in members]

            decoders = {"plain": lambda m: run_free(model, take(prompts, m), take(prefills, m), "alone", pad, n, eos)}
            plans_bi = {}
            for mode in ("fixed-order", "fixed-order-per-row"):
                if mode in modes:

                    def fixed_decode(m, kernels=kernels_of[mode], known=fixed_prefills[mode]):
                        with kernels.active(model):
                            return run_free(
                                model, take(prompts, m), take(known, m), "alone", pad, n, eos, kernels=kernels
                            )

                    decoders[mode] = fixed_decode
            if "start-aligned" in modes:

                def aligned_decode(m):
                    known = take(fixed_prefills["fixed-order"], m)
                    base = PolicySpec("none", "replay").build(
                        model, take(prompts, m), known, kernels=kernels_of["fixed-order"]
                    )
                    return run_free(model, take(prompts, m), known, "alone", pad, n, eos, base)

                decoders["start-aligned"], kernels_of["start-aligned"] = aligned_decode, None
            if "batch-invariant" in modes:
                plans_bi = {
                    tuple(m): probe_model(model, max(take(prompts, m), key=len)[:384], rows=max(2, len(m))).plan
                    for m in batches
                }

                def invariant_decode(m):
                    with decoding_mode(model, take(prompts, m), plans_bi[tuple(m)]):
                        return run_free(model, take(prompts, m), take(prefills, m), "alone", pad, n, eos)

                decoders["batch-invariant"] = invariant_decode
                first = plans_bi[tuple(batches[0])]
                forms["batch-invariant"] = f"{first.attention.label}; {modules_changed(first)}"
            timed = interleaved({mode: over_batches(d, batches) for mode, d in decoders.items()}, args.repeats)
            plain_s = timed["plain"][0]
            for mode, (seconds, tokens) in timed.items():
                kernels, differing, steps = kernels_of[mode], 0, 0
                for m in batches if kernels is not None else []:  # start-aligned: free-running only
                    with (
                        decoding_mode(
                            model, take(prompts, m), plans_bi.get(tuple(m)) if mode == "batch-invariant" else None
                        ),
                        kernels.active(model),
                    ):
                        forced = run_teacher_forced(
                            model, take(prompts, m), take(references[mode], m), "alone", pad, kernels=kernels
                        )
                    differing += sum(int((row["max_abs_logit_diff"] != 0).sum()) for row in forced.rows)
                    steps += sum(len(row["max_abs_logit_diff"]) for row in forced.rows)
                table.add_row(
                    str(size),
                    LABELS.get(mode, mode),
                    REFERENCE.get(mode, "stock solo"),
                    forms[mode],
                    f"{sum(len(t) - 1 for t in tokens) / seconds:.1f}",
                    f"{seconds / plain_s - 1:+.1%} ({seconds:.2f} s vs {plain_s:.2f} s)",
                    f"{determinism(tokens, [s.tokens.tolist() for s in references[mode]]):.2%}",
                    f"{differing}/{steps}" if steps else "-",
                )
                console.print(f"batch {size} {mode}: {seconds:.2f} s ({seconds / plain_s - 1:+.1%})", style="dim")
    console.print(table)


if __name__ == "__main__":
    main()

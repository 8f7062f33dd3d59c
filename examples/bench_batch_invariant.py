"""Plain batched vs batch-invariant decoding at serving batch sizes, side by side in one process.

For each batch size: the same requests (the first B of one seeded sample), prefilled alone once
and shared; free-running decode steps timed plain and in the batch-invariant mode (median of
--repeats, after a warm-up); sequence determinism of both against solo decoding; and, in the mode,
the teacher-forced logits of every row and step compared with solo bitwise. The plan comes from
the probe at that batch size (what `--batch-invariant` runs): its attention form and the
row-wise modules it runs in an exact form (those that varied with the row count) are printed.

    .venv/bin/python examples/bench_batch_invariant.py --batch-sizes 8,32,64 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import statistics

import torch
from rich.console import Console
from rich.table import Table

from mgbench.assets import datasets
from mgbench.assets.models import load_model
from mgbench.engines.inprocess.audit import eos_token_ids, pad_token_id
from mgbench.engines.inprocess.batch_invariant import decoding_mode
from mgbench.engines.inprocess.invariance_probe import probe_model
from mgbench.engines.inprocess.runners import row_prefills, run_free, run_solo, run_teacher_forced
from mgbench.runs.machine import cpu_name


def median_decode_seconds(run, repeats: int) -> tuple[float, list[list[int]]]:
    run()  # warm-up
    results = [run() for _ in range(repeats)]
    return statistics.median(r.decode_seconds for r in results), results[0].tokens


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dataset", default="math500")
    parser.add_argument("--batch-sizes", default="8,32,64")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    console = Console(width=200)  # one line per batch size, also in a log file
    lm = load_model(args.model, "bf16", args.device, "sdpa")
    model, n = lm.model, args.max_new_tokens
    config = datasets.load_config(args.dataset)
    requests = datasets.select_requests(config, datasets.read_records(config), max(sizes), seed=0)
    prompts = [torch.tensor(datasets.encode(lm.tokenizer, config, r.text), device=lm.device) for r in requests]
    eos = eos_token_ids(model, lm.tokenizer)
    pad = pad_token_id(lm.tokenizer, eos)
    table = Table(title=f"plain vs batch-invariant decoding: {args.model}, {args.dataset}, {n} tokens, {cpu_name()}")
    for column in (
        "batch",
        "attention form",
        "row-wise modules changed",
        "plain tok/s",
        "invariant tok/s",
        "decode time",
        "plain determinism",
        "invariant determinism",
        "logit rows != solo",
    ):
        table.add_column(column)
    with torch.inference_mode():
        solos = [run_solo(model, p, n, eos) for p in prompts]
        prefills = row_prefills(model, prompts)
        for size in sizes:
            batch, batch_prefills, batch_solos = prompts[:size], prefills[:size], solos[:size]
            longest = max(batch, key=len)[:384]
            plan = probe_model(model, longest, rows=max(2, size)).plan
            plain_s, plain_tokens = median_decode_seconds(
                lambda: run_free(model, batch, batch_prefills, "alone", pad, n, eos), args.repeats
            )

            def invariant():
                with decoding_mode(model, batch, plan):
                    return run_free(model, batch, batch_prefills, "alone", pad, n, eos)

            invariant_s, invariant_tokens = median_decode_seconds(invariant, args.repeats)
            with decoding_mode(model, batch, plan):
                forced = run_teacher_forced(model, batch, batch_solos, "alone", pad)
            differing = sum(int((row["max_abs_logit_diff"] != 0).sum()) for row in forced.rows)
            steps = sum(len(row["max_abs_logit_diff"]) for row in forced.rows)
            solo_tokens = [s.tokens.tolist() for s in batch_solos]
            generated = sum(len(t) - 1 for t in plain_tokens)  # decode steps after the prefill's token
            table.add_row(
                str(size),
                plan.attention.label,
                modules_changed(plan),
                f"{generated / plain_s:.1f}",
                f"{sum(len(t) - 1 for t in invariant_tokens) / invariant_s:.1f}",
                f"{invariant_s / plain_s - 1:+.1%} ({plain_s:.2f} s vs {invariant_s:.2f} s)",
                f"{determinism(plain_tokens, solo_tokens):.2%}",
                f"{determinism(invariant_tokens, solo_tokens):.2%}",
                f"{differing}/{steps}",
            )
            console.print(f"batch {size}: done", style="dim")
    console.print(table)


if __name__ == "__main__":
    main()

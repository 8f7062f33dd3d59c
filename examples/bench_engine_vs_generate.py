"""Batched tokens/s of the mgbench engine against HF `generate` at the same batch size.

Both decode the same left-padded batch greedily (one padded prefill, then decode steps) on the
default model; the script also checks that they emit the same tokens. Prints a table.

    .venv/bin/python examples/bench_engine_vs_generate.py --batch-size 8 --max-new-tokens 32 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from mgbench.assets import datasets
from mgbench.assets.models import load_model
from mgbench.engines.inprocess.audit import eos_token_ids, pad_token_id
from mgbench.engines.inprocess.decode import left_padded_batch
from mgbench.engines.inprocess.stopwatch import synchronize
from mgbench.engines.inprocess.verification.loop import run_free


def timed(fn, device: str):
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dataset", default="math500")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    lm = load_model(args.model, "bf16", args.device, "sdpa")
    config = datasets.load_config(args.dataset)
    requests = datasets.select_requests(config, datasets.read_records(config), args.batch_size, seed=0)
    prompts = [torch.tensor(datasets.encode(lm.tokenizer, config, r.text), device=lm.device) for r in requests]
    eos = eos_token_ids(lm.model, lm.tokenizer)
    pad = pad_token_id(lm.tokenizer, eos)
    ids, mask, _ = left_padded_batch(prompts, pad)

    def engine():
        result = run_free(lm.model, prompts, None, "batched", pad, args.max_new_tokens, eos)
        return result.tokens

    def generate():
        out = lm.model.generate(
            ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad
        )
        rows = []
        for row in out[:, ids.shape[1] :].tolist():
            # generate pads finished rows; keep tokens up to and including the first EOS, as the engine does
            end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            rows.append(row[:end])
        return rows

    times: dict[str, list[float]] = {"mgbench engine": [], "HF generate": []}
    outputs = {}
    with torch.inference_mode():
        engine(), generate()  # warm-up
        for _ in range(args.repeats):
            for name, fn in (("mgbench engine", engine), ("HF generate", generate)):
                outputs[name], seconds = timed(fn, lm.device)
                times[name].append(seconds)

    tokens = sum(len(t) for t in outputs["mgbench engine"])
    table = Table(
        title=f"{args.model}, batch size {args.batch_size}, {args.max_new_tokens} new tokens, "
        f"{lm.device}, median of {args.repeats}"
    )
    for column in ("decoder", "median s", "min s", "max s", "tokens", "tokens/s"):
        table.add_column(column, justify="right")
    for name, values in times.items():
        median = statistics.median(values)
        table.add_row(
            name, f"{median:.2f}", f"{min(values):.2f}", f"{max(values):.2f}", str(tokens), f"{tokens / median:.1f}"
        )
    console = Console()
    console.print(table)
    speedup = statistics.median(times["HF generate"]) / statistics.median(times["mgbench engine"])
    same = outputs["mgbench engine"] == outputs["HF generate"]
    console.print(f"engine / generate speed: {speedup:.2f}x; identical tokens: {same}")


if __name__ == "__main__":
    main()

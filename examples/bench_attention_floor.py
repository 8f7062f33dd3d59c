"""What exact decode-step attention costs at least, against what plain batched decoding pays.

An exact form has to repeat each row's solo call: one query per head (SDPA with `enable_gqa`,
no mask). Plain batched decoding makes a different call: transformers packs a key head's grouped
query heads into one small query block (`pack_gqa`) under a padding mask. This script times, on
the default model's first attention layer and random keys of equal length per row (so no form
pays for padding):

- plain: the batched call plain decoding makes (packed query heads, with a mask);
- per row: one solo call per row (the always-exact fallback);
- one call: every row's solo arithmetic in a single unmasked call (rows of equal length): the
  floor of any exact form, without Python overhead per row or padded keys;

and checks bitwise which of them equal per row. The extra time of the floor over plain, times
the model's layers, is what the batch-invariant mode must add to a decode step at that batch and
key length whatever its grouping.

    .venv/bin/python examples/bench_attention_floor.py --batch-sizes 8,32,64 --keys 128,256,512
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from mgbench.assets.models import load_model
from mgbench.engines.inprocess.kernels.attention_forms import per_row, sdpa_call
from mgbench.engines.inprocess.kernels.batch_invariant import base_attention
from mgbench.engines.inprocess.stopwatch import synchronize
from mgbench.runs.machine import cpu_name


def median_ms(fn, device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch-sizes", default="8,32,64")
    parser.add_argument("--keys", default="128,256,512")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    lm = load_model(args.model, "bf16", args.device, "sdpa")
    module = lm.model.model.layers[0].self_attn
    config, layers = lm.model.config, lm.model.config.num_hidden_layers
    base, kwargs = base_attention("sdpa", module), {"scaling": module.scaling}
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, module.head_dim
    table = Table(
        title=f"decode-step attention, one layer: {args.model} ({heads} query / {kv_heads} key heads), "
        f"{cpu_name() if torch.device(lm.device).type == 'cpu' else torch.cuda.get_device_name(lm.device)}"
    )
    numbers = ("batch", "keys", "plain ms", "per row ms", "one call ms", "floor / plain", "floor - plain, x layers")
    for column in numbers:
        table.add_column(column, justify="right")
    table.add_column("exact (= per row)")
    generator = torch.Generator().manual_seed(0)
    for size in [int(b) for b in args.batch_sizes.split(",")]:
        for keys in [int(k) for k in args.keys.split(",")]:
            query, key, value = (
                torch.randn(shape, generator=generator).bfloat16().to(lm.device)
                for shape in ((size, heads, 1, dim), (size, kv_heads, keys, dim), (size, kv_heads, keys, dim))
            )
            mask = torch.ones((size, 1, 1, keys), dtype=torch.bool, device=lm.device)
            pads = [0] * size

            def plain():
                return base(module, query, key, value, mask, **kwargs)[0]

            def rows():
                return per_row(base, module, query, key, value, pads, **kwargs)

            def one_call():
                return sdpa_call(module, query, key, value, None, kwargs["scaling"])

            with torch.inference_mode():
                reference = rows()
                candidates = (("plain", plain), ("one call", one_call))
                exact = [name for name, fn in candidates if torch.equal(fn(), reference)]
                plain_ms, rows_ms, floor_ms = (median_ms(fn, lm.device, args.repeats) for fn in (plain, rows, one_call))
            table.add_row(
                str(size),
                str(keys),
                f"{plain_ms:.2f}",
                f"{rows_ms:.2f}",
                f"{floor_ms:.2f}",
                f"{floor_ms / plain_ms:.1f}x",
                f"{(floor_ms - plain_ms) * layers:.0f} ms",
                ", ".join(exact) or "neither",
            )
    Console(width=200).print(table)


if __name__ == "__main__":
    main()

"""Peak memory of `mgbench flips` against max_new_tokens and vocabulary size.

Memory of one group of requests should not grow with the tokens generated: a run that kept
every step's logits (vocabulary x steps x rows floats) would. For each vocabulary size the script
builds a tiny random-init Llama (hidden 64, 2 layers, 4 heads, 2 KV heads) with the default
model's tokenizer, saved in a temporary folder; its lm_head rows of the end-of-sequence ids are
zero, so greedy decoding never stops early and every request generates max_new_tokens (the
table shows the tokens really generated, from the run's sequences.parquet). Each point is one
`mgbench flips` in a subprocess of its own: the peak RSS is that child's (os.wait4), the wall
time its whole run (load, solo, batched, analysis, writing); the manifest's `peak_memory` is shown
when the run records one (with --device cuda it is the figure the growth column uses). A
vocabulary smaller than the tokenizer's 49,152 ids (a quick run) cuts the tokenizer to its first
ids: its byte symbols and special tokens come first, so every prompt still encodes.

The default sweep (vocabularies 49,152 and 128,256; 128 and 512 tokens; 8 gsm8k requests at
batch 8) takes several minutes on 2 CPU cores; one 2048-token point at 49,152 about 15 minutes.

    .venv/bin/python examples/bench_memory.py
    .venv/bin/python examples/bench_memory.py --vocab 49152,128256 --max-new-tokens 256,512,1024,2048
    .venv/bin/python examples/bench_memory.py --device cuda --batch-size 64 --limit 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Run from a checkout: this script, its mgbench imports and the mgbench commands it starts
# (`python -m mgbench`, in the checkout's root) all use the checkout's code.
REPO = Path(__file__).resolve().parents[1]
CHECKOUT = REPO if (REPO / "mgbench" / "__init__.py").is_file() else None
if CHECKOUT is not None and str(CHECKOUT) not in sys.path:
    sys.path.insert(0, str(CHECKOUT))


EOS_ID = 2  # the default model tokenizer's <|im_end|> (its eos and pad token)


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 256,2048") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: .venv/bin/python examples/bench_memory.py --vocab 49152,128256 "
        "--max-new-tokens 256,512,1024,2048 --limit 8 --batch-size 8",
    )
    parser.add_argument(
        "--vocab", type=int_list, default=[49152, 128256], help="vocabulary sizes (default 49152,128256)"
    )
    parser.add_argument(
        "--max-new-tokens", type=int_list, default=[128, 512], help="tokens per request (default 128,512)"
    )
    parser.add_argument("--limit", type=int, default=8, help="requests (default 8)")
    parser.add_argument("--batch-size", type=int, default=8, help="batch size (default 8)")
    parser.add_argument("--dataset", default="gsm8k", help="dataset (default gsm8k)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take (default 1800)")
    parser.add_argument("--keep", type=Path, help="keep the model folders and run directories under this folder")
    args = parser.parse_args(argv)
    if args.limit < 1 or args.batch_size < 1:
        parser.error("--limit and --batch-size must be positive")
    return args


def machine_line(device: str) -> str:
    import torch

    from mgbench import __version__
    from mgbench.runs.machine import cpu_name
    from mgbench.runs.rundir import code_revision

    parts = [
        f"mgbench {__version__} (git {code_revision()})",
        f"cpu: {cpu_name()} ({os.cpu_count()} cores)",
        f"torch {torch.__version__}",
        f"python {platform.python_version()}",
    ]
    if device.startswith("cuda") and torch.cuda.is_available():
        parts.append(f"gpu: {torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})")
    return "; ".join(parts)


def build_model(folder: Path, vocab: int, max_positions: int) -> None:
    """A random-init bf16 Llama with the default model's tokenizer, that never emits EOS."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from mgbench.assets import models

    tokenizer, _ = models.load_tokenizer(models.DEFAULT_MODEL)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=EOS_ID,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        # Logit 0 for every EOS id, while the largest of the other random logits is positive.
        for eos in {EOS_ID, tokenizer.eos_token_id}:
            model.lm_head.weight[eos].zero_()
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    hf_logging.disable_progress_bar()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if vocab < len(tokenizer):
        from mgbench.assets.trimmed_tokenizer import trim_tokenizer

        try:
            trim_tokenizer(folder / "tokenizer.json", vocab)
        except ValueError as exc:
            raise SystemExit(f"--vocab: {exc}") from None


@dataclass
class Point:
    vocab: int
    max_new_tokens: int
    generated: int
    shortest: int
    requests: int
    rss_bytes: int
    manifest_peak: dict | None
    wall_s: float


def run_child(command: list[str], timeout: float, log_dir: Path) -> tuple[int, int, float, str]:
    """(exit code, peak RSS bytes of exactly this child, wall seconds, stderr tail)."""
    stdout_path, stderr_path = log_dir / "stdout.txt", log_dir / "stderr.txt"
    start = time.perf_counter()
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, cwd=CHECKOUT)
    pid = process.pid
    deadline = start + timeout
    try:
        while True:
            waited, status, usage = os.wait4(pid, os.WNOHANG)
            if waited == pid:
                break
            if time.perf_counter() > deadline:
                os.kill(pid, signal.SIGKILL)
                waited, status, usage = os.wait4(pid, 0)
                process.returncode = os.waitstatus_to_exitcode(status)
                wall = time.perf_counter() - start
                return 124, usage.ru_maxrss * 1024, wall, f"timed out after {timeout:.0f} s\n" + tail(stderr_path)
            time.sleep(0.05)
    except KeyboardInterrupt:  # Ctrl-C: the child goes too
        os.kill(pid, signal.SIGKILL)
        os.wait4(pid, 0)
        process.returncode = -signal.SIGKILL
        raise
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, by wait4
    return process.returncode, usage.ru_maxrss * 1024, wall, tail(stderr_path)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def generated_tokens(run: Path) -> tuple[int, int, int]:
    """(solo tokens generated in all, fewest of one request, requests) from the run's sequences table."""
    import pandas as pd

    sequences = pd.read_parquet(run / "sequences.parquet", columns=["request_id", "solo_ids"])
    lengths = sequences.drop_duplicates("request_id")["solo_ids"].map(len)
    return int(lengths.sum()), int(lengths.min()), len(lengths)


def manifest_peak(run: Path) -> dict | None:
    try:
        peak = json.loads((run / "manifest.json").read_text()).get("peak_memory")
    except (OSError, ValueError):
        return None
    return peak if isinstance(peak, dict) and peak.get("bytes") is not None else None


def measure(args, vocab: int, max_new_tokens: int, model_dir: Path, work: Path) -> Point | None:
    run = work / f"run-v{vocab}-n{max_new_tokens}"
    logs = work / f"log-v{vocab}-n{max_new_tokens}"
    logs.mkdir(parents=True)
    command = [
        sys.executable, "-m", "mgbench", "flips",
        "--model", str(model_dir),
        "--dataset", args.dataset,
        "--limit", str(args.limit),
        "--batch-size", str(args.batch_size),
        "--max-new-tokens", str(max_new_tokens),
        "--device", args.device,
        "--out", str(run),
    ]  # fmt: skip
    print(f"  $ {shlex.join(command)}", flush=True)
    code, rss, wall, stderr_tail = run_child(command, args.timeout, logs)
    if code != 0:
        print(f"mgbench flips failed (exit {code}) at vocab {vocab}, max_new_tokens {max_new_tokens}:", file=sys.stderr)
        print(stderr_tail, file=sys.stderr)
        return None
    generated, shortest, requests = generated_tokens(run)
    print(f"    {generated:,} tokens, peak RSS {mb(rss)} MB, {wall:.1f} s", flush=True)
    return Point(vocab, max_new_tokens, generated, shortest, requests, rss, manifest_peak(run), wall)


def mb(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def peak_of(point: Point, device: str) -> float | None:
    """The figure the growth column compares: the child's RSS on CPU, the manifest's on CUDA."""
    if device.startswith("cuda"):
        return point.manifest_peak["bytes"] if point.manifest_peak else None
    return point.rss_bytes


def print_table(points: list[Point], device: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"peak memory of mgbench flips ({device})")
    for column in (
        "vocab",
        "max_new_tokens",
        "tokens generated (solo, all requests)",
        "peak RSS MB",
        "manifest peak MB",
        "growth vs smallest N",
        "wall s",
    ):
        table.add_column(column, justify="right")
    base: dict[int, float | None] = {}
    for point in sorted(points, key=lambda p: (p.vocab, p.max_new_tokens)):
        peak = peak_of(point, device)
        first = base.setdefault(point.vocab, peak)
        growth = "-" if peak is None or not first else f"{100 * (peak / first - 1):+.1f}%"
        generated = f"{point.generated:,} ({point.requests} x >= {point.shortest})"
        recorded = point.manifest_peak
        recorded_text = f"{mb(recorded['bytes'])} ({recorded.get('kind', '?')})" if recorded else "not recorded"
        table.add_row(
            f"{point.vocab:,}",
            str(point.max_new_tokens),
            generated,
            mb(point.rss_bytes),
            recorded_text,
            growth,
            f"{point.wall_s:.1f}",
        )
    Console(width=160).print(table)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"--device {args.device}: CUDA is not available on this machine", file=sys.stderr)
            return 2
    print(machine_line(args.device))
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    keep = None if args.keep is None else args.keep.resolve()
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    failed = False
    with tempfile.TemporaryDirectory(prefix="mgbench-memory-") as temporary:
        work = Path(tempfile.mkdtemp(prefix="mgbench-memory-", dir=keep)) if keep is not None else Path(temporary)
        points = []
        for vocab in args.vocab:
            model_dir = work / f"tiny-llama-v{vocab}"
            build_model(model_dir, vocab, max(4096, 2 * max(args.max_new_tokens) + 1024))
            print(f"vocab {vocab}: model in {model_dir}", flush=True)
            for max_new_tokens in args.max_new_tokens:
                point = measure(args, vocab, max_new_tokens, model_dir, work)
                if point is None:
                    failed = True
                    break
                points.append(point)
            if failed:
                break
        if points:
            print_table(points, args.device)
        for p in points:
            if p.shortest < p.max_new_tokens:
                print(f"note: vocab {p.vocab}, N {p.max_new_tokens}: a request stopped after {p.shortest} tokens")
        print(f"total {time.perf_counter() - start:.0f} s" + (f"; kept: {work}" if keep is not None else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Option types shared by the commands (one declaration, the same help everywhere), and the
default run directory."""

from __future__ import annotations

import re
import tempfile
from datetime import datetime
from pathlib import Path

import typer

from mgbench.assets.models import DEFAULT_MODEL
from mgbench.errors import UserError


def slug(text: str) -> str:
    """A folder-name-safe form of a model or dataset name (a path: its last part)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(text).name if Path(text).exists() else text)


def default_out(command: str, model: str, dataset: str) -> Path:
    """reports/COMMAND-MODEL-DATASET-TIME/: where a run goes without --out."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("reports") / f"{command}-{slug(model)}-{slug(dataset)}-{stamp}"


def check_output_file(path: Path | None, option: str) -> None:
    """An output file (--junit) refused before any decoding when it cannot be written there; writes
    nothing (its missing folders are made when it is written)."""
    if path is None:
        return
    if path.is_dir():
        raise UserError(f"{option} {path} is a directory; give a file name")
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"{option} {path}: {folder} is a file; choose a writable directory")
    try:
        tempfile.TemporaryFile(dir=folder).close()  # a real write, unnamed: nothing is left behind
    except OSError as exc:
        raise UserError(
            f"{option} {path}: cannot write in {folder} ({exc.strerror}); choose a writable directory"
        ) from exc


ModelOpt = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Alias (`mgbench models`), local folder or hub id.")
DatasetOpt = typer.Option(
    "math500", "--dataset", "-d", help="Config name (`mgbench datasets`) or path to a .toml config."
)
LimitOpt = typer.Option(None, "--limit", "-n", help="Decode a seeded sample of N requests (default: all).")
SeedOpt = typer.Option(0, "--seed", help="Seed of the --limit sample.")
BatchSizeOpt = typer.Option(8, "--batch-size", "-b", help="Batch size of the batched runs.")
BatchSizesOpt = typer.Option(
    None, "--batch-sizes", help="Sweep several batch sizes, e.g. 1,4,16 (overrides --batch-size)."
)
MaxNewOpt = typer.Option(None, "--max-new-tokens", help="Tokens to generate per request (default: the dataset's).")
PrefillOpt = typer.Option(
    "alone",
    "--prefill",
    help=(
        "`alone`: prefill each request at batch size 1, batch the decode steps (as serving engines do); "
        "`batched`: one left-padded prefill."
    ),
)
SortOpt = typer.Option(
    False,
    "--sort-by-length/--no-sort-by-length",
    help="Batch requests longest-first to shrink padding (default: arrival order).",
)
DtypeOpt = typer.Option("bf16", "--dtype", help="bf16, fp16 or fp32.")
DeviceOpt = typer.Option("auto", "--device", help="auto (cuda if available), cpu, cuda, cuda:N.")
AttnOpt = typer.Option("sdpa", "--attn", help="Attention implementation: sdpa or eager.")
OutOpt = typer.Option(None, "--out", "-o", help="Run directory (default: reports/COMMAND-MODEL-DATASET-TIME/).")
DebugOpt = typer.Option(False, "--debug", help="Show the traceback of an error.")
ShardOpt = typer.Option(
    None,
    "--shard",
    help="Decode shard I of N (I/N, from 0) into a shared --out; under torchrun RANK/WORLD_SIZE set it.",
)
ResumeOpt = typer.Option(
    False, "--resume", help="Continue an interrupted run in --out from its last finished group of requests."
)
TpPlanOpt = typer.Option(
    None, "--tp-plan", help="`auto`: split the model over the torchrun processes (transformers tensor parallelism)."
)
JsonOpt = typer.Option(False, "--json", help="Print the summary as JSON on stdout (nothing else goes to stdout).")
BaselineOpt = typer.Option(
    None,
    "--baseline",
    help=(
        "A recorded run of the same audit: exit 1 when flips or divergences rose beyond chance (paired "
        "one-sided exact test)."
    ),
)
AlphaOpt = typer.Option(0.01, "--alpha", help="Significance level of the --baseline test.")
BatchInvariantOpt = typer.Option(
    False,
    "--batch-invariant",
    help=(
        "Stock kernels, each batched row made to reproduce STOCK SOLO decoding bitwise (the ops that vary "
        "on this machine, measured by `mgbench probe`, run per row or in exact forms; about solo cost)."
    ),
)
KernelsOpt = typer.Option(
    "stock",
    "--kernels",
    help=(
        "stock: the model's own kernels. fixed-order: every forward, the solo reference's too, runs kernels "
        "whose per-row reduction order is fixed by construction (probed first); determinism is then measured "
        "against solo decoding through the SAME kernels, as vLLM's VLLM_BATCH_INVARIANT=1 and SGLang's "
        "deterministic mode define it."
    ),
)
TileRowsOpt = typer.Option(
    None,
    "--tile-rows",
    help=(
        "Fixed-order kernels (--kernels fixed-order; compare's fixed-order and replay configurations): T, the "
        "rows per call of the 'chunks' (at most T rows) and 'tiles' (exactly T rows, zero-padded) forms, "
        "where a GEMM's kernel depends on the row count. Default: the cheapest exact one of 8, 16, 32, 64 "
        "the probe measures."
    ),
)

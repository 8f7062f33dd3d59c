"""Run options, validated once at the edge (the CLI builds them; everything after trusts them)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from mgbench.assets.models import ATTN_IMPLEMENTATIONS, DEFAULT_MODEL, DTYPES
from mgbench.errors import UserError
from mgbench.runs.machine import check_kernel_environment
from mgbench.runs.schema import AXES, ENDPOINT_AXES, IN_PROCESS_AXES, PREFILL_AXES

# How prompts are prefilled: each alone at batch size 1 (as serving engines do), or one left-padded batch.
PREFILL_MODES = ("alone", "batched")
# The kernels every forward of an in-process run uses: the model's own (`stock`), or kernels whose
# per-row reduction order is fixed by construction (`fixed-order`; the reference is then solo
# decoding through them). Listed here, below the engines, so options validate without torch.
KERNEL_SETS = ("stock", "fixed-order")
# --device: checked by its form here (torch answers anything else with a traceback); whether CUDA is
# there is checked when the model loads.
DEVICE_FORM = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def reference_of(kernels: str) -> str:
    """What the determinism figures of a run with these kernels are measured against."""
    return "fixed-order solo" if kernels == "fixed-order" else "stock solo"


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """'1,4,16' -> (1, 4, 16); a clear error for anything else."""
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UserError(f"--batch-sizes {text!r}: expected comma-separated integers such as 1,4,16") from None
    if not sizes:
        raise UserError("--batch-sizes is empty: give at least one batch size")
    return sizes


def parse_axes(text: str) -> tuple[str, ...]:
    """'batch,prefix-cache' -> ('batch', 'prefix-cache'); a clear error for anything else."""
    axes = tuple(part.strip() for part in text.split(",") if part.strip())
    if not axes:
        raise UserError(f"--axes is empty: choose from {', '.join(AXES)}")
    return axes


# Why an axis runs on one engine only.
AXIS_ELSEWHERE = {
    "chunked-prefill": "--axes chunked-prefill runs in process: a server schedules its own prefill (its "
    "chunked-prefill setting is the one you started it with; audit that server with --axes batch,prefix-cache,repeat)",
    "repeat": "--axes repeat runs over --endpoint: in process the same batch repeats bitwise (other neighbours: "
    "`mgbench verify --needle`)",
}


def check_axes(axes: tuple[str, ...], over_endpoint: bool) -> None:
    """The axes an engine can vary: an endpoint's scheduler is a black box, the in-process engine has none."""
    allowed = ENDPOINT_AXES if over_endpoint else IN_PROCESS_AXES
    for axis in axes:
        if axis in AXIS_ELSEWHERE and axis not in allowed:
            raise UserError(AXIS_ELSEWHERE[axis])


def check_tile_rows(tile_rows: int | None) -> None:
    if tile_rows is not None and not 1 <= tile_rows <= 4096:
        raise UserError(f"--tile-rows must be between 1 and 4096 (got {tile_rows})")


@dataclass(frozen=True)
class RunOptions:
    model: str = DEFAULT_MODEL
    dataset: str = "math500"
    limit: int | None = None
    seed: int = 0
    batch_sizes: tuple[int, ...] = (8,)
    max_new_tokens: int | None = None  # None: the dataset config's default
    prefill: str = "alone"
    sort_by_length: bool = False
    dtype: str = "bf16"
    device: str = "auto"
    attn: str = "sdpa"
    tp_plan: str | None = None  # transformers tensor parallelism ("auto") under torchrun
    batch_invariant: bool = False  # stock kernels made to reproduce stock solo decoding in a batch (probed)
    kernels: str = "stock"  # or "fixed-order": every forward, the solo reference's too, in fixed-order kernels
    tile_rows: int | None = None  # T of the fixed-order chunks and tiles forms (None: the probe's cheapest)
    axes: tuple[str, ...] = ("batch",)  # what the audit varies (AXES)
    prefix_tokens: int | None = None  # prefix-cache axis: tokens cached (None: the prompts' shared prefix)
    chunk_tokens: int = 16  # chunked-prefill axis: tokens per prefill chunk

    @property
    def prefill_axes(self) -> tuple[str, ...]:
        """The axes decoded alone from a prefill cut into pieces (in process), in the order given."""
        return tuple(a for a in self.axes if a in PREFILL_AXES)

    @property
    def passes_per_request(self) -> int:
        """Perturbed decodings of each request (batches it sits in): one per batch size on the batch
        axis, two loads on the repeat axis, one on each other axis."""
        others = [a for a in self.axes if a != "batch"]
        return len(self.batch_sizes) * ("batch" in self.axes) + sum(2 if a == "repeat" else 1 for a in others)

    def __post_init__(self) -> None:
        if any(b < 1 for b in self.batch_sizes):
            raise UserError(f"batch size must be at least 1 (got {', '.join(map(str, self.batch_sizes))})")
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise UserError(f"--batch-sizes repeats a value: {', '.join(map(str, self.batch_sizes))}")
        if self.limit is not None and self.limit < 1:
            raise UserError(f"--limit must be at least 1 (got {self.limit})")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1 (got {self.max_new_tokens})")
        if not DEVICE_FORM.fullmatch(self.device):
            raise UserError(f"--device {self.device!r}: use auto, cpu, cuda or cuda:N")
        if self.prefill not in PREFILL_MODES:
            raise UserError(f"--prefill {self.prefill!r}: choose one of {', '.join(PREFILL_MODES)}")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.attn not in ATTN_IMPLEMENTATIONS:
            raise UserError(f"--attn {self.attn!r}: choose one of {', '.join(ATTN_IMPLEMENTATIONS)}")
        if self.batch_invariant and self.prefill != "alone":
            raise UserError(
                "--batch-invariant prefills each request alone (the padded prefill is the batch "
                "dependence it removes): drop --prefill batched"
            )
        if self.kernels not in KERNEL_SETS:
            raise UserError(f"--kernels {self.kernels!r}: choose one of {', '.join(KERNEL_SETS)}")
        if self.kernels == "fixed-order" and self.batch_invariant:
            raise UserError(
                "--batch-invariant reproduces stock solo decoding and --kernels fixed-order changes the "
                "reference to solo through fixed-order kernels: choose one"
            )
        if self.kernels == "fixed-order" and self.prefill != "alone":
            raise UserError("--kernels fixed-order prefills each request alone: drop --prefill batched")
        if self.tile_rows is not None and self.kernels != "fixed-order":
            raise UserError("--tile-rows sets the fixed-order kernels' tile: add --kernels fixed-order")
        check_tile_rows(self.tile_rows)
        unknown = [a for a in self.axes if a not in AXES]
        if unknown or not self.axes:
            raise UserError(f"--axes {','.join(self.axes)!r}: choose from {', '.join(AXES)}")
        if len(set(self.axes)) != len(self.axes):
            raise UserError(f"--axes repeats an axis: {','.join(self.axes)}")
        if self.chunk_tokens < 1:
            raise UserError(f"--chunk-tokens must be at least 1 (got {self.chunk_tokens})")
        if self.prefix_tokens is not None and self.prefix_tokens < 1:
            raise UserError(f"--prefix-tokens must be at least 1 (got {self.prefix_tokens})")
        if self.kernels == "fixed-order" and self.tp_plan is not None:
            raise UserError("--kernels fixed-order runs on one device: drop --tp-plan")
        if self.tp_plan not in (None, "auto"):
            raise UserError(f"--tp-plan {self.tp_plan!r}: the only plan is auto (the model's own tensor-parallel plan)")
        if not self.device.startswith("cuda"):
            check_kernel_environment()  # before any torch kernel runs: a wrong pair crashes or lies

"""Where this process stands in a multi-process run: its shard, its device, whether it writes."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mgbench.errors import UserError
from mgbench.runs.shards import resolve_shard, torchrun_rank


def rank_device(device: str) -> str:
    """Under torchrun each process takes the GPU of its LOCAL_RANK.

    Where this process runs, not what the run is: applied when the model is loaded, never to the
    run's options (they are fingerprinted, and every rank of one run must fingerprint alike)."""
    launched = torchrun_rank()
    if launched is None or device not in ("auto", "cuda"):
        return device
    import torch

    return f"cuda:{launched[2]}" if torch.cuda.is_available() else device


@dataclass(frozen=True)
class Placement:
    """Which shard this process decodes, whether it resumes, and whether it writes at all."""

    shard: object
    resume: bool
    writes: bool  # False on tensor-parallel ranks other than 0: they compute, rank 0 publishes

    @classmethod
    def resolve(cls, shard_text: str | None, resume: bool, tp_plan: str | None, out: Path | None) -> "Placement":
        shard = resolve_shard(shard_text, tensor_parallel=tp_plan is not None)
        if out is None and (shard.sharded or resume):
            raise UserError(
                ("--resume" if resume else f"shard {shard}") + " needs --out: the run directory "
                "to continue, shared by every shard"
            )
        launched = torchrun_rank()
        return cls(shard, resume, not (tp_plan and launched and launched[0] != 0))


@contextmanager
def output_dir(placement: Placement, out: Path):
    """The run directory, or a throw-away one for a tensor-parallel rank that does not write."""
    if placement.writes:
        yield out
        return
    scratch = Path(tempfile.mkdtemp(prefix="mgbench-tp-rank-"))
    try:
        yield scratch / out.name
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

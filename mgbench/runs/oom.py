"""Out-of-memory during a batch: split the batch in two and retry, down to batch size 1.

A split batch is a different batch (its rows see other neighbours and padding), so its rows
are recorded with the batch size they actually ran at, and the split is reported, never hidden.
"""

from __future__ import annotations

import gc
from typing import Callable, Sequence, TypeVar

from mgbench.errors import UserError

Member = TypeVar("Member")
Result = TypeVar("Result")

# on_split(batch size that ran out of memory, size of the halves it is retried as)
SplitFn = Callable[[int, int], None]


def recording_splits(splits: list[dict], on_split: SplitFn) -> SplitFn:
    """An on_split that also keeps each split, for the run's summary."""

    def split(batch_size: int, half: int) -> None:
        splits.append({"batch_size": batch_size, "retried_as": half})
        on_split(batch_size, half)

    return split


def is_out_of_memory(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    # The CPU allocator raises a plain RuntimeError.
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def release_memory() -> None:
    """Free what a failed attempt held: this process's CUDA caching allocator (the blocks of the
    GPUs this process used, its rank's GPU under torchrun), never touching CUDA on a CPU run."""
    import torch

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


OTHER_RANK = "out of memory on another rank"


def any_rank_out_of_memory(here: bool) -> bool:
    """Whether this attempt ran out of memory on any rank of the process group (tensor
    parallelism: every rank runs the same batch, so all must split together, or all stop).
    Without an initialized process group (one process, or data-parallel shards that decode
    different batches), this process's own answer."""
    import torch

    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return here
    # NCCL reduces GPU tensors only (on this rank's GPU: the current device, bound at load).
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if here else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _attempt(run: Callable[[], Result]) -> tuple[bool, Result | str]:
    """(True, result), or (False, the error's first line) when `run` ran out of memory, here or
    (tensor parallelism) on another rank: a rank whose attempt succeeded then discards its result."""
    result, failed = None, None
    try:
        result = run()
    except BaseException as exc:  # noqa: B036 - only out-of-memory is handled, the rest re-raised
        if not is_out_of_memory(exc):
            raise
        failed = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    # Outside the except block, so the failed attempt's frames (and tensors) are freed.
    if any_rank_out_of_memory(failed is not None) and failed is None:
        result, failed = None, OTHER_RANK
    if failed is None:
        return True, result
    release_memory()
    return False, failed


def _too_big(rows: int, failed: str, fix: str) -> UserError:
    if rows == 1:
        fix = "use a smaller model, fewer --max-new-tokens or a device with more memory"
    return UserError(f"out of memory at batch size {rows} ({failed}); {fix}")


def run_splitting_on_oom(
    members: Sequence[Member],
    run_batch: Callable[[Sequence[Member]], Result],
    on_split: SplitFn,
    batch_size: int | None = None,
) -> list[tuple[Sequence[Member], Result]]:
    """[(members, result)] of running `members` as one batch, or as halves (recursively) after OOM.

    `batch_size` is the batch's row count when it differs from len(members) (needle batches hold
    one request among fillers): such a batch cannot be split and its OOM is reported as is."""
    ok, outcome = _attempt(lambda: run_batch(members))
    if ok:
        return [(members, outcome)]
    if len(members) == 1:
        raise _too_big(batch_size or 1, outcome, "use smaller --batch-sizes")
    half = (len(members) + 1) // 2
    on_split(len(members), half)
    return run_splitting_on_oom(members[:half], run_batch, on_split) + run_splitting_on_oom(
        members[half:], run_batch, on_split
    )


def run_shrinking_on_oom(batch_size: int, run: Callable[[int], Result], on_split: SplitFn) -> tuple[int, Result]:
    """(batch size, result) of `run(batch_size)`, halving the batch size after each OOM.

    For benchmarks: every batch of one measurement must have the same size."""
    while True:
        ok, outcome = _attempt(lambda: run(batch_size))
        if ok:
            return batch_size, outcome
        if batch_size == 1:
            raise _too_big(1, outcome, "")
        half = (batch_size + 1) // 2
        on_split(batch_size, half)
        batch_size = half

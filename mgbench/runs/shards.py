"""Which requests this process decodes: `--shard I/N`, or torchrun's RANK and WORLD_SIZE.

Requests are split by whole groups (the requests that share one solo pass and its batches), so
every batch holds the same requests as in a one-process run and the shards' tables, merged,
equal that run's tables. Groups go round-robin: with --sort-by-length the long groups spread
over all shards instead of piling onto the first.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from mgbench.errors import UserError


@dataclass(frozen=True)
class Shard:
    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise UserError(f"--shard {self.index}/{self.count}: use I/N with 0 <= I < N, e.g. 0/4")

    @classmethod
    def parse(cls, text: str) -> "Shard":
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not match:
            raise UserError(f"--shard {text!r}: expected I/N such as 0/4 (shard I of N, counted from 0)")
        return cls(int(match.group(1)), int(match.group(2)))

    @property
    def sharded(self) -> bool:
        return self.count > 1

    @property
    def label(self) -> str:
        return f"{self.index}-of-{self.count}"

    def owns(self, group_index: int) -> bool:
        return group_index % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def torchrun_rank(environ=os.environ) -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when launched by torchrun with more than one process."""
    try:
        world = int(environ.get("WORLD_SIZE", "1"))
        rank = int(environ.get("RANK", "0"))
        local = int(environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise UserError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them)") from None
    return (rank, world, local) if world > 1 else None


def resolve_shard(text: str | None, tensor_parallel: bool = False, environ=os.environ) -> Shard:
    """--shard wins; else torchrun's rank and world size; one shard under tensor parallelism,
    where all ranks decode the same requests together."""
    if text is not None:
        return Shard.parse(text)
    launched = torchrun_rank(environ)
    if launched is None or tensor_parallel:
        return Shard()
    rank, world, _ = launched
    return Shard(rank, world)


def groups_of(order: list[int], group_size: int) -> list[list[int]]:
    """Requests in decoding order, cut into consecutive groups of `group_size`."""
    return [order[start : start + group_size] for start in range(0, len(order), group_size)]

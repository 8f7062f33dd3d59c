"""Groups of requests: the unit every engine decodes, commits, resumes and shards.

A group is the largest batch size's worth of requests: the unit that is decoded, committed,
resumed and sharded, whichever engine decodes it (in-process or a served endpoint).
"""

from __future__ import annotations

from typing import Callable

from mgbench.runs.options import RunOptions
from mgbench.runs.shards import groups_of

# on_progress(phase, n): "total" first (requests this process will decode), then "solo",
# "batched" (and, for an endpoint, "solo-repeat") as requests finish each pass.
ProgressFn = Callable[[str, int], None]


def order_requests(prompts: list[list[int]], sort_by_length: bool) -> list[int]:
    """Indices in decoding order: arrival order, or longest prompt first to shrink padding."""
    order = list(range(len(prompts)))
    if sort_by_length:
        order.sort(key=lambda i: (-len(prompts[i]), i))
    return order


def plan_groups(prompts: list[list[int]], options: RunOptions) -> list[list[int]]:
    """Request indices per group, in decoding order. A group is decoded alone once, then split
    into batches of every batch size; groups are also the unit of resuming and sharding."""
    return groups_of(order_requests(prompts, options.sort_by_length), max(options.batch_sizes))


def wanted_groups(
    prompts: list[list[int]], options: RunOptions, wanted: Callable[[int], bool], on_progress: ProgressFn
) -> list[tuple[int, list[int]]]:
    """(group index, group) of every wanted group in decoding order; on_progress first hears the
    total (requests this process will decode)."""
    groups = [(index, group) for index, group in enumerate(plan_groups(prompts, options)) if wanted(index)]
    on_progress("total", sum(len(group) for _, group in groups))
    return groups


def batch_id_base(group_index: int, group_size: int, batches_per_member: int) -> int:
    """First batch id of a group. Each batch holds at least one request, so a group never uses
    more than group_size * batches_per_member ids (out-of-memory splits included), and ids stay
    the same whichever process decodes the group."""
    return group_index * group_size * batches_per_member

"""How an audit releases its concurrent requests: all at one instant, so the server's scheduler
batches them, or staggered, so arrival order decides the batches as under real load."""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable


async def release_staggered(calls: list[Callable[[], Awaitable]], gap: float) -> list:
    """Run the calls concurrently, call i released `i * gap` seconds after the first (arrival order
    then decides what the server batches together, as under real load); results in order. The
    first failure cancels the rest."""

    async def one(index, call):
        await asyncio.sleep(index * gap)
        return await call()

    tasks = [asyncio.ensure_future(one(index, call)) for index, call in enumerate(calls)]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def release_together(calls: list[Callable[[], Awaitable]]) -> tuple[list, float]:
    """Run the calls concurrently, all released at one instant so the server's scheduler batches
    them; (results in order, seconds from release to the last answer). The first failure cancels
    the rest."""
    gate = asyncio.Event()

    async def one(call):
        await gate.wait()
        return await call()

    tasks = [asyncio.ensure_future(one(call)) for call in calls]
    await asyncio.sleep(0)  # every task is now waiting at the gate
    started = time.perf_counter()
    gate.set()
    try:
        answers = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return answers, time.perf_counter() - started

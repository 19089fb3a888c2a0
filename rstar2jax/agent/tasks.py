"""Asyncio helpers shared by the rollout and the server."""

import asyncio
from collections.abc import Awaitable, Iterable


async def gather_or_cancel(awaitables: Iterable[Awaitable]) -> list:
    """``asyncio.gather`` that cancels (and waits for) the others when one fails, so none is left running."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise

"""Tools and rewards the plug-in tests name by ``module:function`` (imported by the rollout and by the
verifier's worker processes, so nothing heavy here)."""

import asyncio
import math
import time


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divides a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


def sleepy(seconds: float) -> str:
    """Sleeps, then says so (a tool that hangs past a short timeout).

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "awake"


async def wait_forever(reason: str) -> str:
    """Never returns (an async tool that hangs).

    Args:
        reason: why it waits
    """
    await asyncio.sleep(3600)
    return reason


def string_match(trajectory, problem) -> float:
    """1.0 when the gold answer appears in the model's text after its last "Answer:", else 0.0."""
    return float(trajectory.text.rpartition("Answer:")[2].strip().startswith(problem.answer))


def broken_reward(trajectory, problem) -> float:
    """A reward with a bug."""
    return {}["missing"]


def nan_reward(trajectory, problem) -> float:
    """A reward that returns no number."""
    return math.nan

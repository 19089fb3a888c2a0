"""Generation engine: one state pytree, jitted append/decode/release/fork, async host scheduler.

Device level (pure, jitted, donate the state): :func:`admit`, :func:`append`, :func:`resume`, :func:`decode`,
:func:`fork`, :func:`release` on an :class:`EngineState`. Host level: :class:`EngineCore` (synchronous),
:class:`Engine` / :class:`Session` (asyncio, for agent rollouts) and :func:`generate` (one blocking call).
"""

from rstar2jax.engine.generate import Generation, generate
from rstar2jax.engine.ops import admit, append, decode, fork, read_slots, release, resume
from rstar2jax.engine.sampling import first_argmax, sample_tokens, truncation_mask
from rstar2jax.engine.scheduler import Engine, EngineConfig, EngineCore, SamplingParams, Segment, Session
from rstar2jax.engine.state import (
    BUDGET,
    DONE,
    EOS,
    FINISH_REASON_NAMES,
    FREE,
    LENGTH,
    NO_TOKEN,
    NOT_FINISHED,
    PAUSED,
    RUNNING,
    STOP,
    EngineState,
    init_state,
)

__all__ = [
    "BUDGET",
    "DONE",
    "EOS",
    "FINISH_REASON_NAMES",
    "FREE",
    "LENGTH",
    "NOT_FINISHED",
    "NO_TOKEN",
    "PAUSED",
    "RUNNING",
    "STOP",
    "Engine",
    "EngineConfig",
    "EngineCore",
    "EngineState",
    "Generation",
    "SamplingParams",
    "Segment",
    "Session",
    "admit",
    "append",
    "decode",
    "first_argmax",
    "fork",
    "generate",
    "init_state",
    "read_slots",
    "release",
    "resume",
    "sample_tokens",
    "truncation_mask",
]

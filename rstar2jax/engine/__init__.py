"""Generation engine: one state pytree, jitted append/decode/release/fork, async host scheduler.

Device level (pure, jitted, donate the state): :func:`admit`, :func:`append`, :func:`resume`, :func:`decode`,
:func:`fork`, :func:`release`, :func:`set_pages`, :func:`attach` on an :class:`EngineState`, whose KV is a
pool of pages (:mod:`~rstar2jax.engine.paged_attention`) that the host allocates (:class:`PageAllocator`).
Host level: :class:`EngineCore` (synchronous),
:class:`Engine` / :class:`Session` (asyncio, for agent rollouts) and :func:`generate` (one blocking call).
"""

from rstar2jax.engine.generate import Generation, generate
from rstar2jax.engine.ops import admit, append, attach, decode, fork, read_slots, release, resume, set_pages
from rstar2jax.engine.paged_attention import PagedCacheView, PagedKV, paged_attention_reference
from rstar2jax.engine.pages import PageAllocator
from rstar2jax.engine.sampling import first_argmax, sample_tokens, truncation_mask
from rstar2jax.engine.scheduler import Engine, EngineConfig, EngineCore, SamplingParams, Segment, Session
from rstar2jax.engine.state import (
    BUDGET,
    DONE,
    EOS,
    FINISH_REASON_NAMES,
    FREE,
    LENGTH,
    NO_POLICY_VERSION,
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
    "NO_POLICY_VERSION",
    "NO_TOKEN",
    "PAUSED",
    "RUNNING",
    "STOP",
    "Engine",
    "EngineConfig",
    "EngineCore",
    "EngineState",
    "Generation",
    "PageAllocator",
    "PagedCacheView",
    "PagedKV",
    "SamplingParams",
    "Segment",
    "Session",
    "admit",
    "append",
    "attach",
    "decode",
    "first_argmax",
    "fork",
    "generate",
    "init_state",
    "paged_attention_reference",
    "read_slots",
    "release",
    "resume",
    "sample_tokens",
    "set_pages",
    "truncation_mask",
]

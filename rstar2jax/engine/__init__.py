"""Generation engine: one state pytree, one compiled step program per token bucket, a pipelined host loop,
and the asyncio API on top.

Device level: :func:`rstar2jax.engine.step.step` on an :class:`EngineState` (a pool of KV pages stacked over
layers, :mod:`~rstar2jax.engine.paged_attention`, that the host allocates: :class:`PageAllocator`). Host
level: :class:`EngineCore` (synchronous, one step in flight), :class:`Engine` / :class:`Session` (asyncio, for
agent rollouts and the server; :meth:`Session.stream` yields tokens as they are sampled) and :func:`generate`
(one blocking call).

Modules of the host level: ``scheduler`` (the asyncio API, and how the host side works), ``core`` (the
synchronous core), ``records`` (sessions' host records and what streams back), ``requests`` (request checks,
page arithmetic), ``outbox`` (update data queued for the next step), ``programs`` (the process's compiled step
programs, the engine's weights), ``pages`` (the page allocator and prefix cache).
"""

from rstar2jax.engine.config import EngineConfig, SamplingParams, page_rounded
from rstar2jax.engine.core import EngineCore
from rstar2jax.engine.generate import Generation, generate
from rstar2jax.engine.paged_attention import PagedCacheView, PagedKV, paged_attention_reference
from rstar2jax.engine.pages import PageAllocator
from rstar2jax.engine.records import Chunk, Segment
from rstar2jax.engine.sampling import (
    CANDIDATES,
    Candidates,
    Sampled,
    candidates,
    first_argmax,
    gumbel_at,
    sample_tokens,
    sample_with_logprobs,
    truncation_mask,
)
from rstar2jax.engine.scheduler import Engine, Session
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
from rstar2jax.engine.step import StepBuilder, StepLayout

__all__ = [
    "BUDGET",
    "CANDIDATES",
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
    "Candidates",
    "Chunk",
    "Engine",
    "EngineConfig",
    "EngineCore",
    "EngineState",
    "Generation",
    "PageAllocator",
    "PagedCacheView",
    "PagedKV",
    "Sampled",
    "SamplingParams",
    "Segment",
    "Session",
    "StepBuilder",
    "StepLayout",
    "candidates",
    "first_argmax",
    "generate",
    "gumbel_at",
    "init_state",
    "page_rounded",
    "paged_attention_reference",
    "sample_tokens",
    "sample_with_logprobs",
    "truncation_mask",
]

"""Generation engine: one state pytree, one compiled step program per token bucket, a pipelined host loop,
and the asyncio API on top.

Device level: :func:`rstar2jax.engine.step.step` on an :class:`EngineState` (a pool of KV pages stacked over
layers, :mod:`~rstar2jax.engine.paged_attention`, that the host allocates: :class:`PageAllocator`).

Host level, in rooms (as vLLM's V1 engine: scheduler -> scheduler output -> engine core -> output
processor); one :meth:`EngineCore.step`::

    Scheduler.schedule() -> StepPlan (a value) -> StepRunner.dispatch (build, compile, dispatch)
        -> StepRunner.collect (outputs -> Chunks per slot) -> Scheduler.update_from_output (tokens join the
           sequences the scheduler planned those rows for)

* ``scheduler`` (:class:`~rstar2jax.engine.scheduler.Scheduler`): the plan of each step and when new weights
  apply, over ``sequences`` (:class:`~rstar2jax.engine.sequences.SequenceTable`: slots, admission, queued
  segments, forks, releases; per slot a :class:`~rstar2jax.engine.records.SlotSequence` whose ``Phase`` holds
  prefill, fork wait and recompute alike), ``ledger`` (:class:`~rstar2jax.engine.ledger.PageLedger`: held,
  promised and free pages, the prefix cache, on ``pages``' allocator) and ``outbox`` (update data owed to the
  device, each slot's record snapshotted when a step is planned);
* ``plan``: what passes between the rooms (:class:`~rstar2jax.engine.plan.StepPlan`: slot ids, token tuples
  and per-slot snapshots, never the scheduler's sequences; ``WeightUpdate``, ``DecodeResult``);
* ``buckets`` (:class:`StepLayout`, ``choose_bucket``): the token buckets, which both sides import (the host
  side never imports the device program);
* ``runner`` (:class:`~rstar2jax.engine.runner.StepRunner`): the device state and weights, and its own
  per-slot records (``SlotRecords``, as vLLM V1's ``InputBatch``); builds each plan's inputs, takes its
  program from ``programs`` (the process's compiled steps), dispatches it (one step in flight beside the new
  one) and reads the outputs into chunks;
* ``core`` (:class:`EngineCore`): the synchronous loop joining them (:meth:`EngineCore.step`) and the seam
  for new weights (:meth:`EngineCore.update_weights`: applied between two steps, no recompilation);
* ``async_engine`` (:class:`Engine`, :class:`Session`): the asyncio front, for agent rollouts and the server
  (:meth:`Session.stream` yields tokens as they are sampled); ``generate`` (:func:`generate`): one blocking
  call;
* ``records`` (sessions' host records, written by one thread: the consumer of the chunks; what streams
  back), ``requests`` (request checks, page arithmetic).

Precision: ``EngineConfig.weight_dtype`` / ``kv_dtype`` (``"fp8"``), checked by ``check_precision``; the
engine's weights are prepared by ``programs.engine_weights`` (FP8 quantization included) when it is built and
at every weight update.
"""

from rstar2jax.engine.async_engine import Engine, Session, sibling_seed
from rstar2jax.engine.buckets import StepLayout
from rstar2jax.engine.config import EngineConfig, SamplingParams, page_rounded
from rstar2jax.engine.core import EngineCore
from rstar2jax.engine.generate import Generation, generate
from rstar2jax.engine.paged_attention import (
    PagedCacheView,
    PagedKV,
    kv_bytes_per_token,
    paged_attention_reference,
    pages_for_bytes,
)
from rstar2jax.engine.pages import PageAllocator
from rstar2jax.engine.programs import check_precision, engine_weights
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
from rstar2jax.engine.step import StepBuilder

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
    "check_precision",
    "engine_weights",
    "first_argmax",
    "generate",
    "gumbel_at",
    "init_state",
    "kv_bytes_per_token",
    "page_rounded",
    "paged_attention_reference",
    "pages_for_bytes",
    "sample_tokens",
    "sample_with_logprobs",
    "sibling_seed",
    "truncation_mask",
]

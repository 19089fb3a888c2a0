"""The engine state: one pytree holding the paged KV pool, every slot's page table, pending token, sampling
settings and stop rules. Only small per-slot arrays: the token record lives on the host.

A *slot* holds one sequence. Its life cycle::

    FREE --admit--> PAUSED --start--> RUNNING --(stop sequence | segment limit)--> PAUSED --start--> ...
                                          \\--(EOS | token budget)--> DONE --release--> FREE

Invariant of a slot that holds a sequence of ``seq_len`` tokens: ``last_token`` is its token at position
``seq_len - 1`` and, once its prefill has run, the pages of its page-table row hold the keys/values of its
first ``seq_len - 1`` tokens (position ``p`` in page ``page_table[p // page_size]``). The last token is
*pending*: the next decode step feeds it to the model and samples the token after it. So a prompt is
prefilled once and its siblings, forked from it, sample their first tokens independently.

Pages are owned by the host (:class:`~rstar2jax.engine.pages.PageAllocator`): it allocates them as sequences
grow and sends page-table entries with each step; the device only reads the table. Writes go only to the page
holding position ``seq_len - 1`` and later ones, which the host keeps private to the slot, so full pages can
be shared between sequences (forked siblings, equal prompt prefixes, the prefix cache).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp

from rstar2jax.engine.config import EngineConfig
from rstar2jax.engine.paged_attention import PagedKV, decode_attention, init_pages, pool_shape
from rstar2jax.models import ModelConfig

# Slot status codes (``EngineState.status``), one per line so each carries its meaning.
#: Slot status: holds no sequence.
FREE = 0
#: Slot status: decoding.
RUNNING = 1
#: Slot status: holds its sequence, not decoding (a stop sequence or segment limit; a tool call runs).
PAUSED = 2
#: Slot status: finished (EOS or budget); released by the host.
DONE = 3

# Why a slot left RUNNING (``EngineState.finish_reason``): PAUSED after STOP/LENGTH, DONE after EOS/BUDGET.
#: Finish reason: still running (or never ran).
NOT_FINISHED = 0
#: Finish reason: a stop sequence ended the segment (PAUSED).
STOP = 1
#: Finish reason: an EOS token (DONE).
EOS = 2
#: Finish reason: the response budget is spent (DONE).
BUDGET = 3
#: Finish reason: the segment's token limit (PAUSED).
LENGTH = 4
#: Finish reason code -> its name in outputs.
FINISH_REASON_NAMES = {STOP: "stop", EOS: "eos", BUDGET: "budget", LENGTH: "length"}

#: Padding in stop-sequence and EOS tables; never equal to a real token id.
NO_TOKEN = -1
#: The policy version of a token no policy sampled (prompt, appended tool output); sampled tokens carry the
#: trainer step whose parameters sampled them (>= 0). ``rstar2jax.data.trajectory`` uses the same value.
NO_POLICY_VERSION = -1
MAX_EOS_IDS = 8  # width of the EOS table: a fixed shape, so engines with different EOS ids share programs


@flax.struct.dataclass
class EngineState:
    """Everything the device keeps for ``num_slots`` sequences of up to ``max_len`` tokens.

    Attributes (S = num_slots, P = pages in the pool, W = max_stop_len):
      pages: the KV page pool (:class:`~rstar2jax.engine.paged_attention.PagedKV`); page 0 is the null page.
      page_table: int32 ``[S, max_len // page_size]``: each slot's pages in position order; 0 (null) past its
        end.
      seq_len: int32 ``[S]``: tokens in the slot (the last one is pending, see the module docstring).
      last_token: int32 ``[S]``: the pending token.
      recent: int32 ``[S, W]``: the slot's last W tokens (right-aligned, ``NO_TOKEN`` before its start), what
        stop sequences are matched against.
      status: int32 ``[S]``: FREE / RUNNING / PAUSED / DONE.
      finish_reason: int32 ``[S]``: why the slot last left RUNNING (STOP / EOS / BUDGET / LENGTH).
      temperature, top_p: float32 ``[S]``; top_k: int32 ``[S]`` (0: no top-k). Temperature 0 is greedy.
      seed: uint32 ``[S]``: the token at position ``p`` is drawn with ``fold_in(key(seed), p)``, so a slot's
        samples depend only on its seed and its own tokens, never on scheduling.
      budget_end: int32 ``[S]``: the slot is DONE (BUDGET) once ``seq_len`` reaches it (prompt + response
        budget, inserted tokens included; at most ``max_len``).
      segment_start: int32 ``[S]``: where the current generation segment began; stop sequences match only
        tokens sampled from there on.
      segment_end: int32 ``[S]``: the slot pauses (LENGTH) once ``seq_len`` reaches it.
      stop_seqs: int32 ``[S, max_stops, W]``: stop sequences, right-aligned, padded with ``NO_TOKEN`` on the
        left; an all-padding row is unused.
      eos_ids: int32 ``[MAX_EOS_IDS]``: end-of-sequence token ids (shared by all slots), ``NO_TOKEN``-padded.
      config: the model config (static: part of the tree structure, so jitted functions need no config
        argument).
      attention: the attention implementation (static; see
        :func:`~rstar2jax.engine.paged_attention.decode_attention`).
      block_pages: pages per block of the ``blockwise`` attention's online softmax (static).
      poison_freed: static; when True a step fills the pages freed before it with NaN, so a read of a stale
        page shows up in the outputs (for tests).
    """

    pages: PagedKV
    page_table: jax.Array
    seq_len: jax.Array
    last_token: jax.Array
    recent: jax.Array
    status: jax.Array
    finish_reason: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    seed: jax.Array
    budget_end: jax.Array
    segment_start: jax.Array
    segment_end: jax.Array
    stop_seqs: jax.Array
    eos_ids: jax.Array
    config: ModelConfig = flax.struct.field(pytree_node=False)
    attention: str = flax.struct.field(pytree_node=False, default="blockwise")
    block_pages: int = flax.struct.field(pytree_node=False, default=16)
    poison_freed: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def num_slots(self) -> int:
        return self.seq_len.shape[0]

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]

    @property
    def page_size(self) -> int:
        return self.pages.page_size

    @property
    def num_pages(self) -> int:
        return self.pages.num_pages

    @property
    def max_stops(self) -> int:
        return self.stop_seqs.shape[1]

    @property
    def max_stop_len(self) -> int:
        return self.stop_seqs.shape[2]


def engine_model_config(config: ModelConfig, engine_config: EngineConfig) -> ModelConfig:
    """The model config an engine runs: no gradient checkpoints, and the layer loop ``engine_config`` picks
    (scanned over stacked weights unless ``unstacked_decode``)."""
    return dataclasses.replace(config, remat_policy="none", scan_layers=True)


def _eos_table(config: ModelConfig, engine_config: EngineConfig) -> tuple[int, ...]:
    eos = tuple(config.eos_token_ids if engine_config.eos_token_ids is None else engine_config.eos_token_ids)
    if any(not 0 <= t < config.vocab_size for t in eos) or len(eos) > MAX_EOS_IDS:
        raise ValueError(f"eos_token_ids {eos} must be at most {MAX_EOS_IDS} ids in [0, {config.vocab_size})")
    return eos + (NO_TOKEN,) * (MAX_EOS_IDS - len(eos))


def init_state(config: ModelConfig, engine_config: EngineConfig) -> EngineState:
    """An engine state with every slot FREE, built by one compiled program on the default device.

    Args:
      config: the model config.
      engine_config: slots, ``max_len``, pages, stop-table capacity, KV dtype, attention (passed whole).
    """
    eos = _eos_table(config, engine_config)
    # Resolved here, not in the compiled builder: it may compile a probe of the Pallas kernel once.
    attention = decode_attention(engine_config.attention, engine_config.kv_dtype)
    return _build_state(engine_model_config(config, engine_config), engine_config, eos, attention)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _build_state(config: ModelConfig, cfg: EngineConfig, eos: tuple[int, ...], attention: str) -> EngineState:
    S = cfg.num_slots
    zeros = lambda: jnp.zeros((S,), jnp.int32)
    shape = pool_shape(config.num_layers, config.num_kv_heads, config.head_dim, cfg.pool_pages, cfg.page_size)
    return EngineState(
        pages=init_pages(shape, cfg.kv_dtype or jnp.dtype(config.compute_dtype)),
        page_table=jnp.zeros((S, cfg.max_pages), jnp.int32),
        seq_len=zeros(),
        last_token=zeros(),
        recent=jnp.full((S, cfg.max_stop_len), NO_TOKEN, jnp.int32),
        status=jnp.full((S,), FREE, jnp.int32),
        finish_reason=zeros(),
        temperature=jnp.zeros((S,), jnp.float32),
        top_p=jnp.ones((S,), jnp.float32),
        top_k=zeros(),
        seed=jnp.zeros((S,), jnp.uint32),
        budget_end=zeros(),
        segment_start=zeros(),
        segment_end=zeros(),
        stop_seqs=jnp.full((S, cfg.max_stops, cfg.max_stop_len), NO_TOKEN, jnp.int32),
        eos_ids=jnp.asarray(eos, jnp.int32),
        config=config,
        attention=attention,
        block_pages=cfg.attention_block // cfg.page_size,
        poison_freed=cfg.poison_freed_pages,
    )

"""The engine state: one pytree holding the paged KV pool, every slot's page table, token record, sampling
settings and stop rules.

A *slot* holds one sequence. Its life cycle::

    FREE --admit--> PAUSED --resume--> RUNNING --(stop sequence | segment limit)--> PAUSED --resume--> ...
                                          \\--(EOS | token budget)--> DONE --release--> FREE

Invariant of a slot that holds a sequence of ``seq_len`` tokens: ``tokens[:seq_len]`` is the sequence and the
pages of its page-table row hold the keys/values of its first ``seq_len - 1`` tokens (position ``p`` in page
``page_table[p // page_size]``). The last token is *pending*: the next decode step feeds it to the model and
samples the token after it; the next ``append`` prefills it together with the new chunk. So a prompt is
prefilled once and its siblings, forked from it, sample their first tokens independently.

Pages are owned by the host (:class:`~rstar2jax.engine.pages.PageAllocator`): it allocates them as sequences
grow and writes page-table rows with :func:`~rstar2jax.engine.ops.set_pages`; the device only reads the table.
Writes go only to the page holding position ``seq_len - 1`` and later ones, which the host keeps private to
the slot, so full pages can be shared between sequences (forked siblings, equal prompt prefixes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp

from rstar2jax.engine.paged_attention import PagedKV, init_pages, resolve_attention
from rstar2jax.models import ModelConfig

# Slot status codes (``EngineState.status``).
FREE, RUNNING, PAUSED, DONE = 0, 1, 2, 3

# Why a slot left RUNNING (``EngineState.finish_reason``): PAUSED after STOP/LENGTH, DONE after EOS/BUDGET.
NOT_FINISHED, STOP, EOS, BUDGET, LENGTH = 0, 1, 2, 3, 4
FINISH_REASON_NAMES = {STOP: "stop", EOS: "eos", BUDGET: "budget", LENGTH: "length"}

NO_TOKEN = -1  # padding in stop-sequence and EOS tables; never equal to a real token id
# The policy version of a token no policy sampled (prompt, appended tool output); sampled tokens carry the
# trainer step whose parameters sampled them (>= 0). ``rstar2jax.data.trajectory`` uses the same value.
NO_POLICY_VERSION = -1
MAX_EOS_IDS = 8  # width of the EOS table: a fixed shape, so engines with different EOS ids share programs


@flax.struct.dataclass
class EngineState:
    """Everything the device needs to run ``num_slots`` independent sequences of up to ``max_len`` tokens.

    Attributes (S = num_slots, M = max_len, P = pages in the pool):
      pages: the KV page pool (:class:`~rstar2jax.engine.paged_attention.PagedKV`); page 0 is the null page.
      page_table: int32 ``[S, M // page_size]``: each slot's pages in position order; 0 (null) past its end.
      tokens: int32 ``[S, M]``: prompt, sampled and inserted tokens in order.
      logprobs: float32 ``[S, M]``: for a sampled token, its log-probability under the raw policy
        (``log_softmax(logits)`` at temperature 1, before top-k/top-p truncation); 0 for inserted tokens.
      entropies: float32 ``[S, M]``: for a sampled token, the entropy of the raw policy's distribution it was
        drawn at, ``H = -sum_v p_v log p_v`` with ``p = softmax(logits)`` (temperature 1, untruncated, the
        distribution its log-prob refers to); 0 for inserted tokens.
      seq_len: int32 ``[S]``: tokens in the slot (the last one is pending, see the module docstring).
      status: int32 ``[S]``: FREE / RUNNING / PAUSED / DONE.
      finish_reason: int32 ``[S]``: why the slot last left RUNNING (STOP / EOS / BUDGET / LENGTH).
      temperature, top_p: float32 ``[S]``; top_k: int32 ``[S]`` (0: no top-k). Temperature 0 is greedy.
      rng_key: ``[S]`` typed PRNG keys; the token at position ``p`` is drawn with ``fold_in(rng_key, p)``, so
        a slot's samples depend only on its seed and its own tokens, never on scheduling.
      budget_end: int32 ``[S]``: the slot is DONE (BUDGET) once ``seq_len`` reaches it (prompt + response
        budget, inserted tokens included; at most ``max_len``).
      segment_start: int32 ``[S]``: where the current generation segment began; stop sequences match only
        tokens sampled from there on.
      segment_end: int32 ``[S]``: the slot pauses (LENGTH) once ``seq_len`` reaches it.
      stop_seqs: int32 ``[S, max_stops, max_stop_len]``: stop sequences, right-aligned, padded with
        ``NO_TOKEN`` on the left; an all-padding row is unused.
      eos_ids: int32 ``[MAX_EOS_IDS]``: end-of-sequence token ids (shared by all slots), ``NO_TOKEN``-padded.
      config: the model config (static: part of the tree structure, so jitted functions need no config
        argument).
      attention: the attention implementation (static; see :func:`~rstar2jax.engine.paged_attention.
        resolve_attention`).
      block_pages: pages per block of the ``jnp`` attention's online softmax (static).
      poison_freed: static; when True :func:`~rstar2jax.engine.ops.release` fills freed pages with NaN, so a
        read of a stale page shows up in the outputs (for tests).
    """

    pages: PagedKV
    page_table: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    entropies: jax.Array
    seq_len: jax.Array
    status: jax.Array
    finish_reason: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    rng_key: jax.Array
    budget_end: jax.Array
    segment_start: jax.Array
    segment_end: jax.Array
    stop_seqs: jax.Array
    eos_ids: jax.Array
    config: ModelConfig = flax.struct.field(pytree_node=False)
    attention: str = flax.struct.field(pytree_node=False, default="jnp")
    block_pages: int = flax.struct.field(pytree_node=False, default=16)
    poison_freed: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_len(self) -> int:
        return self.tokens.shape[1]

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


def init_state(
    config: ModelConfig,
    num_slots: int,
    max_len: int,
    *,
    eos_token_ids: Sequence[int] | None = None,
    max_stops: int = 4,
    max_stop_len: int = 8,
    cache_dtype=None,
    page_size: int = 16,
    num_pages: int | None = None,
    attention: str = "auto",
    block_tokens: int = 256,
    poison_freed: bool = False,
) -> EngineState:
    """An engine state with every slot FREE.

    Args:
      config: the model config.
      num_slots: how many sequences run side by side.
      max_len: tokens per slot (prompt + response): the length of the token record and of the page table
        (``max_len // page_size`` pages); KV memory is the pool's, whatever ``max_len`` is.
      eos_token_ids: tokens that end a sequence; default ``config.eos_token_ids``; ``()``: never stop on EOS.
      max_stops, max_stop_len: capacity of the per-slot stop-sequence table (shapes, so fixed per engine).
      cache_dtype: KV cache dtype; default the model's compute dtype.
      page_size: tokens per page; must divide ``max_len``.
      num_pages: pages in the pool, the null page included; default enough for every slot at ``max_len``
        (``num_slots * max_len // page_size + 1``).
      attention: ``"auto"``, ``"jnp"``, ``"pallas_gpu"`` or ``"pallas_interpret"``.
      block_tokens: tokens per block of the ``jnp`` attention (a multiple of ``page_size``).
      poison_freed: fill freed pages with NaN (tests).
    """
    if num_pages is None and isinstance(num_slots, int) and isinstance(max_len, int) and \
            isinstance(page_size, int) and page_size > 0:
        num_pages = num_slots * (max_len // page_size) + 1
    for name, value in (("num_slots", num_slots), ("max_len", max_len), ("max_stops", max_stops),
                        ("max_stop_len", max_stop_len), ("page_size", page_size), ("num_pages", num_pages),
                        ("block_tokens", block_tokens)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if max_len % page_size:
        raise ValueError(f"page_size={page_size} must divide max_len={max_len}")
    if block_tokens % page_size:
        raise ValueError(f"block_tokens={block_tokens} must be a multiple of page_size={page_size}")
    if num_pages < 2:
        raise ValueError(f"num_pages={num_pages} must be at least 2 (page 0 is the null page)")
    eos = tuple(config.eos_token_ids if eos_token_ids is None else eos_token_ids)
    if any(not 0 <= t < config.vocab_size for t in eos) or len(eos) > MAX_EOS_IDS:
        raise ValueError(f"eos_token_ids {eos} must be at most {MAX_EOS_IDS} ids in [0, {config.vocab_size})")
    zeros = lambda: jnp.zeros((num_slots,), jnp.int32)  # a fresh buffer per field: each one is donated
    # The engine's forward needs no gradient checkpoints, and paged layers run unrolled.
    config = dataclasses.replace(config, remat_policy="none")
    state = EngineState(
        pages=init_pages(config.num_layers, config.num_kv_heads, config.head_dim, num_pages, page_size,
                         jnp.dtype(cache_dtype or config.compute_dtype)),
        page_table=jnp.zeros((num_slots, max_len // page_size), jnp.int32),
        tokens=jnp.zeros((num_slots, max_len), jnp.int32),
        logprobs=jnp.zeros((num_slots, max_len), jnp.float32),
        entropies=jnp.zeros((num_slots, max_len), jnp.float32),
        seq_len=zeros(),
        status=jnp.full((num_slots,), FREE, jnp.int32),
        finish_reason=zeros(),
        temperature=jnp.zeros((num_slots,), jnp.float32),
        top_p=jnp.ones((num_slots,), jnp.float32),
        top_k=zeros(),
        rng_key=jax.random.split(jax.random.key(0), num_slots),
        budget_end=zeros(),
        segment_start=zeros(),
        segment_end=zeros(),
        stop_seqs=jnp.full((num_slots, max_stops, max_stop_len), NO_TOKEN, jnp.int32),
        eos_ids=jnp.asarray(eos + (NO_TOKEN,) * (MAX_EOS_IDS - len(eos)), jnp.int32),
        config=config,
        attention=resolve_attention(attention),
        block_pages=block_tokens // page_size,
        poison_freed=poison_freed,
    )
    # Committed to a device like every jitted function's output, so the first call on a fresh state hits the
    # same compiled programs as later calls (jit caches committed and uncommitted inputs apart).
    return jax.device_put(state, jax.devices()[0])

"""Jitted pure functions on a donated :class:`EngineState`.

Every function takes the state as its first argument, donates it (its buffers are reused in place: use the
returned state, never the argument) and returns the new state. Slot lists are int32 arrays that may be
padded with ``num_slots`` (an out-of-range slot): padded entries are ignored, so a host can round list lengths
up to a few sizes and never trigger a recompilation. Budgets, temperatures, stop sequences, lengths and page
tables are array data.

KV lives in the state's page pool. The host allocates pages and writes page-table rows (:func:`set_pages`,
driven by :class:`~rstar2jax.engine.pages.PageAllocator`); :func:`append` and :func:`decode` write keys and
values straight into those pages (a scatter into the donated pool: no copies of cache rows) and attend over
the pages each row holds, for as many blocks as the longest row needs (not ``max_len``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rstar2jax.engine.paged_attention import NULL_PAGE, PagedCacheView
from rstar2jax.engine.sampling import sample_tokens
from rstar2jax.engine.state import (
    BUDGET,
    DONE,
    EOS,
    FREE,
    LENGTH,
    NO_TOKEN,
    NOT_FINISHED,
    PAUSED,
    RUNNING,
    STOP,
    EngineState,
)
from rstar2jax.models import forward

_donate_state = functools.partial(jax.jit, donate_argnames=("state",))


def _check_slots(slots: jax.Array) -> None:
    if slots.ndim != 1 or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"slots must be a 1-D int array, got {slots.dtype}{list(slots.shape)}")


def _check_per_slot(slots: jax.Array, **arrays) -> None:
    for name, value in arrays.items():
        if value.shape[:1] != slots.shape:
            raise ValueError(f"{name} must have one entry per slot ({slots.shape[0]}), got {value.shape}")


def _scatter_rows(array: jax.Array, slots: jax.Array, values) -> jax.Array:
    """``array[slots] = values``, dropping out-of-range (padding) slots."""
    return array.at[slots].set(values, mode="drop")


@_donate_state
def admit(
    state: EngineState,
    slots: jax.Array,
    seeds: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
    budget_end: jax.Array,
) -> EngineState:
    """Take ``slots`` for new sequences: empty, PAUSED, with their sampling settings and token budgets.

    Args:
      slots: int32 ``[B]`` (padding: ``num_slots``).
      seeds: uint32 ``[B]``: each slot's PRNG seed.
      temperature, top_p: float32 ``[B]``; top_k: int32 ``[B]``.
      budget_end: int32 ``[B]``: total tokens (prompt + response) after which the slot is DONE; clipped to
        ``max_len``.
    """
    _check_slots(slots)
    _check_per_slot(slots, seeds=seeds, temperature=temperature, top_p=top_p, top_k=top_k,
                    budget_end=budget_end)
    zeros = jnp.zeros_like(slots)
    set_rows = functools.partial(_scatter_rows, slots=slots)
    return state.replace(
        seq_len=set_rows(state.seq_len, values=zeros),
        status=set_rows(state.status, values=jnp.full_like(slots, PAUSED)),
        finish_reason=set_rows(state.finish_reason, values=jnp.full_like(slots, NOT_FINISHED)),
        temperature=set_rows(state.temperature, values=temperature.astype(jnp.float32)),
        top_p=set_rows(state.top_p, values=top_p.astype(jnp.float32)),
        top_k=set_rows(state.top_k, values=top_k.astype(jnp.int32)),
        rng_key=set_rows(state.rng_key, values=jax.vmap(jax.random.key)(seeds.astype(jnp.uint32))),
        budget_end=set_rows(state.budget_end, values=jnp.minimum(budget_end, state.max_len)),
        segment_start=set_rows(state.segment_start, values=zeros),
        segment_end=set_rows(state.segment_end, values=zeros),
        stop_seqs=set_rows(state.stop_seqs, values=NO_TOKEN),
    )


@_donate_state
def resume(state: EngineState, slots: jax.Array, stop_seqs: jax.Array,
           max_new_tokens: jax.Array) -> EngineState:
    """Start a generation segment: set each slot's stop sequences and segment limit, and make it RUNNING.

    A slot already at its token budget goes straight to DONE (BUDGET) instead.

    Args:
      slots: int32 ``[B]`` (padding: ``num_slots``).
      stop_seqs: int32 ``[B, max_stops, max_stop_len]``, right-aligned and ``NO_TOKEN``-padded.
      max_new_tokens: int32 ``[B]``: the slot pauses (LENGTH) after this many more tokens.
    """
    _check_slots(slots)
    _check_per_slot(slots, stop_seqs=stop_seqs, max_new_tokens=max_new_tokens)
    if stop_seqs.shape[1:] != state.stop_seqs.shape[1:]:
        raise ValueError(f"stop_seqs must be [slots, {state.max_stops}, {state.max_stop_len}], "
                         f"got {stop_seqs.shape}")
    rows = jnp.minimum(slots, state.num_slots - 1)
    seq_len, budget_end = state.seq_len[rows], state.budget_end[rows]
    exhausted = seq_len >= budget_end
    set_rows = functools.partial(_scatter_rows, slots=slots)
    return state.replace(
        status=set_rows(state.status, values=jnp.where(exhausted, DONE, RUNNING)),
        finish_reason=set_rows(state.finish_reason, values=jnp.where(exhausted, BUDGET, NOT_FINISHED)),
        segment_start=set_rows(state.segment_start, values=seq_len),
        segment_end=set_rows(state.segment_end, values=jnp.minimum(seq_len + max_new_tokens, budget_end)),
        stop_seqs=set_rows(state.stop_seqs, values=stop_seqs.astype(jnp.int32)),
    )


@_donate_state
def release(state: EngineState, slots: jax.Array, freed_pages: jax.Array | None = None) -> EngineState:
    """Free ``slots`` (int32 ``[B]``, padding ``num_slots``): their page-table rows point to the null page and
    their token rows become garbage.

    ``freed_pages``: bool ``[num_pages]``, the pages no slot holds any more; with ``state.poison_freed`` they
    are filled with NaN (so a later read of one shows up in the outputs), otherwise they are left as they are.
    """
    _check_slots(slots)
    pages = state.pages
    if state.poison_freed and freed_pages is not None:
        if freed_pages.shape != (state.num_pages,):
            raise ValueError(f"freed_pages must be bool [{state.num_pages}], got {freed_pages.shape}")
        poison = lambda a: jnp.where(freed_pages[None, :, None, None], jnp.nan, a).astype(a.dtype)
        pages = jax.tree.map(poison, pages)
    return state.replace(
        pages=pages,
        page_table=_scatter_rows(state.page_table, slots, NULL_PAGE),
        status=_scatter_rows(state.status, slots, FREE),
        seq_len=_scatter_rows(state.seq_len, slots, 0),
    )


@_donate_state
def set_pages(state: EngineState, slots: jax.Array, rows: jax.Array, copy_src: jax.Array,
              copy_dst: jax.Array) -> EngineState:
    """Write page-table rows and copy pages (the host's allocation, see :mod:`rstar2jax.engine.pages`).

    Args:
      slots: int32 ``[B]`` (padding: ``num_slots``); rows: int32 ``[B, max_len // page_size]``.
      copy_src, copy_dst: int32 ``[C]``: page ``copy_src[i]`` is copied into ``copy_dst[i]`` (a forked
        sibling's private copy of the partly filled page); padding: ``num_pages`` in ``copy_dst``.
    """
    _check_slots(slots)
    _check_per_slot(slots, rows=rows)
    if rows.shape[1:] != state.page_table.shape[1:] or copy_src.shape != copy_dst.shape:
        raise ValueError(f"rows must be [slots, {state.page_table.shape[1]}] and copy_src/copy_dst alike, "
                         f"got {rows.shape}, {copy_src.shape}, {copy_dst.shape}")
    src = jnp.minimum(copy_src, state.num_pages - 1)
    copy = lambda a: a.at[:, copy_dst].set(a[:, src], mode="drop")
    return state.replace(
        pages=jax.tree.map(copy, state.pages),
        page_table=_scatter_rows(state.page_table, slots, rows.astype(jnp.int32)),
    )


@_donate_state
def attach(state: EngineState, slots: jax.Array, tokens: jax.Array, lengths: jax.Array) -> EngineState:
    """Set each slot's token record to ``tokens[b, :lengths[b]]`` without prefilling: the slot's page-table
    row (set by :func:`set_pages`) must already hold the keys/values of its first ``lengths[b] - 1`` tokens
    (pages shared with a sequence whose prompt has the same prefix).

    Args:
      slots: int32 ``[B]`` (padding: ``num_slots``) of admitted, empty slots.
      tokens: int32 ``[B, max_len]``; lengths: int32 ``[B]``.
    """
    _check_slots(slots)
    _check_per_slot(slots, tokens=tokens, lengths=lengths)
    if tokens.shape[1:] != (state.max_len,):
        raise ValueError(f"tokens must be [slots, {state.max_len}], got {tokens.shape}")
    return state.replace(
        tokens=_scatter_rows(state.tokens, slots, tokens.astype(jnp.int32)),
        logprobs=_scatter_rows(state.logprobs, slots, 0.0),
        entropies=_scatter_rows(state.entropies, slots, 0.0),
        seq_len=_scatter_rows(state.seq_len, slots, lengths.astype(jnp.int32)),
    )


@_donate_state
def fork(state: EngineState, src: jax.Array, dsts: jax.Array) -> EngineState:
    """Copy the sequence in slot ``src`` (tokens, log-probs, entropies, length, status and current segment)
    into ``dsts`` (int32 ``[B]``, padding ``num_slots``). Its keys/values are not copied: the host gives the
    destinations page-table rows that share ``src``'s full pages and a copy of its partly filled one
    (:meth:`~rstar2jax.engine.pages.PageAllocator.fork` then :func:`set_pages`).

    The destinations keep their own sampling settings, PRNG key and budget (set by :func:`admit`). Forking a
    slot whose pending token is the prompt's last token (``append(..., sample=False)``) lets every sibling
    sample its first token independently: the prompt is prefilled once for the whole group.
    """
    _check_slots(dsts)
    src = jnp.asarray(src, jnp.int32)
    if src.ndim:
        raise ValueError(f"src must be one slot index, got shape {src.shape}")

    def copy_row(array):
        row = jnp.broadcast_to(array[src], array[dsts].shape)
        return array.at[dsts].set(row, mode="drop")

    per_slot = ("tokens", "logprobs", "entropies", "seq_len", "status", "finish_reason", "segment_start",
                "segment_end", "stop_seqs")
    return state.replace(**{name: copy_row(getattr(state, name)) for name in per_slot})


def _stop_matched(state: EngineState, tokens: jax.Array, rows: jax.Array, pos: jax.Array) -> jax.Array:
    """Whether the tokens of each slot in ``rows`` ending at ``pos`` (inclusive) end with one of the slot's
    stop sequences, all of whose tokens lie in the current segment.

    tokens: int32 ``[S, M]`` token record; rows, pos: int32 ``[B]``. Returns bool ``[B]``.
    """
    width = state.max_stop_len
    window_pos = pos[:, None] - (width - 1) + jnp.arange(width)  # [B, L], right-aligned like stop_seqs
    window = tokens[rows[:, None], jnp.clip(window_pos, 0, state.max_len - 1)]
    in_segment = window_pos >= state.segment_start[rows][:, None]
    stop_seqs = state.stop_seqs[rows]
    used = stop_seqs != NO_TOKEN  # [B, stops, L]
    equal = (window[:, None, :] == stop_seqs) & in_segment[:, None, :]
    return jnp.any(jnp.all(equal | ~used, axis=-1) & jnp.any(used, axis=-1), axis=-1)


def _commit(state: EngineState, slots: jax.Array, active: jax.Array, new_tokens: jax.Array,
            new_logprobs: jax.Array, new_entropies: jax.Array) -> EngineState:
    """Record a sampled token for each active row and apply the stop rules (EOS > budget > stop > length)."""
    rows = jnp.minimum(slots, state.num_slots - 1)
    targets = jnp.where(active, slots, state.num_slots)  # inactive rows write nothing
    pos = state.seq_len[rows]
    tokens = state.tokens.at[targets, pos].set(new_tokens, mode="drop")
    seq_len = pos + 1

    is_eos = jnp.any(new_tokens[:, None] == state.eos_ids[None, :], axis=-1)
    stopped = _stop_matched(state, tokens, rows, pos)
    reason = jnp.select(
        [is_eos, seq_len >= state.budget_end[rows], stopped, seq_len >= state.segment_end[rows]],
        [EOS, BUDGET, STOP, LENGTH],
        NOT_FINISHED,
    )
    finished = (reason == EOS) | (reason == BUDGET)
    status = jnp.where(finished, DONE, jnp.where(reason == NOT_FINISHED, RUNNING, PAUSED))
    set_rows = functools.partial(_scatter_rows, slots=targets)
    return state.replace(
        tokens=tokens,
        logprobs=state.logprobs.at[targets, pos].set(new_logprobs, mode="drop"),
        entropies=state.entropies.at[targets, pos].set(new_entropies, mode="drop"),
        seq_len=set_rows(state.seq_len, values=seq_len),
        status=set_rows(state.status, values=status),
        finish_reason=set_rows(state.finish_reason, values=reason),
    )


def _forward(state: EngineState, params, page_table: jax.Array, tokens: jax.Array, positions: jax.Array):
    """Logits of ``tokens`` at ``positions`` (-1: padding) of rows with ``page_table``; their keys/values are
    written into the pool in place. Returns (logits, new pool)."""
    view = PagedCacheView(pages=state.pages, page_table=page_table, positions=positions,
                          attention=state.attention, block_pages=state.block_pages)
    logits, view = forward(params, state.config, tokens, positions=positions, cache=view)
    return logits, view.pages


def _writable(state: EngineState, rows: jax.Array) -> jax.Array:
    """Whether each row's next key/value (position ``seq_len - 1``) has a page to go to."""
    pos = jnp.maximum(state.seq_len[rows] - 1, 0)
    page = state.page_table[rows, jnp.minimum(pos // state.page_size, state.page_table.shape[1] - 1)]
    return page != NULL_PAGE


def _sample_step(state: EngineState, params, slots: jax.Array | None, active: jax.Array) -> EngineState:
    """Feed each active row's pending token to the model, sample the next token and commit it.

    ``slots=None`` runs every slot; otherwise the rows of ``slots`` (their keys/values go to the shared pool
    in place either way).
    """
    all_slots = jnp.arange(state.num_slots, dtype=jnp.int32)
    rows = all_slots if slots is None else jnp.minimum(slots, state.num_slots - 1)
    pos = state.seq_len[rows] - 1
    last = state.tokens[rows, jnp.maximum(pos, 0)][:, None]
    positions = jnp.where(active, pos, -1)[:, None]
    logits, pages = _forward(state, params, state.page_table[rows], last, positions)
    state = state.replace(pages=pages)
    logits = logits[:, 0]
    keys = jax.vmap(jax.random.fold_in)(state.rng_key[rows], pos + 1)
    # Idle rows count as greedy so that they never switch on the sampling passes.
    new_tokens = sample_tokens(
        logits, keys, jnp.where(active, state.temperature[rows], 0.0),
        jnp.where(active, state.top_p[rows], 1.0), jnp.where(active, state.top_k[rows], 0),
    )
    # A gather, not token_logprobs' select over the whole vocabulary (built for gradients, never taken here).
    picked = jnp.take_along_axis(logits, new_tokens[:, None], axis=-1)[:, 0]
    log_norm = jax.nn.logsumexp(logits, axis=-1)
    # H = log Z - sum_v p_v logit_v: one more reduction over the logits, fused with the normaliser's.
    entropy = log_norm - jnp.sum(jnp.exp(logits - log_norm[:, None]) * logits, axis=-1)
    return _commit(state, all_slots if slots is None else slots, active, new_tokens, picked - log_norm,
                   entropy)


@functools.partial(jax.jit, donate_argnames=("state",), static_argnames=("sample",))
def append(state: EngineState, params, slots: jax.Array, tokens: jax.Array, lengths: jax.Array, *,
           sample: bool = True) -> EngineState:
    """Append a chunk of inserted tokens (a prompt or a tool response) to each slot and prefill it.

    Row ``b`` of ``tokens`` holds ``lengths[b]`` tokens (the rest is padding); they are written at the
    slot's current length (log-prob and entropy 0). Keys/values are written into the slot's pages (which the
    host must have allocated) for the slot's pending token and all new tokens but the last, which becomes the
    pending token; attention reads the pages block by block, so memory grows with ``T`` times a block, not
    ``T^2`` (a long prompt is prefilled in chunks of the largest bucket). With ``sample=True`` that token is
    fed at once and the next token sampled and committed (RUNNING / PAUSED / DONE by the stop rules of the
    slot's current segment, set by :func:`resume`); with ``sample=False`` the slot's status is left as it was
    and the next decode step of a RUNNING slot samples it, at no extra cost (the scheduler's way, and the
    way to prefill a prompt for :func:`fork`).

    Args:
      slots: int32 ``[B]`` (padding: ``num_slots``); slots must hold a sequence (not FREE).
      tokens: int32 ``[B, T]``; T is the prefill bucket (a shape: round it up to a few sizes).
      lengths: int32 ``[B]``, ``1 <= lengths <= T`` for real rows; the slot must have room for them.
    """
    _check_slots(slots)
    _check_per_slot(slots, tokens=tokens, lengths=lengths)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [slots, bucket], got shape {tokens.shape}")
    width = tokens.shape[1]
    real = slots < state.num_slots
    rows = jnp.minimum(slots, state.num_slots - 1)
    seq_len = state.seq_len[rows]
    new_len = seq_len + lengths

    # Write the chunk into the token record (inserted: loss mask 0, log-prob 0).
    offset = jnp.arange(width)[None, :]
    write_pos = seq_len[:, None] + offset
    write_rows = jnp.where(real[:, None] & (offset < lengths[:, None]), slots[:, None], state.num_slots)
    record = state.tokens.at[write_rows, write_pos].set(tokens.astype(jnp.int32), mode="drop")

    # Prefill [start, new_len - 1): the old pending token (if any) and the chunk, minus its new pending token.
    # That is lengths - 1 + (seq_len > 0) <= width positions, so the bucket width always suffices.
    start = jnp.maximum(seq_len - 1, 0)
    window_pos = start[:, None] + offset
    window = jnp.take_along_axis(record[rows], jnp.clip(window_pos, 0, state.max_len - 1), axis=1)
    positions = jnp.where(real[:, None] & (window_pos < new_len[:, None] - 1), window_pos, -1)
    _, pages = _forward(state, params, state.page_table[rows], window, positions)
    state = state.replace(
        pages=pages,
        tokens=record,
        logprobs=state.logprobs.at[write_rows, write_pos].set(0.0, mode="drop"),
        entropies=state.entropies.at[write_rows, write_pos].set(0.0, mode="drop"),
        seq_len=_scatter_rows(state.seq_len, slots, new_len),
    )
    if sample:
        state = _sample_step(state, params, slots, real)
    return state


_SLOT_FIELDS = ("page_table", "tokens", "logprobs", "entropies", "seq_len", "status", "finish_reason",
                "temperature", "top_p", "top_k", "rng_key", "budget_end", "segment_start", "segment_end",
                "stop_seqs")


@functools.partial(jax.jit, donate_argnames=("state",), static_argnames=("num_steps", "return_on_stop"))
def decode(state: EngineState, params, num_steps: int, slots: jax.Array | None = None, *,
           return_on_stop: bool = False) -> EngineState:
    """Run up to ``num_steps`` decode steps for every RUNNING slot, each at its own position, in one on-device
    loop.

    A step feeds each running slot its pending token, samples the next token and commits it: a matched stop
    sequence or the segment limit pauses the slot (PAUSED), EOS or the token budget finishes it (DONE). The
    loop ends once no running slot can go on, after ``num_steps`` steps, or, with ``return_on_stop``, after
    the first step in which some slot stopped (so the host can hand its segment back at once). A running slot
    whose next key/value has no page (its page-table entry is the null page) waits, RUNNING, until the host
    gives it one. ``num_steps`` and ``return_on_stop`` are static: keep them fixed.

    With ``slots`` (int32 ``[B]``, padding ``num_slots``) only those slots are decoded, as a batch of B rows:
    a step then costs B rows instead of ``num_slots``; their per-slot fields are gathered and scattered back
    (the KV pool is shared and written in place). Worth it when most slots are idle (paused on tools, free).

    ``params`` may be stacked or unstacked (:func:`~rstar2jax.models.unstack_layers`); on XLA:CPU every step
    copies each slice of stacked weights, so decode many chunks from weights unstacked once
    (:class:`EngineCore` does, see ``EngineConfig.unstacked_decode``).
    """
    if slots is None:
        return _decode_loop(state, params, num_steps, return_on_stop)
    _check_slots(slots)
    rows = jnp.minimum(slots, state.num_slots - 1)
    part = state.replace(**{name: getattr(state, name)[rows] for name in _SLOT_FIELDS})
    part = part.replace(status=jnp.where(slots < state.num_slots, part.status, FREE))  # padding rows idle
    part = _decode_loop(part, params, num_steps, return_on_stop)
    return state.replace(
        pages=part.pages,
        **{name: _scatter_rows(getattr(state, name), slots, getattr(part, name)) for name in _SLOT_FIELDS},
    )


def _decode_loop(state: EngineState, params, num_steps: int, return_on_stop: bool) -> EngineState:
    all_rows = jnp.arange(state.num_slots, dtype=jnp.int32)
    ready = lambda st: (st.status == RUNNING) & _writable(st, all_rows)
    started = state.status == RUNNING

    def body(carry):
        step, st = carry
        return step + 1, _sample_step(st, params, None, ready(st))

    def cond(carry):
        step, st = carry
        go_on = (step < num_steps) & jnp.any(ready(st))
        if return_on_stop:
            go_on &= ~jnp.any(started & (st.status != RUNNING))
        return go_on

    _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
    return state


@jax.jit
def read_slots(state: EngineState, slots: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Token, log-prob and entropy rows (int32 / float32 / float32 ``[B, max_len]``) of ``slots`` (padding
    rows repeat the last slot), for the host to copy out."""
    rows = jnp.minimum(slots, state.num_slots - 1)
    return state.tokens[rows], state.logprobs[rows], state.entropies[rows]



"""The engine's one device program: :func:`step`, compiled once per token bucket.

A step takes the donated :class:`~rstar2jax.engine.EngineState`, the weights and two flat buffers (one
int32, one float32: two host-to-device copies per step, whatever the work) that
:class:`~rstar2jax.engine.buckets.StepLayout` (its token bucket) packs and unpacks. It

1. applies the host's *update data*, in this order: slot records (admissions, segment starts, releases:
   every per-slot field of a slot the device does not run, which the host therefore knows exactly; a new
   sequence's page-table row is cleared), forks (a sibling's row becomes its source's as the previous steps
   left it, but for its private copy of the prompt's partly filled last page), page-table entries (pages
   given to growing sequences, forked ones included), freed pages poisoned with NaN (tests) and pages copied
   (into a sibling's private page);
2. runs the *ragged step*: a flat batch of T tokens of any mix of sequences, each with its slot and position:
   prefill chunks of prompts and appended tool outputs (their tokens given by the host) and one decode token
   per running slot (its pending token, taken from the device state, since the host may not know it yet).
   Every token's key/value is written into its slot's pages, each attends to its own sequence by position
   (:mod:`~rstar2jax.engine.paged_attention`), and the decode tokens are sampled and committed (stop rules:
   EOS > budget > stop sequence > segment limit);
3. when the step prefilled nothing, goes on with up to ``num_decode`` pure decode iterations of the same
   shape in an on-device loop (ending early once no slot can run, or, with ``return_on_stop``, once a
   slot's segment ended).

It returns the new state and compact outputs: per iteration and decode row, the sampled token (-1: none),
why the row's segment ended (0: it did not), its raw log-prob and entropy. The host maps rows back to
sessions; it never reads per-slot arrays of ``max_len``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rstar2jax.engine.buckets import StepLayout
from rstar2jax.engine.paged_attention import NULL_PAGE, PagedCacheView, RaggedBatch
from rstar2jax.engine.sampling import sample_with_logprobs
from rstar2jax.engine.state import (
    BUDGET,
    DONE,
    EOS,
    LENGTH,
    NO_TOKEN,
    NOT_FINISHED,
    PAUSED,
    RUNNING,
    STOP,
    EngineState,
)
from rstar2jax.models import exact_kernels, forward_hidden, output_head
from rstar2jax.models.quantization import dequantize, einsum, is_fp8_weight

DECODE = -1  # a flat token whose id (and position) is the slot's pending token on the device


def _apply_updates(state: EngineState, f: dict) -> EngineState:
    """Slot records, page-table rows and entries, poisoned and copied pages (see the module docstring)."""
    S, P = state.num_slots, state.num_pages
    slot = f["upd_slot"]
    put = lambda array, values: array.at[slot].set(values.astype(array.dtype), mode="drop")
    page_table = state.page_table.at[jnp.where(f["upd_clear"] > 0, slot, S)].set(NULL_PAGE, mode="drop")
    page_table = page_table.at[f["fork_dst"]].set(page_table[jnp.minimum(f["fork_src"], S - 1)], mode="drop")
    page_table = page_table.at[f["fork_dst"], f["fork_col"]].set(f["fork_page"], mode="drop")
    page_table = page_table.at[f["entry_slot"], f["entry_col"]].set(f["entry_page"], mode="drop")
    pages = state.pages
    if state.poison_freed:
        # Page axis 2 of every leaf (values [K, L, P, ps, Dh], FP8 scales [K, L, P, ps]).
        poison = lambda a: jnp.where(f["poison"].reshape(1, 1, -1, *(1,) * (a.ndim - 3)) > 0, jnp.nan,
                                     a).astype(a.dtype)
        pages = jax.tree.map(poison, pages)

    # The host packs real copies first: as many iterations as there are copies. Every leaf of the pool
    # (FP8 pages: their scales too) is copied.
    def copy_page(i, pages):
        src, dst = f["copy_src"][i], f["copy_dst"][i]
        move = lambda a: jax.lax.dynamic_update_index_in_dim(
            a, jax.lax.dynamic_index_in_dim(a, src, axis=2, keepdims=True), dst, axis=2)
        return jax.tree.map(move, pages)

    pages = jax.lax.fori_loop(0, jnp.sum(f["copy_dst"] < P), copy_page, pages)
    return state.replace(
        pages=pages,
        page_table=page_table,
        seq_len=put(state.seq_len, f["upd_seq_len"]),
        last_token=put(state.last_token, f["upd_last_token"]),
        recent=put(state.recent, f["upd_recent"]),
        status=put(state.status, f["upd_status"]),
        finish_reason=put(state.finish_reason, jnp.zeros_like(slot)),
        temperature=put(state.temperature, f["upd_temperature"]),
        top_p=put(state.top_p, f["upd_top_p"]),
        top_k=put(state.top_k, f["upd_top_k"]),
        seed=put(state.seed, jax.lax.bitcast_convert_type(f["upd_seed"], jnp.uint32)),
        budget_end=put(state.budget_end, f["upd_budget_end"]),
        segment_start=put(state.segment_start, f["upd_segment_start"]),
        segment_end=put(state.segment_end, f["upd_segment_end"]),
        stop_seqs=put(state.stop_seqs, f["upd_stop_seqs"]),
    )


def _stop_matched(state: EngineState, slots: jax.Array, recent: jax.Array, new_len: jax.Array) -> jax.Array:
    """Whether each row's last tokens (``recent`` ``[R, W]``, ending at position ``new_len - 1``) end with one
    of its slot's stop sequences, all of whose tokens lie in the current segment. Returns bool ``[R]``."""
    width = state.max_stop_len
    window_pos = new_len[:, None] - width + jnp.arange(width)  # [R, W], right-aligned like stop_seqs
    in_segment = window_pos >= state.segment_start[slots][:, None]
    stop_seqs = state.stop_seqs[slots]
    used = stop_seqs != NO_TOKEN  # [R, stops, W]
    equal = (recent[:, None, :] == stop_seqs) & in_segment[:, None, :]
    return jnp.any(jnp.all(equal | ~used, axis=-1) & jnp.any(used, axis=-1), axis=-1)


def _ragged_step(state: EngineState, params, tok_slot, tok_pos, tok_id, row_token, tile_token, *,
                 greedy: bool):
    """Feed the flat batch, sample each running decode row (``greedy``: by argmax, whatever its settings)
    and commit. Returns (state, outputs of the rows: token (-1: none), finish code, log-prob, entropy)."""
    S, P, ps = state.num_slots, state.num_pages, state.page_size
    real = tok_slot < S
    slot = jnp.minimum(tok_slot, S - 1)
    decode = real & (tok_id == DECODE)
    pos = jnp.where(decode, state.seq_len[slot] - 1, tok_pos)
    token = jnp.where(decode, state.last_token[slot], tok_id)
    page = state.page_table[slot, jnp.clip(pos // ps, 0, state.max_pages - 1)]
    valid = real & (pos >= 0) & (page != NULL_PAGE) & (~decode | (state.status[slot] == RUNNING))
    positions = jnp.where(valid, pos, -1)
    row_slot = slot.at[row_token].get(mode="fill", fill_value=0)
    tile_slot = slot.at[tile_token[:, 0]].get(mode="fill", fill_value=0)
    batch = RaggedBatch(
        token_page=jnp.where(valid, page, P),
        token_offset=pos % ps,
        row_token=row_token,
        row_positions=positions.at[row_token].get(mode="fill", fill_value=-1)[:, None],
        row_pages=state.page_table[row_slot],
        tile_token=tile_token,
        tile_positions=positions.at[tile_token].get(mode="fill", fill_value=-1),
        tile_pages=state.page_table[tile_slot],
    )
    exact_numerics = state.config.numerics == "exact"
    kernels = exact_kernels.resolve(state.config) if exact_numerics else "xla"
    view = PagedCacheView(pages=state.pages, batch=batch, block_pages=state.block_pages,
                          attention="exact" if exact_numerics else state.attention, exact_kernels=kernels)
    x, view = forward_hidden(params, state.config, token[None], positions=positions[None], cache=view)
    state = state.replace(pages=view.pages)

    # Logits of the decode rows only (prefill tokens need none).
    sample = (decode & valid).at[row_token].get(mode="fill", fill_value=False)
    head, layout = output_head(params, state.config)
    h = x[0].at[row_token].get(mode="fill", fill_value=0)
    if exact_numerics and is_fp8_weight(head):  # one log-prob program: the FP8 head dequantized, as trained
        head = dequantize(head, h.dtype)
    if exact_numerics:  # the trainer's programs, tile by tile (models.exact)
        logits = exact_kernels.logits(h, head, layout, kernels)
    elif is_fp8_weight(head):
        logits = einsum("rd,vd->rv" if layout == "vd" else "rd,dv->rv", h, head,
                        preferred_element_type=jnp.float32)
    else:
        # h @ head.T, not einsum("rd,vd->rv"): XLA:CPU fuses the former into a two-thread vector-matrix loop
        # at one row (the einsum's dot takes ~1.35x the CPU time there); both give the same dot at more rows.
        logits = jnp.dot(h, head.T if layout == "vd" else head, preferred_element_type=jnp.float32)
    row_pos = pos.at[row_token].get(mode="fill", fill_value=0)
    keys = jax.vmap(lambda seed, p: jax.random.fold_in(jax.random.key(seed), p))(state.seed[row_slot],
                                                                               row_pos + 1)
    # Idle rows count as greedy so that they never switch on the sampling passes. The log-probs and entropies
    # come from the greedy max pass and two more (a gather picks the token's logit).
    new, logprob, entropy = sample_with_logprobs(
        logits, keys, jnp.where(sample, state.temperature[row_slot], 0.0),
        jnp.where(sample, state.top_p[row_slot], 1.0), jnp.where(sample, state.top_k[row_slot], 0),
        greedy_only=greedy)
    if exact_numerics:
        logprob, entropy = exact_kernels.token_logprobs(h, head, new, head_layout=layout, kernels=kernels)
    state, reason = _commit(state, row_slot, sample, row_pos, new)
    outputs = (jnp.where(sample, new, -1), jnp.where(sample, reason, NOT_FINISHED),
               jnp.where(sample, logprob, 0.0), jnp.where(sample, entropy, 0.0))
    return state, outputs


def _commit(state: EngineState, slots, sample, pos, new) -> tuple[EngineState, jax.Array]:
    """Record each sampling row's token (at position ``pos + 1``) and apply the stop rules."""
    new_len = pos + 2
    recent = jnp.concatenate([state.recent[slots][:, 1:], new[:, None]], axis=1)
    is_eos = jnp.any(new[:, None] == state.eos_ids[None, :], axis=-1)
    reason = jnp.select(
        [is_eos, new_len >= state.budget_end[slots], _stop_matched(state, slots, recent, new_len),
         new_len >= state.segment_end[slots]],
        [EOS, BUDGET, STOP, LENGTH],
        NOT_FINISHED,
    )
    finished = (reason == EOS) | (reason == BUDGET)
    status = jnp.where(finished, DONE, jnp.where(reason == NOT_FINISHED, RUNNING, PAUSED))
    targets = jnp.where(sample, slots, state.num_slots)  # rows that sampled nothing write nothing
    put = lambda array, values: array.at[targets].set(values, mode="drop")
    return state.replace(
        seq_len=put(state.seq_len, new_len),
        last_token=put(state.last_token, new),
        recent=put(state.recent, recent),
        status=put(state.status, status),
        finish_reason=put(state.finish_reason, reason),
    ), reason


def _runnable(state: EngineState, slots: jax.Array, real: jax.Array) -> jax.Array:
    """Whether each slot is RUNNING and its next key/value (position ``seq_len - 1``) has a page."""
    s = jnp.minimum(slots, state.num_slots - 1)
    col = jnp.clip((state.seq_len[s] - 1) // state.page_size, 0, state.max_pages - 1)
    return real & (state.status[s] == RUNNING) & (state.page_table[s, col] != NULL_PAGE)


def step(state: EngineState, params, ints: jax.Array, floats: jax.Array, *, layout: StepLayout,
         return_on_stop: bool):
    """One engine step (module docstring). Donate ``state``.

    Returns (state, int32 ``[C, R1, 2]`` (sampled token or -1, finish code), float32 ``[C, R1, 2]``
    (log-prob, entropy)), C = ``layout.iterations``, R1 = ``layout.rows``.
    """
    f = layout.views(ints, floats)
    state = _apply_updates(state, f)
    S, T, R1, C = layout.num_slots, layout.tokens, layout.rows, layout.iterations
    row_token = f["row_token"]
    row_is_decode = f["tok_id"].at[row_token].get(mode="fill", fill_value=0) == DECODE
    row_slot = jnp.where(row_is_decode, f["tok_slot"].at[row_token].get(mode="fill", fill_value=S), S)
    first = (f["tok_slot"], f["tok_pos"], f["tok_id"], row_token, f["tile_token"])
    # Later iterations: flat token r is decode row r; no tiles.
    later = (jnp.full((T,), S, jnp.int32).at[:R1].set(row_slot), jnp.full((T,), -1, jnp.int32),
             jnp.full((T,), DECODE, jnp.int32), jnp.arange(R1, dtype=jnp.int32),
             jnp.full(f["tile_token"].shape, T, jnp.int32))
    limit = 1 + jnp.minimum(f["num_decode"][0], C - 1)

    def body(carry):
        i, state, out_i, out_f, _ = carry
        inputs = jax.tree.map(lambda a, b: jnp.where(i == 0, a, b), first, later)
        state, (tokens, reason, logprob, entropy) = _ragged_step(state, params, *inputs, greedy=layout.greedy)
        out_i = out_i.at[i].set(jnp.stack([tokens, reason], axis=-1))
        out_f = out_f.at[i].set(jnp.stack([logprob, entropy], axis=-1))
        go = (i + 1 < limit) & jnp.any(_runnable(state, row_slot, row_slot < S))
        if return_on_stop:
            go &= ~jnp.any(reason != NOT_FINISHED)
        return i + 1, state, out_i, out_f, go

    init = (jnp.int32(0), state, jnp.full((C, R1, 2), -1, jnp.int32).at[..., 1].set(NOT_FINISHED),
            jnp.zeros((C, R1, 2), jnp.float32), jnp.bool_(True))
    _, state, out_i, out_f, _ = jax.lax.while_loop(lambda carry: carry[-1], body, init)
    return state, out_i, out_f


def compile_step(state: EngineState, params, layout: StepLayout, return_on_stop: bool):
    """The compiled :func:`step` of one bucket, for the shapes of ``state`` and ``params`` (concrete or
    abstract: nothing runs)."""
    int_size, float_size = layout.buffer_sizes
    ints = jax.ShapeDtypeStruct((int_size,), jnp.int32)
    floats = jax.ShapeDtypeStruct((float_size,), jnp.float32)
    fn = jax.jit(functools.partial(step, layout=layout, return_on_stop=return_on_stop), donate_argnums=(0,))
    return fn.lower(state, params, ints, floats).compile()




class StepBuilder:
    """Host side of one step's inputs: fills a :class:`StepLayout`'s buffers entry by entry.

    Flat tokens are laid out in the order they are added; a decode token takes a single-query row, a run of
    at most ``tile // 2`` tokens takes single-query rows while some are left (add decode tokens first), any
    other run whole tiles.
    """

    def __init__(self, layout: StepLayout):
        self.layout = layout
        self.ints, self.floats = layout.padding()
        self.view = layout.views(self.ints, self.floats)
        self.num_tokens = self.num_rows = self.num_tiles = 0
        self._counts = {"upd": 0, "fork": 0, "entry": 0, "copy": 0}

    def _as_singles(self, length: int) -> bool:
        """Whether a run goes to single-query rows: short, and rows are left (decode rows come first)."""
        return length <= self.layout.tile // 2 and self.num_rows + length <= self.layout.rows

    def _next(self, kind: str, capacity: int) -> int:
        index = self._counts[kind]
        if index >= capacity:
            raise ValueError(f"step holds at most {capacity} {kind} entries")
        self._counts[kind] = index + 1
        return index

    def room(self, kind: str) -> int:
        capacity = {"upd": self.layout.num_slots, "fork": self.layout.num_slots,
                    "entry": self.layout.num_entries, "copy": self.layout.num_slots}[kind]
        return capacity - self._counts[kind]

    def update(self, slot: int, *, clear: bool, status: int, seq_len: int, last_token: int, recent,
               seed: int, temperature: float, top_p: float, top_k: int, budget_end: int, segment_start: int,
               segment_end: int, stop_seqs) -> None:
        """Write every per-slot field of ``slot`` (and with ``clear`` empty its page-table row first)."""
        i, v = self._next("upd", self.layout.num_slots), self.view
        v["upd_slot"][i], v["upd_clear"][i], v["upd_status"][i] = slot, clear, status
        v["upd_seq_len"][i], v["upd_last_token"][i] = seq_len, last_token
        v["upd_recent"][i] = recent
        v["upd_seed"][i] = np.uint32(seed).view(np.int32)
        v["upd_temperature"][i], v["upd_top_p"][i], v["upd_top_k"][i] = temperature, top_p, top_k
        v["upd_budget_end"][i], v["upd_segment_start"][i] = budget_end, segment_start
        v["upd_segment_end"][i] = segment_end
        v["upd_stop_seqs"][i] = stop_seqs

    def fork(self, src: int, dst: int, col: int, page: int) -> None:
        """``dst``'s page-table row becomes ``src``'s (before this step's entries) but for ``page`` at
        ``col``."""
        i, v = self._next("fork", self.layout.num_slots), self.view
        v["fork_src"][i], v["fork_dst"][i], v["fork_col"][i], v["fork_page"][i] = src, dst, col, page

    def entry(self, slot: int, col: int, page: int) -> None:
        i = self._next("entry", self.layout.num_entries)
        self.view["entry_slot"][i], self.view["entry_col"][i], self.view["entry_page"][i] = slot, col, page

    def copy(self, src: int, dst: int) -> None:
        i = self._next("copy", self.layout.num_slots)
        self.view["copy_src"][i], self.view["copy_dst"][i] = src, dst

    def poison(self, pages) -> None:
        if self.layout.poison:
            self.view["poison"][list(pages)] = 1

    def run(self, slot: int, start: int, tokens, *, singles: bool | None = None) -> None:
        """Feed ``tokens`` of ``slot`` at positions ``start, start + 1, ...`` (prefill: nothing sampled), as
        single-query rows or tiles (``singles``; None: the rule in the class docstring)."""
        n = len(tokens)
        singles = self._as_singles(n) if singles is None else singles
        if self.num_tokens + n > self.layout.tokens or (
                self.num_rows + n > self.layout.rows if singles
                else self.num_tiles + -(-n // self.layout.tile) > self.layout.tiles):
            raise ValueError(f"a run of {n} tokens does not fit the step")
        t0, v = self.num_tokens, self.view
        v["tok_slot"][t0 : t0 + n] = slot
        v["tok_pos"][t0 : t0 + n] = np.arange(start, start + n)
        v["tok_id"][t0 : t0 + n] = tokens
        if singles:
            self.num_tokens += n
            v["row_token"][self.num_rows : self.num_rows + n] = np.arange(t0, t0 + n)
            self.num_rows += n
            return
        self.num_tokens += n
        q = self.layout.tile
        for j in range(-(-n // q)):
            width = min(q, n - j * q)
            v["tile_token"][self.num_tiles, :width] = np.arange(t0 + j * q, t0 + j * q + width)
            self.num_tiles += 1

    def decode(self, slot: int) -> int:
        """Feed ``slot``'s pending token (and sample after it); returns its output row."""
        if self.num_tokens >= self.layout.tokens or self.num_rows >= self.layout.rows:
            raise ValueError("no room for a decode row")
        t, row, v = self.num_tokens, self.num_rows, self.view
        v["tok_slot"][t], v["tok_pos"][t], v["tok_id"][t] = slot, -1, DECODE
        v["row_token"][row] = t
        self.num_tokens, self.num_rows = t + 1, row + 1
        return row

    def decode_iterations(self, n: int) -> None:
        """Pure decode iterations after the ragged one (at most ``decode_chunk - 1``)."""
        self.view["num_decode"][0] = n

"""Host side of the engine: :class:`EngineCore` (synchronous, pipelined) and the asyncio API (:class:`Engine`,
:class:`Session`).

:class:`EngineCore` owns the :class:`~rstar2jax.engine.EngineState` and drives the device one
:func:`~rstar2jax.engine.step.step` at a time, keeping one step in flight: it dispatches step k+1 (JAX's
asynchronous dispatch returns at once) before it reads step k's outputs, so the device never waits for the
host to look at tokens. Every step carries the decode token of each running session, prefill chunks of new
prompts and appended tool outputs (up to the largest token bucket, first come first served: a long prompt is
prefilled over several steps beside the running decodes) and the update data (admissions, segment starts,
releases, forks, page-table entries). Pages are given a step ahead (they were promised at admission), so a
session never waits for one. What comes back per step is compact (per decode row and iteration: token,
log-prob, entropy, why its segment ended) and streams to the sessions as it arrives; a session the host stops
(a stop string, a client gone) is released with the next step and its overshoot discarded, so its output is
what a pause-at-every-token engine would give (sampling keys are ``fold_in(key(seed), position)``: timing
does not change tokens).

:class:`Engine` runs an :class:`EngineCore` on a thread of its own, so that each rollout is plain async
code::

    async with Engine(params, config, EngineConfig(num_slots=32, max_len=8192)) as engine:
        sessions = await engine.open(prompt_ids, n=16, sampling=SamplingParams(), max_tokens=8000)
        segment = await sessions[0].generate(stop=[tool_call_end_ids])  # other slots keep decoding meanwhile
        sessions[0].append(tool_response_ids)  # inserted (loss mask 0), prefilled by the next generate
        async for chunk in sessions[0].stream():  # tokens as they are sampled
            ...
        sessions[0].close()

A group of ``n`` sessions is admitted, first come first served, once ``n`` slots are free and the pool has
the pages the group can ever need that are not promised to sessions already admitted (its prompt's pages,
held once for the group, plus each session's response budget; cached pages count as free): so nothing
admitted ever waits for a page, and work that does not fit waits in the queue, losing nothing. The prompt is
prefilled once and forked to the siblings, which share its full pages; whole pages of a prefix already in the
pool (another group's system prompt, an earlier turn of the same chat) are attached instead of prefilled (the
prefix cache, :mod:`~rstar2jax.engine.pages`). A paused session holds its slot and pages while its coroutine
runs the tool call; a finished one (EOS or budget) frees them at once.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import threading
from collections.abc import AsyncIterator, Sequence

import jax
import numpy as np

from rstar2jax.engine.config import EngineConfig, SamplingParams, pages_for
from rstar2jax.engine.pages import PageAllocator
from rstar2jax.engine.state import (
    FINISH_REASON_NAMES,
    FREE,
    NO_POLICY_VERSION,
    NO_TOKEN,
    PAUSED,
    RUNNING,
    EngineState,
    engine_model_config,
    init_state,
)
from rstar2jax.engine.step import StepBuilder, StepLayout, compile_step
from rstar2jax.models import ModelConfig, layers_are_unstacked, unstack_layers

__all__ = ["Chunk", "Engine", "EngineConfig", "EngineCore", "SamplingParams", "Segment", "Session"]

_DEFAULT_CONFIG, _DEFAULT_SAMPLING = EngineConfig(), SamplingParams()
#: Layer count up to which ``EngineConfig.unstacked_decode=None`` unrolls the layers on CPU (see
#: ``rstar2jax.engine``: the scan's per-step copies of weight slices cost more than unrolling's compile
#: time there).
UNROLL_MAX_LAYERS = 4


@dataclasses.dataclass(frozen=True)
class Segment:
    """Tokens sampled by one ``generate`` call, their raw log-probs, and why it ended: ``"stop"`` (a stop
    sequence, included in ``tokens``) or ``"length"`` (``max_new_tokens``): the session is paused and may go
    on; ``"eos"`` or ``"budget"`` (``max_tokens`` used up): the session is done. ``entropies``: for each
    token, the entropy of the raw policy distribution it was sampled from (see
    :class:`~rstar2jax.engine.EngineState`). ``policy_versions``: for each token, the policy version (the
    trainer step whose parameters sampled it) of the engine that sampled it
    (:attr:`EngineCore.policy_version`)."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    entropies: list[float] = dataclasses.field(default_factory=list)
    policy_versions: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Chunk:
    """Tokens of a segment in flight, as they arrive from one device step (:meth:`Session.stream`), with
    their raw log-probs, entropies and policy version; ``finish_reason`` is set on a segment's last chunk
    (as :attr:`Segment.finish_reason`)."""

    tokens: list[int]
    logprobs: list[float]
    entropies: list[float]
    policy_version: int
    finish_reason: str | None = None


class _Record:
    """Host mirror of one sequence: what the trainer needs (prompt, response, loss mask, log-probs). Updated
    by the consumer of the engine's chunks (the asyncio loop for :class:`Engine`)."""

    def __init__(self, prompt_ids: list[int], max_tokens: int):
        self.prompt_ids = prompt_ids
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.entropies: list[float] = []
        self.policy_versions: list[int] = []
        self.pending: list[int] = []  # appended, not yet sent to the engine
        self.budget_end = len(prompt_ids) + max_tokens
        self.slot: int | None = None  # None once closed or finished
        self.finish_reason: str | None = None  # "eos" / "budget" once done
        self.cached_tokens = 0  # prompt tokens whose keys/values came from the prefix cache

    @property
    def length(self) -> int:
        """Tokens of the sequence (prompt + response), appended ones included once sent."""
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def remaining(self) -> int:
        """Tokens the sequence may still grow by, appended ones included."""
        return self.budget_end - self.length - len(self.pending)

    def add(self, tokens: Sequence[int], logprobs: Sequence[float] | None,
            entropies: Sequence[float] | None = None, policy_version: int = NO_POLICY_VERSION) -> None:
        """Record tokens: sampled (with their log-probs, entropies and the version of the policy that sampled
        them) or inserted (``logprobs=None``: version ``NO_POLICY_VERSION``)."""
        self.response_ids += tokens
        self.loss_mask += [0 if logprobs is None else 1] * len(tokens)
        self.logprobs += [0.0] * len(tokens) if logprobs is None else logprobs
        self.entropies += [0.0] * len(tokens) if entropies is None else entropies
        version = NO_POLICY_VERSION if logprobs is None else policy_version
        self.policy_versions += [version] * len(tokens)

    def receive(self, chunk: Chunk) -> None:
        """Record a chunk of sampled tokens (:meth:`EngineCore.step`'s output); a finished session's slot is
        gone."""
        self.add(chunk.tokens, chunk.logprobs, chunk.entropies, chunk.policy_version)
        if chunk.finish_reason in ("eos", "budget"):
            self.finish_reason, self.slot = chunk.finish_reason, None


# Phases of a sequence on the host (what the device may run next).
_PREFILL, _FORK_WAIT, _READY, _RUNNING, _CLOSED = "prefill", "fork_wait", "ready", "running", "closed"


class _Seq:
    """The core's view of one slot's sequence: its whole token list (prompt, response, appended tokens,
    the pending last one included), how far its keys/values are dispatched, and its phase."""

    def __init__(self, record: _Record, slot: int, seed: int, sampling: SamplingParams):
        self.record, self.slot, self.seed, self.sampling = record, slot, seed, sampling
        self.tokens: list[int] = list(record.prompt_ids)
        self.kv = 0  # positions below this have their key/value writes dispatched
        self.phase = _PREFILL
        # A queued segment: (stop table, max new tokens or None, tokens to append first).
        self.start: tuple[np.ndarray, int | None, list[int]] | None = None
        self.stop_table: np.ndarray | None = None
        self.segment_start = self.segment_end = 0
        self.reserve = 0  # pages the sequence may still take from the pool (promised at admission)
        self.siblings: list[_Seq] = []  # a group's source: the sessions forked from it once prefilled
        self.source: _Seq | None = None  # a sibling: its group's source
        self.in_flight: collections.deque[int] = collections.deque()  # iterations of dispatched steps
        self.copy: tuple[int, int] | None = None  # a sibling: (source page, its private copy)
        self.closing = False  # a source closed before its siblings were forked

    @property
    def budget_end(self) -> int:
        return self.record.budget_end


_cast = jax.jit(lambda params, dtype: jax.tree.map(lambda p: p.astype(dtype), params),
                static_argnames=("dtype",))
_unstack = jax.jit(lambda params: unstack_layers({"layers": params})["layers"])


def engine_params(params, config: ModelConfig, unstacked: bool | None = None):
    """The weights an engine decodes from: the caller's tree, cast once to ``config.compute_dtype`` where a
    leaf differs, and with ``unstacked`` (see ``EngineConfig.unstacked_decode``) its layers split into
    per-layer buffers (layers unrolled) or left stacked (layers scanned). Leaves needing neither are the
    caller's buffers, not copies."""
    compute = jax.numpy.dtype(config.compute_dtype)
    if unstacked is None:
        unstacked = jax.default_backend() == "cpu" and config.num_layers <= UNROLL_MAX_LAYERS
    if not all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(params)):
        params = jax.device_put(params)  # once, not with every step
    cast = {name: _cast(value, config.compute_dtype)
            if any(leaf.dtype != compute for leaf in jax.tree.leaves(value)) else value
            for name, value in params.items()}
    if unstacked and not layers_are_unstacked(cast):
        cast["layers"] = _unstack(cast["layers"])
    return cast


def _slot_seed(entropy: Sequence[int]) -> int:
    """A well-mixed uint32 seed from a tuple of ints (so nearby tuples give unrelated streams)."""
    return int(np.random.SeedSequence([int(e) & 0xFFFFFFFF for e in entropy]).generate_state(1)[0])


def _abstract(tree):
    abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return jax.tree.map(abstract, tree)


_PROGRAMS: dict = {}  # (bucket layout, return_on_stop, abstract state and params) -> compiled step
_PROGRAMS_LOCK = threading.Lock()
# Compiles programs an engine is likely to need next while it runs (or compiles) the current one.
_COMPILE_AHEAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rstar2jax-compile")


def _program(abstract, layout: StepLayout, return_on_stop: bool):
    """The compiled step for the shapes ``abstract`` = (state, params): compiled once per process (engines of
    equal shapes share it, as does JAX's persistent compilation cache across processes)."""
    key = (layout, return_on_stop, jax.tree.structure(abstract),
           tuple((x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(abstract)))
    with _PROGRAMS_LOCK:
        entry = _PROGRAMS.get(key)
        if entry is None:
            entry = _PROGRAMS[key] = concurrent.futures.Future()
            owner = True
        else:
            owner = False
    if owner:
        try:
            entry.set_result(compile_step(*abstract, layout, return_on_stop))
        except BaseException as error:
            with _PROGRAMS_LOCK:
                del _PROGRAMS[key]
            entry.set_exception(error)
    return entry.result()


@dataclasses.dataclass
class _Dispatched:
    """A step in flight: its outputs (device arrays) and which session each decode row belongs to."""

    outputs: tuple
    rows: list[tuple[int, _Seq]]
    iterations: int


class EngineCore:
    """Synchronous engine: owns the device state, maps sequences to slots and pages, and runs the pipelined
    step loop (module docstring).

    Not thread-safe: one caller at a time. :class:`Engine` drives it from a thread of its own;
    :func:`~rstar2jax.engine.generate` drives it directly. Use: :meth:`admit` groups (when
    :meth:`admissible`), :meth:`start` their segments, call :meth:`step` while :attr:`num_active` (it returns
    the chunks of tokens that arrived), :meth:`close` sessions.

    ``policy_version`` (an int >= 0, the trainer step whose parameters ``params`` are) tags every token the
    engine samples (``Segment.policy_versions``); inserted tokens get ``NO_POLICY_VERSION`` (-1).
    """

    def __init__(self, params, config: ModelConfig, engine_config: EngineConfig, *, policy_version: int = 0):
        if not isinstance(policy_version, (int, np.integer)) or isinstance(policy_version, bool) or (
                policy_version < 0):
            raise ValueError(f"policy_version must be an int >= 0, got {policy_version!r}")
        self.policy_version = int(policy_version)
        self.config = config
        self.engine_config = cfg = engine_config
        self.params = engine_params(params, engine_model_config(config, cfg), cfg.unstacked_decode)
        self.state: EngineState = init_state(config, cfg)
        self.pages = PageAllocator(cfg.pool_pages, cfg.page_size, cfg.num_slots, cfg.max_pages,
                                   cache=cfg.prefix_sharing)
        self._layouts = {t: StepLayout.of(cfg, t) for t in cfg.token_buckets}
        self._abstract = (_abstract(self.state), _abstract(self.params))
        self._programs: dict[StepLayout, object] = {}  # this engine's compiled steps, by bucket
        self._reserved = 0  # pages promised to admitted sequences, not yet taken from the pool
        self._free = collections.deque(range(cfg.num_slots))
        self._seqs: dict[int, _Seq] = {}  # id(record) -> sequence
        self._updates: dict[int, tuple[_Seq | None, bool]] = {}  # slot -> (sequence or None: FREE, clear)
        self._entries: list[tuple[int, int, int]] = []  # page-table entries for the next steps
        self._copies: list[tuple[int, int]] = []
        self._forks: list[tuple[int, int, int, int]] = []  # (src, dst, column, private page)
        self._freed: list[int] = []  # pages freed since the last step (poisoned in tests)
        self._in_flight: collections.deque[_Dispatched] = collections.deque()
        self._last_prefilled = False  # whether the last step prefilled (the next one decodes a chunk)
        self._reported: list[tuple[_Record, Chunk]] = []
        self.stats = collections.Counter()  # steps, prompt_tokens, cached_tokens, sampled_tokens

    # ---- sizes

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_free_pages(self) -> int:
        """Pages neither held by a sequence nor promised to one (cached pages count as free)."""
        return self.pages.num_free - self._reserved

    @property
    def num_active(self) -> int:
        """Sequences with work queued or in flight (prefill, a segment), plus steps and chunks not yet
        read."""
        busy = sum(bool(s.phase in (_PREFILL, _FORK_WAIT, _RUNNING) or s.start is not None or s.siblings)
                   for s in self._seqs.values())
        return busy + len(self._in_flight) + len(self._reported)

    @property
    def kv_bytes_held(self) -> int:
        """Bytes of the pages sequences hold now."""
        return self.pages.num_used * self.state.pages.nbytes_per_page

    def warmup(self, threads: int = 2) -> None:
        """Compile every bucket's step program ahead of time (in ``threads`` threads; nothing runs), so that
        serving never compiles."""
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(self._program, reversed(self._layouts.values())))

    @property
    def programs(self) -> int:
        """Step programs this engine has used (each compiled once per process)."""
        return len(self._programs)

    def _program(self, layout: StepLayout):
        program = self._programs.get(layout)
        if program is None:
            program = self._programs[layout] = _program(self._abstract, layout,
                                                        self.engine_config.return_on_stop)
        return program

    def _compile_ahead(self, layout: StepLayout) -> None:
        """Compile ``layout``'s program in the background unless this engine has it."""
        if layout not in self._programs:
            _COMPILE_AHEAD.submit(_program, self._abstract, layout, self.engine_config.return_on_stop)

    def stop_table(self, stop: Sequence[Sequence[int]]) -> np.ndarray:
        """``[max_stops, max_stop_len]`` right-aligned stop table; raises ValueError if it does not fit."""
        cfg = self.engine_config
        table = np.full((cfg.max_stops, cfg.max_stop_len), NO_TOKEN, np.int32)
        if len(stop) > cfg.max_stops:
            raise ValueError(f"{len(stop)} stop sequences given; this engine takes at most {cfg.max_stops}")
        for row, seq in zip(table, stop, strict=False):
            seq = [int(t) for t in seq]
            if not 0 < len(seq) <= cfg.max_stop_len or min(seq) < 0:
                raise ValueError(f"stop sequence {seq} must be 1..{cfg.max_stop_len} non-negative token ids")
            row[cfg.max_stop_len - len(seq) :] = seq
        return table

    # ---- requests

    def pages_needed(self, prompt_ids: Sequence[int], n: int, max_tokens: int, *, shared: int = 0) -> int:
        """Pages a group can ever take from the pool: its prompt's (but ``shared`` whole pages already in the
        pool), a private copy of the prompt's last page per sibling, and each session's response budget."""
        ps = self.engine_config.page_size
        prompt_pages = pages_for(len(prompt_ids), ps)
        growth = pages_for(len(prompt_ids) + max_tokens, ps) - prompt_pages
        return prompt_pages - shared + (n - 1) + n * growth

    def check_request(self, prompt_ids: Sequence[int], n: int, max_tokens: int) -> None:
        """Raise ValueError for a request that could never be admitted."""
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        if len(prompt_ids) + max_tokens > self.engine_config.max_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"slot capacity max_len={self.engine_config.max_len}"
            )
        if not isinstance(n, int) or not 1 <= n <= self.engine_config.num_slots:
            raise ValueError(f"n={n} must be in [1, num_slots={self.engine_config.num_slots}]")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.config.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, vocab_size={self.config.vocab_size})")
        needed, pool = self.pages_needed(prompt_ids, n, max_tokens), self.engine_config.pool_pages - 1
        if needed > pool:
            raise ValueError(
                f"a group of {n} with a {len(prompt_ids)}-token prompt and max_tokens={max_tokens} needs "
                f"{needed} KV pages of {self.engine_config.page_size} tokens; the pool holds only {pool} "
                "(raise EngineConfig.num_pages)"
            )

    def _shared_prefix(self, prompt_ids: Sequence[int]) -> list[int]:
        return self.pages.match(prompt_ids) if self.engine_config.prefix_sharing else []

    def admissible(self, requests: Sequence[tuple[Sequence[int], int, SamplingParams, int, Sequence[int]]]
                   ) -> int:
        """How many of ``requests`` (in order) fit in the free slots and unpromised pages now (host
        arithmetic only)."""
        slots, pages = self.num_free_slots, self.num_free_pages
        for count, (prompt_ids, n, _, max_tokens, _) in enumerate(requests):
            shared = self._shared_prefix(prompt_ids)
            needed = self.pages_needed(prompt_ids, n, max_tokens, shared=len(shared))
            needed += self.pages.num_cached_in(shared)  # attached cached pages stop counting as free
            if n > slots or needed > pages:
                return count
            slots, pages = slots - n, pages - needed
        return len(requests)

    def admit(
        self, requests: Sequence[tuple[Sequence[int], int, SamplingParams, int, Sequence[int]]]
    ) -> list[list[_Record]]:
        """Take slots and pages for groups ``(prompt_ids, n, sampling, max_tokens, seed_entropy)``: each
        prompt is prefilled once by the next steps (but whole pages of a prefix already in the pool) and
        forked to its siblings (sibling ``j`` seeded by ``(*seed_entropy, j)``), which share its full pages.

        Returns each group's records (paused once prefilled: :meth:`start` them). Raises ValueError if they do
        not fit (see :meth:`admissible`).
        """
        for prompt_ids, n, _, max_tokens, _ in requests:
            self.check_request(prompt_ids, n, max_tokens)
        if self.admissible(requests) < len(requests):
            raise ValueError(f"{len(requests)} groups requested; {self.num_free_slots} slots and "
                             f"{self.num_free_pages} pages are free")
        ps = self.engine_config.page_size
        groups = []
        for prompt_ids, n, sampling, max_tokens, entropy in requests:
            prompt_ids = [int(t) for t in prompt_ids]
            shared = self._shared_prefix(prompt_ids)
            self._reserved += self.pages_needed(prompt_ids, n, max_tokens, shared=len(shared))
            seqs = []
            for j in range(n):
                record = _Record(prompt_ids, max_tokens)
                seq = _Seq(record, self._free.popleft(), _slot_seed((*entropy, j)), sampling)
                record.slot = seq.slot
                seq.reserve = pages_for(record.budget_end, ps)  # all its pages, shared ones deducted below
                self._seqs[id(record)] = seq
                self._updates[seq.slot] = (seq, True)
                seqs.append(seq)
            src = seqs[0]
            if shared:
                self.pages.attach(src.slot, shared)
                self._entries += [(src.slot, col, page) for col, page in enumerate(shared)]
                src.reserve -= len(shared)
                src.kv = len(shared) * ps
                src.record.cached_tokens = src.kv
            self._grow(src, len(prompt_ids))
            if n > 1:  # the siblings' pages now; the device copies src's last page once it is prefilled
                copies = self.pages.fork(src.slot, [s.slot for s in seqs[1:]], len(prompt_ids))
                self._reserved -= len(copies)  # each took its copy of the prompt's last page
                for sibling, pair in zip(seqs[1:], copies, strict=True):
                    sibling.reserve -= int(self.pages.held[sibling.slot])
                    sibling.phase, sibling.source, sibling.copy = _FORK_WAIT, src, pair
                src.siblings = seqs[1:]
            if src.kv >= len(prompt_ids) - 1:
                src.phase = _READY  # nothing to prefill: all but the pending token came from the cache
            self.stats["prompt_tokens"] += len(prompt_ids)
            self.stats["cached_tokens"] += src.kv
            groups.append([s.record for s in seqs])
        return groups

    def start(self, record: _Record, stop: Sequence[Sequence[int]] = (), max_new_tokens: int | None = None,
              appended: Sequence[int] = ()) -> None:
        """Queue a generation segment for ``record`` (run by the next :meth:`step`), after inserting the
        ``appended`` tokens (a tool response: prefilled first)."""
        seq = self._seqs.get(id(record))
        if seq is None or seq.phase == _CLOSED:
            raise ValueError("the session is closed or finished")
        if seq.start is not None or seq.phase == _RUNNING:
            raise RuntimeError("the session already has a segment in flight")
        if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if len(seq.tokens) + len(appended) > record.budget_end:
            raise ValueError(f"{len(appended)} tokens appended but only "
                             f"{record.budget_end - len(seq.tokens)} remain in the budget")
        seq.start = (self.stop_table(stop), max_new_tokens, [int(t) for t in appended])
        self._prepare_start(seq)

    def _prepare_start(self, seq: _Seq) -> None:
        """Insert a queued segment's appended tokens once ``seq`` may take them (not before its group is
        forked: the siblings copy its prompt's last page); a session with no budget left is done at once."""
        table, limit, appended = seq.start
        if seq.siblings or seq.phase == _FORK_WAIT:
            return
        if appended:
            seq.tokens += appended
            seq.start = (table, limit, [])
            if seq.phase == _READY:
                seq.phase = _PREFILL
        if len(seq.tokens) >= seq.budget_end:  # nothing may be sampled
            self._reported.append((seq.record, Chunk([], [], [], self.policy_version, "budget")))
            self._release(seq)

    def close(self, record: _Record) -> None:
        """Free the record's slot and pages (on the device with the next step); its outputs still in flight
        are discarded. Idempotent. A group's source closed before its siblings were forked goes on
        prefilling for them, invisibly, and is freed once they are."""
        record.slot = None
        seq = self._seqs.get(id(record))
        if seq is not None:
            self._release(seq)

    def _release(self, seq: _Seq) -> None:
        seq.start = None
        if seq.siblings:
            seq.closing = True
            return
        del self._seqs[id(seq.record)]
        seq.phase = _CLOSED
        source = seq.source
        if source is not None and seq in source.siblings:  # closed before its fork: none will come
            source.siblings.remove(seq)
            if source.closing and not source.siblings:
                self._release(source)
        if self.engine_config.prefix_sharing:  # its written pages stay findable: a chat's next turn hits
            self.pages.register(seq.slot, seq.tokens, min(seq.kv, len(seq.tokens) - 1))
        self._freed += self.pages.release(seq.slot)
        self._reserved -= seq.reserve
        seq.reserve = 0
        self._updates[seq.slot] = (None, True)
        self._free.append(seq.slot)

    # ---- device work

    def _grow(self, seq: _Seq, num_tokens: int) -> None:
        """Take pages from the pool (promised at admission) for ``num_tokens`` tokens of ``seq``."""
        new = self.pages.grow(seq.slot, min(num_tokens, seq.budget_end))
        self._entries += [(seq.slot, col, page) for col, page in new]
        seq.reserve -= len(new)
        self._reserved -= len(new)
        if seq.reserve < 0:
            raise AssertionError(f"slot {seq.slot} took more pages than promised")

    def _bucket(self, tokens: int, rows: int, tiles: int) -> StepLayout:
        for layout in self._layouts.values():
            if layout.tokens >= tokens and layout.rows >= rows and layout.tiles >= tiles:
                return layout
        raise AssertionError(f"no bucket holds {tokens} tokens, {rows} rows, {tiles} tiles")

    def _fork_ready(self) -> None:
        """Fork on the device the siblings of every source whose prompt prefill went out in an earlier step
        (the page copies run before this step's writes)."""
        cfg = self.engine_config
        for src in list(self._seqs.values()):
            if not src.siblings or src.phase == _PREFILL:
                continue
            if len(src.siblings) > min(cfg.num_slots - len(self._copies), cfg.num_slots - len(self._forks)):
                continue
            for sibling in src.siblings:
                (page, copy), col = sibling.copy, int(self.pages.held[sibling.slot]) - 1
                self._copies.append((page, copy))
                self._forks.append((src.slot, sibling.slot, col, copy))
                sibling.tokens, sibling.kv, sibling.phase = list(src.tokens), src.kv, _READY
                self._updates[sibling.slot] = (sibling, False)
            src.siblings = []
            if src.closing:
                self._release(src)

    def _begin(self, seq: _Seq) -> None:
        """Make a ready sequence with a queued segment RUNNING from this step."""
        table, limit, _ = seq.start
        # The device clips the segment to the budget, so "no limit" is the whole budget.
        end = seq.budget_end if limit is None else min(len(seq.tokens) + limit, seq.budget_end)
        seq.start, seq.phase = None, _RUNNING
        seq.stop_table, seq.segment_start, seq.segment_end = table, len(seq.tokens), end
        self._updates[seq.slot] = (seq, self._updates.get(seq.slot, (None, False))[1])

    def _startable(self, seq: _Seq) -> bool:
        return (seq.phase == _READY and seq.start is not None and not seq.start[2] and not seq.siblings
                and not seq.closing)

    def _schedule(self, updates_only: bool = False):
        """Decide the next step: (bucket, decoding sequences, prefill runs, iterations), or None if there is
        nothing to send. ``updates_only``: no decode or prefill, just the update data."""
        cfg = self.engine_config
        tile = cfg.prefill_tile
        if updates_only:
            if not (self._updates or self._entries or self._copies or self._forks):
                return None
            return self._layouts[cfg.token_buckets[0]], [], [], 1
        self._fork_ready()
        for seq in list(self._seqs.values()):
            if seq.start is not None and seq.start[2]:
                self._prepare_start(seq)  # appended tokens waiting for the group's fork
            if self._startable(seq):
                self._begin(seq)
        decoding = [s for s in self._seqs.values() if s.phase == _RUNNING]
        for seq in decoding:  # pages a step ahead: the step in flight and this one may each fill a chunk
            self._grow(seq, len(seq.tokens) + sum(seq.in_flight) + cfg.decode_chunk)
        largest = self._layouts[cfg.max_step_tokens]
        room = largest.num_entries
        blocked = {slot for slot, _, _ in self._entries[room:]}  # their pages reach the device later
        room -= len(self._entries)
        tokens, rows, tiles, runs = len(decoding), len(decoding), 0, []
        # Prefill goes into every other step while sessions decode: a prefill step decodes one token per
        # session, the decode step after it a whole chunk, so arriving work never starves the running.
        prefill = not (decoding and self._last_prefilled)
        for seq in self._seqs.values() if prefill else ():
            if seq.phase != _PREFILL:
                continue
            if seq.slot in blocked:
                break  # first come, first served
            n = min(len(seq.tokens) - 1 - seq.kv, cfg.max_step_tokens - tokens)  # the last one stays pending
            singles = n <= tile // 2 and rows + n <= largest.rows
            if not singles:
                n = min(n, (largest.tiles - tiles) * tile)
            new_pages = pages_for(seq.kv + n + 1, cfg.page_size) - int(self.pages.held[seq.slot])
            if n <= 0 or new_pages > room:
                break
            rows, tiles = (rows + n, tiles) if singles else (rows, tiles + -(-n // tile))
            tokens += n
            runs.append((seq, seq.kv, seq.tokens[seq.kv : seq.kv + n], singles))
            seq.kv += n
            self._grow(seq, seq.kv + 1)
            room = largest.num_entries - len(self._entries)
            if cfg.prefix_sharing:
                self.pages.register(seq.slot, seq.tokens, seq.kv)
            if seq.kv == len(seq.tokens) - 1:  # prefilled: it may run in this very step
                seq.phase = _READY
                if self._startable(seq) and rows < largest.rows and tokens < cfg.max_step_tokens:
                    self._begin(seq)
                    decoding.append(seq)
                    tokens, rows = tokens + 1, rows + 1
        if not (decoding or runs or self._updates or self._entries or self._copies or self._forks):
            return None
        iterations = 1 if runs else cfg.decode_chunk
        self._last_prefilled = bool(runs)
        return self._bucket(tokens, rows, tiles), decoding, runs, iterations

    def _build(self, layout: StepLayout, decoding, runs, iterations) -> tuple[StepBuilder, list]:
        builder = StepBuilder(layout)
        rows = [(builder.decode(seq.slot), seq) for seq in decoding]
        for seq, start, tokens, singles in runs:
            builder.run(seq.slot, start, tokens, singles=singles)
        builder.decode_iterations(iterations - 1)
        W = self.engine_config.max_stop_len
        for slot, (seq, clear) in self._updates.items():
            if seq is None:
                builder.update(slot, clear=clear, status=FREE, seq_len=0, last_token=0,
                               recent=np.full((W,), NO_TOKEN), seed=0, temperature=0.0, top_p=1.0, top_k=0,
                               budget_end=0, segment_start=0, segment_end=0, stop_seqs=NO_TOKEN)
                continue
            recent = np.full((W,), NO_TOKEN, np.int32)
            tail = seq.tokens[-W:]
            recent[W - len(tail):] = tail
            running = seq.phase == _RUNNING
            builder.update(
                slot, clear=clear, status=RUNNING if running else PAUSED, seq_len=len(seq.tokens),
                last_token=seq.tokens[-1], recent=recent, seed=seq.seed,
                temperature=seq.sampling.temperature, top_p=seq.sampling.top_p, top_k=seq.sampling.top_k,
                budget_end=min(seq.budget_end, self.engine_config.max_len),
                segment_start=seq.segment_start if running else len(seq.tokens),
                segment_end=seq.segment_end if running else 0,
                stop_seqs=seq.stop_table if running else NO_TOKEN)
        self._updates = {}
        room = builder.room("entry")
        for slot, col, page in self._entries[:room]:
            builder.entry(slot, col, page)
        self._entries = self._entries[room:]
        for fork in self._forks:
            builder.fork(*fork)
        self._forks = []
        for src, dst in self._copies:
            builder.copy(src, dst)
        self._copies = []
        builder.poison(self._freed)
        self._freed = []
        return builder, rows

    def step(self, *, updates_only: bool = False) -> list[tuple[_Record, Chunk]]:
        """Dispatch the next step if there is work (keeping at most one step in flight beside it), then read
        the oldest step's outputs once a newer one is queued (or nothing more is to come). Returns the chunks
        of tokens that arrived, per record, in order; a chunk with a ``finish_reason`` ends its segment (a
        finished session's slot and pages are freed)."""
        plan = self._schedule(updates_only)
        if plan is not None:
            layout, decoding, runs, iterations = plan
            builder, rows = self._build(layout, decoding, runs, iterations)
            if runs:  # the decode steps after this prefill: their program may compile meanwhile
                starting = sum(s.phase == _READY and s.start is not None for s in self._seqs.values())
                n = min(len(decoding) + starting, self.engine_config.num_slots)
                self._compile_ahead(self._bucket(n, n, 0))
            program = self._program(layout)
            self.state, out_i, out_f = program(self.state, self.params, builder.ints, builder.floats)
            for _, seq in rows:
                seq.in_flight.append(iterations)
            self._in_flight.append(_Dispatched((out_i, out_f), rows, iterations))
            self.stats["steps"] += 1
        if self._in_flight and (plan is None or len(self._in_flight) > 1):
            self._collect(self._in_flight.popleft())
        reported, self._reported = self._reported, []
        return reported

    def flush(self) -> list[tuple[_Record, Chunk]]:
        """Send what is queued (releases, page entries) and read every step in flight, starting nothing new
        (running sessions stay running for later steps); returns the chunks that arrived."""
        reported = []
        while self._in_flight or self._updates or self._entries or self._forks or self._copies:
            reported += self.step(updates_only=True)
        return reported

    def _collect(self, done: _Dispatched) -> None:
        out_i, out_f = jax.device_get(done.outputs)
        for row, seq in done.rows:
            seq.in_flight.popleft()
            if seq.phase != _RUNNING or self._seqs.get(id(seq.record)) is not seq:
                continue  # closed by the host meanwhile: its overshoot is discarded
            tokens = out_i[:, row, 0]
            sampled = np.flatnonzero(tokens >= 0)
            if not len(sampled):
                continue
            new = tokens[sampled].tolist()
            seq.tokens += new
            seq.kv = len(seq.tokens) - 1
            self.stats["sampled_tokens"] += len(new)
            reasons = out_i[sampled, row, 1]
            finish = int(reasons[-1])
            chunk = Chunk(new, out_f[sampled, row, 0].tolist(), out_f[sampled, row, 1].tolist(),
                          self.policy_version, FINISH_REASON_NAMES.get(finish))
            self._reported.append((seq.record, chunk))
            if finish:
                seq.phase = _READY
                if chunk.finish_reason in ("eos", "budget"):
                    self._release(seq)
                else:  # paused (a tool call, a segment limit): the pages given ahead, never written, go back
                    freed = self.pages.shrink(seq.slot, len(seq.tokens))
                    self._freed += freed
                    seq.reserve += len(freed)
                    self._reserved += len(freed)


class Session:
    """One sequence (rollout) in an :class:`Engine`; create with :meth:`Engine.open`.

    The host record (``prompt_ids``, ``response_ids``, ``loss_mask``, ``logprobs``) is exactly what
    :class:`rstar2jax.agent.Trajectory` needs: ``response_ids`` holds sampled and appended tokens in order,
    ``loss_mask`` is 1 on sampled ones, ``logprobs`` their raw policy log-probs (0.0 on appended ones);
    ``entropies`` the entropy of the distribution each was sampled from (0.0 on appended ones);
    ``policy_versions`` the policy version that sampled each (``NO_POLICY_VERSION``, -1, on appended ones).
    ``cached_tokens``: prompt tokens whose keys/values came from the prefix cache.
    """

    def __init__(self, engine: Engine, record: _Record):
        self._engine = engine
        self._record = record
        self._busy = False

    prompt_ids = property(lambda self: list(self._record.prompt_ids))
    response_ids = property(lambda self: list(self._record.response_ids + self._record.pending))
    loss_mask = property(lambda self: self._record.loss_mask + [0] * len(self._record.pending))
    logprobs = property(lambda self: self._record.logprobs + [0.0] * len(self._record.pending))
    entropies = property(lambda self: self._record.entropies + [0.0] * len(self._record.pending),
                         doc="per response token: its sampling distribution's entropy (0.0 on appended ones)")
    policy_versions = property(
        lambda self: self._record.policy_versions + [NO_POLICY_VERSION] * len(self._record.pending),
        doc="per response token: the policy version that sampled it (NO_POLICY_VERSION on appended ones)")
    finish_reason = property(lambda self: self._record.finish_reason, doc='"eos" or "budget" once done')
    done = property(lambda self: self._record.finish_reason is not None)
    remaining = property(lambda self: self._record.remaining, doc="tokens left in the budget")
    cached_tokens = property(lambda self: self._record.cached_tokens,
                             doc="prompt tokens whose keys/values came from the prefix cache")

    async def generate(
        self, *, stop: Sequence[Sequence[int]] = (), max_new_tokens: int | None = None
    ) -> Segment:
        """Sample until a stop sequence (token ids; at most ``max_stops`` of at most ``max_stop_len`` tokens),
        ``max_new_tokens``, EOS or the budget. Appended tokens are prefilled first. Other sessions keep
        decoding while this one waits."""
        tokens, logprobs, entropies, versions = [], [], [], []
        async for chunk in self.stream(stop=stop, max_new_tokens=max_new_tokens):
            tokens += chunk.tokens
            logprobs += chunk.logprobs
            entropies += chunk.entropies
            versions += [chunk.policy_version] * len(chunk.tokens)
        return Segment(tokens, logprobs, chunk.finish_reason, entropies, versions)

    async def stream(
        self, *, stop: Sequence[Sequence[int]] = (), max_new_tokens: int | None = None
    ) -> AsyncIterator[Chunk]:
        """:meth:`generate`, yielding the segment's tokens as they arrive (a :class:`Chunk` per device step
        that sampled some; the last one has the ``finish_reason``). Leaving the loop before the last chunk
        closes the session (its slot is freed with the next step; what was sampled beyond is dropped)."""
        if self._busy:
            raise RuntimeError("this session already has a generate call in flight")
        if self._record.slot is None:
            raise RuntimeError(f"the session is {'done' if self.done else 'closed'}")
        queue = self._engine._start(self._record, stop, max_new_tokens)
        self._busy, finished = True, False
        try:
            while not finished:
                chunk = await queue.get()
                if isinstance(chunk, BaseException):
                    raise chunk
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            self._busy = False
            if not finished:
                self.close()

    def append(self, token_ids: Sequence[int]) -> None:
        """Insert tokens (a tool response, turn markers) with loss mask 0; the next :meth:`generate` prefills
        them. Raises ValueError if they exceed :attr:`remaining`."""
        if self._busy or self._record.slot is None:
            raise RuntimeError("append needs a paused session (not generating, done or closed)")
        token_ids = [int(t) for t in token_ids]
        if len(token_ids) > self._record.remaining:
            raise ValueError(
                f"{len(token_ids)} tokens appended but only {self._record.remaining} remain in the budget"
            )
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= self._engine._core.config.vocab_size):
            raise ValueError("appended token ids must lie in [0, vocab_size)")
        self._record.pending += token_ids

    def close(self) -> None:
        """Free the slot (idempotent); a segment in flight is stopped with the next device step. The host
        record stays readable."""
        self._engine._close(self._record)


class Engine:
    """Asyncio front end of an :class:`EngineCore`: use as ``async with Engine(...) as engine``.

    The core runs on a thread of its own (so the event loop stays free for tool calls and HTTP): it admits
    waiting groups that fit, applies the sessions' segment starts and closes, and runs the pipelined step
    loop, handing each step's tokens to the sessions' streams on the event loop. ``async with`` may be
    entered again after it exits: the engine keeps its state and compiled programs.
    """

    def __init__(self, params, config: ModelConfig, engine_config: EngineConfig = _DEFAULT_CONFIG, *,
                 policy_version: int = 0):
        self._core = EngineCore(params, config, engine_config, policy_version=policy_version)
        self._commands: collections.deque = collections.deque()  # callables for the engine thread
        self._wake = threading.Event()
        self._waiting: collections.deque = collections.deque()  # (request, future): engine thread only
        self._streams: dict[int, asyncio.Queue] = {}  # id(record) -> chunks of its segment in flight
        self._opens: set[asyncio.Future] = set()
        self._opened = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None

    @property
    def core(self) -> EngineCore:
        """The synchronous core (read its ``stats`` and ``pages`` between calls; do not drive it)."""
        return self._core

    async def __aenter__(self) -> Engine:
        self._loop = asyncio.get_running_loop()
        self._stopping, self._error = False, None
        self._thread = threading.Thread(target=self._run, name="rstar2jax-engine", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self._fail_all(RuntimeError("the engine was stopped"))

    async def open(
        self,
        prompt_ids: Sequence[int],
        n: int = 1,
        *,
        sampling: SamplingParams = _DEFAULT_SAMPLING,
        max_tokens: int,
        seed: int | None = None,
    ) -> list[Session]:
        """Open ``n`` sessions on one prompt (a GRPO group), waiting until ``n`` slots and the pages the group
        may need are free.

        Args:
          prompt_ids: prompt tokens (prefilled once for the group).
          n: sessions; sibling ``j`` samples with seed ``(seed, j)``.
          sampling: temperature / top-p / top-k of every sibling.
          max_tokens: response budget of each session: sampled plus appended tokens.
          seed: makes the group reproducible; None: derived from the engine seed and the opening order.
        """
        self._check_running()
        self._core.check_request(prompt_ids, n, max_tokens)
        entropy = (self._core.engine_config.seed, 1, self._opened) if seed is None else (seed, 0)
        self._opened += 1
        future = self._loop.create_future()
        self._opens.add(future)
        request = (list(prompt_ids), n, sampling, max_tokens, entropy)
        self._submit(lambda: self._waiting.append((request, future)))
        try:
            return [Session(self, record) for record in await future]
        finally:
            self._opens.discard(future)

    def _check_running(self) -> None:
        if self._error is not None:
            raise RuntimeError("the engine failed") from self._error
        if self._thread is None or self._stopping:
            raise RuntimeError("the engine is not running: use `async with engine:`")

    def _submit(self, command) -> None:
        self._commands.append(command)
        self._wake.set()

    def _start(self, record: _Record, stop, max_new_tokens) -> asyncio.Queue:
        self._check_running()
        self._core.stop_table(stop)  # validate now, in the caller's frame
        if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        appended, record.pending = record.pending, []
        record.add(appended, None)
        queue = self._streams[id(record)] = asyncio.Queue()

        def start():
            try:
                self._core.start(record, stop, max_new_tokens, appended)
            except (ValueError, RuntimeError) as error:  # a race with the engine (it finished the session)
                self._loop.call_soon_threadsafe(queue.put_nowait, error)

        self._submit(start)
        return queue

    def _close(self, record: _Record) -> None:
        if record.slot is None and id(record) not in self._streams:
            return
        record.slot = None
        queue = self._streams.pop(id(record), None)
        if queue is not None:  # a segment in flight: whoever waits on it learns why it ends
            queue.put_nowait(RuntimeError("the session was closed"))
        self._submit(lambda: self._core.close(record))

    def _run(self) -> None:
        """The engine thread: commands, admissions, steps; results go to the event loop."""
        core = self._core
        try:
            while True:
                self._wake.clear()
                while self._commands:
                    self._commands.popleft()()
                if self._stopping:  # leave the state consistent for the next `async with`
                    self._deliver_soon([], core.flush())
                    return
                admitted = []
                while self._waiting and core.admissible([self._waiting[0][0]]):
                    request, future = self._waiting.popleft()
                    admitted.append((core.admit([request])[0], future))
                events = core.step() if core.num_active else []
                if admitted or events:
                    self._deliver_soon(admitted, events)
                if not (core.num_active or self._commands or admitted):
                    self._wake.wait()
        except BaseException as error:  # a device or host bug: fail every waiter rather than hang them
            self._error = error
            self._loop.call_soon_threadsafe(self._fail_all, error)

    def _deliver_soon(self, admitted, events) -> None:
        self._loop.call_soon_threadsafe(self._deliver, admitted, events)

    def _deliver(self, admitted, events) -> None:
        """On the event loop: hand admitted groups to their openers and chunks to their sessions."""
        for group, future in admitted:
            if future.done():  # the opener gave up waiting: nobody will close these
                for record in group:
                    self._close(record)
            else:
                future.set_result(group)
        for record, chunk in events:
            queue = self._streams.get(id(record))
            if queue is None:
                continue  # closed: what it sampled since is dropped
            record.receive(chunk)
            if chunk.finish_reason is not None:
                del self._streams[id(record)]
            queue.put_nowait(chunk)

    def _fail_all(self, error: BaseException) -> None:
        for future in list(self._opens):
            if not future.done():
                future.set_exception(error)
        for queue in self._streams.values():
            queue.put_nowait(error)
        self._streams.clear()

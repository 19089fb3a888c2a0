"""Host side of the engine: slot bookkeeping (:class:`EngineCore`) and the asyncio API (:class:`Engine`).

:class:`EngineCore` owns the :class:`EngineState` and turns host requests into batched calls of the jitted
functions in :mod:`rstar2jax.engine.ops`, padding every shape to a few buckets. Only small per-slot arrays
(status, length, finish reason) come back after each decode chunk, plus the token rows of slots whose segment
just ended.

:class:`Engine` runs an :class:`EngineCore` in a background task so that each rollout is plain async code::

    async with Engine(params, config, EngineConfig(num_slots=32, max_len=8192)) as engine:
        sessions = await engine.open(prompt_ids, n=16, sampling=SamplingParams(), max_tokens=8000)
        segment = await sessions[0].generate(stop=[tool_call_end_ids])  # other slots keep decoding meanwhile
        sessions[0].append(tool_response_ids)  # inserted (loss mask 0), prefilled by the next generate
        ...
        sessions[0].close()

KV lives in a pool of pages (:mod:`rstar2jax.engine.paged_attention`), allocated as sequences grow
(:class:`~rstar2jax.engine.pages.PageAllocator`). A group of ``n`` sessions is admitted, first come first
served, once ``n`` slots are free and the pool has the pages the group can ever need that are not promised to
sessions already running (its prompt's pages, held once for the group, plus each session's response budget):
so nothing admitted ever waits for a page, and work that does not fit waits in the queue, losing nothing. The
prompt is prefilled once and forked to the siblings, which share its full pages; whole pages of a prompt
prefix already in the pool (another group with the same system prompt) are shared instead of prefilled. A
paused session holds its slot and pages while its coroutine runs the tool call; a finished one (EOS or
budget) frees them at once.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from rstar2jax.engine import ops
from rstar2jax.engine.paged_attention import ATTENTION_IMPLS
from rstar2jax.engine.pages import PageAllocator, pages_for
from rstar2jax.engine.state import (
    DONE,
    FINISH_REASON_NAMES,
    NO_POLICY_VERSION,
    NO_TOKEN,
    RUNNING,
    EngineState,
    init_state,
)
from rstar2jax.models import ModelConfig, layers_are_unstacked, unstack_layers


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a session samples: ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 disable truncation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes of an engine (shapes: each distinct value compiles its own programs).

    Attributes:
      num_slots: sequences decoded side by side.
      max_len: the longest sequence a slot may hold; a session's prompt + ``max_tokens`` must fit. Sets the
        width of the page table and token record only: KV memory is ``num_pages``.
      decode_chunk: decode steps per device call (one on-device loop); the host looks at slot statuses
        between chunks.
      return_on_stop: end a decode chunk as soon as some session's segment ends (EOS, a stop sequence such
        as a tool-call end tag, its budget or segment limit), so its coroutine resumes at once.
      page_size: tokens per KV page; must divide ``max_len``.
      num_pages: pages in the pool (page 0, the null page, included); None: enough for every slot at
        ``max_len`` (``num_slots * max_len // page_size + 1``). Admission counts these.
      attention: ``"auto"`` (the Pallas GPU kernel on CUDA GPUs, ``jnp`` elsewhere), ``"jnp"``,
        ``"pallas_gpu"`` or ``"pallas_interpret"`` (the kernel in the Pallas interpreter: tests).
      attention_block: tokens per block of the ``jnp`` attention (a multiple of ``page_size``).
      prefix_sharing: share whole pages of a prompt prefix already in the pool instead of prefilling them.
      poison_freed_pages: fill pages with NaN when they are freed, so that a stale read shows (tests).
      prefill_buckets: chunk lengths an append is padded to; longer chunks are split into pieces of the
        largest bucket.
      max_stops, max_stop_len: how many stop sequences a segment may have, and their longest length.
      eos_token_ids: tokens that finish a session; None: the model config's.
      cache_dtype: KV cache dtype; None: the model's compute dtype.
      seed: mixed into the seed of every session opened without one.
      unstacked_decode: run from per-layer copies of the weights in the compute dtype, made once when the
        engine is built (:func:`~rstar2jax.models.unstack_layers`): faster where slicing the layer-stacked
        weights copies them (XLA:CPU copies every layer of every decode step), at the cost of a second copy
        of the layer weights for the engine's lifetime. False: the caller's tree is used as it is (cast once
        to the compute dtype if it differs). None (default): unstack when a cast to the compute dtype is
        needed anyway (that copy is then the only one) or on CPU; otherwise use the caller's tree. The paged
        forward runs its layers unrolled, so stacked weights are sliced per layer in every step: for the
        fastest decode pass weights unstacked once (:func:`~rstar2jax.models.unstack_layers`).
    """

    num_slots: int = 32
    max_len: int = 4096
    decode_chunk: int = 16
    prefill_buckets: tuple[int, ...] = (32, 128, 512)
    max_stops: int = 4
    max_stop_len: int = 8
    eos_token_ids: tuple[int, ...] | None = None
    cache_dtype: str | None = None
    seed: int = 0
    unstacked_decode: bool | None = None
    return_on_stop: bool = True
    page_size: int = 16
    num_pages: int | None = None
    attention: str = "auto"
    attention_block: int = 256
    prefix_sharing: bool = True
    poison_freed_pages: bool = False

    def __post_init__(self):
        for name in ("num_slots", "max_len", "decode_chunk", "max_stops", "max_stop_len", "page_size",
                     "attention_block"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.max_len % self.page_size:
            raise ValueError(f"page_size={self.page_size} must divide max_len={self.max_len}")
        if self.attention_block % self.page_size:
            raise ValueError(f"attention_block={self.attention_block} must be a multiple of "
                             f"page_size={self.page_size}")
        if self.num_pages is not None and (not isinstance(self.num_pages, int) or self.num_pages < 2):
            raise ValueError(f"num_pages must be an int >= 2 (page 0 is the null page), "
                             f"got {self.num_pages!r}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention={self.attention!r}; expected one of {ATTENTION_IMPLS}")
        if not self.prefill_buckets or any(b <= 0 for b in self.prefill_buckets):
            raise ValueError(f"prefill_buckets must be positive lengths, got {self.prefill_buckets}")
        object.__setattr__(self, "prefill_buckets", tuple(sorted(set(self.prefill_buckets))))

    @property
    def pool_pages(self) -> int:
        """Pages in the pool, the null page included."""
        if self.num_pages is not None:
            return self.num_pages
        return self.num_slots * (self.max_len // self.page_size) + 1


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


class _Record:
    """Host mirror of one sequence: what the trainer needs (prompt, response, loss mask, log-probs) and where
    it lives on the device."""

    def __init__(self, prompt_ids: list[int], max_tokens: int):
        self.prompt_ids = prompt_ids
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.entropies: list[float] = []
        self.policy_versions: list[int] = []
        self.pending: list[int] = []  # appended, not yet on the device
        self.budget_end = len(prompt_ids) + max_tokens
        self.reserve = 0  # pages the sequence may still take from the pool (promised at admission)
        self.slot: int | None = None
        self.finish_reason: str | None = None  # "eos" / "budget" once done

    @property
    def length(self) -> int:
        """Tokens on the device (prompt + response)."""
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


_unstack_layers = jax.jit(unstack_layers, static_argnames=("dtype",))
_cast = jax.jit(lambda params, dtype: jax.tree.map(lambda p: p.astype(dtype), params),
                static_argnames=("dtype",))


def engine_params(params, config: ModelConfig, unstacked: bool | None = None):
    """The weights an engine decodes from: the caller's tree, cast once to ``config.compute_dtype`` where a
    leaf differs, and with ``unstacked`` (see ``EngineConfig.unstacked_decode``) split into per-layer
    buffers."""
    compute = jax.numpy.dtype(config.compute_dtype)
    needs_cast = any(leaf.dtype != compute for leaf in jax.tree.leaves(params))
    if unstacked is None:
        unstacked = needs_cast or jax.default_backend() == "cpu"
    if unstacked and not layers_are_unstacked(params):
        return _unstack_layers(params, config.compute_dtype)
    return _cast(params, config.compute_dtype) if needs_cast else params


def _slot_seed(entropy: Sequence[int]) -> int:
    """A well-mixed uint32 seed from a tuple of ints (so nearby tuples give unrelated streams)."""
    return int(np.random.SeedSequence([int(e) & 0xFFFFFFFF for e in entropy]).generate_state(1)[0])


class EngineCore:
    """Synchronous engine: owns the device state, maps sequences to slots and pages, and batches device calls.

    Not thread-safe: one caller at a time. :class:`Engine` drives it from a worker thread; :func:`generate`
    drives it directly.

    ``policy_version`` (an int >= 0, the trainer step whose parameters ``params`` are) tags every token the
    engine samples (``Segment.policy_versions``); inserted tokens get ``NO_POLICY_VERSION`` (-1).
    """

    def __init__(self, params, config: ModelConfig, engine_config: EngineConfig, *, policy_version: int = 0):
        if not isinstance(policy_version, (int, np.integer)) or isinstance(policy_version, bool) or (
                policy_version < 0):
            raise ValueError(f"policy_version must be an int >= 0, got {policy_version!r}")
        self.policy_version = int(policy_version)
        self.params = engine_params(params, config, engine_config.unstacked_decode)
        self.config = config
        self.engine_config = engine_config
        cfg = engine_config
        self.state: EngineState = init_state(
            config,
            cfg.num_slots,
            cfg.max_len,
            eos_token_ids=cfg.eos_token_ids,
            max_stops=cfg.max_stops,
            max_stop_len=cfg.max_stop_len,
            cache_dtype=cfg.cache_dtype,
            page_size=cfg.page_size,
            num_pages=cfg.pool_pages,
            attention=cfg.attention,
            block_tokens=cfg.attention_block,
            poison_freed=cfg.poison_freed_pages,
        )
        self.pages = PageAllocator(cfg.pool_pages, cfg.page_size, cfg.num_slots, cfg.max_len // cfg.page_size)
        self._reserved = 0  # pages promised to admitted sequences, not yet taken from the pool
        self._lengths = np.zeros((cfg.num_slots,), np.int64)  # tokens on the device per slot (last read)
        self._records: dict[int, _Record] = {}  # slot -> record
        self._copies: list[tuple[int, int]] = []  # (page, copy) for the next set_pages
        self._freed = np.zeros((cfg.pool_pages,), bool)  # pages freed since the last device release
        self._free = collections.deque(range(cfg.num_slots))
        self._to_release: list[int] = []
        self._to_start: list[tuple[_Record, np.ndarray, int]] = []
        self._active: dict[int, tuple[_Record, int]] = {}  # slot -> (record, segment start)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_free_pages(self) -> int:
        """Pages neither held by a sequence nor promised to one."""
        return self.pages.num_free - self._reserved

    @property
    def num_active(self) -> int:
        """Sessions with a generation segment in flight (or about to start)."""
        return len(self._active) + len(self._to_start)

    @property
    def kv_bytes_held(self) -> int:
        """Bytes of the pages sequences hold now."""
        return self.pages.num_used * self.state.pages.nbytes_per_page

    # ---- shapes

    def _slot_array(self, slots: Sequence[int], *, bucketed: bool = False) -> np.ndarray:
        """int32 slot list padded with the out-of-range ``num_slots``: to ``num_slots`` entries (cheap ops:
        one program each), or with ``bucketed`` to a power of two (prefill: its cost grows with the rows)."""
        num_slots = self.engine_config.num_slots
        size = min(1 << max(len(slots) - 1, 0).bit_length(), num_slots) if bucketed else num_slots
        padded = np.full((size,), num_slots, np.int32)
        padded[: len(slots)] = slots
        return padded

    def warmup(self) -> None:
        """Compile every program the engine can run (each prefill bucket and compacted decode for each
        slot-count bucket), so that serving never compiles. Leaves the state unchanged: every call gets
        padding slots only."""
        num_slots = self.engine_config.num_slots
        nothing = np.full((num_slots,), num_slots, np.int32)
        size_of = {n: len(self._slot_array(range(n), bucketed=True)) for n in range(1, num_slots + 1)}
        for size in sorted({size_of[n] for n in size_of if self._compact_decode(n)}):
            self.state = self._decode(nothing[:size])
        for size in sorted(set(size_of.values())):
            for bucket in self.engine_config.prefill_buckets:
                self.state = ops.append(
                    self.state,
                    self.params,
                    nothing[:size],
                    np.zeros((size, bucket), np.int32),
                    np.zeros((size,), np.int32),
                    sample=False,
                )
        zeros = lambda dtype: np.zeros((num_slots,), dtype)
        self.state = ops.admit(
            self.state,
            nothing,
            zeros(np.uint32),
            zeros(np.float32),
            zeros(np.float32),
            zeros(np.int32),
            zeros(np.int32),
        )
        self.state = ops.fork(self.state, np.int32(0), nothing)
        self.state = ops.resume(
            self.state,
            nothing,
            np.full((num_slots, *self.state.stop_seqs.shape[1:]), NO_TOKEN, np.int32),
            zeros(np.int32),
        )
        self.state = ops.set_pages(self.state, *self._page_args([]))  # nothing to set: compiles it
        self.state = ops.attach(self.state, nothing,
                                np.zeros((num_slots, self.engine_config.max_len), np.int32), zeros(np.int32))
        self.state = ops.release(self.state, nothing, np.zeros_like(self._freed))
        self.state = self._decode(None)
        jax.block_until_ready(ops.read_slots(self.state, nothing))

    def _decode(self, slots: np.ndarray | None) -> EngineState:
        """One decode chunk of every running slot (``slots=None``) or of the compacted ``slots``."""
        cfg = self.engine_config
        return ops.decode(self.state, self.params, cfg.decode_chunk, slots, return_on_stop=cfg.return_on_stop)

    def _compact_decode(self, num_running: int) -> bool:
        """Decode only the running slots (gathered) when they are at most half of all slots: a step costs
        every row it is given, running or not."""
        return 2 * num_running <= self.engine_config.num_slots

    def _bucket(self, length: int) -> int:
        return next(b for b in self.engine_config.prefill_buckets if b >= length)

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
            needed = self.pages_needed(prompt_ids, n, max_tokens, shared=len(self._shared_prefix(prompt_ids)))
            if n > slots or needed > pages:
                return count
            slots, pages = slots - n, pages - needed
        return len(requests)

    def admit(
        self, requests: Sequence[tuple[Sequence[int], int, SamplingParams, int, Sequence[int]]]
    ) -> list[list[_Record]]:
        """Take slots and pages for groups ``(prompt_ids, n, sampling, max_tokens, seed_entropy)``: prefill
        each prompt once (but whole pages of a prefix already in the pool) and fork it to its siblings
        (sibling ``j`` seeded by ``(*seed_entropy, j)``).

        Returns each group's records. Raises ValueError if they do not fit (see :meth:`admissible`).
        """
        if not requests:
            return []
        for prompt_ids, n, _, max_tokens, _ in requests:
            self.check_request(prompt_ids, n, max_tokens)
        if self.admissible(requests) < len(requests):
            raise ValueError(f"{len(requests)} groups requested; {self.num_free_slots} slots and "
                             f"{self.num_free_pages} pages are free")
        ps = self.engine_config.page_size
        groups, columns, attached, prefills = [], collections.defaultdict(list), [], []
        for prompt_ids, n, sampling, max_tokens, entropy in requests:
            prompt_ids = [int(t) for t in prompt_ids]
            shared = self._shared_prefix(prompt_ids)
            self._reserved += self.pages_needed(prompt_ids, n, max_tokens, shared=len(shared))
            group = []
            for j in range(n):
                record = _Record(prompt_ids, max_tokens)
                record.slot = self._free.popleft()
                record.reserve = pages_for(record.budget_end, ps)  # all its pages, shared ones deducted below
                self._records[record.slot] = record
                group.append(record)
                for name, value in (
                    ("slots", record.slot),
                    ("seeds", _slot_seed((*entropy, j))),
                    ("temperature", sampling.temperature),
                    ("top_p", sampling.top_p),
                    ("top_k", sampling.top_k),
                    ("budget_end", record.budget_end),
                ):
                    columns[name].append(value)
            groups.append(group)
            src = group[0]
            if shared:
                self.pages.attach(src.slot, shared)
                src.reserve -= len(shared)
                attached.append((src.slot, prompt_ids, len(shared) * ps + 1))
                prefills.append((src.slot, prompt_ids[len(shared) * ps + 1 :]))
            else:
                prefills.append((src.slot, prompt_ids))
        slots = self._slot_array(columns.pop("slots"))
        pad = len(slots) - len(columns["seeds"])
        dtypes = dict(
            seeds=np.uint32, temperature=np.float32, top_p=np.float32, top_k=np.int32, budget_end=np.int32
        )
        per_slot = {name: np.pad(np.asarray(columns[name], dtypes[name]), (0, pad)) for name in dtypes}
        # Positional, exactly as in warmup(): jit caches keyword and positional calls apart.
        self.state = ops.admit(self.state, slots, *per_slot.values())
        if attached:
            tokens = np.zeros((self.engine_config.num_slots, self.engine_config.max_len), np.int32)
            lengths = np.zeros((self.engine_config.num_slots,), np.int32)
            for row, (slot, prompt_ids, length) in enumerate(attached):
                tokens[row, :length] = prompt_ids[:length]
                lengths[row] = length
                self._lengths[slot] = length
            self._push_pages()
            self.state = ops.attach(self.state, self._slot_array([a[0] for a in attached]), tokens, lengths)
        self._prefill(prefills)  # also gives each source the pages of its whole prompt
        for group in groups:
            src = group[0]
            if self.engine_config.prefix_sharing:
                self.pages.register(src.slot, src.prompt_ids, len(src.prompt_ids) - 1)
            if len(group) > 1:
                dsts = [r.slot for r in group[1:]]
                self._copies += self.pages.fork(src.slot, dsts, len(src.prompt_ids))
                self._reserved -= len(dsts)  # each took its copy of the prompt's last page
                for record in group[1:]:
                    record.reserve -= int(self.pages.held[record.slot])
                    self._lengths[record.slot] = len(src.prompt_ids)
        self._push_pages()
        for group in groups:
            if len(group) > 1:
                self.state = ops.fork(
                    self.state, np.int32(group[0].slot), self._slot_array([r.slot for r in group[1:]])
                )
        return groups

    def start(
        self, record: _Record, stop: Sequence[Sequence[int]] = (), max_new_tokens: int | None = None
    ) -> None:
        """Queue a generation segment for ``record`` (run by the next :meth:`step`)."""
        if record.slot is None:
            raise ValueError("the session is closed or finished")
        if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        # The device clips the segment to the budget, so "no limit" is the whole budget.
        limit = record.budget_end if max_new_tokens is None else max_new_tokens
        self._to_start.append((record, self.stop_table(stop), limit))

    def close(self, record: _Record) -> None:
        """Free the record's slot and pages (on the device with the next device call)."""
        if record.slot is not None:
            slot = record.slot
            self._freed[self.pages.release(slot)] = True
            self._reserved -= record.reserve
            record.reserve = 0
            del self._records[slot]
            self._lengths[slot] = 0
            self._to_release.append(slot)
            self._free.append(slot)
            record.slot = None

    # ---- device work

    def _grow(self, slot: int, num_tokens: int) -> None:
        """Take pages from the pool (promised at admission) for ``num_tokens`` tokens of ``slot``."""
        record = self._records[slot]
        taken = len(self.pages.grow(slot, min(num_tokens, record.budget_end)))
        record.reserve -= taken
        self._reserved -= taken
        if record.reserve < 0:
            raise AssertionError(f"slot {slot} took more pages than promised")

    def _page_args(self, dirty: Sequence[int]):
        num_slots = self.engine_config.num_slots
        rows = np.zeros((num_slots, self.pages.table.shape[1]), np.int32)
        rows[: len(dirty)] = self.pages.table[list(dirty)]
        copy_src = np.zeros((num_slots,), np.int32)
        copy_dst = np.full((num_slots,), self.engine_config.pool_pages, np.int32)
        copies, self._copies = self._copies[:num_slots], self._copies[num_slots:]
        for i, (src, dst) in enumerate(copies):
            copy_src[i], copy_dst[i] = src, dst
        return self._slot_array(dirty), rows, copy_src, copy_dst

    def _push_pages(self) -> None:
        """Send changed page-table rows and page copies to the device."""
        self._release_closed()
        while self.pages.dirty or self._copies:
            self.state = ops.set_pages(self.state, *self._page_args(self.pages.take_dirty()))

    def _prefill(self, chunks: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Append inserted tokens to slots (no sampling), in rounds of at most the largest bucket per slot."""
        for slot, tokens in chunks:
            self._grow(slot, int(self._lengths[slot]) + len(tokens))
        self._push_pages()
        largest = self.engine_config.prefill_buckets[-1]
        pieces = [
            (slot, tokens[i : i + largest]) for slot, tokens in chunks for i in range(0, len(tokens), largest)
        ]
        while pieces:
            round_, seen, rest = [], set(), []
            for slot, piece in pieces:  # one piece per slot per round, in order
                (rest if slot in seen else round_).append((slot, piece))
                seen.add(slot)
            pieces = rest
            slots = self._slot_array([slot for slot, _ in round_], bucketed=True)
            tokens = np.zeros((len(slots), self._bucket(max(len(p) for _, p in round_))), np.int32)
            lengths = np.zeros((len(slots),), np.int32)
            for row, (_, piece) in enumerate(round_):
                tokens[row, : len(piece)] = piece
                lengths[row] = len(piece)
            self.state = ops.append(self.state, self.params, slots, tokens, lengths, sample=False)
        for slot, tokens in chunks:
            self._lengths[slot] += len(tokens)

    def _release_closed(self) -> None:
        """Free closed slots on the device (before anything reuses them or their pages)."""
        if self._to_release:
            self.state = ops.release(self.state, self._slot_array(self._to_release), self._freed)
            self._to_release = []
            self._freed = np.zeros_like(self._freed)

    def _flush(self) -> None:
        """Apply queued releases, appended chunks and segment starts."""
        self._release_closed()
        if not self._to_start:
            return
        self._prefill([(r.slot, r.pending) for r, _, _ in self._to_start if r.pending])
        for record, _, _ in self._to_start:
            record.add(record.pending, None)
            record.pending = []
        slots = self._slot_array([r.slot for r, _, _ in self._to_start])
        stop_seqs = np.full((len(slots), *self.state.stop_seqs.shape[1:]), NO_TOKEN, np.int32)
        max_new = np.ones((len(slots),), np.int32)
        for row, (record, table, limit) in enumerate(self._to_start):
            stop_seqs[row], max_new[row] = table, limit
            self._active[record.slot] = (record, record.length)
        self.state = ops.resume(self.state, slots, stop_seqs, max_new)
        self._to_start = []

    def step(self) -> list[tuple[_Record, Segment]]:
        """Apply queued work, decode one chunk if a segment is in flight, and return the segments that ended
        (paused or finished sessions; finished ones have their slot and pages freed)."""
        self._flush()
        if not self._active:
            return []
        running = list(self._active)
        for slot in running:  # pages for the whole chunk, so the device loop never lacks one
            self._grow(slot, int(self._lengths[slot]) + self.engine_config.decode_chunk)
        self._push_pages()
        compact = self._slot_array(running, bucketed=True) if self._compact_decode(len(running)) else None
        self.state = self._decode(compact)
        state = self.state
        status, reason, seq_len = jax.device_get((state.status, state.finish_reason, state.seq_len))
        self._lengths[running] = seq_len[running]
        ended = [slot for slot in self._active if status[slot] != RUNNING]
        if not ended:
            return []
        tokens, logprobs, entropies = jax.device_get(ops.read_slots(self.state, self._slot_array(ended)))
        results = []
        for row, slot in enumerate(ended):
            record, start = self._active.pop(slot)
            end = seq_len[slot]
            segment = Segment(
                tokens[row, start:end].tolist(),
                logprobs[row, start:end].tolist(),
                FINISH_REASON_NAMES[int(reason[slot])],
                entropies[row, start:end].tolist(),
                [self.policy_version] * int(end - start),
            )
            record.add(segment.tokens, segment.logprobs, segment.entropies, self.policy_version)
            if status[slot] == DONE:
                record.finish_reason = segment.finish_reason
                self.close(record)
            results.append((record, segment))
        return results


class Session:
    """One sequence (rollout) in an :class:`Engine`; create with :meth:`Engine.open`.

    The host record (``prompt_ids``, ``response_ids``, ``loss_mask``, ``logprobs``) is exactly what
    :class:`rstar2jax.agent.Trajectory` needs: ``response_ids`` holds sampled and appended tokens in order,
    ``loss_mask`` is 1 on sampled ones, ``logprobs`` their raw policy log-probs (0.0 on appended ones);
    ``entropies`` the entropy of the distribution each was sampled from (0.0 on appended ones);
    ``policy_versions`` the policy version that sampled each (``NO_POLICY_VERSION``, -1, on appended ones).
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

    async def generate(
        self, *, stop: Sequence[Sequence[int]] = (), max_new_tokens: int | None = None
    ) -> Segment:
        """Sample until a stop sequence (token ids; at most ``max_stops`` of at most ``max_stop_len`` tokens),
        ``max_new_tokens``, EOS or the budget. Appended tokens are prefilled first. Other sessions keep
        decoding while this one waits."""
        if self._busy:
            raise RuntimeError("this session already has a generate call in flight")
        if self._record.slot is None:
            raise RuntimeError(f"the session is {'done' if self.done else 'closed'}")
        self._busy = True
        try:
            return await self._engine._submit_start(self._record, stop, max_new_tokens)
        finally:
            self._busy = False

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
        """Free the slot (idempotent). The host record stays readable."""
        if self._busy:
            raise RuntimeError("cannot close a session while it generates")
        self._engine._submit_close(self._record)


class Engine:
    """Asyncio front end of an :class:`EngineCore`: use as ``async with Engine(...) as engine``.

    A background task repeatedly (in a worker thread, so the event loop stays free for tool calls) frees
    closed slots, admits waiting groups that fit, prefills appended chunks, starts segments and decodes one
    chunk; then it wakes the coroutines whose segments ended.
    """

    def __init__(self, params, config: ModelConfig, engine_config: EngineConfig = EngineConfig(), *,
                 policy_version: int = 0):
        self._core = EngineCore(params, config, engine_config, policy_version=policy_version)
        self._waiting: collections.deque = collections.deque()  # (request, future) for open()
        self._starts: list = []  # (record, stop, max_new_tokens, future)
        self._closes: list[_Record] = []
        self._futures: dict[int, asyncio.Future] = {}  # id(record) -> generate future
        self._opened = 0
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._inflight: asyncio.Future | None = None  # the iteration running in the worker thread

    async def __aenter__(self) -> Engine:
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        if self._inflight is not None:
            await asyncio.wait([self._inflight])
        for record in self._closes:  # host bookkeeping only: their slots and pages count as free again
            self._core.close(record)
        self._closes = []
        self._fail_all(RuntimeError("the engine was stopped"))

    async def open(
        self,
        prompt_ids: Sequence[int],
        n: int = 1,
        *,
        sampling: SamplingParams = SamplingParams(),
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
        if seed is None:
            entropy = (self._core.engine_config.seed, 1, self._opened)
        else:
            entropy = (seed, 0)
        self._opened += 1
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(((list(prompt_ids), n, sampling, max_tokens, entropy), future))
        self._wakeup.set()
        return [Session(self, record) for record in await future]

    def _check_running(self) -> None:
        if self._error is not None:
            raise RuntimeError("the engine failed") from self._error
        if self._task is None or self._task.done():
            raise RuntimeError("the engine is not running: use `async with engine:`")

    def _submit_start(self, record: _Record, stop, max_new_tokens) -> asyncio.Future:
        self._check_running()
        self._core.stop_table(stop)  # validate now, in the caller's frame
        if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        future = asyncio.get_running_loop().create_future()
        self._starts.append((record, stop, max_new_tokens))
        self._futures[id(record)] = future
        self._wakeup.set()
        return future

    def _submit_close(self, record: _Record) -> None:
        self._closes.append(record)
        if self._wakeup is not None:
            self._wakeup.set()

    def _iteration(self, waiting, starts, closes):
        """One round of device work (runs in a worker thread). Returns (groups admitted, segments ended)."""
        core = self._core
        for record in closes:
            core.close(record)
        # First come, first served: a group that does not fit (slots or pages) blocks later ones.
        requests = [request for request, _ in waiting]
        admitted, fits = [], requests[: core.admissible(requests)]
        if fits:
            admitted = core.admit(fits)
        for record, stop, max_new_tokens in starts:
            core.start(record, stop, max_new_tokens)
        return admitted, core.step()

    async def _run(self) -> None:
        try:
            while True:
                head_fits = self._waiting and self._core.admissible([self._waiting[0][0]]) == 1
                if not (head_fits or self._starts or self._closes or self._core.num_active):
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                await asyncio.sleep(0)  # let ready coroutines queue their requests: bigger batches per round
                waiting, starts, closes = list(self._waiting), self._starts, self._closes
                self._starts, self._closes = [], []
                # Shielded: stopping the engine must not cancel an iteration before it ran (its closes would
                # be lost); __aexit__ waits for it instead.
                self._inflight = asyncio.ensure_future(
                    asyncio.to_thread(self._iteration, waiting, starts, closes))
                admitted, ended = await asyncio.shield(self._inflight)
                for group in admitted:
                    _, future = self._waiting.popleft()
                    if not future.cancelled():
                        future.set_result(group)
                    else:  # the opener gave up waiting: nobody will close these
                        self._closes += [record for record in group]
                for record, segment in ended:
                    future = self._futures.pop(id(record))
                    if not future.cancelled():
                        future.set_result(segment)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # a device or host bug: fail every waiter rather than hang them
            self._error = error
            self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        pending = [f for _, f in self._waiting] + list(self._futures.values())
        self._waiting.clear()
        self._futures.clear()
        for future in pending:
            if not future.done():
                future.set_exception(error)

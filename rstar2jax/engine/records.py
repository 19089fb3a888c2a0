"""Host records of the engine's sessions: what a session owns (:class:`Record`: prompt, response, loss mask,
log-probs, the trainer's view), what the scheduler tracks per slot (:class:`SlotSequence`: its tokens, how far
its keys/values are written, its :class:`Phase`, its queued :class:`SegmentRequest`, its open segment and its
group's pending fork), and what streams back (:class:`Chunk`, :class:`Segment`)."""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Sequence

import numpy as np

from rstar2jax.engine.config import SamplingParams
from rstar2jax.engine.seeds import mix_seed
from rstar2jax.engine.state import NO_POLICY_VERSION

__all__ = ["Chunk", "OpenSegment", "PendingFork", "Phase", "Record", "Segment", "SegmentRequest",
           "SlotSequence", "StreamSeeds", "sibling_seeds", "slot_seed"]


@dataclasses.dataclass(frozen=True)
class Segment:
    """Tokens sampled by one ``generate`` call, their raw log-probs, and why it ended: ``"stop"`` (a stop
    sequence, included in ``tokens``) or ``"length"`` (``max_new_tokens``): the session is paused and may go
    on; ``"eos"`` or ``"budget"`` (``max_tokens`` used up): the session is done. ``entropies``: for each
    token, the entropy of the raw policy distribution it was sampled from (see
    :class:`~rstar2jax.engine.EngineState`). ``policy_versions``: for each token, the policy version (the
    trainer step whose parameters sampled it) of the weights the engine's step that sampled it ran on
    (:meth:`EngineCore.update_weights` changes them between two steps)."""

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


class Record:
    """Host mirror of one sequence: what the trainer needs (prompt, response, loss mask, log-probs).

    One thread writes it: the consumer of the engine's chunks (the asyncio loop for :class:`Engine`, the
    caller of :meth:`EngineCore.step`). The engine builds it whole at admission (slot, cached tokens) and then
    only reads its fixed fields (``prompt_ids``, ``budget_end``), so a record handed to the event loop is
    never written by the engine thread while the loop reads or writes it (no lock, no torn read of
    ``slot``)."""

    def __init__(self, prompt_ids: list[int], max_tokens: int, *, slot: int | None = None,
                 cached_tokens: int = 0):
        self.prompt_ids = prompt_ids
        self.response_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.entropies: list[float] = []
        self.policy_versions: list[int] = []
        self.pending: list[int] = []  # appended, not yet sent to the engine
        self.budget_end = len(prompt_ids) + max_tokens
        self.slot = slot  # None once closed or finished (set so by the consumer)
        self.finish_reason: str | None = None  # "eos" / "budget" once done
        self.cached_tokens = cached_tokens  # prompt tokens whose keys/values came from the prefix cache

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


class Phase(enum.Enum):
    """Where a sequence stands on the host: what the device may run for it next. New weights with
    ``on_update="recompute"`` put every sequence (but a sibling waiting for its fork) in ``RESTART``."""

    PREFILL = "prefill"  # tokens whose keys/values are not dispatched yet (the pending last one aside)
    # New weights (``on_update="recompute"``): every key/value is dispatched again, from a position found once
    # its turn comes (after the leading pages a sequence prefilled again before it wrote)...
    RESTART = "restart"
    RECOMPUTE = "recompute"  # ...and, that position found, from there
    FORK_WAIT = "fork_wait"  # a sibling waiting for its group's prompt to be prefilled and forked to it
    READY = "ready"  # every key/value dispatched: it may run a segment (paused on the device)
    RUNNING = "running"  # a segment runs on the device
    CLOSED = "closed"  # released: its slot and pages are free

    @property
    def prefilling(self) -> bool:
        """Keys/values (but the pending token's) still to dispatch, new ones or again."""
        return self in (Phase.PREFILL, Phase.RESTART, Phase.RECOMPUTE)

    @property
    def recomputing(self) -> bool:
        """Keys/values still to dispatch again with new weights."""
        return self in (Phase.RESTART, Phase.RECOMPUTE)


@dataclasses.dataclass(frozen=True)
class SegmentRequest:
    """A segment asked for and not begun yet: its stop table, its token limit (None: the budget) and the
    tokens to insert before it (a tool response; emptied once they are in the sequence)."""

    stop_table: np.ndarray
    max_new_tokens: int | None
    appended: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class OpenSegment:
    """A segment begun and not ended: its stop table and the positions ``[start, end)`` it may sample. A
    sequence holding one is RUNNING, or suspended while its keys/values are prefilled again (it resumes
    once they are, bounds and stop table unchanged)."""

    stop_table: np.ndarray
    start: int
    end: int


@dataclasses.dataclass(eq=False)
class PendingFork:
    """A group's prompt not yet forked to its siblings, held by its source and by each waiting sibling: the
    siblings still waiting (each with its private copy of the prompt's last page: ``(page, copy)``) and
    whether the source was closed meanwhile (it goes on prefilling for them and is released once none
    waits)."""

    source: SlotSequence
    waiting: dict[SlotSequence, tuple[int, int]] = dataclasses.field(default_factory=dict)
    source_closed: bool = False


class SlotSequence:
    """The scheduler's view of one slot's sequence: its whole token list (prompt, response, appended tokens,
    the pending last one included), how far its keys/values are dispatched, its :class:`Phase`, its queued
    :class:`SegmentRequest`, its :class:`OpenSegment` and its group's :class:`PendingFork`. Its state changes
    only through the methods below (the scheduler calls them)."""

    def __init__(self, record: Record, slot: int, seed: int, sampling: SamplingParams):
        self.record, self.slot, self.seed, self.sampling = record, slot, seed, sampling
        self.tokens: list[int] = list(record.prompt_ids)
        self.kv = 0  # positions below this have their key/value writes dispatched
        self.phase = Phase.PREFILL
        self.queued: SegmentRequest | None = None  # a segment asked for, not begun
        self.segment: OpenSegment | None = None  # the segment begun and not ended
        self.fork: PendingFork | None = None  # a source or sibling of a group not forked yet
        self.in_flight: collections.deque[int] = collections.deque()  # decode iterations of dispatched steps

    @property
    def budget_end(self) -> int:
        """The position the sequence may not grow past (prompt + response budget)."""
        return self.record.budget_end

    @property
    def unprefilled(self) -> int:
        """Tokens whose keys/values are not dispatched yet (the pending last one aside)."""
        return len(self.tokens) - 1 - self.kv

    @property
    def is_fork_source(self) -> bool:
        """A group's source whose siblings are not forked yet."""
        return self.fork is not None and self.fork.source is self

    @property
    def startable(self) -> bool:
        """Whether a queued segment may begin now (prefilled, its tokens inserted, its group forked)."""
        return (self.phase is Phase.READY and self.queued is not None and not self.queued.appended
                and self.fork is None)

    @property
    def resumable(self) -> bool:
        """Whether its suspended segment may run on now (its keys/values prefilled again)."""
        return self.phase is Phase.READY and self.segment is not None

    def attach_prefix(self, num_tokens: int) -> None:
        """The keys/values of the first ``num_tokens`` tokens came from the prefix cache."""
        self.kv = num_tokens
        if self.unprefilled <= 0:
            self.phase = Phase.READY  # nothing to prefill: all but the pending token came from the cache

    def group(self) -> PendingFork:
        """A group's source: its siblings will wait for its prompt (:meth:`await_fork`)."""
        self.fork = PendingFork(self)
        return self.fork

    def await_fork(self, fork: PendingFork, copy: tuple[int, int]) -> None:
        """A sibling: wait for ``fork``'s source's prompt, then take its pages (``copy``: its private last
        page)."""
        self.phase, self.fork = Phase.FORK_WAIT, fork
        fork.waiting[self] = copy

    def fork_from(self, source: SlotSequence) -> None:
        """A sibling forked now: it holds its source's tokens and keys/values."""
        self.tokens, self.kv, self.phase, self.fork = list(source.tokens), source.kv, Phase.READY, None

    def queue(self, request: SegmentRequest) -> None:
        self.queued = request

    def insert_appended(self) -> None:
        """Move the queued segment's appended tokens into the sequence (to be prefilled)."""
        self.tokens += self.queued.appended
        self.queued = dataclasses.replace(self.queued, appended=())
        if self.phase is Phase.READY:
            self.phase = Phase.PREFILL

    def prefilled(self, num_tokens: int) -> bool:
        """``num_tokens`` more keys/values dispatched; returns whether the sequence is prefilled now."""
        self.kv += num_tokens
        if self.unprefilled:
            return False
        self.phase = Phase.READY
        return True

    def begin(self) -> None:
        """Run the queued segment from the next step (the device clips it to the budget, so "no limit" is the
        whole budget)."""
        request, self.queued = self.queued, None
        limit, length = request.max_new_tokens, len(self.tokens)
        end = self.budget_end if limit is None else min(length + limit, self.budget_end)
        self.segment, self.phase = OpenSegment(request.stop_table, length, end), Phase.RUNNING

    def expect(self, iterations: int) -> None:
        """A step decoding up to ``iterations`` tokens of this sequence was planned."""
        self.in_flight.append(iterations)

    def settle(self) -> None:
        """The oldest of its planned steps was read."""
        self.in_flight.popleft()

    def receive(self, tokens: Sequence[int]) -> None:
        """Tokens sampled on the device (their keys/values are written but for the new pending one)."""
        self.tokens += tokens
        self.kv = len(self.tokens) - 1

    def end_segment(self) -> None:
        self.phase, self.segment = Phase.READY, None

    def cancel(self) -> None:
        """Forget a queued segment (the session is closing)."""
        self.queued = None

    def close(self) -> None:
        self.phase = Phase.CLOSED

    def forked(self) -> None:
        """A source whose siblings took its pages, or whose last waiting sibling closed."""
        self.fork = None

    def prefill_again(self) -> None:
        """New weights with ``on_update="recompute"``: prefill the keys/values again (from where
        :meth:`restart_at` says); a running segment is suspended until then."""
        self.phase = Phase.RESTART

    def restart_at(self, num_tokens: int) -> None:
        """Begin that prefill after ``num_tokens`` tokens whose keys/values are written with the new weights
        already (pages shared with a sequence prefilled again before it)."""
        self.kv, self.phase = min(num_tokens, len(self.tokens) - 1), Phase.RECOMPUTE

    def resume_segment(self) -> None:
        """Run the suspended segment on (its bounds and stop table are unchanged)."""
        self.phase = Phase.RUNNING


def slot_seed(entropy: Sequence[int]) -> int:
    """A well-mixed uint32 seed from a tuple of ints (so nearby tuples give unrelated streams)."""
    return mix_seed(*(int(e) & 0xFFFFFFFF for e in entropy))


@dataclasses.dataclass(frozen=True)
class StreamSeeds:
    """The sampling-stream seed of each sibling of a group, given outright (uint32s, one per sibling) instead
    of the group's seed entropy: a sibling admitted alone with its own stream seed samples exactly what it
    samples beside its siblings."""

    seeds: tuple[int, ...]

    def __post_init__(self):
        for seed in self.seeds:
            if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < 2**32:
                raise ValueError(f"a stream seed must be an int in [0, 2**32), got {seed!r}")


def sibling_seeds(entropy: Sequence[int] | StreamSeeds, n: int) -> list[int]:
    """The stream seeds of a group's ``n`` siblings: sibling ``j`` of seed entropy ``e`` gets
    ``slot_seed((*e, j))``; :class:`StreamSeeds` are taken as they are (exactly ``n`` of them)."""
    if isinstance(entropy, StreamSeeds):
        if len(entropy.seeds) != n:
            raise ValueError(f"{len(entropy.seeds)} stream seeds for a group of {n}")
        return [int(s) for s in entropy.seeds]
    return [slot_seed((*entropy, j)) for j in range(n)]

"""Host records of the engine's sessions: what a session owns (:class:`Record`: prompt, response, loss mask,
log-probs, the trainer's view), what the core tracks per slot (:class:`SlotSequence`: its tokens, how far its
keys/values are written, its :class:`Phase`), and what streams back (:class:`Chunk`, :class:`Segment`)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from rstar2jax.engine.config import SamplingParams
from rstar2jax.engine.state import NO_POLICY_VERSION

__all__ = ["Chunk", "Phase", "Record", "Segment", "SlotSequence", "slot_seed"]


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


class Record:
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


class Phase:
    """Phases of a sequence on the host (what the device may run next)."""

    PREFILL, FORK_WAIT, READY, RUNNING, CLOSED = "prefill", "fork_wait", "ready", "running", "closed"


class SlotSequence:
    """The core's view of one slot's sequence: its whole token list (prompt, response, appended tokens,
    the pending last one included), how far its keys/values are dispatched, and its phase."""

    def __init__(self, record: Record, slot: int, seed: int, sampling: SamplingParams):
        self.record, self.slot, self.seed, self.sampling = record, slot, seed, sampling
        self.tokens: list[int] = list(record.prompt_ids)
        self.kv = 0  # positions below this have their key/value writes dispatched
        self.phase = Phase.PREFILL
        # A queued segment: (stop table, max new tokens or None, tokens to append first).
        self.start: tuple[np.ndarray, int | None, list[int]] | None = None
        self.stop_table: np.ndarray | None = None
        self.segment_start = self.segment_end = 0
        self.reserve = 0  # pages the sequence may still take from the pool (promised at admission)
        self.siblings: list[SlotSequence] = []  # a group's source: the sessions forked from it once prefilled
        self.source: SlotSequence | None = None  # a sibling: its group's source
        self.in_flight: collections.deque[int] = collections.deque()  # iterations of dispatched steps
        self.copy: tuple[int, int] | None = None  # a sibling: (source page, its private copy)
        self.closing = False  # a source closed before its siblings were forked

    @property
    def budget_end(self) -> int:
        """The position the sequence may not grow past (prompt + response budget)."""
        return self.record.budget_end


def slot_seed(entropy: Sequence[int]) -> int:
    """A well-mixed uint32 seed from a tuple of ints (so nearby tuples give unrelated streams)."""
    return int(np.random.SeedSequence([int(e) & 0xFFFFFFFF for e in entropy]).generate_state(1)[0])

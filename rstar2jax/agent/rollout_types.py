"""The rollout's records and interfaces: its options (``RolloutConfig``), what it needs of an engine, a
session, a sandbox and an observer, a tool call's outcome, and an unfinished rollout (``PartialRollout``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from rstar2jax.data.conversation import (
    PromptConfig,
)
from rstar2jax.data.problems import Problem
from rstar2jax.data.rollout_contract import declare_record_types
from rstar2jax.data.tool_parser import FunctionCall, ToolCallError
from rstar2jax.data.trajectory import NO_POLICY_VERSION, Trajectory
from rstar2jax.engine.config import SamplingParams
from rstar2jax.engine.records import Segment

# ``error_type`` of the ``internal`` results the sandbox client makes up when no server answered.
_CLIENT_FAILURE_TYPES = frozenset(
    {"DeadlineExceeded", "ConnectionError", "ClientClosed", "BadResponse", "Unreachable"})
# Outcomes that are the sandbox service's fault, never the model's: waited out or retried (outage.py), and a
# trajectory still left with one (a call whose worker died under it every time) is dropped by
# :class:`PolicyRollout` rather than penalised by RoC.
INFRA_OUTCOMES = frozenset({"unreachable", "internal"})


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How a rollout samples and where it stops. Defaults are the paper's RL stage 1 (§5.1).

    Attributes:
      max_response_length: response budget in tokens, sampled and inserted (tool) tokens together.
      max_turns: assistant turns allowed, the first included (paper: 10, 15 in stage 3).
      max_tool_calls_per_turn: a turn's calls run once it holds this many (or when the turn ends).
      tool_timeout: seconds one sandbox call may run.
      tool_output_chars: a tool response (sandbox output or parse error) keeps at most this many
        characters, its head and tail.
      sampling: temperature / top-p / top-k of the policy (paper: temperature 1.0).
      prompt: system prompt, user prefix, assistant opener and tool schemas.
      seed: makes every group's sampling reproducible (group ``i`` is seeded by ``(seed, i)``); None: the
        engine derives seeds from its own seed and the opening order.
      segment_tokens: sample at most this many tokens between looks at the text (for showing it live,
        :func:`converse_async`'s observer); None: a whole turn at once. Either way the tokens are the same.
      tool_infra_retries: a one-shot call whose worker died under it (``killed`` / ``WorkerDied``: the
        service answered, the call did not run to its end) is run again up to this many times. A service that
        does not answer at all is waited for instead, under the rollout's
        :class:`~rstar2jax.agent.outage.OutagePolicy`.
      stateful_tool: each trajectory's calls run in one sandbox session (Jupyter-like: variables persist
        across its turns; an unguessable id per trajectory, closed when it ends). Off by default (the paper's
        tool is stateless).
    """

    max_response_length: int = 8192
    max_turns: int = 10
    max_tool_calls_per_turn: int = 1
    tool_timeout: float = 10.0
    tool_output_chars: int = 2048
    sampling: SamplingParams = SamplingParams()
    prompt: PromptConfig = dataclasses.field(default_factory=PromptConfig)
    seed: int | None = None
    segment_tokens: int | None = None
    tool_infra_retries: int = 2
    stateful_tool: bool = False

    def __post_init__(self):
        for name in ("max_response_length", "max_turns", "max_tool_calls_per_turn", "tool_output_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"RolloutConfig.{name} must be a positive int, got {value!r}")
        if not self.tool_timeout > 0:
            raise ValueError(f"RolloutConfig.tool_timeout must be > 0 seconds, got {self.tool_timeout!r}")
        for name, kind in (("sampling", SamplingParams), ("prompt", PromptConfig)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"RolloutConfig.{name} must be a {kind.__name__}, "
                                f"got {type(getattr(self, name)).__name__}")
        if self.segment_tokens is not None and (
            not isinstance(self.segment_tokens, int) or isinstance(self.segment_tokens, bool)
            or self.segment_tokens < 1
        ):
            raise ValueError(f"RolloutConfig.segment_tokens must be a positive int or None, got "
                             f"{self.segment_tokens!r}")
        if not isinstance(self.tool_infra_retries, int) or self.tool_infra_retries < 0:
            raise ValueError(
                f"RolloutConfig.tool_infra_retries must be an int >= 0, got {self.tool_infra_retries!r}")
        if not isinstance(self.stateful_tool, bool):
            raise ValueError(f"RolloutConfig.stateful_tool must be a bool, got {self.stateful_tool!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"RolloutConfig.seed must be an int or None, got {self.seed!r}")


class RolloutSession(Protocol):
    """What a rollout needs of one engine sequence (:class:`rstar2jax.engine.Session` has it)."""

    done: bool
    remaining: int

    async def generate(self, *, stop: Sequence[Sequence[int]] = (), max_new_tokens: int | None = None
                       ) -> Segment: ...

    def append(self, token_ids: Sequence[int]) -> None: ...

    def close(self) -> None: ...


class RolloutEngine(Protocol):
    """What a rollout needs of the engine (:class:`rstar2jax.engine.Engine` has it)."""

    async def open(self, prompt_ids: Sequence[int], n: int = 1, *, sampling: SamplingParams,
                   max_tokens: int, seed: int | None = None) -> list[RolloutSession]: ...


class ToolSandbox(Protocol):
    """What a rollout needs of the code sandbox (:class:`rstar2jax.agent.SandboxClient` has it): ``run``
    returns a result with ``status``, ``stdout``, ``stderr`` and ``error_type`` and never raises for service
    failures. With ``RolloutConfig.stateful_tool`` it is also called with ``session=`` and needs an async
    ``close_session(session)``. The rollout runs it as its Python tool
    (:class:`~rstar2jax.agent.tools.PythonTool`); other tools plug in as
    :class:`~rstar2jax.agent.tools.Tool` objects or plain functions (``tools=``)."""

    async def run(self, code: str, stdin: str = "", timeout: float | None = None) -> Any: ...


class Observer(Protocol):
    """Sees a conversation as it happens (:func:`converse_async`): each piece of model text, each parsed
    tool call before it runs, and its outcome and the text the model is shown."""

    def on_text(self, text: str) -> None: ...

    def on_call(self, call: FunctionCall | ToolCallError) -> None: ...

    def on_result(self, call: FunctionCall | ToolCallError, outcome: str, response: str) -> None: ...


def tool_outcome(result: Any) -> str:
    """The :data:`~rstar2jax.data.trajectory.ToolOutcome` of a tool's result: its status, or
    ``"unreachable"`` for the ``internal`` results the client returns when no server answered."""
    error_type = result.error_type or ""
    if result.status == "internal" and (error_type in _CLIENT_FAILURE_TYPES or error_type.startswith("HTTP")):
        return "unreachable"
    if result.status == "killed" and error_type in ("WorkerDied", "SessionClosed"):
        return "internal"  # its worker died, or the server closed the session (idle past its TTL)
    if error_type == "SessionNotFound":
        return "internal"  # the server lost the session this client opened (it was restarted)
    return result.status


def drop_infra_failures(trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], int]:
    """``(kept, number dropped)``: the trajectories none of whose tool calls ended in an
    :data:`INFRA_OUTCOMES` outcome (the sandbox's fault, which RoC must not count as the model's)."""
    kept = [t for t in trajectories if INFRA_OUTCOMES.isdisjoint(t.tool_outcomes)]
    return kept, len(trajectories) - len(kept)


class PhaseClock:
    """Seconds spent per phase of one trajectory."""

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


@dataclasses.dataclass
class SessionRecord:
    """The growing record of one session (:class:`~rstar2jax.agent.session.SessionLoop` writes it): token
    stream, the model's own text and per-call outcomes; a :class:`PartialRollout` keeps it to resume."""

    response_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    # None once a segment came without versions (an engine that does not record them).
    policy_versions: list[int] | None = dataclasses.field(default_factory=list)
    # None once a segment came without entropies (a scripted engine, say).
    entropies: list[float] | None = dataclasses.field(default_factory=list)
    model_text: list[str] = dataclasses.field(default_factory=list)
    tool_outcomes: list[str] = dataclasses.field(default_factory=list)
    num_turns: int = 1
    truncated: bool = False
    tool_session: str | None = None  # the sandbox session of a stateful tool (RolloutConfig.stateful_tool)
    clock: PhaseClock = dataclasses.field(default_factory=PhaseClock)

    def add_sampled(self, segment: Segment, text: str) -> None:
        self.response_ids += segment.tokens
        self.loss_mask += [1] * len(segment.tokens)
        self.logprobs += segment.logprobs
        versions = getattr(segment, "policy_versions", [])
        if self.policy_versions is not None and len(versions) == len(segment.tokens):
            self.policy_versions += versions
        else:
            self.policy_versions = None
        entropies = getattr(segment, "entropies", [])
        if self.entropies is not None and len(entropies) == len(segment.tokens):
            self.entropies += entropies
        else:
            self.entropies = None
        self.model_text.append(text)

    def add_inserted(self, token_ids: Sequence[int]) -> None:
        self.response_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        if self.policy_versions is not None:
            self.policy_versions += [NO_POLICY_VERSION] * len(token_ids)
        if self.entropies is not None:
            self.entropies += [0.0] * len(token_ids)

    def to_dict(self) -> dict[str, Any]:
        """The record as plain JSON data: ``SESSION_RECORD_FIELDS`` by name, the clock's seconds by phase."""
        record = {name: getattr(self, name) for name in SESSION_RECORD_FIELDS}
        record = {name: list(v) if isinstance(v, list) else v for name, v in record.items()}
        return {**record, "clock": dict(self.clock.seconds)}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> SessionRecord:
        """The record ``to_dict`` wrote (unknown fields fail)."""
        unknown = set(record) - {*SESSION_RECORD_FIELDS, "clock"}
        if unknown:
            raise ValueError(f"session record has unknown fields {sorted(unknown)}")
        clock = PhaseClock()
        clock.seconds.update(record.get("clock", {}))
        return cls(**{name: record[name] for name in SESSION_RECORD_FIELDS if name in record}, clock=clock)


#: ``SessionRecord``'s fields in its JSON form (``to_dict``), but the clock (its seconds by phase).
SESSION_RECORD_FIELDS = ("response_ids", "loss_mask", "logprobs", "policy_versions", "entropies",
                         "model_text", "tool_outcomes", "num_turns", "truncated", "tool_session")

#: The records' names before they were public: partial rollouts pickled in the checkpoints of earlier runs
#: (``rollout_carry``) name them, and unpickle through them.
_Conversation = SessionRecord
_Clock = PhaseClock


@dataclasses.dataclass(eq=False)
class PartialRollout:
    """A rollout a token budget stopped before it finished (see :func:`rollout_async`): everything needed to
    resume it in a later call (``resume=``), with new parameters or not. Its tokens so far keep the log-probs
    and policy versions of the policy that sampled them.

    Attributes:
      problem: the problem (its gold answer grades the finished rollout).
      prompt_ids: the rendered prompt.
      conversation: the record so far (response tokens, loss mask, log-probs, versions, text, tool outcomes).
      unparsed: model text of the current turn not yet searched for tool calls (a turn cut mid-way).
      seed: seed of this rollout's sampling (each resume derives its own from it); None: the engine's.
      resumes: how many times it was resumed so far.
    """

    problem: Problem
    prompt_ids: list[int]
    conversation: SessionRecord
    unparsed: str = ""
    seed: int | None = None
    resumes: int = 0

    @property
    def problem_id(self) -> str:
        return self.problem.id

    @property
    def num_tokens(self) -> int:
        """Response tokens so far (sampled and inserted)."""
        return len(self.conversation.response_ids)

    @property
    def policy_versions(self) -> list[int] | None:
        return self.conversation.policy_versions

    def to_dict(self) -> dict[str, Any]:
        """The rollout as plain JSON data: ``PARTIAL_ROLLOUT_FIELDS`` by name, the records by their own."""
        return {"problem": self.problem.to_dict(), "prompt_ids": list(self.prompt_ids),
                "conversation": self.conversation.to_dict(), "unparsed": self.unparsed, "seed": self.seed,
                "resumes": self.resumes}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> PartialRollout:
        """The rollout ``to_dict`` wrote (unknown fields fail)."""
        unknown = set(record) - set(PARTIAL_ROLLOUT_FIELDS)
        if unknown:
            raise ValueError(f"partial rollout record has unknown fields {sorted(unknown)}")
        return cls(Problem.from_dict(record["problem"]), list(record["prompt_ids"]),
                   SessionRecord.from_dict(record["conversation"]), record.get("unparsed", ""),
                   record.get("seed"), record.get("resumes", 0))


#: ``PartialRollout``'s fields in its JSON form (``to_dict``).
PARTIAL_ROLLOUT_FIELDS = ("problem", "prompt_ids", "conversation", "unparsed", "seed", "resumes")

# A checkpoint keeps unfinished rollouts as JSON; the old names admit them out of earlier runs' pickles.
declare_record_types({"PartialRollout": PartialRollout, "SessionRecord": SessionRecord,
                      "_Conversation": SessionRecord, "PhaseClock": PhaseClock, "_Clock": PhaseClock})

"""Agentic rollouts: multi-turn reason → code → execute → reflect, token in / token out (paper §2.1, Fig. 3).

Each problem's prompt is rendered once (:func:`~rstar2jax.data.conversation.render_prompt_ids`) and opened as
one engine group of ``samples_per_problem`` sessions (prefilled once, forked). Every session then runs its own
coroutine, and all of them share one event loop, so decoding, sandbox calls and answer verification overlap:

1. generate until ``</tool_call>``, the end of the assistant turn or the response budget;
2. parse the call: a malformed one (bad JSON, unknown tool, bad arguments) becomes an error message that the
   model sees (outcome ``"parse_error"``); a valid one goes to the sandbox at once (outcome: the sandbox
   status). A sandbox that does not answer is waited for (:mod:`rstar2jax.agent.outage`: back-off until it
   answers or the outage budget runs out, then :class:`~rstar2jax.agent.outage.SandboxUnavailable`), so an
   outage never reaches the model;
3. append the results as one ``<tool_response>`` user turn plus the next assistant opener (loss mask 0,
   :func:`~rstar2jax.data.conversation.tool_response_ids`) and go back to 1.

The history is never re-tokenised: the response is exactly the sampled tokens and the appended ones, in order.
A finished response is graded by the :class:`~rstar2jax.reward.AnswerVerifier` (off the event loop) on the
text the model wrote, never on tool output; a truncated one scores 0 (paper §4.3.1).

Limits (:class:`RolloutConfig`): a turn that calls a tool when ``max_turns`` assistant turns (the first
included) have been used ends the rollout ``truncated`` without running the call; a turn's calls run once it
holds ``max_tool_calls_per_turn`` of them or the turn ends; a tool response that does not fit in the rest of
the response budget (tool tokens count against it) ends the rollout ``truncated``, as does a budget reached
while sampling.

Partial rollouts (``token_budget``): once the sessions of one call have sampled that many tokens together,
each session stops at its next segment boundary (``RolloutConfig.segment_tokens``, so a turn can be cut in
the middle) where no tool call of it is running, and comes back as a :class:`PartialRollout`: its tokens,
log-probs and policy versions so far. A later call resumes it (``resume=``, usually with new parameters
and a new ``policy_version``): the engine prefills prompt + response so far and sampling goes on; the old
tokens keep their log-probs and versions. Groups not yet opened when the budget runs out come back as
partial rollouts with no tokens.

Turn ends: the rollout passes the tokenizer's end-of-turn token (``<|im_end|>``) as a stop sequence. An engine
that also counts it as EOS finishes the session there (the usual set-up, and the paper's protocol with one
call per turn). With ``max_tool_calls_per_turn > 1`` a turn can close with calls still unanswered; to show the
model their results, build the engine with ``eos_token_ids`` that leave out the end-of-turn token, so the
session pauses there instead. Otherwise those calls still run and are recorded, and the rollout ends.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np
from transformers import PreTrainedTokenizerBase

from rstar2jax.agent.outage import OutagePolicy, OutageTracker
from rstar2jax.agent.tasks import gather_or_cancel
from rstar2jax.data.conversation import (
    PromptConfig,
    encode_text,
    format_tool_result,
    render_prompt_ids,
    tool_response_ids,
    truncate_middle,
)
from rstar2jax.data.problems import Problem
from rstar2jax.data.tool_parser import TOOL_CALL_CLOSE, ToolCall, ToolCallError, parse_tool_calls
from rstar2jax.data.trajectory import NO_POLICY_VERSION, Trajectory, answer_tag_counts
from rstar2jax.engine.config import page_rounded
from rstar2jax.engine.scheduler import Engine, EngineConfig, SamplingParams, Segment
from rstar2jax.models import ModelConfig
from rstar2jax.reward import AnswerVerifier, default_verifier, extract_answer

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
    ``close_session(session)``."""

    async def run(self, code: str, stdin: str = "", timeout: float | None = None) -> Any: ...


class Observer(Protocol):
    """Sees a conversation as it happens (:func:`converse_async`): each piece of model text, each parsed
    tool call before it runs, and its outcome and the text the model is shown."""

    def on_text(self, text: str) -> None: ...

    def on_call(self, call: ToolCall | ToolCallError) -> None: ...

    def on_result(self, call: ToolCall | ToolCallError, outcome: str, response: str) -> None: ...


def tool_outcome(result: Any) -> str:
    """The :data:`~rstar2jax.data.trajectory.ToolOutcome` of a sandbox result: its status, or
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


class _Clock:
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
class _Conversation:
    """The growing record of one session: token stream, the model's own text and per-call outcomes."""

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
    clock: _Clock = dataclasses.field(default_factory=_Clock)

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
    conversation: _Conversation
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


class _Rollout:
    """One ``rollout_async`` call: the shared pieces and the per-group / per-session coroutines."""

    def __init__(self, engine: RolloutEngine | None, sandbox: ToolSandbox, tokenizer: PreTrainedTokenizerBase,
                 verifier: AnswerVerifier | None, config: RolloutConfig, observer: Observer | None = None,
                 token_budget: int | None = None, outage: OutagePolicy | None = None):
        self.engine, self.sandbox, self.tokenizer, self.verifier, self.config = (
            engine, sandbox, tokenizer, verifier, config)
        where = ", ".join(getattr(sandbox, "urls", ())) or "service"
        self.outage = OutageTracker(outage or OutagePolicy(), where, worker_retries=config.tool_infra_retries)
        self.token_budget = token_budget
        self.sampled = 0  # tokens the sessions of this call sampled, together
        if not tokenizer.eos_token:
            raise ValueError("the tokenizer has no eos_token: the rollout needs the end-of-turn token")
        self.tool_call_end = encode_text(tokenizer, TOOL_CALL_CLOSE)
        self.stops = [self.tool_call_end, encode_text(tokenizer, tokenizer.eos_token)]
        self.tool_names = config.prompt.tool_names
        self.observer = observer

    def group_seed(self, index: int) -> int | None:
        if self.config.seed is None:
            return None
        return int(np.random.SeedSequence([self.config.seed, index]).generate_state(1)[0])

    def out_of_budget(self) -> bool:
        return self.token_budget is not None and self.sampled >= self.token_budget

    @staticmethod
    def derived_seed(*entropy: int | None) -> int | None:
        """A well-mixed seed from ints (None if the first is None: the engine derives one)."""
        if entropy[0] is None:
            return None
        return int(np.random.SeedSequence([int(e) for e in entropy]).generate_state(1)[0])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    async def problem(self, index: int, problem: Problem, n: int) -> list[Trajectory | PartialRollout]:
        prompt_ids = render_prompt_ids(self.tokenizer, problem.problem, self.config.prompt)
        seed = self.group_seed(index)
        if self.out_of_budget():  # not opened: the whole group waits for a later call
            return [PartialRollout(problem, list(prompt_ids), _Conversation(),
                                   seed=self.derived_seed(seed, j)) for j in range(n)]
        start = time.perf_counter()
        try:
            sessions = await self.engine.open(prompt_ids, n, sampling=self.config.sampling,
                                              max_tokens=self.config.max_response_length, seed=seed)
        except ValueError as error:
            raise ValueError(f"problem {problem.id!r}: {error}") from error
        queued = time.perf_counter() - start
        return await gather_or_cancel(
            self.session(s, problem, prompt_ids, queued, seed=self.derived_seed(seed, j))
            for j, s in enumerate(sessions))

    async def resume(self, partial: PartialRollout) -> Trajectory | PartialRollout:
        """Go on with a rollout an earlier call stopped: a new session whose prompt is the prompt and the
        response so far (prefilled with this call's parameters), budget what is left of the response's."""
        if self.out_of_budget():
            return partial
        conversation = partial.conversation
        start = time.perf_counter()
        left = self.config.max_response_length - len(conversation.response_ids)
        if left < 1:
            raise ValueError(f"resume: the partial rollout of problem {partial.problem_id!r} has "
                             f"{len(conversation.response_ids)} response tokens, no budget left of "
                             f"max_response_length={self.config.max_response_length}")
        resumes = partial.resumes + 1
        (session,) = await self.engine.open(
            partial.prompt_ids + conversation.response_ids, 1, sampling=self.config.sampling, max_tokens=left,
            seed=self.derived_seed(partial.seed, resumes))
        conversation.clock.seconds["queue"] += time.perf_counter() - start
        return await self.session(session, partial.problem, partial.prompt_ids, 0.0, seed=partial.seed,
                                  conversation=conversation, unparsed=partial.unparsed, resumes=resumes)

    async def session(self, session: RolloutSession, problem: Problem, prompt_ids: list[int],
                      queued: float, *, seed: int | None = None, conversation: _Conversation | None = None,
                      unparsed: str = "", resumes: int = 0) -> Trajectory | PartialRollout:
        if conversation is None:
            conversation = _Conversation()
            if self.config.stateful_tool:  # unguessable: the capability
                conversation.tool_session = f"rollout-{secrets.token_urlsafe(18)}"
        conversation.clock.seconds["queue"] += queued
        interrupted = None
        try:
            interrupted = await self.converse(session, conversation, unparsed)
        finally:
            session.close()
            if conversation.tool_session is not None:
                await self.sandbox.close_session(conversation.tool_session)
        if interrupted is not None:
            return PartialRollout(problem, list(prompt_ids), conversation, interrupted, seed, resumes)
        text = "".join(conversation.model_text)
        opens, closes, pairs = answer_tag_counts(text)
        if conversation.truncated:
            answer, reward = extract_answer(text), 0.0
        else:
            with conversation.clock.phase("verify"):
                grade = await self.verifier.grade(text, problem.answer)
            answer, reward = grade.extracted_answer, float(grade.is_correct)
        return Trajectory(
            problem_id=problem.id,
            prompt_ids=list(prompt_ids),
            response_ids=conversation.response_ids,
            loss_mask=conversation.loss_mask,
            logprobs=conversation.logprobs,
            tool_outcomes=conversation.tool_outcomes,
            num_turns=conversation.num_turns,
            num_answer_blocks=opens,
            num_answer_closes=closes,
            num_answer_pairs=pairs,
            truncated=conversation.truncated,
            answer=answer,
            reward=reward,
            timings=dict(conversation.clock.seconds),
            policy_versions=conversation.policy_versions,
            entropies=conversation.entropies,
        )

    async def execute(self, call: ToolCall | ToolCallError, session: str | None = None) -> tuple[str, str]:
        """(outcome, text the model sees) of one parsed call, run under the rollout's outage policy."""
        limit = self.config.tool_output_chars
        if self.observer is not None:
            self.observer.on_call(call)
        if isinstance(call, ToolCallError):
            outcome, response = "parse_error", truncate_middle(call.message, limit)
        else:
            extra = {} if session is None else {"session": session}
            timeout = self.config.tool_timeout
            result = await self.outage.call(
                lambda: self.sandbox.run(call.code, stdin=call.input, timeout=timeout, **extra),
                session=session is not None)
            outcome, response = tool_outcome(result), format_tool_result(result, limit)
        if self.observer is not None:
            self.observer.on_result(call, outcome, response)
        return outcome, response

    async def collect(self, running: list[asyncio.Task], conversation: _Conversation) -> list[str]:
        """Wait for a turn's dispatched calls, record their outcomes and return the texts the model sees."""
        with conversation.clock.phase("tool"):
            results = await asyncio.gather(*running)
        conversation.tool_outcomes += [outcome for outcome, _ in results]
        return [response for _, response in results]

    async def converse(self, session: RolloutSession, conversation: _Conversation, unparsed: str = ""
                       ) -> str | None:
        """Run the turns of one session until it finishes, is truncated or hits a limit (returns None), or
        until the call's token budget is spent at a point where it can stop (no tool call running, budget
        left): then it returns the text of the current turn not yet parsed (``unparsed``: what a resumed
        conversation starts from)."""
        config = self.config
        running: list[asyncio.Task] = []  # this turn's calls, dispatched as soon as they were written
        try:
            while True:
                if self.out_of_budget() and not running and session.remaining > 0:
                    return unparsed
                with conversation.clock.phase("generate"):
                    segment = await session.generate(stop=self.stops, max_new_tokens=config.segment_tokens)
                self.sampled += len(segment.tokens)
                text = self.decode(segment.tokens)
                conversation.add_sampled(segment, text)
                if self.observer is not None:
                    self.observer.on_text(text)
                unparsed += text
                if segment.finish_reason == "budget":
                    conversation.truncated = True
                    await self.collect(running, conversation)  # calls of the cut turn ran: record them
                    return None
                called = (segment.finish_reason == "stop"
                          and segment.tokens[-len(self.tool_call_end):] == self.tool_call_end)
                turn_over = not called and segment.finish_reason in ("stop", "eos")
                if not (called or turn_over):
                    continue  # paused mid-turn ("length"): keep sampling
                calls = parse_tool_calls(unparsed, tool_names=self.tool_names)
                unparsed = ""
                if calls and conversation.num_turns >= config.max_turns and not session.done:
                    conversation.truncated = True  # no turn is left to show the results in
                    return None
                running += [asyncio.ensure_future(self.execute(call, conversation.tool_session))
                            for call in calls]
                if called and len(running) < config.max_tool_calls_per_turn:
                    continue
                if not running:
                    return None  # the model ended its turn without calling a tool: finished
                responses = await self.collect(running, conversation)
                running = []
                if session.done:
                    return None  # the turn ended at an engine EOS: nothing can follow it
                ids = tool_response_ids(self.tokenizer, responses, config.prompt, turn_closed=turn_over)
                if len(ids) > session.remaining:
                    conversation.truncated = True
                    return None
                session.append(ids)
                conversation.add_inserted(ids)
                conversation.num_turns += 1
        except BaseException:
            for task in running:
                task.cancel()
            raise


def _checked_problems(problems: Iterable[Problem]) -> list[Problem]:
    problems = list(problems)
    for i, problem in enumerate(problems):
        if not isinstance(problem, Problem):
            raise TypeError(
                f"problems[{i}] is a {type(problem).__name__}, expected rstar2jax.data.problems.Problem "
                "(a SyntheticProblem converts with .as_problem())"
            )
    return problems


async def rollout_async(
    problems: Iterable[Problem],
    samples_per_problem: int,
    *,
    engine: RolloutEngine,
    sandbox: ToolSandbox,
    tokenizer: PreTrainedTokenizerBase,
    verifier: AnswerVerifier | None = None,
    config: RolloutConfig = RolloutConfig(),
    stats: collections.Counter | None = None,
    token_budget: int | None = None,
    resume: Sequence[PartialRollout] = (),
    outage: OutagePolicy | None = None,
) -> list[Trajectory | PartialRollout]:
    """Roll out every problem ``samples_per_problem`` times with the tool, concurrently; see the module doc.

    Args:
      problems: the problems (their ``answer`` is the gold answer).
      samples_per_problem: rollouts per problem (2G in GRPO-RoC); one engine group each, so the prompt is
        prefilled once. At most the engine's slot count.
      engine: a running :class:`~rstar2jax.engine.Engine` (inside ``async with engine``) holding the policy.
      sandbox: a :class:`~rstar2jax.agent.SandboxClient` (or anything with its ``run``).
      tokenizer: the policy's tokenizer (its chat template frames prompts and tool responses).
      verifier: grades final answers; None: the process-wide :func:`~rstar2jax.reward.default_verifier`.
      config: limits, sampling and prompt.
      stats: if given, the sandbox counts of :meth:`~rstar2jax.agent.outage.OutageTracker.stats` are added
        to it (seconds of outage, calls retried, restarts, worker deaths).
      token_budget: partial rollouts (see the module doc): once the sessions have sampled this many tokens
        together, each stops at its next segment boundary and comes back as a :class:`PartialRollout`
        (``config.segment_tokens`` bounds how far past the budget a session can go). None: no budget.
      resume: partial rollouts of earlier calls to go on with (this call's ``engine`` samples their new
        tokens; ``config.max_response_length`` must be the one they started with).
      outage: how long and how to wait for a sandbox that does not answer (default ``OutagePolicy()``: up
        to 300 s); past it :class:`~rstar2jax.agent.outage.SandboxUnavailable` is raised.

    Returns:
      The resumed rollouts (in ``resume`` order), then ``len(problems) * samples_per_problem`` rollouts,
      problem by problem, in order: :class:`Trajectory` records, and with a ``token_budget``
      :class:`PartialRollout` records of the unfinished ones.
    """
    problems = _checked_problems(problems)
    if not isinstance(samples_per_problem, int) or samples_per_problem < 1:
        raise ValueError(f"samples_per_problem must be a positive int, got {samples_per_problem!r}")
    if token_budget is not None:
        if not isinstance(token_budget, int) or isinstance(token_budget, bool) or token_budget < 1:
            raise ValueError(f"token_budget must be a positive int or None, got {token_budget!r}")
        if config.stateful_tool:
            raise ValueError("token_budget (partial rollouts) does not support RolloutConfig.stateful_tool: "
                             "a stopped rollout would hold its sandbox session until resumed")
    resume = list(resume)
    for i, partial in enumerate(resume):
        if not isinstance(partial, PartialRollout):
            raise TypeError(f"resume[{i}] is a {type(partial).__name__}, expected a PartialRollout")
    run = _Rollout(engine, sandbox, tokenizer, verifier or default_verifier(), config,
                   token_budget=token_budget, outage=outage)
    groups = await gather_or_cancel(
        [run.resume(p) for p in resume]
        + [run.problem(i, p, samples_per_problem) for i, p in enumerate(problems)])
    if stats is not None:
        stats.update(run.outage.stats())
    resumed, groups = groups[: len(resume)], groups[len(resume):]
    return resumed + [trajectory for group in groups for trajectory in group]


@dataclasses.dataclass(frozen=True)
class Conversation:
    """What :func:`converse_async` returns: the response stream (sampled and inserted tokens), the model's
    own text, every tool call's outcome, the turns used and whether a limit cut the conversation."""

    response_ids: list[int]
    loss_mask: list[int]
    text: str
    tool_outcomes: list[str]
    num_turns: int
    truncated: bool


async def converse_async(
    session: RolloutSession,
    *,
    sandbox: ToolSandbox,
    tokenizer: PreTrainedTokenizerBase,
    config: RolloutConfig = RolloutConfig(),
    observer: Observer | None = None,
) -> Conversation:
    """Runs one opened session as a rollout does (generate, parse calls, run them in the sandbox, append the
    tool responses, until the model ends its turn without a call or a limit is hit), without grading: the
    chat's turn. ``observer`` sees the text and the tool calls as they happen. The session is left open
    (the caller closes it)."""
    run = _Rollout(None, sandbox, tokenizer, None, config, observer=observer)
    conversation = _Conversation()
    await run.converse(session, conversation)
    return Conversation(conversation.response_ids, conversation.loss_mask, "".join(conversation.model_text),
                        conversation.tool_outcomes, conversation.num_turns, conversation.truncated)


_background_loop: asyncio.AbstractEventLoop | None = None
_background_loop_lock = threading.Lock()


def _rollout_loop() -> asyncio.AbstractEventLoop:
    """The event loop behind :func:`rollout`: one per process, on a daemon thread, started on first use."""
    global _background_loop
    with _background_loop_lock:
        if _background_loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="rstar2jax-rollout", daemon=True).start()
            _background_loop = loop
        return _background_loop


def rollout(
    problems: Iterable[Problem],
    samples_per_problem: int,
    *,
    engine: Engine,
    sandbox: ToolSandbox,
    tokenizer: PreTrainedTokenizerBase,
    verifier: AnswerVerifier | None = None,
    config: RolloutConfig = RolloutConfig(),
    stats: collections.Counter | None = None,
    token_budget: int | None = None,
    resume: Sequence[PartialRollout] = (),
    outage: OutagePolicy | None = None,
) -> list[Trajectory | PartialRollout]:
    """Blocking :func:`rollout_async` for notebooks and scripts (it works inside Jupyter's running loop).

    ``engine`` must not be running: it is started for the call (``async with engine``) and stopped after,
    keeping its compiled programs for the next call. Calls run on one private event loop that lives as long
    as the process, so a :class:`~rstar2jax.agent.SandboxClient` (bound by aiohttp to the first loop that
    uses it) can be passed to every ``rollout`` call; do not use it from another loop as well.
    """

    async def run() -> list[Trajectory]:
        async with engine:
            return await rollout_async(problems, samples_per_problem, engine=engine, sandbox=sandbox,
                                       tokenizer=tokenizer, verifier=verifier, config=config, stats=stats,
                                       token_budget=token_budget, resume=resume, outage=outage)

    future = asyncio.run_coroutine_threadsafe(run(), _rollout_loop())
    try:
        return future.result()
    except BaseException:
        future.cancel()  # e.g. KeyboardInterrupt: stop the sessions and their tool calls too
        raise


@dataclasses.dataclass(eq=False, repr=False)
class PolicyRollout:
    """The trainer's ``rollout_fn`` (see :mod:`rstar2jax.train.rl`) on the real engine and sandbox::

        rollout_fn = PolicyRollout(model_config, tokenizer, SandboxClient(url),
                                   engine_config=EngineConfig(num_slots=64), max_prompt_length=1024)
        trajectories = rollout_fn(params, problems, samples_per_problem=32, max_response_length=8192,
                                  max_turns=10, seed=step_seed, policy_version=step)

    Each call decodes with the ``params`` it is given, on a fresh :class:`~rstar2jax.engine.Engine` (a new KV
    cache) with ``max_len = max_prompt_length + max_response_length`` rounded up to whole KV pages. The
    engine's programs are compiled for shapes, never values, so the new parameters of every training step
    reuse them; only a new response budget (a new stage) compiles again.

    Args:
      model_config: the policy's model config (the trainer's, so parameters match).
      tokenizer: the policy's tokenizer.
      sandbox: the sandbox client, used from :func:`rollout`'s private loop only; :meth:`close` closes it.
      engine_config: slots, decode chunk, buckets...; its ``max_len`` is replaced per call.
      max_prompt_length: the longest rendered prompt the engine must hold.
      config: everything but ``max_response_length``, ``max_turns`` and ``seed``, which each call sets.
      verifier: grades final answers; None: the process-wide default.
      outage: how long and how to wait for a sandbox that does not answer (:mod:`rstar2jax.agent.outage`);
        past its budget a call raises :class:`~rstar2jax.agent.outage.SandboxUnavailable`.

    A sandbox outage shorter than the budget costs time, not trajectories: the calls wait and every session
    keeps its tokens. A trajectory whose tool call still failed for the sandbox's own reasons (its worker
    died under it every time it ran: an :data:`INFRA_OUTCOMES` outcome) is dropped from its group, so the
    RoC tool-error penalty never counts the server's fault against the model (the trainer accepts groups
    smaller than ``samples_per_problem``). Each call's counts are in :attr:`last_stats`, which the trainer
    logs as ``rollout/<name>``: ``sandbox_outage_s``, ``sandbox_outages``, ``sandbox_retried_calls``,
    ``sandbox_restarts``, ``sandbox_worker_deaths`` and ``trajectories_dropped_for_sandbox_failures``; a
    call that met an outage or dropped anything says so in one line.

    ``policy_version`` (the trainer step of ``params``) tags the sampled tokens. Partial rollouts: with
    ``token_budget`` the call returns ``(finished trajectories, unfinished PartialRollouts)``, and ``resume``
    takes the unfinished ones of an earlier call (see :func:`rollout_async`); sessions then sample in
    segments of ``config.segment_tokens`` (``partial_segment_tokens`` when that is None) between looks at
    the budget.
    """

    model_config: ModelConfig
    tokenizer: PreTrainedTokenizerBase
    sandbox: ToolSandbox
    _: dataclasses.KW_ONLY
    engine_config: EngineConfig
    max_prompt_length: int
    config: RolloutConfig = RolloutConfig()
    verifier: AnswerVerifier | None = None
    partial_segment_tokens: int = 64
    outage: OutagePolicy = OutagePolicy()
    last_stats: dict = dataclasses.field(default_factory=dict, init=False)

    def __post_init__(self):
        if not isinstance(self.max_prompt_length, int) or self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be a positive int, got {self.max_prompt_length!r}")

    def __call__(self, params, problems: Sequence[Problem], *, samples_per_problem: int,
                 max_response_length: int, max_turns: int, seed: int, policy_version: int = 0,
                 token_budget: int | None = None, resume: Sequence[PartialRollout] = ()
                 ) -> list[Trajectory] | tuple[list[Trajectory], list[PartialRollout]]:
        max_len = page_rounded(self.max_prompt_length + max_response_length, self.engine_config.page_size)
        engine_config = dataclasses.replace(self.engine_config, max_len=max_len)
        config = dataclasses.replace(self.config, max_response_length=max_response_length,
                                     max_turns=max_turns, seed=seed)
        partial = token_budget is not None
        if partial and config.segment_tokens is None:
            config = dataclasses.replace(config, segment_tokens=self.partial_segment_tokens)
        stats = collections.Counter()
        self.last_stats = {}
        engine = self.make_engine(params, engine_config, policy_version)
        results = rollout(problems, samples_per_problem, engine=engine, sandbox=self.sandbox,
                          tokenizer=self.tokenizer, verifier=self.verifier, config=config, stats=stats,
                          token_budget=token_budget, resume=resume, outage=self.outage)
        trajectories = [t for t in results if isinstance(t, Trajectory)]
        unfinished = [t for t in results if isinstance(t, PartialRollout)]
        kept, dropped = drop_infra_failures(trajectories)
        self.last_stats = {**stats, "trajectories_dropped_for_sandbox_failures": dropped}
        if stats["sandbox_retried_calls"] or dropped:
            print(f"rollout: sandbox calls retried {stats['sandbox_retried_calls']:g}, outage "
                  f"{stats['sandbox_outage_s']:.1f} s, restarts {stats['sandbox_restarts']:g}; "
                  f"{len(kept)} of {len(trajectories)} trajectories kept", flush=True)
        return (kept, unfinished) if partial else kept

    def make_engine(self, params, engine_config: EngineConfig, policy_version: int) -> RolloutEngine:
        """The engine one call samples with (not started: :func:`rollout` runs it)."""
        return Engine(params, self.model_config, engine_config, policy_version=policy_version)

    def close(self) -> None:
        """Close the sandbox client (on the loop it was used from), if it has an async ``close``."""
        close = getattr(self.sandbox, "close", None)
        if asyncio.iscoroutinefunction(close):
            asyncio.run_coroutine_threadsafe(close(), _rollout_loop()).result()

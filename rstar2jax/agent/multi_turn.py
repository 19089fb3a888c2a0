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
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from rstar2jax.agent.outage import OutagePolicy
from rstar2jax.agent.rollout_types import (
    Observer,
    PartialRollout,
    RolloutConfig,
    RolloutEngine,
    RolloutSession,
    SessionRecord,
    ToolSandbox,
    drop_infra_failures,
)
from rstar2jax.agent.session import SessionLoop
from rstar2jax.agent.stream import RolloutStream, StreamSpec
from rstar2jax.agent.tasks import gather_or_cancel
from rstar2jax.data.problems import Problem
from rstar2jax.data.trajectory import Trajectory
from rstar2jax.engine.async_engine import Engine
from rstar2jax.engine.config import EngineConfig, page_rounded
from rstar2jax.models import ModelConfig
from rstar2jax.reward import AnswerVerifier, default_verifier

logger = logging.getLogger(__name__)
#: The options a rollout takes when given none (a frozen record: shared safely as a default).
DEFAULT_CONFIG = RolloutConfig()

# The records and protocols a rollout works with (RolloutConfig, PartialRollout, ToolSandbox, ...) live in
# ``agent.rollout_types``; the package ``rstar2jax.agent`` offers both modules' names.
__all__ = ["BackgroundLoop", "Conversation", "PolicyRollout", "converse_async", "rollout", "rollout_async"]


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
    sandbox: ToolSandbox | None,
    tokenizer: PreTrainedTokenizerBase,
    verifier: AnswerVerifier | None = None,
    config: RolloutConfig = DEFAULT_CONFIG,
    stats: collections.Counter | None = None,
    token_budget: int | None = None,
    resume: Sequence[PartialRollout] = (),
    outage: OutagePolicy | None = None,
    tools: Sequence[Any] | None = None,
    reward: str | None = None,
) -> list[Trajectory | PartialRollout]:
    """Roll out every problem ``samples_per_problem`` times with the tool, concurrently; see the module doc.

    Args:
      problems: the problems (their ``answer`` is the gold answer).
      samples_per_problem: rollouts per problem (2G in GRPO-RoC); one engine group each, so the prompt is
        prefilled once. At most the engine's slot count.
      engine: a running :class:`~rstar2jax.engine.Engine` (inside ``async with engine``) holding the policy.
      sandbox: a :class:`~rstar2jax.agent.SandboxClient` (or anything with its ``run``): the Python tool
        under every name ``config.prompt`` lists, unless ``tools`` are given (None: none needed).
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
      tools: the rollout's tools (:class:`~rstar2jax.agent.tools.Tool` objects or plain functions, e.g.
        ``[PythonTool(sandbox), calculator]``); ``config.prompt`` must list their schemas (it shows them to
        the model; ``agent.load_tools`` builds both). None: the sandbox's Python tool.
      reward: ``"module:function"`` scoring a finished trajectory from ``(trajectory, problem)`` instead of
        the answer verifier (run in the verifier's worker processes, see
        :meth:`~rstar2jax.reward.AnswerVerifier.reward`); None: the verifier's answer check.

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
    run = SessionLoop(engine, sandbox, tokenizer, verifier or default_verifier(), config,
                      token_budget=token_budget, outage=outage, tools=tools, reward=reward)
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
    sandbox: ToolSandbox | None,
    tokenizer: PreTrainedTokenizerBase,
    config: RolloutConfig = DEFAULT_CONFIG,
    observer: Observer | None = None,
    tools: Sequence[Any] | None = None,
) -> Conversation:
    """Runs one opened session as a rollout does (generate, parse calls, run them in the sandbox, append the
    tool responses, until the model ends its turn without a call or a limit is hit), without grading: the
    chat's turn. ``observer`` sees the text and the tool calls as they happen. The session is left open
    (the caller closes it). ``tools``: as :func:`rollout_async`'s."""
    run = SessionLoop(None, sandbox, tokenizer, None, config, observer=observer, tools=tools)
    conversation = SessionRecord()
    await run.converse(session, conversation)
    return Conversation(conversation.response_ids, conversation.loss_mask, "".join(conversation.model_text),
                        conversation.tool_outcomes, conversation.num_turns, conversation.truncated)


class BackgroundLoop:
    """An event loop on a daemon thread, started on first use and stopped by :meth:`close` (a later use
    starts a new one). What runs on it keeps its loop across calls: a
    :class:`~rstar2jax.agent.SandboxClient` is bound by aiohttp to the first loop that uses it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _running(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="rstar2jax-rollout",
                                                daemon=True)
                self._thread.start()
            return self._loop

    def start(self, coroutine) -> concurrent.futures.Future:
        """Schedules ``coroutine`` on the loop and returns its future at once (``cancel()`` stops it)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._running())

    def run(self, coroutine):
        """Runs ``coroutine`` on the loop and waits for its result (works inside Jupyter's running loop); an
        interruption (e.g. KeyboardInterrupt) cancels it, stopping its sessions and tool calls too."""
        future = self.start(coroutine)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        """Stops the loop and its thread; closing twice, or a loop never started, is harmless."""
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def rollout(
    problems: Iterable[Problem],
    samples_per_problem: int,
    *,
    engine: Engine,
    loop: BackgroundLoop | None = None,
    **options: Any,
) -> list[Trajectory | PartialRollout]:
    """Blocking :func:`rollout_async` for notebooks and scripts (it works inside Jupyter's running loop).

    ``options`` are :func:`rollout_async`'s keywords (``sandbox``, ``tokenizer``, ``verifier``, ``config``,
    ``stats``, ``token_budget``, ``resume``, ``outage``). ``engine`` must not be running: it is started for
    the call (``async with engine``) and stopped after, keeping its compiled programs for the next call. The
    call runs on ``loop``; pass the same :class:`BackgroundLoop` to every call that shares a
    :class:`~rstar2jax.agent.SandboxClient` (bound by aiohttp to the first loop that uses it), and close it
    when done. None: a loop for this call only.
    """

    async def run() -> list[Trajectory]:
        async with engine:
            return await rollout_async(problems, samples_per_problem, engine=engine, **options)

    if loop is not None:
        return loop.run(run())
    own = BackgroundLoop()
    try:
        return own.run(run())
    finally:
        own.close()


@dataclasses.dataclass(eq=False, repr=False)
class PolicyRollout:
    """The trainer's ``rollout_fn`` (see :mod:`rstar2jax.schedules.schedule`) on the real engine and sandbox::

        rollout_fn = PolicyRollout(model_config, tokenizer, SandboxClient(url),
                                   engine_config=EngineConfig(num_slots=64), max_prompt_length=1024)
        trajectories = rollout_fn(params, problems, samples_per_problem=32, max_response_length=8192,
                                  max_turns=10, seed=step_seed, policy_version=step)
        finished, unfinished = rollout_fn.partial(params, problems, ..., token_budget=4096, resume=unfinished)

    Each call decodes with the ``params`` it is given, on a fresh :class:`~rstar2jax.engine.Engine` (a new KV
    cache) with ``max_len = max_prompt_length + max_response_length`` rounded up to whole KV pages
    (:meth:`engine_for`, for calls and streams alike). The
    engine's programs are compiled for shapes, never values, so the new parameters of every training step
    reuse them; only a new response budget (a new stage) compiles again. Every call runs on this object's
    own :class:`BackgroundLoop` (the sandbox client is bound to it); :meth:`close` closes both.

    Args:
      model_config: the policy's model config (the trainer's, so parameters match).
      tokenizer: the policy's tokenizer.
      sandbox: the sandbox client, used from this object's loop only; :meth:`close` closes it.
      engine_config: slots, decode chunk, buckets...; its ``max_len`` is replaced per call.
      max_prompt_length: the longest rendered prompt the engine must hold.
      config: everything but ``max_response_length``, ``max_turns`` and ``seed``, which each call sets.
      verifier: grades final answers; None: the process-wide default.
      outage: how long and how to wait for a sandbox that does not answer (:mod:`rstar2jax.agent.outage`);
        past its budget a call raises :class:`~rstar2jax.agent.outage.SandboxUnavailable`.
      tools, reward: as :func:`rollout_async`'s (None: the sandbox's Python tool, the answer verifier).

    A sandbox outage shorter than the budget costs time, not trajectories: the calls wait and every session
    keeps its tokens. A trajectory whose tool call still failed for the sandbox's own reasons (its worker
    died under it every time it ran: an :data:`INFRA_OUTCOMES` outcome) is dropped from its group, so the
    RoC tool-error penalty never counts the server's fault against the model (the trainer accepts groups
    smaller than ``samples_per_problem``). Each call's counts are in :attr:`last_stats`, which the trainer
    logs as ``rollout/<name>``: ``sandbox_outage_s``, ``sandbox_outages``, ``sandbox_retried_calls``,
    ``sandbox_restarts``, ``sandbox_worker_deaths`` and ``trajectories_dropped_for_sandbox_failures``; a
    call that met an outage or dropped anything says so in one log line.

    ``policy_version`` (the trainer step of ``params``) tags the sampled tokens. Partial rollouts
    (:meth:`partial`) stop at a ``token_budget`` and return ``(finished trajectories, unfinished
    PartialRollouts)``; ``resume`` takes the unfinished ones of an earlier call (see :func:`rollout_async`);
    sessions then sample in segments of ``config.segment_tokens`` (``partial_segment_tokens`` when that is
    None) between looks at the budget.
    """

    model_config: ModelConfig
    tokenizer: PreTrainedTokenizerBase
    sandbox: ToolSandbox
    _: dataclasses.KW_ONLY
    engine_config: EngineConfig
    max_prompt_length: int
    config: RolloutConfig = DEFAULT_CONFIG
    verifier: AnswerVerifier | None = None
    partial_segment_tokens: int = 64
    outage: OutagePolicy = OutagePolicy()
    tools: Sequence[Any] | None = None
    reward: str | None = None
    last_stats: dict = dataclasses.field(default_factory=dict, init=False)
    loop: BackgroundLoop = dataclasses.field(default_factory=BackgroundLoop, init=False)

    def __post_init__(self):
        if not isinstance(self.max_prompt_length, int) or self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be a positive int, got {self.max_prompt_length!r}")

    def __call__(self, params, problems: Sequence[Problem], *, samples_per_problem: int,
                 max_response_length: int, max_turns: int, seed: int, policy_version: int = 0
                 ) -> list[Trajectory]:
        """``samples_per_problem`` finished trajectories per problem (fewer where the sandbox failed)."""
        finished, _ = self._run(params, problems, samples_per_problem, max_response_length, max_turns, seed,
                                policy_version, token_budget=None, resume=())
        return finished

    def partial(self, params, problems: Sequence[Problem], *, samples_per_problem: int,
                max_response_length: int, max_turns: int, seed: int, policy_version: int = 0,
                token_budget: int, resume: Sequence[PartialRollout] = ()
                ) -> tuple[list[Trajectory], list[PartialRollout]]:
        """Partial rollouts: ``problems`` opened and ``resume`` continued until the sessions sampled
        ``token_budget`` tokens together; returns ``(finished trajectories, unfinished rollouts)``."""
        return self._run(params, problems, samples_per_problem, max_response_length, max_turns, seed,
                         policy_version, token_budget=token_budget, resume=resume)

    def _run(self, params, problems, samples_per_problem, max_response_length, max_turns, seed,
             policy_version, *, token_budget: int | None, resume: Sequence[PartialRollout]):
        config = self._call_config(max_response_length, max_turns, seed)
        if token_budget is not None and config.segment_tokens is None:
            config = dataclasses.replace(config, segment_tokens=self.partial_segment_tokens)
        stats = collections.Counter()
        self.last_stats = {}
        engine = self.engine_for(params, max_response_length, policy_version)
        results = rollout(problems, samples_per_problem, engine=engine, sandbox=self.sandbox,
                          tokenizer=self.tokenizer, verifier=self.verifier, config=config, stats=stats,
                          token_budget=token_budget, resume=resume, outage=self.outage, loop=self.loop,
                          tools=self.tools, reward=self.reward)
        trajectories = [t for t in results if isinstance(t, Trajectory)]
        unfinished = [t for t in results if isinstance(t, PartialRollout)]
        kept, dropped = drop_infra_failures(trajectories)
        self.last_stats = {**stats, "trajectories_dropped_for_sandbox_failures": dropped}
        if stats["sandbox_retried_calls"] or dropped:
            logger.info("rollout: sandbox calls retried %g, outage %.1f s, restarts %g; %d of %d "
                        "trajectories kept", stats["sandbox_retried_calls"], stats["sandbox_outage_s"],
                        stats["sandbox_restarts"], len(kept), len(trajectories))
        return kept, unfinished

    def stream(self, params, *, policy_version: int, samples_per_problem: int, max_response_length: int,
               max_turns: int, on_update: str = "keep", device=None) -> RolloutStream:
        """These rollouts as a stream (:class:`~rstar2jax.agent.stream.RolloutStream`): one engine on
        ``device`` with ``params`` from now until the stream is closed, groups submitted one by one and handed
        back as they finish, new weights taken in flight. The asynchronous schedule's producer."""
        spec = StreamSpec(engine=self.engine_for, sessions=self.stream_sessions, loop=self.loop)
        return RolloutStream(spec, params, policy_version=policy_version,
                             samples_per_problem=samples_per_problem, max_response_length=max_response_length,
                             max_turns=max_turns, on_update=on_update, device=device)

    def engine_for(self, params, max_response_length: int, policy_version: int) -> RolloutEngine:
        """The engine of a call or a stream with this response budget (not started): ``engine_config`` with
        ``max_len = max_prompt_length + max_response_length`` rounded up to whole KV pages."""
        max_len = page_rounded(self.max_prompt_length + max_response_length, self.engine_config.page_size)
        engine_config = dataclasses.replace(self.engine_config, max_len=max_len)
        return self.make_engine(params, engine_config, policy_version)

    def stream_sessions(self, engine: RolloutEngine, max_response_length: int, max_turns: int) -> SessionLoop:
        """The session loop of a stream's groups on ``engine`` (no call seed: each group is seeded when it is
        submitted), with this rollout's sandbox, tokenizer, verifier, outage policy, tools and reward."""
        return SessionLoop(engine, self.sandbox, self.tokenizer, self.verifier or default_verifier(),
                           self._call_config(max_response_length, max_turns, None), outage=self.outage,
                           tools=self.tools, reward=self.reward)

    def _call_config(self, max_response_length: int, max_turns: int, seed: int | None) -> RolloutConfig:
        return dataclasses.replace(self.config, max_response_length=max_response_length, max_turns=max_turns,
                                   seed=seed)

    def make_engine(self, params, engine_config: EngineConfig, policy_version: int) -> RolloutEngine:
        """The engine one call samples with (not started: :func:`rollout` runs it)."""
        return Engine(params, self.model_config, engine_config, policy_version=policy_version)

    def close(self) -> None:
        """Closes the sandbox client (on the loop it was used from), if it has an async ``close``, then the
        loop; closing twice is harmless."""
        close = getattr(self.sandbox, "close", None)
        try:
            if asyncio.iscoroutinefunction(close):
                self.loop.run(close())
        finally:
            self.loop.close()

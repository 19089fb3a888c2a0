"""The session loop of one rollout call (see :mod:`rstar2jax.agent.multi_turn`): each problem's group opened
on the engine, and each session's coroutine generating, running its tool calls in the sandbox, appending
their responses, stopping at a limit or the token budget, and grading the answer.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from rstar2jax.agent.outage import OutagePolicy, OutageTracker
from rstar2jax.agent.rollout_types import (
    Observer,
    PartialRollout,
    RolloutConfig,
    RolloutEngine,
    RolloutSession,
    SessionRecord,
    ToolSandbox,
    tool_outcome,
)
from rstar2jax.agent.tasks import gather_or_cancel
from rstar2jax.agent.tools import parse_calls, rollout_tools
from rstar2jax.data.chat_template import encode_text
from rstar2jax.data.conversation import render_prompt_ids, tool_response_ids
from rstar2jax.data.problems import Problem
from rstar2jax.data.tool_parser import TOOL_CALL_CLOSE, FunctionCall, ToolCallError
from rstar2jax.data.tool_result import format_tool_result, truncate_middle
from rstar2jax.data.trajectory import Trajectory, answer_tag_counts
from rstar2jax.engine.seeds import mix_seed
from rstar2jax.reward import AnswerVerifier, extract_answer


class SessionLoop:
    """The agent's sessions on one engine: the shared pieces (sandbox, tokenizer, verifier, options, outage
    tracker, token budget) and the per-group (:meth:`problem`, :meth:`resume`) and per-session
    (:meth:`session`, :meth:`converse`) coroutines. One per ``rollout_async`` call, one per open
    :class:`~rstar2jax.agent.stream.RolloutStream`, one per chat turn (:func:`converse_async`, no engine);
    each session's :class:`~rstar2jax.agent.rollout_types.SessionRecord` becomes its trajectory."""

    def __init__(self, engine: RolloutEngine | None, sandbox: ToolSandbox, tokenizer: PreTrainedTokenizerBase,
                 verifier: AnswerVerifier | None, config: RolloutConfig, observer: Observer | None = None,
                 token_budget: int | None = None, outage: OutagePolicy | None = None, tools=None,
                 reward: str | None = None):
        self.engine, self.sandbox, self.tokenizer, self.verifier, self.config = (
            engine, sandbox, tokenizer, verifier, config)
        self.reward = reward  # "module:function" in place of the answer check; None: the verifier's
        if config.stateful_tool and sandbox is None:
            raise ValueError("RolloutConfig.stateful_tool needs a sandbox (its sessions hold the state)")
        self.tools = rollout_tools(config.prompt, sandbox, tools)
        where = ", ".join(getattr(sandbox, "urls", ())) or "service"
        self.outage = OutageTracker(outage or OutagePolicy(), where, worker_retries=config.tool_infra_retries)
        self.token_budget = token_budget
        self.sampled = 0  # tokens the sessions of this call sampled, together
        if not tokenizer.eos_token:
            raise ValueError("the tokenizer has no eos_token: the rollout needs the end-of-turn token")
        self.tool_call_end = encode_text(tokenizer, TOOL_CALL_CLOSE)
        self.stops = [self.tool_call_end, encode_text(tokenizer, tokenizer.eos_token)]
        self.observer = observer

    def group_seed(self, index: int, seed: int | None = None) -> int | None:
        """The seed of group ``index`` of a call seeded ``seed`` (default: ``config.seed``; None: none)."""
        seed = self.config.seed if seed is None else seed
        if seed is None:
            return None
        return mix_seed(seed, index)

    def out_of_budget(self) -> bool:
        return self.token_budget is not None and self.sampled >= self.token_budget

    @staticmethod
    def derived_seed(*entropy: int | None) -> int | None:
        """A well-mixed seed from ints (None if the first is None: the engine derives one)."""
        if entropy[0] is None:
            return None
        return mix_seed(*entropy)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    async def problem(self, index: int, problem: Problem, n: int, *, seed: int | None = None
                      ) -> list[Trajectory | PartialRollout]:
        """Group ``index`` of this call (``seed``: of a call seeded so, default ``config.seed``)."""
        prompt_ids = render_prompt_ids(self.tokenizer, problem.problem, self.config.prompt)
        seed = self.group_seed(index, seed)
        if self.out_of_budget():  # not opened: the whole group waits for a later call
            return [PartialRollout(problem, list(prompt_ids), SessionRecord(),
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
                      queued: float, *, seed: int | None = None, conversation: SessionRecord | None = None,
                      unparsed: str = "", resumes: int = 0) -> Trajectory | PartialRollout:
        if conversation is None:
            conversation = SessionRecord()
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
        answer, reward = extract_answer(text), 0.0  # a truncated response scores 0 (paper §4.3.1)
        if not conversation.truncated and self.reward is None:
            with conversation.clock.phase("verify"):
                grade = await self.verifier.grade(text, problem.answer)
            answer, reward = grade.extracted_answer, float(grade.is_correct)
        trajectory = Trajectory(
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
            text=text,
        )
        if not conversation.truncated and self.reward is not None:
            with conversation.clock.phase("verify"):
                trajectory.reward = await self.verifier.reward(self.reward, trajectory, problem)
            trajectory.timings = dict(conversation.clock.seconds)
        return trajectory

    async def execute(self, call: FunctionCall | ToolCallError, session: str | None = None
                      ) -> tuple[str, str]:
        """(outcome, text the model sees) of one parsed call, run under the rollout's outage policy."""
        limit = self.config.tool_output_chars
        if self.observer is not None:
            self.observer.on_call(call)
        if isinstance(call, ToolCallError):
            outcome, response = "parse_error", truncate_middle(call.message, limit)
        else:
            tool, timeout = self.tools[call.name], self.config.tool_timeout
            result = await self.outage.call(
                lambda: tool.call(call.arguments, timeout=timeout, session=session),
                session=session is not None)
            outcome, response = tool_outcome(result), format_tool_result(result, limit)
        if self.observer is not None:
            self.observer.on_result(call, outcome, response)
        return outcome, response

    async def collect(self, running: list[asyncio.Task], conversation: SessionRecord) -> list[str]:
        """Wait for a turn's dispatched calls, record their outcomes and return the texts the model sees."""
        with conversation.clock.phase("tool"):
            results = await asyncio.gather(*running)
        conversation.tool_outcomes += [outcome for outcome, _ in results]
        return [response for _, response in results]

    async def converse(self, session: RolloutSession, conversation: SessionRecord, unparsed: str = ""
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
                calls = parse_calls(unparsed, self.tools)
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


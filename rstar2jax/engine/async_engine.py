"""The engine's asyncio front: :class:`Engine` runs an :class:`~rstar2jax.engine.core.EngineCore` on a thread
of its own and hands each step's tokens to the :class:`Session` that waits for them, so that each rollout is
plain async code::

    async with Engine(params, config, EngineConfig(num_slots=32, max_len=8192)) as engine:
        sessions = await engine.open(prompt_ids, n=16, sampling=SamplingParams(), max_tokens=8000)
        segment = await sessions[0].generate(stop=[tool_call_end_ids])  # other slots keep decoding meanwhile
        sessions[0].append(tool_response_ids)  # inserted (loss mask 0), prefilled by the next generate
        async for chunk in sessions[0].stream():  # tokens as they are sampled
            ...
        sessions[0].close()
        await engine.update_weights(new_params, policy_version=1)  # from the next step on

A group waits in the queue until the scheduler admits it (:mod:`rstar2jax.engine.sequences`: slots and the
pages it can ever need). A paused session holds its slot and pages while its coroutine runs the tool call; a
finished one (EOS or budget) frees them at once; a session the host stops (a stop string, a client gone) is
released with the next step and its overshoot discarded, so its output is what a pause-at-every-token engine
would give (sampling keys are ``fold_in(key(seed), position)``: timing does not change tokens).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator, Sequence

from rstar2jax.engine.config import EngineConfig, SamplingParams
from rstar2jax.engine.core import EngineCore
from rstar2jax.engine.records import Chunk, Record, Segment, StreamSeeds, sibling_seeds, slot_seed
from rstar2jax.engine.state import NO_POLICY_VERSION
from rstar2jax.models import ModelConfig

__all__ = ["Engine", "Session", "sibling_seed"]

_DEFAULT_CONFIG, _DEFAULT_SAMPLING = EngineConfig(), SamplingParams()


class Session:
    """One sequence (rollout) in an :class:`Engine`; create with :meth:`Engine.open`.

    The host record (``prompt_ids``, ``response_ids``, ``loss_mask``, ``logprobs``) is exactly what
    :class:`rstar2jax.agent.Trajectory` needs: ``response_ids`` holds sampled and appended tokens in order,
    ``loss_mask`` is 1 on sampled ones, ``logprobs`` their raw policy log-probs (0.0 on appended ones);
    ``entropies`` the entropy of the distribution each was sampled from (0.0 on appended ones);
    ``policy_versions`` the policy version that sampled each (``NO_POLICY_VERSION``, -1, on appended ones).
    ``cached_tokens``: prompt tokens whose keys/values came from the prefix cache.
    """

    def __init__(self, engine: Engine, record: Record):
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
    """Asyncio front of an :class:`EngineCore`: use as ``async with Engine(...) as engine``.

    The core runs on a thread of its own (so the event loop stays free for tool calls and HTTP): it admits
    waiting groups that fit, applies the sessions' segment starts and closes, and runs the pipelined step
    loop, handing each step's tokens to the sessions' streams on the event loop. ``async with`` may be
    entered again after it exits: the engine keeps its state and compiled programs. :meth:`update_weights`
    swaps the weights between two steps while sessions run.
    """

    def __init__(self, params, config: ModelConfig, engine_config: EngineConfig = _DEFAULT_CONFIG, *,
                 policy_version: int = 0):
        self._core = EngineCore(params, config, engine_config, policy_version=policy_version)
        self._commands: collections.deque = collections.deque()  # callables for the engine thread
        self._wake = threading.Event()
        self._waiting: collections.deque = collections.deque()  # (request, future): engine thread only
        self._streams: dict[int, asyncio.Queue] = {}  # id(record) -> chunks of its segment in flight
        self._waiters: set[asyncio.Future] = set()  # opens and weight updates the engine thread answers
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
        stream_seeds: Sequence[int] | None = None,
    ) -> list[Session]:
        """Open ``n`` sessions on one prompt (a GRPO group), waiting until ``n`` slots and the pages the group
        may need are free.

        Args:
          prompt_ids: prompt tokens (prefilled once for the group).
          n: sessions; each sibling draws from a random stream of its own.
          sampling: temperature / top-p / top-k of every sibling.
          max_tokens: response budget of each session: sampled plus appended tokens.
          seed: makes the group reproducible: sibling ``j`` samples the stream :func:`sibling_seed`
            ``(seed, j)`` names, whatever else the engine runs; None: derived from the engine seed and the
            opening order.
          stream_seeds: instead of ``seed``, each sibling's stream seed (``n`` uint32s): ``open(p, 1,
            stream_seeds=[sibling_seed(s, j)])`` samples exactly sibling ``j`` of ``open(p, n, seed=s)``.
        """
        self._check_running()
        self._core.check_request(prompt_ids, n, max_tokens)
        if stream_seeds is not None:
            if seed is not None:
                raise ValueError("give seed or stream_seeds, not both")
            entropy = StreamSeeds(tuple(stream_seeds))
            sibling_seeds(entropy, n)  # the count, in the caller's frame
        else:
            entropy = (self._core.engine_config.seed, 1, self._opened) if seed is None else (seed, 0)
        self._opened += 1
        future = self._loop.create_future()
        self._waiters.add(future)
        request = (list(prompt_ids), n, sampling, max_tokens, entropy)
        self._submit(lambda: self._waiting.append((request, future)))
        try:
            return [Session(self, record) for record in await future]
        finally:
            self._waiters.discard(future)

    async def update_weights(self, params, policy_version: int, *, on_update: str = "keep") -> None:
        """Sample with ``params`` (policy version ``policy_version``) from the next device step on: the step
        in flight keeps the old weights, sessions keep their state (:meth:`EngineCore.update_weights`:
        ``on_update``, and what it checks). The checks and the cast run here (a ValueError is raised in this
        frame, changing nothing); returns once the engine has queued the weights, before a step uses them."""
        self._check_running()
        update = await asyncio.to_thread(self._core.prepare_weights, params, policy_version, on_update)
        queued = self._loop.create_future()
        self._waiters.add(queued)  # failed if the engine fails

        def queue():
            self._core.queue_weights(update)
            self._loop.call_soon_threadsafe(queued.set_result, None)

        self._submit(queue)
        try:
            await queued
        finally:
            self._waiters.discard(queued)

    def _check_running(self) -> None:
        if self._error is not None:
            raise RuntimeError("the engine failed") from self._error
        if self._thread is None or self._stopping:
            raise RuntimeError("the engine is not running: use `async with engine:`")

    def _submit(self, command) -> None:
        self._commands.append(command)
        self._wake.set()

    def _start(self, record: Record, stop, max_new_tokens) -> asyncio.Queue:
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

    def _close(self, record: Record) -> None:
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
                events = []
                if core.num_active:  # busy_s: the loop's seconds with work (a device step to run or read)
                    start = time.perf_counter()
                    events = core.step()
                    core.stats["busy_s"] += time.perf_counter() - start
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
        for future in list(self._waiters):
            if not future.done():
                future.set_exception(error)
        for queue in self._streams.values():
            queue.put_nowait(error)
        self._streams.clear()


def sibling_seed(seed: int, j: int) -> int:
    """The stream seed sibling ``j`` of a group opened with ``seed`` samples with (:meth:`Engine.open`): a
    request for that sibling alone, ``open(prompt, 1, stream_seeds=[sibling_seed(seed, j)])``, samples the
    same tokens."""
    return slot_seed((seed, 0, j))  # Engine.open: a group of seed s has the seed entropy (s, 0)

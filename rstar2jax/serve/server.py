"""An OpenAI-compatible chat-completions server on the generation engine (aiohttp).

Every request's choices are sessions of one shared :class:`~rstar2jax.engine.Engine`, so concurrent
requests decode side by side (continuous batching); requests beyond the engine's slots wait in its queue,
first come first served. Each choice streams its session (:meth:`~rstar2jax.engine.Session.stream`): tokens
arrive as the engine's steps sample them, while the device goes on decoding; the server streams text and
checks ``stop`` strings as they arrive, and a choice that must end (a stop string, a client that went away)
closes its session, which the engine stops with its next step (what it sampled beyond is dropped). A
conversation whose earlier turns are still in the engine's prefix cache is not prefilled again.

Endpoints: ``GET /health`` (200 once the engine is up, 503 before and while draining), ``GET /metrics``
(requests running and waiting, KV pages, prefix cache, token counts, latency histograms), ``GET /v1/models``,
``POST /v1/chat/completions`` (see :mod:`rstar2jax.serve.protocol` for what is accepted).

Conversation format: the messages (and ``tools``) are rendered by the model's chat template, in the format
the policy was trained in (:attr:`~rstar2jax.policy.loader.Policy.prompt`, recorded in its folder): a request
without a system message gets the policy's system prompt, the template gets its variables, and the assistant
opener (``<reason>`` for rStar2-Agent policies) is appended, as in the rollouts the policy was trained on; the
opener is the start of the returned content. A plain HF folder records no format: nothing is added to what
its chat template renders. :class:`ServerConfig` overrides the system prompt and the opener either way.

With tools, generation stops after ``</tool_call>`` as in training, and the Hermes ``<tool_call>`` blocks are
parsed with the training parser (:func:`~rstar2jax.data.tool_parser.parse_function_calls`) into OpenAI
``tool_calls``; the stream never shows part of a tag: text that could start ``<tool_call>`` or a stop string
is held back until it is known not to.

Load: requests wait from their arrival until the engine gives them their slots; at most
:attr:`ServerConfig.max_waiting` wait at once, and one more is answered 429 (OpenAI's error object, with a
``Retry-After`` estimated from the recent request latency). Shutdown: :meth:`ChatService.drain` (SIGTERM or
Ctrl-C under :func:`run_server`) answers new requests 503 and ``/health`` 503 ``{"status": "draining"}``, lets
the requests in flight finish for up to :attr:`ServerConfig.drain_timeout_s`, then ends what remains: a stream
with a last chunk per unfinished choice whose ``finish_reason`` is ``"abort"`` (then its usage, if asked, and
``data: [DONE]``), a non-streamed or still-waiting request with 503. ``GET /metrics`` serves Prometheus' text
format, or JSON when the client asks for it (:mod:`rstar2jax.serve.metrics`).

This module holds the engine-owning service (:class:`ChatService`: the engine, the tokenizer, the prompt, the
HTTP routes, admission and drain) and the ways to run it; one choice's token-to-text logic is
:mod:`rstar2jax.serve.choice`, the JSON and event-stream responses and the error middleware
:mod:`rstar2jax.serve.responses`, the metrics :mod:`rstar2jax.serve.metrics`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import signal
import threading
import time
import uuid
from collections.abc import Sequence

from aiohttp import web

from rstar2jax.data.chat_template import encode_text, render_chat
from rstar2jax.data.conversation import PromptConfig
from rstar2jax.data.tool_parser import TOOL_CALL_CLOSE
from rstar2jax.engine import Engine, EngineConfig, SamplingParams, Session, page_rounded
from rstar2jax.engine.paged_attention import pages_for_bytes
from rstar2jax.policy.loader import Policy
from rstar2jax.serve.admission import Admission, InFlight, shutting_down
from rstar2jax.serve.choice import ABORT, ChoiceContext, ChoiceStream, TokenText
from rstar2jax.serve.metrics import ServerMetrics, render_prometheus, wants_json
from rstar2jax.serve.protocol import ChatRequest, RequestError, parse_chat_request
from rstar2jax.serve.responses import complete, errors_middleware, stream, usage_block

__all__ = ["BackgroundServer", "ChatService", "ServerConfig", "run_server", "served_format", "start_server"]

_log = logging.getLogger(__name__)
#: ``max_waiting`` when not given: this many requests per engine slot.
WAITING_PER_SLOT = 8
_PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


#: A drain's default deadline: 25 s, so the process ends its streams and exits inside the termination grace
#: period orchestrators give a pod after SIGTERM (Kubernetes' ``terminationGracePeriodSeconds``: 30 s by
#: default; SIGKILL after it), with 5 s left for the last chunks, the engine's shutdown and the exit.
DEFAULT_DRAIN_TIMEOUT_S = 25.0
#: The termination grace period :data:`DEFAULT_DRAIN_TIMEOUT_S` stays under.
TERMINATION_GRACE_S = 30.0


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How the server runs the engine.

    Attributes:
      num_slots: sequences decoded side by side (requests beyond them queue).
      max_len: context length: prompt + completion tokens of one sequence.
      decode_chunk: the engine's decode steps per device call (tokens stream out after each call).
      kv_pool_gib: GiB of KV pages (what bounds memory); None: enough for every slot at ``max_len``.
      prefix_cache: keep the keys/values of prompts and finished conversations in the pool for later
        requests that start with them (a chat's next turn, a shared system prompt).
      assistant_opener: text appended after the generation prompt; None: the opener of the policy's recorded
        format ('' for a plain HF folder).
      system_prompt: system message of requests that have none ('' none); None: the system prompt of the
        policy's recorded format ('' for a plain HF folder).
      model_name: the model id reported and accepted; None: the policy's name.
      warmup: compile every engine program before reporting healthy (compiling only: nothing runs).
      max_body_bytes: largest accepted request body.
      max_waiting: most requests waiting at once (arrived, not generating yet); one more gets 429. None:
        ``WAITING_PER_SLOT`` (8) per slot, 128 at 16 slots: beyond that a client waits longer than 8
        requests' time, and is better told to retry (or go to another replica).
      drain_timeout_s: how long a drain (SIGTERM, Ctrl-C) lets the requests in flight finish before it ends
        them (default :data:`DEFAULT_DRAIN_TIMEOUT_S`, inside the usual 30 s termination grace period).
    """

    num_slots: int = 16
    max_len: int = 2048
    decode_chunk: int = 16
    kv_pool_gib: float | None = None
    prefix_cache: bool = True
    assistant_opener: str | None = None
    system_prompt: str | None = None
    model_name: str | None = None
    warmup: bool = True
    max_body_bytes: int = 32 * 2**20
    max_waiting: int | None = None
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S

    def __post_init__(self):
        for name in ("num_slots", "max_len", "decode_chunk", "max_body_bytes", "waiting_bound"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                shown = "max_waiting" if name == "waiting_bound" else name
                raise ValueError(f"ServerConfig.{shown} must be a positive int, got {getattr(self, shown)!r}")
        if self.kv_pool_gib is not None and not self.kv_pool_gib > 0:
            raise ValueError(f"ServerConfig.kv_pool_gib must be > 0 or None, got {self.kv_pool_gib!r}")
        if isinstance(self.drain_timeout_s, bool) or not (isinstance(self.drain_timeout_s, int | float)
                                                          and 0 <= self.drain_timeout_s < math.inf):
            raise ValueError(f"ServerConfig.drain_timeout_s must be a number >= 0, got "
                             f"{self.drain_timeout_s!r}")

    @property
    def waiting_bound(self) -> int:
        """``max_waiting``, or its default for ``num_slots``."""
        return WAITING_PER_SLOT * self.num_slots if self.max_waiting is None else self.max_waiting


def served_format(policy: Policy, config: ServerConfig) -> PromptConfig:
    """The conversation format ``policy`` is served in: the one recorded with it (a plain HF folder records
    none: nothing is added), with ``config``'s system prompt and opener where given. The server uses its
    ``system_prompt`` (for requests without a system message), ``assistant_opener`` and
    ``chat_template_kwargs``; clients send their own user turns and tools."""
    recorded = policy.prompt or PromptConfig(system_prompt="", assistant_opener="")
    given = {"system_prompt": config.system_prompt, "assistant_opener": config.assistant_opener}
    return dataclasses.replace(recorded, **{k: v for k, v in given.items() if v is not None})


class ChatService:
    """The engine, the policy's tokenizer and the HTTP handlers; :meth:`app` builds the aiohttp app.

    Use ``async with ChatService(policy, config):`` (or let :func:`run_server` do it) so that the engine's
    background task runs.
    """

    def __init__(self, policy: Policy, config: ServerConfig = ServerConfig()):
        self.policy, self.config = policy, config
        self.tokenizer = policy.tokenizer
        self.model_name = config.model_name or policy.name
        self.format = served_format(policy, config)
        self.eos_ids = set(policy.eos_token_ids)
        self.tool_call_end = encode_text(self.tokenizer, TOOL_CALL_CLOSE)
        model = policy.model_config
        self.engine_config = EngineConfig(
            num_slots=config.num_slots,
            max_len=page_rounded(config.max_len),
            max_stops=1,
            max_stop_len=max(8, len(self.tool_call_end)),
            eos_token_ids=tuple(self.eos_ids),
            decode_chunk=config.decode_chunk,
            num_pages=(None if config.kv_pool_gib is None  # pages of the engine's KV dtype in those bytes
                       else pages_for_bytes(config.kv_pool_gib * 2**30, model,
                                            page_size=EngineConfig.page_size)),
            prefix_sharing=config.prefix_cache,
        )
        self.engine: Engine | None = None
        self.ready = False
        self.created = int(time.time())
        self.metrics = ServerMetrics()
        self.text = TokenText(self.tokenizer, policy.params, model)
        self.choice_context = ChoiceContext(self.text, frozenset(self.eos_ids), tuple(self.tool_call_end),
                                            self.format.assistant_opener, self.metrics)
        self.admission = Admission(self.metrics, max_waiting=config.waiting_bound, num_slots=config.num_slots,
                                   drain_timeout_s=config.drain_timeout_s)

    @property
    def stats(self):
        """The counters (``requests``, ``prompt_tokens``, ``cached_tokens``, ``completion_tokens``,
        ``cancelled_choices``): :attr:`ServerMetrics.counts`."""
        return self.metrics.counts

    async def __aenter__(self) -> ChatService:
        self.engine = Engine(self.policy.params, self.policy.model_config, self.engine_config)
        if self.config.warmup:  # the engine's few programs, compiled (in two threads) before the first client
            await asyncio.to_thread(self.engine.core.warmup)
        await self.engine.__aenter__()
        self.ready = True
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.ready = False
        if self.engine is not None:
            await self.engine.__aexit__(*exc_info)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.text.decode(tokens)

    def prompt_ids(self, request: ChatRequest) -> list[int]:
        """The request's conversation (with the policy's system prompt when it has no system message) rendered
        by the chat template, plus the assistant opener."""
        messages, system_prompt = request.messages, self.format.system_prompt
        if system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": system_prompt}, *messages]
        try:
            text = render_chat(
                self.tokenizer,
                messages,
                tools=request.tools,
                add_generation_prompt=True,
                **self.format.chat_template_kwargs,
            )
        except Exception as error:  # the template's own checks (role order, ...) raise from Jinja
            raise RequestError(
                f"the chat template rejected the messages: {error}", param="messages"
            ) from error
        return encode_text(self.tokenizer, text + self.format.assistant_opener)

    # ---- HTTP

    def app(self) -> web.Application:
        app = web.Application(middlewares=[errors_middleware], client_max_size=self.config.max_body_bytes)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not self.ready:
            return web.json_response({"status": "starting"}, status=503)
        return web.json_response({"status": "ok"})

    def engine_gauges(self) -> dict[str, int]:
        """KV pages used / cached / free / total and slots used / total, read from the engine's core."""
        core, slots = (self.engine.core if self.engine else None), self.config.num_slots
        if core is None:
            return dict.fromkeys(("kv_pages_used", "kv_pages_cached", "kv_pages_free", "kv_pages_total",
                                  "slots_used"), 0) | {"slots_total": slots}
        used, cached, total = core.num_used_pages, core.num_cached_pages, core.num_pages
        return {"kv_pages_used": used, "kv_pages_cached": cached, "kv_pages_total": total,
                "kv_pages_free": max(total - used - cached, 0), "slots_used": slots - core.num_free_slots,
                "slots_total": slots}

    async def metrics_page(self, request: web.Request) -> web.Response:
        """``GET /metrics``: Prometheus' text format, or JSON (``?format=json``, or an Accept header that
        prefers ``application/json``)."""
        engine = self.engine_gauges()
        try:
            as_json = wants_json(request.query.get("format"), request.headers.get("Accept", ""))
        except ValueError as error:
            raise RequestError(str(error), param="format") from None
        if as_json:
            return web.json_response(self.metrics.as_json(engine))
        text = render_prometheus(self.metrics, engine, {"model_name": self.model_name})
        return web.Response(body=text.encode(), headers={"Content-Type": _PROMETHEUS_TYPE})

    async def list_models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "rstar2jax",
                 "max_model_len": self.config.max_len}
        return web.json_response({"object": "list", "data": [model]})

    async def chat_completions(self, http_request: web.Request) -> web.StreamResponse:
        if not self.ready:
            raise RequestError("the server is starting", type="server_error", status=503)
        entry = self.admission.accept()
        try:
            return await self._serve(http_request, entry)
        finally:  # also when cancelled before a choice ran at all: no slot outlives its request
            self.admission.release(entry)

    async def _serve(self, http_request: web.Request, entry: InFlight) -> web.StreamResponse:
        try:
            body = await http_request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise RequestError(f"the request body is not valid JSON: {error}") from error
        request = parse_chat_request(body, max_n=self.config.num_slots)
        if request.model is not None and request.model != self.model_name:
            raise RequestError(
                f"the model {request.model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
                status=404,
            )
        prompt_ids = self.prompt_ids(request)
        room = self.config.max_len - len(prompt_ids)
        if room < 1 or (request.max_tokens is not None and request.max_tokens > room):
            asked = f" + max_tokens {request.max_tokens}" if request.max_tokens is not None else ""
            raise RequestError(
                f"This model's maximum context length is {self.config.max_len} tokens; the messages take "
                f"{len(prompt_ids)} tokens{asked}. Shorten the messages or lower max_tokens.",
                param="messages",
                code="context_length_exceeded",
            )
        sampling = SamplingParams(temperature=request.temperature, top_p=request.top_p)
        opening = self.engine.open(prompt_ids, request.n, sampling=sampling,
                                   max_tokens=request.max_tokens or room, seed=request.seed)
        sessions: list[Session] = await self.admission.admit(entry, opening)
        choices = [ChoiceStream(self.choice_context, request, s, prompt_ids, entry.arrived) for s in sessions]
        self.admission.running(entry, choices)
        counts, cached = self.metrics.counts, sessions[0].cached_tokens
        counts["requests"] += 1
        counts["prompt_tokens"] += len(prompt_ids)
        counts["cached_tokens"] += cached
        return await self._respond(http_request, request, entry.choices, len(prompt_ids), cached)

    async def _respond(self, http_request, request, choices, prompt_tokens, cached) -> web.StreamResponse:
        meta = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": self.model_name,
            "system_fingerprint": None,
        }
        usage = lambda: usage_block(prompt_tokens, cached, choices)  # noqa: E731
        if request.stream:
            return await stream(http_request, request, choices, meta, usage)
        body = await complete(request, choices, meta, usage)
        if any(choice.finish_reason == ABORT for choice in choices):
            done = sum(choice.num_sampled for choice in choices)
            raise shutting_down(f"the completion was ended after {done} tokens, before it finished")
        return web.json_response(body)

    # ---- shutdown

    @property
    def draining(self) -> bool:
        return self.metrics.draining

    async def drain(self, timeout: float | None = None) -> int:
        """Stops taking requests (503; ``/health`` says draining), lets the requests in flight finish for up
        to ``timeout`` (default ``config.drain_timeout_s``), then ends what remains (see the module
        docstring). Returns how many it ended (:meth:`Admission.drain`)."""
        return await self.admission.drain(timeout)


async def start_server(service: ChatService, host: str, port: int) -> web.AppRunner:
    """Serves ``service`` (already entered) on ``host:port``; returns the runner (``await runner.cleanup()``).
    Handlers are cancelled when their client disconnects, which frees the client's engine slots."""
    runner = web.AppRunner(service.app(), handler_cancellation=True, access_log=None, shutdown_timeout=10)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def _drain_on_signals(service: ChatService, stop: asyncio.Event) -> list[int]:
    """In the main thread, SIGINT and SIGTERM set ``stop`` (the caller drains), a second one ends the drain's
    wait; returns the signals handled (none elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return []

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            _log.info("%s: ending the %d requests left now", name, service.admission.in_flight)
            service.admission.end_now()
            return
        stop.set()
        _log.info("%s: draining: new requests get 503; the %d in flight have %g s to finish (Ctrl-C again "
                  "ends them now)", name, service.admission.in_flight, service.config.drain_timeout_s)

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    return [signal.SIGINT, signal.SIGTERM]


async def run_server(
    policy: Policy, config: ServerConfig, host: str, port: int, ready: asyncio.Event | None = None
) -> int:
    """Serves until SIGINT / SIGTERM (in the main thread; :mod:`experiments.serve`) or cancellation; a signal
    drains the server (:meth:`ChatService.drain`), a second one ends the drain's wait. Returns how many
    requests the drain ended."""
    async with ChatService(policy, config) as service:
        runner = await start_server(service, host, port)
        stop = asyncio.Event()
        handled = _drain_on_signals(service, stop)
        if ready is not None:
            ready.set()
        try:
            await stop.wait()
            ended = await service.drain()
            _log.info("drained: %s", f"ended {ended} requests at the deadline" if ended else
                      "every request in flight finished")
            return ended
        finally:
            for signum in handled:
                asyncio.get_running_loop().remove_signal_handler(signum)
            await runner.cleanup()


class BackgroundServer:
    """A :class:`ChatService` served from its own event loop on a daemon thread (tests, benchmarks,
    notebooks): ``with BackgroundServer(policy, config) as server: ... server.url ...``."""

    def __init__(
        self, policy: Policy, config: ServerConfig = ServerConfig(), host: str = "127.0.0.1", port: int = 0
    ):
        self.policy, self.config, self.host, self.port = policy, config, host, port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rstar2jax-serve", daemon=True)
        self.service: ChatService | None = None
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def call(self, coroutine, timeout: float | None = None):
        """Runs ``coroutine`` on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def drain(self, timeout: float | None = None) -> int:
        """:meth:`ChatService.drain` on the server's loop (the server keeps answering: 503 to new ones)."""
        return self.call(self.service.drain(timeout))

    def __enter__(self) -> BackgroundServer:
        self.thread.start()

        async def start():
            self.service = ChatService(self.policy, self.config)
            await self.service.__aenter__()
            self.runner = await start_server(self.service, self.host, self.port)
            if self.port == 0:
                self.port = self.runner.addresses[0][1]

        self.call(start())
        return self

    def __exit__(self, *exc_info) -> None:
        async def stop():
            if self.runner is not None:
                await self.runner.cleanup()
            if self.service is not None:
                await self.service.__aexit__(None, None, None)

        try:
            self.call(stop(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

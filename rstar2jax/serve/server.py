"""An OpenAI-compatible chat-completions server on the generation engine (aiohttp).

Every request's choices are sessions of one shared :class:`~rstar2jax.engine.Engine`, so concurrent
requests decode side by side (continuous batching); requests beyond the engine's slots wait in its queue,
first come first served. Each choice streams its session (:meth:`~rstar2jax.engine.Session.stream`): tokens
arrive as the engine's steps sample them, while the device goes on decoding; the server streams text and
checks ``stop`` strings as they arrive, and a choice that must end (a stop string, a client that went away)
closes its session, which the engine stops with its next step (what it sampled beyond is dropped). A
conversation whose earlier turns are still in the engine's prefix cache is not prefilled again.

Endpoints: ``GET /health`` (200 once the engine is up, 503 before), ``GET /metrics`` (request and token
counts, the prefix cache's hit rate), ``GET /v1/models``, ``POST /v1/chat/completions`` (see
:mod:`rstar2jax.serve.protocol` for what is accepted).

Conversation format: the messages (and ``tools``) are rendered by the model's chat template, in the format
the policy was trained in (:attr:`~rstar2jax.train.loader.Policy.prompt`, recorded in its folder): a request
without a system message gets the policy's system prompt, the template gets its variables, and the assistant
opener (``<reason>`` for rStar2-Agent policies) is appended, as in the rollouts the policy was trained on; the
opener is the start of the returned content. A plain HF folder records no format: nothing is added to what
its chat template renders. :class:`ServerConfig` overrides the system prompt and the opener either way.

With tools, generation stops after ``</tool_call>`` as in training, and the Hermes ``<tool_call>`` blocks are
parsed with the training parser (:func:`~rstar2jax.data.tool_parser.parse_function_calls`) into OpenAI
``tool_calls``; the stream never shows part of a tag: text that could start ``<tool_call>`` or a stop string
is held back until it is known not to.

This module holds the engine-owning service (:class:`ChatService`: the engine, the tokenizer, the prompt and
the HTTP routes) and the ways to run it; one choice's token-to-text logic is :mod:`rstar2jax.serve.choice`,
the JSON and event-stream responses and the error middleware :mod:`rstar2jax.serve.responses`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from aiohttp import web

from rstar2jax import models
from rstar2jax.data.chat_template import encode_text, render_chat
from rstar2jax.data.conversation import PromptConfig
from rstar2jax.data.tool_parser import TOOL_CALL_CLOSE
from rstar2jax.engine import Engine, EngineConfig, SamplingParams, page_rounded
from rstar2jax.serve.choice import ChoiceStream
from rstar2jax.serve.protocol import ChatRequest, RequestError, parse_chat_request
from rstar2jax.serve.responses import complete, errors_middleware, stream, usage_block
from rstar2jax.train.loader import Policy

__all__ = ["BackgroundServer", "ChatService", "ServerConfig", "run_server", "served_format", "start_server"]


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

    def __post_init__(self):
        for name in ("num_slots", "max_len", "decode_chunk", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ServerConfig.{name} must be a positive int, got {value!r}")
        if self.kv_pool_gib is not None and not self.kv_pool_gib > 0:
            raise ValueError(f"ServerConfig.kv_pool_gib must be > 0 or None, got {self.kv_pool_gib!r}")


def served_format(policy: Policy, config: ServerConfig) -> PromptConfig:
    """The conversation format ``policy`` is served in: the one recorded with it (a plain HF folder records
    none: nothing is added), with ``config``'s system prompt and opener where given. The server uses its
    ``system_prompt`` (for requests without a system message), ``assistant_opener`` and
    ``chat_template_kwargs``; clients send their own user turns and tools."""
    recorded = policy.prompt or PromptConfig(system_prompt="", assistant_opener="")
    given = {"system_prompt": config.system_prompt, "assistant_opener": config.assistant_opener}
    return dataclasses.replace(recorded, **{k: v for k, v in given.items() if v is not None})


@functools.partial(jax.jit, static_argnames=("config", "k"))
def _top_logprobs(params, tokens, *, config: models.ModelConfig, k: int):
    """Top-``k`` next-token log-probs at each position of ``tokens [1, T]``: ids, logprobs ``[T, k]``."""
    logits, _ = models.forward(params, config, tokens)
    logprobs = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)
    values, ids = jax.lax.top_k(logprobs, k)
    return ids, values


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
        stop_len = max(8, len(self.tool_call_end))
        model = policy.model_config
        kv_bytes_per_page = (2 * model.num_layers * model.num_kv_heads * model.head_dim
                             * EngineConfig.page_size * jnp.dtype(model.compute_dtype).itemsize)
        self.engine_config = EngineConfig(
            num_slots=config.num_slots,
            max_len=page_rounded(config.max_len),
            max_stops=1,
            max_stop_len=stop_len,
            eos_token_ids=tuple(self.eos_ids),
            decode_chunk=config.decode_chunk,
            num_pages=(None if config.kv_pool_gib is None
                       else int(config.kv_pool_gib * 2**30) // kv_bytes_per_page),
            prefix_sharing=config.prefix_cache,
        )
        self.engine: Engine | None = None
        self.ready = False
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        #: Counters: requests, prompt_tokens, cached_tokens (prompt tokens served by the prefix cache),
        #: completion_tokens (sampled, all choices), cancelled_choices (client gone).
        self.stats: collections.Counter = collections.Counter()

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

    # ---- text helpers

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(
            list(tokens), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def logprob_entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.decode([token])
        return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}

    def top_logprobs(self, prompt_ids: list[int], tokens: list[int], start: int, k: int):
        """The ``k`` most likely tokens (raw model distribution) at each of ``tokens[start:]``."""
        sequence = prompt_ids + tokens
        size = 1 << max(len(sequence) - 1, 63).bit_length()  # a few padded lengths, a few programs
        padded = np.zeros((1, size), np.int32)
        padded[0, : len(sequence)] = sequence
        ids, values = jax.device_get(
            _top_logprobs(self.policy.params, padded, config=self.policy.model_config, k=k)
        )
        first = len(prompt_ids) + start - 1  # the logits that predicted tokens[start]
        rows = range(first, len(sequence) - 1)
        return [list(zip(ids[r].tolist(), values[r].tolist(), strict=True)) for r in rows]

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
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if not self.ready:
            return web.json_response({"status": "starting"}, status=503)
        return web.json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        """Counters since start; ``prefix_cache_hit_rate``: prompt tokens whose keys/values came from the
        prefix cache over all prompt tokens."""
        stats = dict(self.stats)
        prompt_tokens = stats.get("prompt_tokens", 0)
        stats["prefix_cache_hit_rate"] = stats.get("cached_tokens", 0) / max(prompt_tokens, 1)
        return web.json_response(stats)

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "rstar2jax",
                        "max_model_len": self.config.max_len,
                    }
                ],
            }
        )

    async def chat_completions(self, http_request: web.Request) -> web.StreamResponse:
        if not self.ready:
            raise RequestError("the server is starting", type="server_error", status=503)
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
        sessions = await self.engine.open(
            prompt_ids,
            request.n,
            sampling=SamplingParams(temperature=request.temperature, top_p=request.top_p),
            max_tokens=request.max_tokens or room,
            seed=request.seed,
        )
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(prompt_ids)
        self.stats["cached_tokens"] += sessions[0].cached_tokens
        choices = [ChoiceStream(self, request, s, prompt_ids) for s in sessions]
        try:
            return await self._respond(http_request, request, choices, len(prompt_ids),
                                       sessions[0].cached_tokens)
        finally:  # also when cancelled before a choice ran at all: no slot outlives its request
            for choice in choices:
                choice.close()
                self.stats["cancelled_choices"] += not choice.finished

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
        return web.json_response(await complete(request, choices, meta, usage))

async def start_server(service: ChatService, host: str, port: int) -> web.AppRunner:
    """Serves ``service`` (already entered) on ``host:port``; returns the runner (``await runner.cleanup()``).
    Handlers are cancelled when their client disconnects, which frees the client's engine slots."""
    runner = web.AppRunner(service.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def run_server(
    policy: Policy, config: ServerConfig, host: str, port: int, ready: asyncio.Event | None = None
) -> None:
    """Serves until cancelled (Ctrl-C in :mod:`experiments.serve`)."""
    async with ChatService(policy, config) as service:
        runner = await start_server(service, host, port)
        if ready is not None:
            ready.set()
        try:
            await asyncio.Event().wait()
        finally:
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

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
the policy was trained in (:attr:`~rstar2jax.serve.policy.Policy.prompt`, recorded in its folder): a request
without a system message gets the policy's system prompt, the template gets its variables, and the assistant
opener (``<reason>`` for rStar2-Agent policies) is appended, as in the rollouts the policy was trained on; the
opener is the start of the returned content. A plain HF folder records no format: nothing is added to what
its chat template renders. :class:`ServerConfig` overrides the system prompt and the opener either way.

With tools, generation stops after ``</tool_call>`` as in training, and the Hermes ``<tool_call>`` blocks are
parsed with the training parser (:func:`~rstar2jax.data.tool_parser.parse_function_calls`) into OpenAI
``tool_calls``; the stream never shows part of a tag: text that could start ``<tool_call>`` or a stop string
is held back until it is known not to.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from aiohttp import web

from rstar2jax import models
from rstar2jax.agent.tasks import gather_or_cancel
from rstar2jax.data.conversation import PromptConfig, encode_text, render_chat
from rstar2jax.data.tool_parser import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, FunctionCall, parse_function_calls
from rstar2jax.engine import Engine, EngineConfig, SamplingParams, Session, page_rounded
from rstar2jax.serve.policy import Policy
from rstar2jax.serve.protocol import ChatRequest, RequestError, error_body, parse_chat_request

_FINISH = {"eos": "stop", "budget": "length"}


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


class _Choice:
    """One choice of a request: streams its engine session and turns tokens into the content, tool calls and
    log-probs a client sees."""

    def __init__(self, service: ChatService, request: ChatRequest, session: Session, prompt_ids: list[int]):
        self.service, self.request, self.session, self.prompt_ids = service, request, session, prompt_ids
        self.tokens: list[int] = []  # sampled, the end-of-turn token excluded
        self.logprobs: list[float] = []
        self.num_sampled = 0
        self.text = ""
        self.emitted = 0  # characters of self.text already given to the client
        self.emitted_tokens = 0  # tokens whose log-probs were given
        self.token_ends: list[int] = []  # len(decode(tokens[:i + 1])) when log-probs are asked for
        self.top: list[list[tuple[int, float]]] = []
        self.finished = False

    def close(self) -> None:
        """Free the session's slot (idempotent); a segment in flight stops with the engine's next step."""
        self.session.close()

    def _held_back(self, text: str) -> int:
        """How many trailing characters may be the start of a tag or stop string (or of a UTF-8 sequence)."""
        guards = list(self.request.stop) + ([TOOL_CALL_OPEN] if self.request.parse_tools else [])
        held = 0
        for guard in guards:
            for size in range(min(len(guard) - 1, len(text)), held, -1):
                if guard.startswith(text[-size:]):
                    held = size
                    break
        while held < len(text) and text[len(text) - held - 1] == "\ufffd":
            held += 1
        if self.request.parse_tools:  # whitespace before a call is not content (the template writes its own)
            while held < len(text) and text[len(text) - held - 1].isspace():
                held += 1
        return held

    async def run(self) -> AsyncIterator[tuple[str, Any]]:
        """Yields ``("content", text, logprob entries)`` deltas, then ``("tool_calls", calls)`` if any,
        then ``("finish", finish_reason)``."""
        service, request = self.service, self.request
        stop_ids = [service.tool_call_end] if request.parse_tools else []
        opener = service.format.assistant_opener
        if opener:
            yield "content", opener, []
        finish = None
        try:
            async for chunk in self.session.stream(stop=stop_ids):
                self.num_sampled += len(chunk.tokens)
                tokens, logprobs = list(chunk.tokens), list(chunk.logprobs)
                if chunk.finish_reason == "eos" and tokens and tokens[-1] in service.eos_ids:
                    tokens, logprobs = tokens[:-1], logprobs[:-1]
                start = len(self.tokens)
                self.tokens += tokens
                self.logprobs += logprobs
                self.text = service.decode(self.tokens)
                if request.logprobs:
                    await self._token_logprobs(start)
                finish = _FINISH.get(chunk.finish_reason)
                if chunk.finish_reason == "stop":  # after </tool_call>: the turn ends here, as in training
                    finish = "stop"
                cut = self._find_stop(start)
                if cut is not None:
                    self.text, finish = self.text[:cut], "stop"
                content_end = len(self.text)
                if request.parse_tools and TOOL_CALL_OPEN in self.text:
                    content_end = len(self.text[: self.text.index(TOOL_CALL_OPEN)].rstrip())
                if finish is None:
                    content_end = min(content_end, len(self.text) - self._held_back(self.text))
                if content_end > self.emitted:
                    delta = self.text[self.emitted : content_end]
                    yield "content", delta, self._logprob_entries(content_end)
                    self.emitted = content_end
                if finish is not None:
                    break  # a stop string: leaving the stream stops the session
        finally:
            service.stats["completion_tokens"] += self.num_sampled
            self.close()
        calls = self._tool_calls() if request.parse_tools else []
        if calls:
            yield "tool_calls", calls
            finish = "tool_calls"
        elif self.emitted < len(self.text):  # an unparsable call stays visible as text
            yield "content", self.text[self.emitted :], self._logprob_entries(len(self.text))
            self.emitted = len(self.text)
        self.finished = True
        yield "finish", finish

    def _find_stop(self, start_token: int) -> int | None:
        """Where the first stop string starts in the text (looking only where new tokens could make one)."""
        if not self.request.stop:
            return None
        first = max(0, len(self.service.decode(self.tokens[:start_token])) - max(map(len, self.request.stop)))
        hits = [i for i in (self.text.find(s, first) for s in self.request.stop) if i != -1]
        return min(hits) if hits else None

    def _tool_calls(self) -> list[dict[str, Any]]:
        """The turn's calls when every block parses as a call of a listed tool; else none (the text stays)."""
        calls = parse_function_calls(self.text, tool_names=self.request.tool_names)
        if not calls or not all(isinstance(c, FunctionCall) for c in calls):
            return []
        self.emitted = len(self.text)
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
            }
            for c in calls
        ]

    async def _token_logprobs(self, start: int) -> None:
        """Extends the per-token text ends and, with ``top_logprobs``, the alternatives of the new tokens."""
        decode = self.service.decode
        for i in range(start, len(self.tokens)):
            self.token_ends.append(len(decode(self.tokens[: i + 1])))
        k = self.request.top_logprobs
        if k and len(self.tokens) > start:
            self.top += await asyncio.to_thread(
                self.service.top_logprobs, self.prompt_ids, self.tokens, start, k
            )

    def _logprob_entries(self, content_end: int) -> list[dict[str, Any]]:
        """OpenAI log-prob entries of the tokens that end within the first ``content_end`` characters and were
        not given yet."""
        if not self.request.logprobs:
            return []
        entries = []
        while self.emitted_tokens < len(self.tokens) and self.token_ends[self.emitted_tokens] <= content_end:
            i = self.emitted_tokens
            entry = self.service.logprob_entry(self.tokens[i], self.logprobs[i])
            if self.request.top_logprobs:
                entry["top_logprobs"] = [self.service.logprob_entry(t, lp) for t, lp in self.top[i]]
            entries.append(entry)
            self.emitted_tokens += 1
        return entries


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
        app = web.Application(middlewares=[_errors], client_max_size=self.config.max_body_bytes)
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
        choices = [_Choice(self, request, s, prompt_ids) for s in sessions]
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
        usage = lambda: self._usage(prompt_tokens, cached, choices)  # noqa: E731
        if request.stream:
            return await self._stream(http_request, request, choices, meta, usage)
        return web.json_response(await self._complete(request, choices, meta, usage))

    @staticmethod
    def _usage(prompt_tokens: int, cached: int, choices: list[_Choice]) -> dict[str, Any]:
        completion = sum(c.num_sampled for c in choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def _complete(self, request, choices, meta, usage) -> dict[str, Any]:
        async def collect(choice: _Choice) -> dict[str, Any]:
            content, entries, calls, finish = [], [], None, None
            async for kind, *value in choice.run():
                if kind == "content":
                    content.append(value[0])
                    entries += value[1]
                elif kind == "tool_calls":
                    calls = value[0]
                else:
                    finish = value[0]
            text = "".join(content)
            message = {
                "role": "assistant",
                "content": text if (text.strip() or not calls) else None,
                "refusal": None,
            }
            if calls:
                message["tool_calls"] = calls
            return {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "logprobs": {"content": entries, "refusal": None} if request.logprobs else None,
            }

        results = await gather_or_cancel([collect(c) for c in choices])
        for index, result in enumerate(results):
            result["index"] = index
        return {
            **meta,
            "object": "chat.completion",
            "choices": results,
            "usage": usage(),
        }

    async def _stream(self, http_request, request, choices, meta, usage) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(http_request)
        no_usage = {"usage": None} if request.include_usage else {}

        async def send(payload: dict[str, Any]) -> None:
            await response.write(f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode())

        def chunk(index: int, delta: dict[str, Any], finish=None, entries=None) -> dict[str, Any]:
            choice = {
                "index": index,
                "delta": delta,
                "finish_reason": finish,
                "logprobs": {"content": entries, "refusal": None} if entries else None,
            }
            return {**meta, "object": "chat.completion.chunk", "choices": [choice], **no_usage}

        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, choice: _Choice) -> None:
            async for event in choice.run():
                await queue.put((index, event))
            await queue.put((index, None))

        for index in range(len(choices)):
            await send(chunk(index, {"role": "assistant", "content": ""}))
        tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(choices)]
        try:
            running = len(tasks)
            while running:
                getter = asyncio.ensure_future(queue.get())
                await asyncio.wait(
                    [getter, *[t for t in tasks if not t.done()]], return_when=asyncio.FIRST_COMPLETED
                )
                for task in tasks:  # a choice that failed: raise its error here
                    if task.done() and not task.cancelled() and task.exception() is not None:
                        getter.cancel()
                        raise task.exception()
                if not getter.done():
                    continue
                index, event = getter.result()
                if event is None:
                    running -= 1
                    continue
                kind, *value = event
                if kind == "content":
                    await send(chunk(index, {"content": value[0]}, entries=value[1]))
                elif kind == "tool_calls":
                    delta = [{"index": k, **call} for k, call in enumerate(value[0])]
                    await send(chunk(index, {"tool_calls": delta}))
                else:
                    await send(chunk(index, {}, finish=value[0]))
            if request.include_usage:
                await send(
                    {
                        **meta,
                        "object": "chat.completion.chunk",
                        "choices": [],
                        "usage": usage(),
                    }
                )
        except ConnectionResetError:  # the client went away: nobody to answer
            return response
        except Exception as error:  # headers are sent: report in the stream, as OpenAI does
            await send(error_body(f"generation failed: {error}", type="server_error"))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@web.middleware
async def _errors(request: web.Request, handler):
    """Client mistakes as OpenAI error objects (never a 500); unexpected failures as a 500 server_error."""
    try:
        return await handler(request)
    except RequestError as error:
        return web.json_response(error.body(), status=error.status)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        kind = "invalid_request_error" if error.status < 500 else "server_error"
        return web.json_response(error_body(error.reason, type=kind), status=error.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as error:  # noqa: BLE001 - a server bug or an engine failure
        return web.json_response(
            error_body(f"internal error: {type(error).__name__}: {error}", type="server_error"), status=500
        )


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
        import threading

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
